"""Traces: W3C trace context through the plane, and OpenTelemetry spans when asked for.

The `traceparent` (and `tracestate`) a caller sends (over NATS, through the HTTP gateway, or
on a Kafka record the bridge carries) goes with the request: the router puts it on the slot
message, the node echoes it on the reply. That costs a header copy and is always on.

Spans are off by default. With `OTEL_EXPORTER_OTLP_ENDPOINT` set (the OpenTelemetry
convention; `plane router`, `plane node` and `plane up` read it) or an exporter passed in (the
tests), the router records `plane.admission` (receipt to decision) as a child of the caller's
span and passes its own context on the slot message; the node records `plane.slot_wait`
(the router's publish to the node's fetch), `plane.compute` (the device call) and
`plane.write_back` (ack, done-event, reply) under it. A request without a `traceparent` starts
a trace at the router. opentelemetry-api/sdk (and the OTLP exporter) come with the `tracing`
extra and are imported only when spans are on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from plane.contract.subjects import TRACE_HEADER_MAX, TRACE_HEADERS

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace context among `headers`, bounded."""
    return {h: v for h in TRACE_HEADERS if (v := headers.get(h)) and len(v) <= TRACE_HEADER_MAX}


def epoch_ns_of(perf_ns: int) -> int:
    """A `perf_counter_ns` reading as wall-clock epoch ns (what spans carry)."""
    return time.time_ns() - (time.perf_counter_ns() - perf_ns)


class Span:
    """An open span: its W3C context to pass on, ended once with explicit times."""

    def __init__(self, span: Any) -> None:
        self._span = span

    def context_headers(self) -> dict[str, str]:
        from opentelemetry import trace
        from opentelemetry.propagate import inject

        out: dict[str, str] = {}
        inject(out, context=trace.set_span_in_context(self._span))
        return out

    def end(self, end_ns: int, **attributes: str | int) -> None:
        self._span.set_attributes(attributes)
        self._span.end(end_time=end_ns)


class Tracing:
    """`Tracing.off()` records nothing; `Tracing.to(exporter, service)` records spans."""

    def __init__(self, tracer: Any | None, provider: Any | None = None) -> None:
        self._tracer = tracer
        self._provider = provider

    @property
    def on(self) -> bool:
        return self._tracer is not None

    @classmethod
    def off(cls) -> Tracing:
        return cls(None)

    @classmethod
    def to(cls, exporter: Any, service: str, *, batch: bool = True) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        # Batching keeps the export off the request path (a thread exports); tests export
        # at once to read what was recorded.
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch
                                    else SimpleSpanProcessor(exporter))
        return cls(provider.get_tracer("plane"), provider)

    @classmethod
    def from_env(cls, service: str) -> Tracing:
        """Spans to the OTLP endpoint in `OTEL_EXPORTER_OTLP_ENDPOINT`, else off."""
        if not os.environ.get(ENDPOINT_ENV):
            return cls.off()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls.to(OTLPSpanExporter(), service)  # reads the endpoint from the env

    def start(self, name: str, parent: Mapping[str, str], start_ns: int,
              attributes: Mapping[str, str | int]) -> Span | None:
        """A span under the W3C context in `parent` (a new trace when it has none)."""
        if self._tracer is None:
            return None
        from opentelemetry.propagate import extract

        span = self._tracer.start_span(name, context=extract(dict(parent)),
                                       start_time=start_ns, attributes=dict(attributes))
        return Span(span)

    def record(self, name: str, parent: Mapping[str, str], start_ns: int, end_ns: int,
               attributes: Mapping[str, str | int]) -> None:
        span = self.start(name, parent, start_ns, attributes)
        if span is not None:
            span.end(end_ns)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


__all__ = ["ENDPOINT_ENV", "Span", "Tracing", "epoch_ns_of", "trace_headers"]
