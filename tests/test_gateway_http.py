"""The gateway's HTTP conventions, against a real nats-server and a scripted router: JSON
bodies for every error (its own, and aiohttp's 404/405), 404 for an unknown model, /readyz
false while no router answers `$SRV.PING`, an OpenAPI document that validates and covers
every route, and the deadline header passed on only when the caller sent one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from nats.aio.client import Client as NATS
from nats.micro import add_service
from openapi_spec_validator import validate

from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.models import MODELS
from plane.contract.subjects import Header, Names
from plane.gateway import Gateway, GatewayConfig

NAMES = Names()


@pytest.fixture
async def gateway(nats_server: EmbeddedNats) -> AsyncIterator[Gateway]:
    config = GatewayConfig(port=0, ready_timeout_s=0.2, ready_cache_s=0.05)
    async with Gateway(config, ConnectOptions(url=nats_server.url)) as gw:
        yield gw


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_unknown_model_is_a_json_404(gateway: Gateway, http: aiohttp.ClientSession,
                                           seen: list[dict[str, str]]) -> None:
    async with http.post(f"{gateway.url}/v1/infer/nosuchmodel", json={},
                         headers={Header.REQUEST_ID: "r-404"}) as r:
        assert r.status == 404 and r.content_type == "application/json"
        body = await r.json()
        assert body["reason"] == "not-found" and "nosuchmodel" in body["error"]
        assert "calibrated" in body["error"] and r.headers[Header.REQUEST_ID] == "r-404"
    assert seen == []  # never reached NATS
    async with http.get(f"{gateway.url}/metrics") as r:  # invented names add no series
        text = await r.text()
    assert 'model="_unknown",status="404"' in text and "nosuchmodel" not in text


async def test_every_error_has_a_json_body(gateway: Gateway, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{gateway.url}/no/such/path") as r:
        assert r.status == 404 and r.content_type == "application/json"
        assert (await r.json())["reason"] == "not-found"
    async with http.get(f"{gateway.url}/v1/infer/calibrated") as r:
        assert r.status == 405 and r.content_type == "application/json"
        assert (await r.json())["reason"] == "method-not-allowed"
        assert r.headers["Allow"] == "POST"
    async with http.post(f"{gateway.url}/v1/infer/bad.model", json={}) as r:
        assert r.status == 400 and (await r.json())["reason"] == "bad-request"
    async with http.post(f"{gateway.url}/v1/infer/calibrated", json={"duration_us": 1},
                         headers={Header.DEADLINE_MS: "0"}) as r:
        assert r.status == 400 and Header.DEADLINE_MS in (await r.json())["error"]


async def test_readyz_follows_the_routers(gateway: Gateway, http: aiohttp.ClientSession,
                                          nc: NATS) -> None:
    async def ready() -> tuple[int, dict[str, bool]]:
        async with http.get(f"{gateway.url}/readyz") as r:
            return r.status, await r.json()

    assert await ready() == (503, {"ready": False, "nats": True, "router": False})
    # What a router registers (nats.micro): `$SRV.PING.plane-router` answers.
    service = await add_service(nc, name=NAMES.router_service, version="0.1.0")
    await nc.flush()
    try:
        await asyncio.sleep(0.1)  # past the probe's cache
        assert await ready() == (200, {"ready": True, "nats": True, "router": True})
    finally:
        await service.stop()
    await asyncio.sleep(0.1)
    assert (await ready())[0] == 503


async def test_openapi_document_is_valid_and_covers_every_route(
        gateway: Gateway, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{gateway.url}/openapi.json") as r:
        assert r.status == 200 and r.content_type == "application/json"
        doc = await r.json()
    validate(doc)
    paths = set(doc["paths"])
    assert {f"/v1/infer/{m}" for m in MODELS} | {"/healthz", "/readyz", "/metrics",
                                                  "/openapi.json", "/v1/completions",
                                                  "/v1/chat/completions", "/v1/models"} == paths
    risk = doc["paths"]["/v1/infer/risk"]["post"]
    assert set(risk["responses"]) >= {"200", "400", "404", "429", "503", "504"}
    assert doc["components"]["schemas"]["RiskRequest"]["properties"]["features"]["minItems"] == 32
    params = {p["name"] for p in risk["parameters"]}
    assert {Header.DEADLINE_MS, Header.REQUEST_ID, Header.TICKET} <= params


async def test_deadline_header_only_when_the_caller_sends_one(
        gateway: Gateway, http: aiohttp.ClientSession, seen: list[dict[str, str]]) -> None:
    url = f"{gateway.url}/v1/infer/calibrated"
    async with http.post(url, json={"duration_us": 1}) as r:
        assert r.status == 200
    async with http.post(url, json={"duration_us": 1}, headers={Header.DEADLINE_MS: "70"}) as r:
        assert r.status == 200
    assert Header.DEADLINE_MS not in seen[0]  # the router's live deadline applies
    assert 1 <= int(seen[1][Header.DEADLINE_MS]) <= 70


async def test_wait_header_passes_on_only_when_the_caller_sends_one(
        gateway: Gateway, http: aiohttp.ClientSession, seen: list[dict[str, str]]) -> None:
    """`Plane-Wait-Ms` (a caller that waits for its start rather than retry a 429) reaches
    the router as the caller sent it (`call_args`, which the OpenAI routes use too); none
    otherwise."""
    url = f"{gateway.url}/v1/infer/calibrated"
    async with http.post(url, json={"duration_us": 1}) as r:
        assert r.status == 200
    async with http.post(url, json={"duration_us": 1}, headers={Header.WAIT_MS: "50"}) as r:
        assert r.status == 200
    assert Header.WAIT_MS not in seen[0]
    assert seen[1][Header.WAIT_MS] == "50"
