"""The live router: an aiohttp proxy in front of vLLM/SGLang-style engines, around the one routing
core (:mod:`kvroute.routing`). Its parts import downward only (``tests/test_layers.py``
checks every import with ast, lazy ones included):

=========== =====================================================================  =====================
layer       what it holds                                                          may import (server/)
=========== =====================================================================  =====================
wire/       HTTP in and out: request validation, error JSON, bounded bodies, the    nothing
            upstream transport and its HTTP/1.1 client, the relay of an answer
config.py   the router's frozen settings and their parsing                         nothing
state/      backends, leases, the shared load table, model pools, the router's     wire, config
            state (membership, KV view, routing core, counters)
sync/       engines' metrics and models scraping, fleet membership and KV-event    state, wire, config
            subscribers, replica peers, discovery, the admin API and its journal
observe/    decision records, metrics and exporters, tracing, dashboard, debug     state, wire, config
stages/     one request's stages: prepare, decide, reserve/forward, settle         observe, state, wire,
                                                                                   config
pipeline.py the handler that runs the stages in order, and the in-flight requests   stages and below
app.py,     process lifecycle: the server (app), one process's run loop and        everything below
cluster.py, reload (run), the multi-worker supervisor (workers), engine clusters
run.py,     for ``up``/``demo`` (cluster)
workers.py
=========== =====================================================================  =====================

``sync`` and ``observe`` are siblings: neither imports the other. Inside a subpackage modules import
each other freely (no cycles). What every driver needs of a request and an engine (tokenizing, the
chain memo, KV-event subscription) is :mod:`kvroute.prepare`, not here.
"""
