"""The gateway's streams against a real plane (nats-server, router, a `tinylm` node with one
slot): the `openai` package from PyPI, unchanged, on `/v1/completions` and
`/v1/chat/completions`, and the plane's own Server-Sent Events on `/v1/infer/tinylm`.

The gateway names a tenant by bearer token here, as in production: the `openai` client's
`api_key` is that token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import nats
import openai
import pytest
from nats.aio.client import Client as NATS
from openai.types.chat import ChatCompletionMessageParam
from openapi_spec_validator import validate

from plane.client import Client
from plane.client.result import Result
from plane.contract.config import ConnectOptions
from plane.contract.messages import DoneEvent, read_done
from plane.contract.subjects import Header
from plane.gateway import Gateway, GatewayConfig
from plane.gateway.openai_compat import from_result
from plane.stack import PlaneStack, StackConfig
from tests.plane_fixtures import NAMES, listen, slots_running, wait_until
from tests.plane_fixtures import slow_steps as slow

MODEL = "tinylm"
NODE = "node0-tinylm"
PROMPT = "The plane"  # greedy from here never samples END: a stream runs to max_tokens
TOKEN = "acme-token-0123"
BURST = 3


@pytest.fixture
async def stack() -> AsyncIterator[PlaneStack]:
    async with PlaneStack(StackConfig(models=(MODEL,), slots=1, allow_faults=True)) as s:
        yield s


@pytest.fixture
async def gateway(stack: PlaneStack) -> AsyncIterator[Gateway]:
    config = GatewayConfig(port=0, tenant_tokens={TOKEN: "acme"})
    async with Gateway(config, ConnectOptions(url=stack.url)) as gw:
        yield gw


@pytest.fixture
async def oa(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    # No retries of its own: each test sees what the gateway answered.
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=TOKEN,
                                  max_retries=0, timeout=20) as client:
        yield client


@pytest.fixture
async def admin(stack: PlaneStack) -> AsyncIterator[NATS]:
    nc = await nats.connect(stack.url)
    yield nc
    await nc.close()


async def plane_text(stack: PlaneStack, max_tokens: int, prompt: str = PROMPT) -> str:
    """What the plane itself answers (greedy: the one text every route must give)."""
    async with Client.connect(stack.url) as c:
        r = await c.invoke(MODEL, {"prompt": prompt, "max_tokens": max_tokens},
                           deadline_ms=5000)
    text: str = r.json()["text"]
    return text




# -- the openai package ----------------------------------------------------------------------
async def test_completions_whole_and_streamed(stack: PlaneStack,
                                              oa: openai.AsyncOpenAI) -> None:
    expected = await plane_text(stack, 60)
    raw = await oa.completions.with_raw_response.create(model=MODEL, prompt=PROMPT,
                                                        max_tokens=60)
    # Where it ran, as a whole answer on /v1/infer says (the start's headers, merged).
    assert raw.headers[Header.NODE] == NODE and raw.headers[Header.SLOT] == "0"
    assert int(raw.headers[Header.SERVICE_US]) > 0
    whole = raw.parse()
    assert whole.object == "text_completion" and whole.model == MODEL
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 60
    assert whole.usage.prompt_tokens == len(PROMPT) and whole.usage.total_tokens == 60 + 9
    assert whole.id.startswith("cmpl-")

    chunks = [c async for c in await oa.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=60, stream=True,
        stream_options={"include_usage": True})]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == expected and len([t for t in texts if t]) >= 2
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 60
    assert len({c.id for c in chunks}) == 1


async def test_chat_whole_and_streamed(stack: PlaneStack, oa: openai.AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "hi"}]
    prompt = "system: be brief\nuser: hi\nassistant:"
    expected = await plane_text(stack, 40, prompt)
    whole = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=40)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt)

    stream = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                              stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)


async def test_temperature_top_p_and_seed_reach_the_plane(stack: PlaneStack,
                                                          oa: openai.AsyncOpenAI) -> None:
    async with Client.connect(stack.url) as c:
        r = await c.invoke(MODEL, {"prompt": "x", "max_tokens": 30, "temperature": 1.5,
                                   "seed": 42}, deadline_ms=5000)
        nucleus = await c.invoke(MODEL, {"prompt": "x", "max_tokens": 30, "temperature": 1.5,
                                         "seed": 42, "top_p": 0.3}, deadline_ms=5000)
    sampled = await oa.completions.create(model=MODEL, prompt="x", max_tokens=30,
                                          temperature=1.5, seed=42)
    assert sampled.choices[0].text == r.json()["text"]
    greedy = await plane_text(stack, 30, "x")
    assert sampled.choices[0].text != greedy  # not greedy
    narrowed = await oa.completions.create(model=MODEL, prompt="x", max_tokens=30,
                                           temperature=1.5, seed=42, top_p=0.3)
    assert narrowed.choices[0].text == nucleus.json()["text"] != sampled.choices[0].text
    only_likeliest = await oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=30,
        temperature=1.5, seed=42, top_p=0.0)
    assert only_likeliest.choices[0].message.content == await plane_text(
        stack, 30, "user: x\nassistant:")  # top_p 0: the likeliest token each time


async def test_a_busy_plane_is_a_rate_limit_error(stack: PlaneStack, admin: NATS,
                                                  oa: openai.AsyncOpenAI) -> None:
    await slow(admin, 3000)  # the holder's 100 tokens take 0.3 s at least
    async with Client.connect(stack.url) as c, c.stream(
            MODEL, {"prompt": PROMPT, "max_tokens": 100}, deadline_ms=5000) as holder:
        assert holder.started
        with pytest.raises(openai.RateLimitError) as info:
            await oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
        with pytest.raises(openai.RateLimitError):
            await oa.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                stream=True)
    await slow(admin, 0)
    err = info.value
    assert err.status_code == 429 and int(err.response.headers["Retry-After"]) >= 1
    assert int(err.response.headers[Header.RETRY_AFTER_MS]) >= 1
    assert err.response.headers.get(Header.TICKET)
    assert err.code == "busy" and err.type == "rate_limit_error"
    assert isinstance(err.body, dict) and "busy" in err.body["message"]


@pytest.mark.parametrize("how", ["openai", "openai-stream", "curl-retry"])
async def test_a_retry_at_retry_after_without_the_ticket_is_served(
        gateway: Gateway, admin: NATS, how: str) -> None:
    """The `openai` package retries a 429 after its `Retry-After-Ms`, and curl --retry after
    its Retry-After, but neither can send `Plane-Ticket` back: each came back as a newcomer,
    and while promises were pinned its own promise refused it again (the openai package with
    `max_retries=1`: 2 of 10 raised `RateLimitError` after their retry, found from outside;
    here, nearly every one). The gateway holds each 429's ticket and gives it to the retry:
    a burst refused behind a stream is served, every one at its first retry."""
    # Token steps of 40 ms learned by the router (from done-events, of the shapes that
    # follow), then of 30: the slot frees before each predicted time, whatever else this
    # host runs (a retry late by its event loop, 10-20 ms with everything in one process,
    # does not make the next one's slot late), and a holder that finds its slot still busy
    # is the ticket's failure, not the schedule's.
    await slow(admin, 40_000)
    deadline = {Header.DEADLINE_MS: "5000"}  # the default's is shorter than the burst's wait
    auth = {"Authorization": f"Bearer {TOKEN}", **deadline}
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=TOKEN,
                                  max_retries=1, timeout=20,
                                  default_headers=deadline) as retrying, \
            aiohttp.ClientSession(headers=auth) as http:
        for _ in range(2):
            await retrying.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        await slow(admin, 30_000)
        # The holder is the burst's tenant's (another tenant's would halve its share:
        # refusals `tenant-share`, with no ticket to carry).
        holder = await retrying.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                   stream=True)
        async for _ in holder:
            break  # it started: the slot is its own for 210 ms more at least

        async def with_openai(i: int) -> int:
            raw = await retrying.completions.with_raw_response.create(
                model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=4,
                stream=how == "openai-stream")
            if how == "openai-stream":
                async for _ in raw.parse():
                    pass
            return raw.retries_taken

        async def like_curl(i: int) -> int:  # the same bytes again, at Retry-After-Ms
            body = msgspec.json.encode({"prompt": f"{PROMPT} {i}", "max_tokens": 4})
            for retries in range(2):
                async with http.post(f"{gateway.url}/v1/infer/{MODEL}", data=body) as r:
                    await r.read()
                    if r.status != 429 or retries:
                        assert r.status == 200, (retries, r.headers)
                        return retries
                    assert r.headers[Header.REASON] == "busy", r.headers
                    await asyncio.sleep(int(r.headers[Header.RETRY_AFTER_MS]) / 1000)
            raise AssertionError("unreachable")

        one = like_curl if how == "curl-retry" else with_openai
        retries = await asyncio.gather(*(one(i) for i in range(BURST)))
        await holder.close()
    await slow(admin, 0)
    assert retries.count(1) >= BURST - 1, retries  # refused: the slot was the holder's
    assert set(retries) <= {0, 1}, retries


async def test_a_client_that_leaves_mid_stream_frees_the_slot(
        stack: PlaneStack, admin: NATS, oa: openai.AsyncOpenAI) -> None:
    cancels = await listen(admin, NAMES.cancel_all())
    dones = await listen(admin, NAMES.done_all())
    await slow(admin, 2000)  # 200 tokens: 0.4 s at least, if not cancelled
    stream = await oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200,
                                         stream=True)
    rid = stream.response.headers[Header.REQUEST_ID]
    async for _ in stream:
        break
    await stream.close()  # the HTTP connection goes
    await wait_until(lambda: any((c.headers or {}).get(Header.REQUEST_ID) == rid
                                 for c in cancels), 5, "the gateway's cancel")
    took_s = await wait_until(lambda: slots_running(stack) == 0, 5, "the slot to free")
    assert took_s < 0.3
    def events() -> list[DoneEvent]:
        return [e for d in dones for e in read_done(d.data, batch=NAMES.is_done_batch(d.subject))]

    await wait_until(lambda: any(e.request_id == rid for e in events()), 5, "the done-event")
    done = next(e for e in events() if e.request_id == rid)
    assert done.tokens < 100
    await slow(admin, 0)
    again = await oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert len(again.choices[0].text) == 5  # the slot serves on


@pytest.mark.parametrize("path", ["/v1/completions", f"/v1/infer/{MODEL}"])
async def test_a_client_that_leaves_before_a_whole_answer_frees_the_slot(
        stack: PlaneStack, gateway: Gateway, admin: NATS, path: str) -> None:
    """A whole completion (`stream: false`), or the plane's own route asked for one reply,
    whose HTTP client gives up (its timeout, a closed tab) is cancelled: the slot generated
    for nobody up to max_tokens (found from outside, on each route in turn). The client's
    disconnect cancels the gateway's handler, which cancels the generation."""
    cancels = await listen(admin, NAMES.cancel_all())
    await slow(admin, 5000)  # 200 tokens: a second at least, if not cancelled
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200}
    if path != "/v1/completions":
        del body["model"]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        with pytest.raises(TimeoutError):
            async with http.post(f"{gateway.url}{path}", json=body,
                                 headers={Header.REQUEST_ID: "whole-1"},
                                 timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
    await wait_until(lambda: any((c.headers or {}).get(Header.REQUEST_ID) == "whole-1"
                                 for c in cancels), 5, "the gateway's cancel")
    took_s = await wait_until(lambda: slots_running(stack) == 0, 5, "the slot to free")
    assert took_s < 0.5
    async with aiohttp.ClientSession() as anon, anon.get(f"{gateway.url}/metrics") as r:
        assert 'plane_gateway_requests_total{model="tinylm",status="499"} 1.0' in await r.text()
    await slow(admin, 0)


async def test_a_generation_cancelled_by_another_client_is_an_error_not_a_cut_answer(
        stack: PlaneStack, gateway: Gateway, admin: NATS) -> None:
    """A cancel for a generation's request id on its slot's cancel subject, from another NATS
    client: OpenAI's routes and /v1/infer's whole answer sent the cut text as a 200, with
    `finish_reason: "cancelled"` (no OpenAI finish reason). Now a whole answer is a 503
    `cancelled` (the openai package told not to retry it), an OpenAI stream under way ends
    with an error event and `[DONE]`, and the plane's own SSE keeps its `end` event."""
    await slow(admin, 3000)  # 200 tokens: 0.6 s at least, if not cancelled

    async def cancel(rid: str) -> None:
        await wait_until(lambda: slots_running(stack) == 1, 5, "the generation to start")
        await admin.publish(NAMES.cancel(NODE, 0), b"", headers={Header.REQUEST_ID: rid})

    openai_body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200}
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 200}
    cases: list[tuple[str, dict[str, object], dict[str, str]]] = [
        ("/v1/completions", openai_body, {}),
        ("/v1/chat/completions", chat_body, {}),
        (f"/v1/infer/{MODEL}", {"prompt": PROMPT, "max_tokens": 200}, {}),
        ("/v1/completions", {**openai_body, "stream": True}, {}),
        ("/v1/chat/completions", {**chat_body, "stream": True}, {}),
        (f"/v1/infer/{MODEL}", {"prompt": PROMPT, "max_tokens": 200}, {Header.STREAM: "1"}),
    ]
    got = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for i, (path, body, extra) in enumerate(cases):
            rid = f"victim-{i}"
            canceller = asyncio.create_task(cancel(rid))
            async with http.post(f"{gateway.url}{path}", json=body,
                                 headers={Header.REQUEST_ID: rid, **extra}) as r:
                got.append((r.status, r.headers.copy(), await r.text()))
            await canceller
            await wait_until(lambda: slots_running(stack) == 0, 5, "the slot to free")
    await slow(admin, 0)
    for status, headers, text in got[:2]:  # OpenAI's whole answers
        assert status == 503 and headers[Header.REASON] == "cancelled", text
        assert headers["x-should-retry"] == "false" and headers[Header.NODE] == NODE
        error = json.loads(text)["error"]
        assert error["code"] == "cancelled" and error["type"] == "server_error"
        assert "not by this client" in error["message"] and "send the request again" in (
            error["message"])
    status, headers, text = got[2]  # /v1/infer's whole answer
    assert status == 503 and headers[Header.STATUS] == "503", text
    assert json.loads(text)["reason"] == "cancelled" and "text" not in json.loads(text)
    for status, _, text in got[3:5]:  # OpenAI's streams: cut as a deadline cuts them
        assert status == 200 and "cancelled" not in [
            (c.get("choices") or [{}])[0].get("finish_reason")
            for c in map(json.loads, _data(text)[:-1])], text
        assert _data(text)[-1] == "[DONE]" and json.loads(_data(text)[-2])["error"][
            "code"] == "cancelled", text
    status, _, text = got[5]  # the plane's own SSE: its documented end event
    name, end = events(text)[-1]
    assert status == 200 and name == "end" and end["finish_reason"] == "cancelled", text
    assert end["status"] == 200


def _data(sse: str) -> list[str]:
    """The data lines of an SSE body, in order."""
    return [line[len("data: "):] for line in sse.splitlines() if line.startswith("data: ")]


async def test_errors_come_in_openais_shape(gateway: Gateway, oa: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await oa.completions.create(model="risk", prompt="x")
    assert missing.value.code == "model_not_found" and "tinylm" in missing.value.message
    with pytest.raises(openai.BadRequestError) as too_long:
        await oa.completions.create(model=MODEL, prompt="x" * 10, max_tokens=255, stream=True)
    assert too_long.value.code == "context_length_exceeded"  # OpenAI's code for it
    assert "the prompt is 10 UTF-8 bytes, and 255 are to be generated" in too_long.value.message
    assert "shorten it by at least 9 bytes or ask for at most 246 tokens (max_tokens)" in (
        too_long.value.message)
    with pytest.raises(openai.BadRequestError) as chat_too_long:  # in its own fields' terms
        await oa.chat.completions.create(model=MODEL, max_completion_tokens=16,
                                         messages=[{"role": "user", "content": "x" * 300}])
    assert chat_too_long.value.code == "context_length_exceeded"
    assert "the messages are 317 UTF-8 bytes" in chat_too_long.value.message
    assert "$.prompt" not in chat_too_long.value.message
    assert "shorten it by at least 77 bytes" in chat_too_long.value.message
    assert too_long.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="n \\(only 1\\)"):
        await oa.completions.create(model=MODEL, prompt="x", n=2)
    # Token ids, as OpenAI takes them: said what to send instead, not msgspec's raw text.
    for ids in ([15496, 11, 995], [[15496, 11], [995]]):
        with pytest.raises(openai.BadRequestError) as token_ids:
            await oa.completions.create(model=MODEL, prompt=ids, max_tokens=4)
        assert token_ids.value.code == "unsupported_parameter", token_ids.value.message
        assert ("not supported by the plane: prompt as token ids (tinylm reads text: give "
                "the prompt as a string, or a list of one string)") in token_ids.value.message
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                         temperature=3.0)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        await oa.completions.create(model=MODEL, prompt="x", temperature=1.0, top_p=1.5)
    with pytest.raises(openai.BadRequestError, match=r"'user'.*got 'usr' - at `\$\.messages\[0\]`"):
        await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "usr", "content": "x"}],  # type: ignore[misc, list-item]
            max_tokens=4)
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="wrong-token",
                                  max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            await stranger.completions.create(model=MODEL, prompt="x")
    assert [m.id async for m in oa.models.list()] == [MODEL]


async def test_the_plane_s_route_answers_a_generation_in_one_reply_as_a_plain_request(
        stack: PlaneStack, gateway: Gateway) -> None:
    """Without `Plane-Stream`, `/v1/infer/tinylm` runs the generation as a stream (so that a
    client gone cancels it) and answers what a plain NATS request gets: the same body (JSON
    or msgpack) and the node's headers."""
    body = {"prompt": PROMPT, "max_tokens": 20}
    async with Client.connect(stack.url) as c:
        plain = await c.call(MODEL, body, deadline_ms=5000)
    assert plain.ok
    auth = {"Authorization": f"Bearer {TOKEN}", Header.DEADLINE_MS: "5000"}
    async with aiohttp.ClientSession(headers=auth) as http:
        async with http.post(f"{gateway.url}/v1/infer/{MODEL}", json=body,
                             headers={Header.REQUEST_ID: "one-1"}) as r:
            assert r.status == 200 and r.content_type == "application/json"
            got = await r.json()
            headers = r.headers
        packed = msgspec.msgpack.encode(body)
        async with http.post(f"{gateway.url}/v1/infer/{MODEL}", data=packed,
                             headers={"Content-Type": "application/msgpack"}) as r:
            assert r.status == 200 and r.content_type == "application/msgpack"
            unpacked = msgspec.msgpack.decode(await r.read())
    want = plain.json()
    assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 20 and set(got) == set(want)
    assert unpacked["text"] == want["text"]
    assert headers[Header.REQUEST_ID] == "one-1" and headers[Header.NODE] == NODE
    assert headers[Header.SLOT] == "0" and int(headers[Header.SERVICE_US]) > 0


# -- the plane's own SSE ---------------------------------------------------------------------
def events(raw: str) -> list[tuple[str, dict[str, object]]]:
    out = []
    for block in raw.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields["event"], json.loads(fields["data"])))
    return out


async def test_plane_sse_streams_and_refuses_as_json(stack: PlaneStack, gateway: Gateway,
                                                     admin: NATS) -> None:
    expected = await plane_text(stack, 50)
    url = f"{gateway.url}/v1/infer/{MODEL}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"prompt": PROMPT, "max_tokens": 50}
    async with aiohttp.ClientSession(headers=auth) as http:
        async with http.post(url, json=body, headers={Header.STREAM: "1",
                                                      Header.REQUEST_ID: "sse-1"}) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            assert r.headers[Header.NODE] == NODE and r.headers[Header.REQUEST_ID] == "sse-1"
            got = events(await r.text())
        assert got[0] == ("start", {"request_id": "sse-1", "node": NODE, "slot": 0})
        tokens = [data for name, data in got if name == "token"]
        assert "".join(str(t["text"]) for t in tokens) == expected
        assert [t["seq"] for t in tokens] == list(range(1, len(tokens) + 1))
        name, end = got[-1]
        assert name == "end" and end["status"] == 200 and end["finish_reason"] == "length"
        assert isinstance(end["usage"], dict) and end["usage"]["completion_tokens"] == 50
        # Accept: text/event-stream asks the same of a model that streams.
        async with http.post(url, json=body, headers={"Accept": "text/event-stream"}) as r:
            assert r.content_type == "text/event-stream"
            assert events(await r.text())[-1][0] == "end"
        # A refusal before the start is an ordinary JSON answer, status and all.
        await slow(admin, 3000)
        async with Client.connect(stack.url) as c, c.stream(
                MODEL, {"prompt": PROMPT, "max_tokens": 100}, deadline_ms=5000) as holder:
            assert holder.started
            async with http.post(url, json=body, headers={Header.STREAM: "1"}) as r:
                assert r.status == 429 and r.content_type == "application/json"
                assert int(r.headers["Retry-After"]) >= 1 and r.headers.get(Header.TICKET)
                assert (await r.json())["reason"] == "busy"
        await slow(admin, 0)
        async with http.post(url, json={"prompt": 3}, headers={Header.STREAM: "1"}) as r:
            assert r.status == 400 and (await r.json())["reason"] == "bad-request"


async def test_openapi_lists_the_streaming_routes(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.url}/openapi.json") as r:
        doc = await r.json()
    validate(doc)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(doc["paths"])
    op = doc["paths"][f"/v1/infer/{MODEL}"]["post"]
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert {Header.STREAM, Header.STREAM_DEADLINE_MS} <= {p["name"] for p in op["parameters"]}
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearer": []}]
    assert set(chat["responses"]) >= {"200", "400", "404", "429"}


@pytest.mark.parametrize(("reason", "retry"), [("busy", "true"), ("deadline", "false"),
                                               ("overloaded", "false")])
def test_a_refusal_says_whether_the_openai_client_should_retry(reason: str, retry: str) -> None:
    """The `openai` package retries a 429 unless `x-should-retry: false`: a final refusal
    (the caller's deadline cannot be met here, or the plane is overloaded past its promises)
    must say so, a `busy` one with a Retry-After must not."""
    result = Result(status=429, body=json.dumps({"error": "no", "reason": reason}).encode(),
                    headers={Header.REASON: reason, Header.RETRY_AFTER_MS: "7"},
                    request_id="r1", statuses=(429,))
    response = from_result(result)
    assert response.status == 429 and response.headers["x-should-retry"] == retry
    assert response.headers[Header.RETRY_AFTER_MS] == "7"
    assert json.loads(response.body)["error"]["code"] == reason
