"""The Envoy config in front of the picker and the engines: made from :class:`GatewaySettings`, pure.

What it sets up (one listener, two clusters):

- the listener: HTTP/1.1 and HTTP/2 from clients; the ext_proc filter, then the router filter. The
  ext_proc filter streams both bodies to the picker (FULL_DUPLEX_STREAMED, trailers sent, as the
  protocol requires), fails closed (``failure_mode_allow: false``: with the picker down, clients get
  an error, never an unrouted request), accepts the picker's ``envoy.lb`` metadata and asks for the
  ``upstream.address`` attribute with the response (the served endpoint);
- cluster ``pool``: the engines, listed statically (a request can only go to one of them, whatever a
  client sends), load-balanced by Envoy's ``override_host`` policy from the picker's endpoint list:
  the ``x-gateway-destination-endpoint`` header and the ``envoy.lb`` metadata (metadata only with
  ``metadata_only``), tried in order on a connection failure (``retries`` more attempts);
- cluster ``picker``: the picker's gRPC port (HTTP/2);
- the answers Envoy makes itself (an upstream that fails, a malformed request) carry an OpenAI-style
  JSON error body, as the router's own do; up to 256 request headers.

The admin port is for ``/ready`` and ``/stats/prometheus`` on loopback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvroute.server.extproc.messages import DESTINATION, LB_NAMESPACE

__all__ = ["GatewaySettings", "envoy_config", "split_endpoint"]

_T = "type.googleapis.com/envoy."


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → (host, port); ValueError when malformed."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The gateway: clients on ``host``:``port``; the picker's gRPC at ``picker`` (``host:port``);
    the engines' ``endpoints`` (``host:port``); Envoy's admin on loopback ``admin_port``;
    ``metadata_only``: route by the metadata alone; ``retries``: more endpoints of the list tried on
    a connection failure; ``timeout_s``: a request's whole time (seconds, 0: none);
    ``message_timeout_s``: how long Envoy waits for one picker answer (seconds)."""

    host: str
    port: int
    picker: str
    endpoints: tuple[str, ...]
    admin_port: int
    metadata_only: bool = False
    retries: int = 1
    timeout_s: float = 0.0
    message_timeout_s: float = 60.0


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _cluster_endpoints(name: str, endpoints: tuple[str, ...]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": _addr(*split_endpoint(e))}} for e in endpoints]}
        ],
    }


def _seconds(s: float) -> str:
    return f"{s:.3f}s"


def _limits() -> dict[str, Any]:
    big = 1_000_000
    return {
        "thresholds": [
            {"max_connections": big, "max_pending_requests": big, "max_requests": big, "max_retries": big}
        ]
    }


def _override_host(metadata_only: bool) -> dict[str, Any]:
    sources: list[dict[str, Any]] = [] if metadata_only else [{"header": DESTINATION}]
    sources.append({"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}})
    round_robin = {
        "name": "envoy.load_balancing_policies.round_robin",
        "typed_config": {"@type": _T + "extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
    }
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": _T + "extensions.load_balancing_policies.override_host.v3.OverrideHost",
                        "override_host_sources": sources,
                        "fallback_policy": {"policies": [{"typed_extension_config": round_robin}]},
                    },
                }
            }
        ]
    }


def _ext_proc(s: GatewaySettings) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}},
            "failure_mode_allow": False,
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "message_timeout": _seconds(s.message_timeout_s),
            "metadata_options": {
                "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
                "forwarding_namespaces": {"untyped": [LB_NAMESPACE, LB_NAMESPACE + ".subset_hint"]},
            },
            "response_attributes": ["upstream.address"],
        },
    }


GATEWAY_ERROR_FLAGS = ("UF", "UH", "UO", "URX", "UPE", "UC", "UT", "UR", "NR", "DPE", "UMSDR", "DC")
"""Envoy's response flags of the answers it makes itself for an upstream or protocol failure: these
get an OpenAI-style JSON error body (a picker's immediate responses carry none: kept as they are)."""


def _local_replies() -> dict[str, Any]:
    error = {
        "message": "%LOCAL_REPLY_BODY%",
        "type": "gateway_error",
        "param": None,
        "code": "%RESPONSE_CODE%",
    }
    return {
        "mappers": [
            {
                "filter": {"response_flag_filter": {"flags": list(GATEWAY_ERROR_FLAGS)}},
                "body_format_override": {"json_format": {"error": error}},
            }
        ]
    }


def envoy_config(s: GatewaySettings) -> dict[str, Any]:
    """Envoy's bootstrap config (a JSON-able dict) for ``s`` (module docstring)."""
    route = {
        "cluster": "pool",
        "timeout": _seconds(s.timeout_s),
        "retry_policy": {"retry_on": "connect-failure,refused-stream", "num_retries": s.retries},
    }
    hcm = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "common_http_protocol_options": {"max_headers_count": 256},
        # the request's id is the client's x-request-id, else the picker's (as from the proxy)
        "preserve_external_request_id": True,
        "generate_request_id": False,
        "local_reply_config": _local_replies(),
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [
                {"name": "all", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": route}]}
            ],
        },
        "http_filters": [
            _ext_proc(s),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": _T + "extensions.filters.http.router.v3.Router",
                    "suppress_envoy_headers": True,
                },
            },
        ],
    }
    picker_host, picker_port = split_endpoint(s.picker)
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return {
        "admin": {"address": _addr("127.0.0.1", s.admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _addr(s.host, s.port),
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "pool",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": _cluster_endpoints("pool", s.endpoints),
                    "load_balancing_policy": _override_host(s.metadata_only),
                    "circuit_breakers": _limits(),
                },
                {
                    "name": "picker",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": _cluster_endpoints("picker", (f"{picker_host}:{picker_port}",)),
                    "typed_extension_protocol_options": http2,
                    "circuit_breakers": _limits(),
                },
            ],
        },
    }
