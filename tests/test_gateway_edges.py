"""What the gateway answers to inputs that a session trying it from outside found answered
wrong (each a 500, a silently ignored ask, or a hang), against a real plane (`tinylm`, one
slot): every one is now a 4xx that says what to do, and a failure of the gateway itself is
a 500 in the route's own shape that its metrics count."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.subjects import Header
from plane.gateway import Gateway, GatewayConfig, openai_compat
from plane.stack import PlaneStack, StackConfig

MODEL = "tinylm"
TOKEN = "edge-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def stack() -> AsyncIterator[PlaneStack]:
    async with PlaneStack(StackConfig(models=(MODEL,), slots=1)) as s:
        yield s


@pytest.fixture
async def gateway(stack: PlaneStack) -> AsyncIterator[Gateway]:
    async with Gateway(GatewayConfig(port=0, bearer_token=TOKEN),
                       ConnectOptions(url=stack.url)) as gw:
        yield gw


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers=AUTH) as session:
        yield session


async def _post(http: aiohttp.ClientSession, url: str, body: bytes | dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(url, headers=headers, **kw) as r:
        return r.status, await r.json(content_type=None)


async def test_openai_bodies_the_plane_cannot_honour_are_400s_that_name_them(
        gateway: Gateway, http: aiohttp.ClientSession) -> None:
    completions, chat = f"{gateway.url}/v1/completions", f"{gateway.url}/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, bytes | dict[str, Any], int, str]] = [
        (completions, {"model": MODEL, "prompt": []}, 400, "prompt as a list"),
        (completions, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt as a list"),
        # msgspec walks a field it then ignores: 30,000 levels were a RecursionError.
        (completions, b'{"model":"tinylm","prompt":"hi","x":' + b"[" * 30_000 + b"]" * 30_000
         + b"}", 400, "nested too deeply"),
        (chat, {"model": MODEL, "messages": user, "tools": [[[[[[]]]]]] * 2}, 400, "tools"),
        (chat, {"model": MODEL, "messages": user, "max_completion_tokens": 0}, 400,
         "max_completion_tokens must be at least 1"),
        (completions, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400,
         "max_tokens must be at least 1"),
        # Asks an answer that ignored would look honoured: a JSON-mode caller gets no JSON.
        (chat, {"model": MODEL, "messages": user, "response_format": {"type": "json_object"}},
         400, "response_format"),
        (chat, {"model": MODEL, "messages": user, "tool_choice": "required"}, 400,
         "tool_choice"),
        (chat, {"model": MODEL, "messages": user, "functions": [{"name": "f"}]}, 400,
         "functions"),
        (chat, {"model": MODEL, "messages": user, "top_logprobs": 2}, 400, "top_logprobs"),
        (completions, {"model": MODEL, "prompt": "hi", "logit_bias": {"50": 10}}, 400,
         "logit_bias"),
        # OpenAI refuses it too: a caller that asked for a usage chunk gets no stream.
        (chat, {"model": MODEL, "messages": user, "stream_options": {"include_usage": True}},
         400, "stream_options is only allowed with \"stream\": true"),
        (completions, {"model": MODEL, "prompt": "hi", "stream": False,
                       "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ]
    wrong = []
    for url, body, status, says in cases:
        got, answer = await _post(http, url, body)
        message = answer.get("error", {}).get("message", "")
        if got != status or says not in message:
            wrong.append((url.rsplit("/", 1)[1], str(body)[:60], got, message[:120]))
    assert not wrong, wrong
    # Asking for nothing the plane lacks is served.
    for url, body in [(chat, {"model": MODEL, "messages": user, "max_tokens": 2,
                              "response_format": {"type": "text"}, "tool_choice": "none"}),
                      (completions, {"model": MODEL, "prompt": ["hi"], "max_tokens": 2,
                                     "logit_bias": {}})]:
        got, answer = await _post(http, url, body)
        assert got == 200, answer
    # msgpack is /v1/infer's: the OpenAI routes say so, not "Expected `object`, got `int`".
    got, answer = await _post(http, completions, {"model": MODEL, "prompt": "hi"},
                              {"Content-Type": "application/msgpack"})
    assert got == 415 and "JSON" in answer["error"]["message"], answer
    async with http.get(f"{gateway.url}/metrics") as r:
        assert 'status="500"' not in await r.text()


async def test_openai_fields_null_where_openai_allows_it_are_not_given(
        gateway: Gateway, http: aiohttp.ClientSession) -> None:
    """Every field OpenAI's schema marks nullable may be null, meaning its default: clients
    that send each field they know (null when unset) got 400 "Expected `int`, got `null`"
    for `n`, `stream`, `echo`."""
    nulls = dict.fromkeys(("max_tokens", "temperature", "top_p", "seed", "stream",
                           "stream_options", "n", "stop", "logit_bias", "frequency_penalty",
                           "presence_penalty", "user"))
    completion = {"model": MODEL, "prompt": "hi", **nulls,
                  **dict.fromkeys(("echo", "logprobs", "best_of", "suffix"))}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": None}], **nulls,
            **dict.fromkeys(("max_completion_tokens", "logprobs", "top_logprobs", "tools",
                             "tool_choice", "functions", "function_call", "response_format"))}
    for path, body in [("/v1/completions", completion), ("/v1/chat/completions", chat)]:
        got, answer = await _post(http, f"{gateway.url}{path}", body)
        assert got == 200, (path, answer)
        assert answer["usage"]["completion_tokens"] == 16, answer  # tinylm's default
        async with http.post(f"{gateway.url}{path}", json={
                **body, "stream": True, "stream_options": {"include_usage": None}}) as r:
            text = await r.text()
            assert r.status == 200 and text.endswith("data: [DONE]\n\n"), (path, text)


async def test_a_completion_with_no_prompt_or_a_null_one_is_openais_default(
        gateway: Gateway, http: aiohttp.ClientSession) -> None:
    """OpenAI's `prompt` defaults to `<|endoftext|>` (generation as from a new document),
    and the `openai` package sends `prompt=None` as null: both were a 400 here ("Expected
    `str | array`, got `null`", "Object missing required field `prompt`"). Now both are
    the empty prompt, which tinylm begins with its END token, the document boundary."""
    url = f"{gateway.url}/v1/completions"
    got, answer = await _post(http, url, {"model": MODEL, "prompt": "", "max_tokens": 8})
    assert got == 200, answer
    expected = answer["choices"][0]["text"]  # greedy: the one text from the boundary alone
    for body in [{"model": MODEL, "prompt": None, "max_tokens": 8},
                 {"model": MODEL, "max_tokens": 8}]:
        got, answer = await _post(http, url, body)
        assert got == 200, (body, answer)
        assert answer["choices"][0]["text"] == expected, (body, answer)
        assert answer["usage"]["prompt_tokens"] == 0, answer
        async with http.post(url, json={**body, "stream": True}) as r:
            text = await r.text()
            assert r.status == 200 and text.endswith("data: [DONE]\n\n"), (body, text)
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=TOKEN,
                                  max_retries=0, timeout=20) as oa:
        whole = await oa.completions.create(model=MODEL, prompt=None, max_tokens=8)
    assert whole.choices[0].text == expected


async def test_a_stream_deadline_shorter_than_the_first_tokens_is_a_400_on_both_routes(
        gateway: Gateway, http: aiohttp.ClientSession) -> None:
    headers = {Header.DEADLINE_MS: "100", Header.STREAM_DEADLINE_MS: "50"}
    got, answer = await _post(http, f"{gateway.url}/v1/completions",
                              {"model": MODEL, "prompt": "hi", "stream": True}, headers)
    assert got == 400 and Header.STREAM_DEADLINE_MS in answer["error"]["message"], answer
    got, answer = await _post(http, f"{gateway.url}/v1/infer/{MODEL}", {"prompt": "hi"},
                              {**headers, Header.STREAM: "1", Header.REQUEST_ID: "sd-1"})
    assert got == 400 and answer["reason"] == "bad-request", answer
    assert "(50) is shorter than" in answer["error"] and "(100)" in answer["error"]


async def test_a_failure_in_the_gateway_is_a_500_its_metrics_count(
        gateway: Gateway, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(openai_compat, "_generate", broken)
    got, answer = await _post(http, f"{gateway.url}/v1/completions",
                              {"model": MODEL, "prompt": "hi"})
    assert got == 500 and answer["error"]["type"] == "server_error", answer  # OpenAI's shape
    async with http.get(f"{gateway.url}/metrics") as r:
        assert 'plane_gateway_requests_total{model="_unknown",status="500"} 1.0' in await r.text()


async def test_openai_routes_answer_a_wrong_method_or_path_in_openais_shape(
        gateway: Gateway, http: aiohttp.ClientSession) -> None:
    for method, path, status in [("GET", "/v1/completions", 405),
                                 ("POST", "/v1/completions/", 404),
                                 ("POST", "/v1/models", 405)]:
        async with http.request(method, f"{gateway.url}{path}") as r:
            answer = await r.json()
            assert r.status == status, (method, path, answer)
            assert answer["error"]["type"] == "invalid_request_error", (method, path, answer)


async def test_the_bearer_scheme_is_case_insensitive(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as anon:
        for given, status in [(f"bearer {TOKEN}", 200), (f"BEARER  {TOKEN} ", 200),
                              (f"Basic {TOKEN}", 401), ("bearer", 401), (TOKEN, 401)]:
            async with anon.get(f"{gateway.url}/v1/models",
                                headers={"Authorization": given}) as r:
                assert r.status == status, given


async def test_with_nats_down_a_request_is_a_503_within_the_reconnect_wait() -> None:
    """The gateway's connection lost: a request waits `reconnect_wait_ms` for it to come back,
    then is a 503 `no-capacity` with its request id (it was held 30 s, then a 504 "deadline
    passed" for a caller that had set no deadline)."""
    async with EmbeddedNats() as srv, Gateway(
            GatewayConfig(port=0, reconnect_wait_ms=300), ConnectOptions(url=srv.url)) as gw:
        await srv.stop()
        async with aiohttp.ClientSession() as anon:
            t0 = time.monotonic()
            async with anon.post(f"{gw.url}/v1/infer/calibrated", json={"duration_us": 1},
                                 headers={Header.REQUEST_ID: "down-1"}) as r:
                took = time.monotonic() - t0
                assert r.status == 503 and r.headers[Header.REASON] == "no-capacity"
                assert r.headers[Header.REQUEST_ID] == "down-1"
                assert "connection to NATS is down" in (await r.json())["error"]
        await srv.start()
    assert took < 3.0, took
