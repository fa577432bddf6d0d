"""The stages of one request in the live router, each a function with one job, in the order
:meth:`kvroute.server.pipeline.Proxy.handle` calls them: :mod:`.prepare` (tokens, block chain),
:mod:`.decide` (the routing core → a frozen plan), :mod:`.forward` (reserve a backend, send the body),
then :mod:`kvroute.server.wire.relay` (the answer) and :mod:`.settle` (the outcome booked). A later
stage may import an earlier one's frozen types; no stage calls an earlier one."""
