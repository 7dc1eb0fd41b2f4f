"""The gateway's HTTP calls in flight when its NATS connection drops (the nats-server killed),
against a real plane on a nats-server of its own: each is answered at once, exactly once, 503
`unhealthy` (a whole answer, in its route's error shape) or, for a stream already under way,
its final error event. They waited before for an answer the drop had lost: a whole answer
until its deadline and the SDK's margin (18 s after the kill, of a 20 s deadline), a stream
until its stream deadline (59 s of 60 s)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats
import pytest

from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.subjects import Header
from plane.gateway import Gateway, GatewayConfig
from plane.stack import PlaneStack
from tests.plane_fixtures import plane, slots_running, slow_steps, wait_until

SLOTS = 3  # per node: three generations at once (a stream, a stream, a whole answer)
# Long enough that nothing here ends by itself while the test runs: every answer after the
# kill is the drop's.
LONG = {Header.DEADLINE_MS: "30000", Header.STREAM_DEADLINE_MS: "60000"}
ANSWERED_WITHIN_S = 8.0  # generous on a loaded box; the deadlines above are 30 s and 60 s


@pytest.fixture
async def stack(nats_server: EmbeddedNats) -> AsyncIterator[PlaneStack]:
    async with plane(nats_server.url, models=("calibrated", "tinylm"), slots=SLOTS,
                     allow_faults=True) as s:
        nc = await nats.connect(nats_server.url)
        for k in range(SLOTS):  # 200 tokens take 8 s at least: still running at the kill
            await slow_steps(nc, 40_000, k=k)
        await nc.close()
        yield s


@pytest.fixture
async def gateway(stack: PlaneStack, nats_server: EmbeddedNats) -> AsyncIterator[Gateway]:
    async with Gateway(GatewayConfig(port=0), ConnectOptions(url=nats_server.url)) as gw:
        yield gw


async def _started(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                   headers: dict[str, str]) -> aiohttp.ClientResponse:
    """A stream's response, once its head (200, the stream started) and first event came."""
    r = await http.post(url, json=body, headers=headers)
    assert r.status == 200, await r.text()
    await r.content.readuntil(b"\n\n")
    return r


async def _whole(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 headers: dict[str, str]) -> tuple[int, dict[str, str], dict[str, Any], float]:
    async with http.post(url, json=body, headers=headers) as r:
        answer = await r.json()
        return r.status, dict(r.headers), answer, time.monotonic()


async def _rest(r: aiohttp.ClientResponse) -> tuple[str, float]:
    text = (await r.read()).decode()
    r.release()
    return text, time.monotonic()


async def test_calls_in_flight_when_nats_drops_are_answered_at_once_exactly_once(
        stack: PlaneStack, gateway: Gateway, nats_server: EmbeddedNats) -> None:
    prompt = {"prompt": "The plane", "max_tokens": 200}
    async with aiohttp.ClientSession() as http:
        sse = await _started(http, f"{gateway.url}/v1/infer/tinylm", prompt,
                             {**LONG, Header.STREAM: "1", Header.REQUEST_ID: "drop-sse"})
        chunks = await _started(http, f"{gateway.url}/v1/completions",
                                {"model": "tinylm", **prompt, "stream": True}, LONG)
        wholes = [
            asyncio.create_task(_whole(
                http, f"{gateway.url}/v1/infer/calibrated", {"duration_us": 9_000_000},
                {Header.DEADLINE_MS: "20000", Header.REQUEST_ID: "drop-whole"})),
            asyncio.create_task(_whole(
                http, f"{gateway.url}/v1/chat/completions",
                {"model": "tinylm", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 200}, LONG)),
        ]
        await wait_until(lambda: slots_running(stack) == 4, 10, "all four to run")
        await nats_server.stop(kill=True)
        killed = time.monotonic()
        try:
            async with asyncio.timeout(ANSWERED_WITHIN_S * 3):  # before: 18 s to a minute
                (infer_status, infer_headers, infer_answer, infer_at), (
                    chat_status, _, chat_answer, chat_at) = await asyncio.gather(*wholes)
                sse_text, sse_at = await _rest(sse)
                chunks_text, chunks_at = await _rest(chunks)
        finally:
            await nats_server.start()  # the plane stops as usual, not into a dead server

    took = {name: at - killed for name, at in [("infer", infer_at), ("chat", chat_at),
                                               ("sse", sse_at), ("chunks", chunks_at)]}
    assert max(took.values()) < ANSWERED_WITHIN_S, took
    # A whole answer: 503 `unhealthy`, `{"error", "reason"}` with its request id.
    assert infer_status == 503 and infer_answer["reason"] == "unhealthy", infer_answer
    assert "connection to NATS dropped" in infer_answer["error"], infer_answer
    assert infer_headers[Header.REASON] == "unhealthy"
    assert infer_headers[Header.REQUEST_ID] == "drop-whole"
    # OpenAI's whole answer: the same in its shape (the `openai` package retries a 503).
    assert chat_status == 503 and chat_answer["error"]["code"] == "unhealthy", chat_answer
    assert chat_answer["error"]["type"] == "server_error"
    # The plane's SSE: tokens, then one `end`, the last event, with the 503 inside.
    events = [e for e in sse_text.split("\n\n") if e]
    ends = [e for e in events if e.startswith("event: end")]
    assert len(ends) == 1 and events[-1] == ends[0], events[-3:]
    end = json.loads(ends[0].split("data: ", 1)[1])
    assert end["status"] == 503 and end["reason"] == "unhealthy", end
    assert "dropped mid-stream" in end["error"] and end["request_id"] == "drop-sse", end
    # OpenAI's stream: one `error` event, then `[DONE]`, and nothing after.
    data = [e.split("data: ", 1)[1] for e in chunks_text.split("\n\n") if e]
    assert data[-1] == "[DONE]", data[-3:]
    errors = [json.loads(d)["error"] for d in data[:-1] if '"error"' in d]
    assert len(errors) == 1 and json.loads(data[-2]).get("error") == errors[0], data[-3:]
    assert errors[0]["code"] == "unhealthy", errors
