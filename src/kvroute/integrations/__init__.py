"""Adapters that run kvroute's routing core inside other serving stacks (optional extras).

- :mod:`kvroute.integrations.ray_serve`: a Ray Serve ``RequestRouter`` (extra ``kvroute[ray]``).
- :mod:`kvroute.integrations.ray_state`: the state the routers of one deployment share.
- :mod:`kvroute.integrations.ray_engine`: kvroute's emulated engine as a Ray Serve deployment body.
- :mod:`kvroute.integrations.ray_tasks`: ``kvroute compare --executor ray`` (simulations as Ray tasks).
"""
