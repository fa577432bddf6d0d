"""The one routing path: every routing decision of kvroute is made here.

Drivers (the live router, the simulator, ``validate``, adapters) gather instance views and carry out
decisions; they never decide. Pure: no I/O, no asyncio, no clock (time is passed in), no globals.
"""
