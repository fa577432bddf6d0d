"""The real-vLLM suite's fixtures live in :mod:`harness` (with its helpers); registered here."""

from .harness import _fleet, fleet, router_factory, tokenizer  # noqa: F401
