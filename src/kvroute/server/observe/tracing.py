"""OpenTelemetry traces of routed requests (the optional extra ``kvroute[otel]``; ``--otel``).

Per request: a server span ``POST /v1/...`` (a child of the client's ``traceparent`` when it sent
one) with the routing attributes ``kvroute.request_id``, ``kvroute.backend``, ``kvroute.policy``,
``kvroute.reason``, ``kvroute.score``, ``kvroute.cached_tokens_expected``, ``kvroute.prompt_tokens``,
and at its end ``kvroute.cached_tokens`` (the engine's), ``kvroute.retries`` and
``http.response.status_code``; each attempt is a client child span ``upstream POST`` (``server.address``,
``kvroute.backend``, ``kvroute.retry``) whose W3C ``traceparent`` is injected into the request sent to
the backend, so an engine that traces continues the same trace. A failed attempt's span ends with an
error status.

``kvroute serve --otel`` builds an SDK tracer provider exporting over OTLP/HTTP, configured by the
standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME``; default endpoint ``http://localhost:4318``);
``OTEL_TRACES_EXPORTER=console`` prints spans instead. Tracing is on only with the flag (the config's
``otel: true``): an environment variable alone never changes the request path. Tests inject their own
provider (``RouterServer(tracer_provider=...)``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvroute.errors import UserError

__all__ = ["Tracing", "make_provider"]

_MISSING = (
    "--otel needs OpenTelemetry: pip install 'kvroute[otel]' "
    "(opentelemetry-api, opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
)


def make_provider() -> Any:
    """An SDK ``TracerProvider`` for ``--otel`` (module docstring); UserError when the packages are
    missing."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    except ImportError:
        raise UserError(_MISSING) from None
    service = os.environ.get("OTEL_SERVICE_NAME") or "kvroute"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter: SpanExporter
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
        exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise UserError(_MISSING) from None
        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class Tracing:
    """Starts the spans of the module docstring from ``provider`` (an OpenTelemetry tracer provider);
    no global OpenTelemetry state is read or set (the W3C propagator is used directly)."""

    def __init__(self, provider: Any) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise UserError(_MISSING) from None
        self._trace = trace
        self._kinds = (trace.SpanKind.SERVER, trace.SpanKind.CLIENT)
        self._error = trace.Status(trace.StatusCode.ERROR)
        self.tracer = provider.get_tracer("kvroute")
        self.propagator = TraceContextTextMapPropagator()

    def request_span(self, name: str, client_headers: Mapping[str, str], start_ns: int) -> Any:
        """The request's server span, started at ``start_ns`` (Unix ns) as a child of the client's
        trace context, if any."""
        ctx = self.propagator.extract(client_headers)
        return self.tracer.start_span(name, context=ctx, kind=self._kinds[0], start_time=start_ns)

    def upstream_span(self, parent: Any, url: str, retry: bool, headers: dict[str, str]) -> Any:
        """A client span for one attempt to ``url`` under ``parent``; its ``traceparent`` is written
        into ``headers`` (mutated: the upstream request's headers)."""
        ctx = self._trace.set_span_in_context(parent)
        span = self.tracer.start_span(
            "upstream POST",
            context=ctx,
            kind=self._kinds[1],
            attributes={"server.address": url, "kvroute.backend": url, "kvroute.retry": retry},
        )
        self.propagator.inject(headers, context=self._trace.set_span_in_context(span))
        return span

    def fail(self, span: Any, why: str) -> None:
        """End ``span`` as failed (``why``: a short description)."""
        span.set_status(self._error)
        span.set_attribute("error.type", why)
        span.end()
