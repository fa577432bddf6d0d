"""A data-path conformance suite for any front door of OpenAI-style LLM traffic.

- :mod:`~kvroute.conformance.upstream`: a misbehaving upstream, a real HTTP/1.1 server that acts like
  an OpenAI-compatible engine and misbehaves on request (:mod:`~kvroute.conformance.faults`);
- :mod:`~kvroute.conformance.clients`: a catalogue of hostile and odd clients over raw sockets;
- :mod:`~kvroute.conformance.invariant`: the checks every response (and every forwarded request) must
  pass: its own id, no byte of another response, no hang, no 5xx for a client's fault;
- :mod:`~kvroute.conformance.runner`: runs each case, then ordinary requests over the same pooled
  connections, and checks the front door's log;
- :mod:`~kvroute.conformance.frontdoor`: what a front door must offer, and ``kvroute serve`` as one.

``python -m kvroute.conformance --help`` runs it from the command line. Nothing here imports pytest.
"""
