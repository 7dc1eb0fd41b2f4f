"""A node serving `risk` on the `interpret` backend (the Triton kernel under the interpreter)
answers through the plane, and agrees with the torch backend's score."""

from __future__ import annotations

import json

from plane.contract.subjects import Header
from tests.plane_fixtures import NAMES, RISK_BODY, client, header, plane, status


async def test_node_on_interpret_backend_scores_like_torch() -> None:
    async with plane(models=("risk",), slots=1, backend="torch") as torch_stack, \
            client(torch_stack.url) as nc:
        m = await nc.request(NAMES.infer("risk"), RISK_BODY, timeout=10)
        assert status(m) == 200
        want = json.loads(m.data)["score"]
    async with plane(models=("risk",), slots=1, backend="interpret") as stack, \
            client(stack.url) as nc:
        assert stack.nodes[0].backend.name == "interpret"
        m = await nc.request(NAMES.infer("risk"), RISK_BODY, timeout=30)
        assert status(m) == 200, m.data
        assert abs(json.loads(m.data)["score"] - want) < 1e-5
        assert header(m, Header.NODE) == "node0-risk"
        # The advert says which backend serves.
        info = json.loads((await nc.request(NAMES.node_status("node0-risk"), b"",
                                            timeout=5)).data)
        assert info["backend"] == "interpret"
