"""Traces: a caller's W3C `traceparent` goes through the router and the slot to the node and
comes back on the reply; with spans on, the router's admission and the node's slot wait,
compute and write-back are recorded in the caller's trace, each under the one before."""

from __future__ import annotations

import nats
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from plane.contract.subjects import Header
from plane.contract.tracing import Tracing
from plane.stack import PlaneStack, StackConfig
from tests.plane_fixtures import NAMES, calibrated, header, plane, status, wait_until

pytestmark = pytest.mark.slow

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


async def test_the_trace_context_comes_back_on_the_reply_with_spans_off() -> None:
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack:
        nc = await nats.connect(stack.url)
        try:
            m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5,
                                 headers={Header.TRACEPARENT: TRACEPARENT,
                                          Header.TRACESTATE: "vendor=x"})
            assert status(m) == 200
            assert header(m, Header.TRACEPARENT) == TRACEPARENT
            assert header(m, Header.TRACESTATE) == "vendor=x"
            bad = await nc.request(NAMES.infer("calibrated"), b"{", timeout=5,
                                   headers={Header.TRACEPARENT: TRACEPARENT})
            assert status(bad) == 400 and header(bad, Header.TRACEPARENT) == TRACEPARENT
        finally:
            await nc.close()


async def test_spans_of_one_request_are_in_the_callers_trace() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing.to(exporter, "plane-test", batch=False)
    cfg = StackConfig(models=("calibrated",), slots=1, backend="torch")
    try:
        async with PlaneStack(cfg, tracing=tracing) as stack:
            nc = await nats.connect(stack.url)
            try:
                m = await nc.request(NAMES.infer("calibrated"), calibrated(2000), timeout=5,
                                     headers={Header.TRACEPARENT: TRACEPARENT})
                assert status(m) == 200
                names = {"plane.admission", "plane.slot_wait", "plane.compute",
                         "plane.write_back"}
                await wait_until(lambda: names <= {s.name for s in exporter.get_finished_spans()},
                                 5.0, "the four spans")
            finally:
                await nc.close()
    finally:
        tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    admission = spans["plane.admission"]
    assert f"{admission.context.trace_id:032x}" == TRACE_ID
    assert admission.parent is not None and f"{admission.parent.span_id:016x}" == CALLER_SPAN
    assert admission.attributes is not None and admission.attributes["outcome"] == "placed"
    for name in ("plane.slot_wait", "plane.compute", "plane.write_back"):
        span = spans[name]
        assert span.context.trace_id == admission.context.trace_id, name
        assert span.parent is not None and span.parent.span_id == admission.context.span_id
    compute = spans["plane.compute"]
    assert compute.end_time is not None and compute.start_time is not None
    assert compute.end_time - compute.start_time >= 2_000_000  # the 2 ms of work
    # The reply carries the trace on (the router's admission span, under the caller's).
    assert (header(m, Header.TRACEPARENT) or "").split("-")[1] == TRACE_ID
