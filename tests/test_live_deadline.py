"""Live settings reach every caller: a request with no deadline of its own gets the router's
live `deadline_ms.<model>` (PLANE_CONFIG), whether it comes through the SDK or the HTTP
gateway, because neither sends `Plane-Deadline-Ms` unless its caller asked. The model's
shipped default for `calibrated` is 1000 ms, which a 100 ms request fits; the live 40 ms
does not."""

from __future__ import annotations

import aiohttp

from plane.client import Client
from plane.contract.config import ConnectOptions
from plane.contract.subjects import Header, Names, config_key
from plane.gateway import Gateway, GatewayConfig
from tests.plane_fixtures import client, plane, wait_until

NAMES = Names()
LONG = {"duration_us": 100_000}  # 100 ms of work


def _missed(status: int, reason: str | None) -> bool:
    """Refused at once for want of time, or cut at its deadline."""
    return (status == 429 and reason == "deadline") or status == 504


async def test_the_live_deadline_applies_when_the_caller_sets_none() -> None:
    async with plane(models=("calibrated",), slots=1) as stack, client(stack.url) as nc:
        kv = await nc.jetstream().key_value(NAMES.config_bucket)
        await kv.put(config_key("deadline_ms", "calibrated"), b"40")
        await wait_until(lambda: all(r.settings.deadline_ms("calibrated") == 40
                                     for r in stack.routers), 10, "routers see the setting")
        async with Client.connect(stack.url) as sdk:
            r = await sdk.call("calibrated", LONG)
            assert _missed(r.status, r.reason), (r.status, r.headers)
            ok = await sdk.call("calibrated", LONG, deadline_ms=1000)
            assert ok.status == 200, (ok.status, ok.headers)
        async with Gateway(GatewayConfig(port=0), ConnectOptions(url=stack.url)) as gw, \
                aiohttp.ClientSession() as http:
            url = f"{gw.url}/v1/infer/calibrated"
            async with http.post(url, json=LONG) as resp:
                assert _missed(resp.status, resp.headers.get(Header.REASON)), resp.status
            async with http.post(url, json=LONG, headers={Header.DEADLINE_MS: "1000"}) as resp:
                assert resp.status == 200
