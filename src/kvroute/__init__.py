"""kvroute: a KV-cache-aware request router for LLM serving clusters.

One policy core (``kvroute.policies``) and one prefix index (``kvroute.index``) serve three faces:
the live router (``kvroute.server``), the cluster simulator (``kvroute.sim``) and the emulated
vLLM-compatible engine (``kvroute.emulator``), the last two sharing ``kvroute.engine.EngineModel``.
"""

__version__ = "0.1.0"
