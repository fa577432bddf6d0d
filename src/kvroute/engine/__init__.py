"""The engine model: one vLLM-v1-like instance as a clock-free state machine.

Shared by the simulator (simulated clock) and the emulated engine server (wall clock).
"""
