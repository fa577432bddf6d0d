"""Derived profile tables shipped with kvroute (JSON written by ``scripts/derive_profiles.py``).

- ``qwen3-30b-a3b-rtxpro6000-tp1.json``: LLMServingSim v1 bundle
  ``profiler/perf/RTXPRO6000/Qwen/Qwen3-30B-A3B-Instruct-2507/bf16/tp1`` (dense.csv, per_sequence.csv,
  attention.csv, moe.csv): dense ops summed per token count, all attention and MoE rows kept as profiled.
- ``llama31-8b-h100-tp1.json``: LLMServingSim v0 ``H100/meta-llama/Llama-3.1-8B/tp1/layers.csv``: ops summed
  per token count, token grid thinned to 1-16 and every 16th up to 2048.

- ``qwen3-30b-a3b-instruct-2507.config.json`` and ``llama-3.1-8b.config.json``: the Hugging Face
  ``config.json`` of the models those tables were profiled with (Qwen/Qwen3-30B-A3B-Instruct-2507,
  meta-llama/Llama-3.1-8B), verbatim as LLMServingSim keeps them (``configs/model/<org>/<name>.json`` at
  casys-kaist/LLMServingSim 5daddb2, "the full raw config.json from the model's HuggingFace repo");
  the packaged profiles read their architecture from them (:mod:`kvroute.engine.modelconfig`).

Times are µs per kernel of ONE decoder layer (the profiles ran with num_hidden_layers 1); see
``kvroute.engine.cost`` for how they are combined.
"""
