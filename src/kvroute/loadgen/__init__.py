"""Open-loop load generator for OpenAI-compatible servers (`kvroute bench`)."""

from kvroute.loadgen.ready import wait_ready
from kvroute.loadgen.runner import BenchResult, run_bench
from kvroute.loadgen.text import BlockText

__all__ = ["BenchResult", "BlockText", "run_bench", "wait_ready"]
