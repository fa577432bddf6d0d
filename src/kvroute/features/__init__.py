"""Production features around the routing score (design §4–6), shared by the simulator and the router.

Every object here is pure: no I/O, no clock (time in seconds is passed in), no module-level state.
The router logs and exports what they record; the simulator puts it in its JSON output.

- :mod:`.prefix`: the *prefix class* of a request (its first K blocks), the unit of hot-spot detection.
- :mod:`.window`: per-key counts over a sliding time window.
- :mod:`.hotspot`: the two-stage KV hot-spot detector and its mitigation switch (design §4.1, paper §5.2).
- :mod:`.coldstart`: warming instances (BS cap, (P-token + 10) × BS), frequent prefixes to preload (§4.2).
- :mod:`.monitor`: the P-token × BS distribution of decisions, rolling p95 and its persistent-excess alert.
- :mod:`.loadadapt`: cluster load and the BS exponent above 70 % load (§5.3).
- :mod:`.classes`: request classes (TTFT- vs TPOT-sensitive) and their BS exponents (§5.3).
- :mod:`.limits`: P-token cap, spot-instance exclusion and per-user token-bucket quotas (§6.1).

:class:`kvroute.routing.guarded.Guarded` combines them around any registry policy. Which are on:
:class:`.settings.FeatureConfig`. Their command-line flags and YAML section are read in
:mod:`kvroute.commands.settings`; the router exports them to Prometheus in
:mod:`kvroute.server.observe.feature_metrics`.
"""
