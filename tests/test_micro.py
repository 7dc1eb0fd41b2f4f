"""Inference is a NATS micro endpoint: `$SRV.INFO` lists it, `$SRV.STATS` counts every
request and the errors the router answered; error replies carry the services standard's
headers beside the plane's own."""

from __future__ import annotations

import json

import nats
import pytest
from nats.aio.msg import Msg

from plane.contract.messages import Reason, Status
from plane.contract.replies import error_reply
from plane.contract.subjects import Header
from plane.router.requests import RequestPath
from tests.plane_fixtures import NAMES, calibrated, client, header, plane, status

pytestmark = pytest.mark.slow


async def test_srv_stats_counts_inference_requests_and_errors() -> None:
    async with plane(models=("calibrated",), slots=2, backend="torch") as stack:
        nc = await nats.connect(stack.url)
        try:
            for _ in range(7):
                assert status(await nc.request(NAMES.infer("calibrated"), calibrated(0),
                                               timeout=5)) == 200
            bad = await nc.request(NAMES.infer("calibrated"), b"{not json", timeout=5)
            assert status(bad) == 400
            assert header(bad, Header.NATS_SERVICE_ERROR_CODE) == "400"
            assert "JSON" in (header(bad, Header.NATS_SERVICE_ERROR) or "")

            service = NAMES.router_service
            info = json.loads((await nc.request(f"$SRV.INFO.{service}", b"", timeout=2)).data)
            [infer] = [e for e in info["endpoints"] if e["name"] == "infer"]
            assert infer["subject"] == NAMES.infer_all()
            assert infer["queue_group"] == "plane-routers"
            stats = json.loads((await nc.request(f"$SRV.STATS.{service}", b"",
                                                 timeout=2)).data)
            [infer_stats] = [e for e in stats["endpoints"] if e["name"] == "infer"]
            assert infer_stats["num_requests"] == 8
            assert infer_stats["num_errors"] == 1
            assert infer_stats["last_error"].startswith("400 ")
            assert infer_stats["processing_time"] > 0
        finally:
            await nc.close()


def test_the_service_error_header_is_one_printable_bounded_line() -> None:
    """`Nats-Service-Error` carries the refusal's message as one line: control characters
    become spaces (a newline would end the header), and a long message is cut at 256."""
    _, plain = error_reply("r-1", Status.BUSY, Reason.BUSY, "all slots are busy: 12 ms")
    assert plain[Header.NATS_SERVICE_ERROR] == "all slots are busy: 12 ms"
    body, odd = error_reply("r-2", Status.BAD_REQUEST, Reason.BAD_REQUEST, "bad\r\nfield\tx")
    assert odd[Header.NATS_SERVICE_ERROR] == "bad  field x"
    assert json.loads(body)["error"] == "bad\r\nfield\tx"  # the body keeps it as it was
    _, long = error_reply("r-3", Status.BUSY, Reason.BUSY, "x" * 300)
    assert len(long[Header.NATS_SERVICE_ERROR]) == 256
    assert long[Header.NATS_SERVICE_ERROR].endswith("...")


async def test_a_request_the_router_fails_on_is_answered_500_and_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint's callback is the plane's own (`InferEndpoint._counted`), not nats-py's
    `Endpoint._handle_request`: a handler that raises still gets its caller one answer, a
    500, and the endpoint's statistics count it, as nats-py's would."""
    real = RequestPath.on_request

    async def failing(self: RequestPath, msg: Msg) -> None:
        if msg.data == b"boom":
            raise RuntimeError("boom")
        await real(self, msg)

    monkeypatch.setattr(RequestPath, "on_request", failing)
    async with (plane(models=("calibrated",), slots=1, backend="torch") as stack,
                client(stack.url) as nc):
        failed = await nc.request(NAMES.infer("calibrated"), b"boom", timeout=5)
        assert header(failed, Header.NATS_SERVICE_ERROR_CODE) == "500"
        assert "boom" in (header(failed, Header.NATS_SERVICE_ERROR) or "")
        assert status(await nc.request(NAMES.infer("calibrated"), calibrated(0),
                                       timeout=5)) == 200
        stats = json.loads((await nc.request(f"$SRV.STATS.{NAMES.router_service}", b"",
                                             timeout=2)).data)
        [infer] = [e for e in stats["endpoints"] if e["name"] == "infer"]
        assert (infer["num_requests"], infer["num_errors"]) == (2, 1)
        assert "boom" in infer["last_error"]
        assert infer["processing_time"] > 0 and infer["average_processing_time"] > 0
