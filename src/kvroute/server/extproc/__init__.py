"""The Gateway API endpoint picker's wire: Envoy's external processing (ext_proc) in and out.

A front door beside :mod:`kvroute.server.wire` (the aiohttp proxy's): Envoy carries the bytes, and the
picker only parses, prepares, decides, reserves and settles, through the same stages
(:mod:`kvroute.server.stages`) and against the same router state as the proxy.

- :mod:`.exchange`: one HTTP request's trip through the stages, fed by the gateway's events (no
  protobuf here);
- :mod:`.messages`: ext_proc messages read and made (headers, metadata, immediate responses);
- :mod:`.service`: the gRPC services (``ExternalProcessor`` and ``grpc.health.v1.Health``);
- :mod:`.envoyconf`: the Envoy config in front of the picker, made and validated.
"""
