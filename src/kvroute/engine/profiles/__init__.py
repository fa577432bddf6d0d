"""Derived profile tables shipped with kvroute (JSON written by ``scripts/derive_profiles.py``).

- ``qwen3-30b-a3b-rtxpro6000-tp1.json``: LLMServingSim v1 bundle
  ``profiler/perf/RTXPRO6000/Qwen/Qwen3-30B-A3B-Instruct-2507/bf16/tp1`` (dense.csv, per_sequence.csv,
  attention.csv, moe.csv): dense ops summed per token count, all attention and MoE rows kept as profiled.
- ``llama31-8b-h100-tp1.json``: LLMServingSim v0 ``H100/meta-llama/Llama-3.1-8B/tp1/layers.csv``: ops summed
  per token count, token grid thinned to 1-16 and every 16th up to 2048.

Times are µs per kernel of ONE decoder layer (the profiles ran with num_hidden_layers 1); see
``kvroute.engine.cost`` for how they are combined.
"""
