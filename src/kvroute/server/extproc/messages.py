"""Envoy ext_proc v3 messages, read and made: the endpoint-picker protocol's side of the wire.

What the protocol (Gateway API Inference Extension, endpoint picker protocol v1.0.0) puts where:

- the picked endpoints, ``host:port`` best first, comma-separated: the request header
  :data:`DESTINATION` (unless metadata-only) *and* the dynamic metadata ``envoy.lb`` → :data:`DESTINATION`
  (the same value);
- a subset hint from the gateway: filter metadata ``envoy.lb.subset_hint`` → :data:`SUBSET` (a list);
- the endpoint that served: metadata ``envoy.lb`` → :data:`SERVED`, or with a stock Envoy the
  ``upstream.address`` attribute that the filter's ``response_attributes`` asks for;
- bodies in FULL_DUPLEX_STREAMED mode: every chunk the picker receives goes back to Envoy as a
  ``streamed_response`` (request bodies in pieces of at most :data:`BODY_PIECE` bytes).

Header values are sent as ``raw_value`` (what Envoy reads since 1.27); both forms are read.
"""

from __future__ import annotations

from collections.abc import Iterator

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvroute.server.observe.observer import REQUEST_ID_HEADER
from kvroute.server.wire.http import HOP_BY_HOP

__all__ = [
    "BODY_PIECE",
    "DESTINATION",
    "LB_NAMESPACE",
    "SERVED",
    "SUBSET",
    "SUBSET_NAMESPACE",
    "body_pieces",
    "continue_headers",
    "first_request_id",
    "headers_of",
    "hop_by_hop",
    "immediate",
    "route_headers",
    "served_endpoint",
    "status_of",
    "streamed_body",
    "subset_hint",
]

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
"""The key under which Envoy's ext_proc filter sends the attributes it was asked for."""

BODY_PIECE = 62_000
"""A request body goes back to Envoy in pieces of at most this many bytes (as the reference picker)."""

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

_ENVOY_OWN = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"})
"""Hop-by-hop headers Envoy itself never forwards (and does not let a processor touch)."""


def headers_of(headers: pb.HttpHeaders) -> list[tuple[str, str]]:
    """The (lower-case name, value) pairs of an ext_proc header map, pseudo-headers included."""
    return [
        (h.key.lower(), h.raw_value.decode("latin-1") if h.raw_value else h.value)
        for h in headers.headers.headers
    ]


def status_of(pairs: list[tuple[str, str]]) -> int:
    """The ``:status`` of a response's header pairs (502 when absent or malformed)."""
    for k, v in pairs:
        if k == ":status":
            return int(v) if v.isdigit() else 502
    return 502


def _mutation(headers: dict[str, str]) -> list[base_pb2.HeaderValueOption]:
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")), append_action=_OVERWRITE
        )
        for k, v in headers.items()
    ]


def hop_by_hop(pairs: list[tuple[str, str]]) -> list[str]:
    """The request's headers that must not reach the upstream (the proxy's rule, RFC 9110 section
    7.6.1): :data:`~kvroute.server.wire.http.HOP_BY_HOP` and those its ``Connection`` names, as
    present in ``pairs`` (lower-case names)."""
    named = {t.strip().lower() for k, v in pairs if k == "connection" for t in v.split(",")}
    return sorted({k for k, _ in pairs if k in HOP_BY_HOP or k in named} - _ENVOY_OWN)


def first_request_id(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``pairs`` with the client's first ``x-request-id`` only: Envoy joins repeated ones with commas
    (the proxy, too, takes the first)."""
    return [(k, v.split(",", 1)[0].strip()) if k == REQUEST_ID_HEADER else (k, v) for k, v in pairs]


def route_headers(
    endpoints: tuple[str, ...],
    upstream: tuple[tuple[str, str], ...],
    metadata_only: bool,
    drop: list[str] | None = None,
) -> pb.ProcessingResponse:
    """The answer to the request headers: the destination in the metadata and (unless
    ``metadata_only``) in the header, which is always overwritten (a client's own value, forged or
    not, never reaches Envoy's load balancer: metadata-only removes it); ``upstream``: more headers
    to set on the upstream request; ``drop``: headers to remove from it."""
    value = ",".join(endpoints)
    headers = dict(upstream)
    remove: list[str] = list(drop or ())
    if metadata_only:
        remove.append(DESTINATION)
    else:
        headers[DESTINATION] = value
    mutation = pb.HeaderMutation(set_headers=_mutation(headers), remove_headers=remove)
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION: value}})
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation)),
        dynamic_metadata=meta,
    )


def continue_headers(response: bool, add: dict[str, str] | None = None) -> pb.ProcessingResponse:
    """Go on with the request (``response`` False) or response headers, adding ``add``."""
    common = pb.CommonResponse()
    if add:
        common.header_mutation.set_headers.extend(_mutation(add))
    answer = pb.HeadersResponse(response=common)
    if response:
        return pb.ProcessingResponse(response_headers=answer)
    return pb.ProcessingResponse(request_headers=answer)


def streamed_body(chunk: bytes, end: bool, response: bool) -> pb.ProcessingResponse:
    """A body chunk handed back to Envoy unchanged (FULL_DUPLEX_STREAMED)."""
    answer = pb.BodyResponse(
        response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end)
            )
        )
    )
    if response:
        return pb.ProcessingResponse(response_body=answer)
    return pb.ProcessingResponse(request_body=answer)


def body_pieces(body: bytes) -> Iterator[pb.ProcessingResponse]:
    """A whole request body handed back to Envoy in pieces of at most :data:`BODY_PIECE` bytes."""
    n = len(body)
    for at in range(0, max(n, 1), BODY_PIECE):
        yield streamed_body(body[at : at + BODY_PIECE], at + BODY_PIECE >= n, False)


def immediate(status: int, body: bytes, headers: tuple[tuple[str, str], ...]) -> pb.ProcessingResponse:
    """Envoy answers the client itself: ``status``, ``body`` and ``headers``."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=_mutation(dict(headers))),
            body=body,
        )
    )


def subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    """The gateway's subset hint (endpoints), or None when it gave none."""
    ns = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in ns:
        return None
    fields = ns[SUBSET_NAMESPACE].fields
    if SUBSET not in fields:
        return None
    value = fields[SUBSET]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    if value.HasField("string_value"):
        return [e.strip() for e in value.string_value.split(",") if e.strip()]
    return []


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The endpoint that served the response: the protocol's metadata, else Envoy's
    ``upstream.address`` attribute; None when neither is there."""
    ns = req.metadata_context.filter_metadata
    if LB_NAMESPACE in ns and SERVED in ns[LB_NAMESPACE].fields:
        return ns[LB_NAMESPACE].fields[SERVED].string_value or None
    attrs = req.attributes
    if EXT_PROC_ATTRIBUTES in attrs and "upstream.address" in attrs[EXT_PROC_ATTRIBUTES].fields:
        return attrs[EXT_PROC_ATTRIBUTES].fields["upstream.address"].string_value or None
    return None
