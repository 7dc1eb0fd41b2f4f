"""Routers split by model (`plane router --models`): each takes its models' requests and hears
their done-events and notes only, makes their promises, and reads none of the other routers'
traffic."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner
from nats.aio.msg import Msg

from plane.cli import main as cli
from plane.contract.budget import Prediction
from plane.contract.messages import Presence, admission_note_decoder
from plane.contract.subjects import Header
from plane.router.admission import Ask, Place
from plane.router.occupancy import SlotView
from plane.router.service import Router
from tests.plane_fixtures import (
    NAMES,
    RISK_BODY,
    calibrated,
    client,
    header,
    plane,
    slots_running,
    status,
    wait_until,
)
from tests.test_peers import note, peers

CALIBRATED = frozenset({"calibrated"})
RISK = frozenset({"risk"})


async def test_routers_split_by_model_each_serve_their_own_and_read_nothing_of_the_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[tuple[str, str]] = []  # (router, subject) of every done-event each one read
    real_done_read = Router._done_read

    def done_read(self: Router, msg: Msg) -> None:
        read.append((self.cfg.router_id, msg.subject))
        real_done_read(self, msg)

    monkeypatch.setattr(Router, "_done_read", done_read)
    async with plane(models=("calibrated", "risk"), slots=1, routers=2,
                     router_models=(CALIBRATED, RISK)) as stack, client(stack.url) as nc:
        r_cal, r_risk = stack.routers
        await wait_until(lambda: all(r.peers.seen_s for r in stack.routers), 5,
                         "the routers hear each other's presence")
        notes: list[object] = []

        async def spy(msg: Msg) -> None:
            notes.append(admission_note_decoder.decode(msg.data))

        await nc.subscribe(NAMES.admission_all(), cb=spy)
        for _ in range(20):
            for model, body in (("calibrated", calibrated(0)), ("risk", RISK_BODY)):
                assert status(await nc.request(NAMES.infer(model), body, timeout=5)) == 200
        await wait_until(lambda: len(read) >= 40, 5, "the done-events")
        # Each router took its own model's requests and knows no slot of the other's.
        assert set(r_cal.models) == {"calibrated"} and set(r_risk.models) == {"risk"}
        assert r_cal._infer["calibrated"]._endpoint._num_requests == 20  # type: ignore[union-attr]
        assert r_risk._infer["risk"]._endpoint._num_requests == 20  # type: ignore[union-attr]
        # ... read only its own model's done-events, and told the other nothing: each is the
        # only router of its model, so it makes its promises and sends no notes but presence.
        assert {r for r, subject in read if ".done.calibrated." in subject} == {"router0"}
        assert {r for r, subject in read if ".done.risk." in subject} == {"router1"}
        assert not [n for n in notes if not isinstance(n, Presence)], notes[:3]
        assert {n.models for n in notes if isinstance(n, Presence)} <= {
            ("calibrated",), ("risk",)}
        for r, serves in ((r_cal, ["calibrated"]), (r_risk, ["risk"])):
            said = json.loads((await nc.request(NAMES.router_status(r.cfg.router_id), b"",
                                                timeout=5)).data)
            assert said["serves"] == serves and list(said["models"]) == serves
        # router0 is first by id but serves no risk: router1 makes risk's promises.
        assert r_risk.peers.promiser("risk") == "router1"
        assert r_cal.peers.promiser("calibrated") == "router0"
        # A refusal of each model carries a ticket of its own router.
        held = asyncio.create_task(nc.request(NAMES.infer("calibrated"), calibrated(400_000),
                                              timeout=5))
        await wait_until(lambda: slots_running(stack) == 1, 5, "the calibrated slot running")
        refused = await nc.request(NAMES.infer("calibrated"), calibrated(1000), timeout=5,
                                   headers={Header.DEADLINE_MS: "2000"})
        assert status(refused) == 429
        assert (header(refused, Header.TICKET) or "").startswith("router0-")
        assert status(await held) == 200


async def test_a_router_of_every_model_and_one_of_risk_share_risk_only() -> None:
    """Mixed: router0 serves every model, router1 risk only. risk's promises are router0's
    (first by id of the two that serve it) and the two tell each other about risk; nobody
    tells router1 about calibrated, which it does not hear."""
    async with plane(models=("calibrated", "risk"), slots=1, routers=2,
                     router_models=(None, RISK)) as stack, client(stack.url) as nc:
        r_all, r_risk = stack.routers
        await wait_until(lambda: r_all.peers.serves.get("router1") == RISK
                         and "router0" in r_risk.peers.seen_s, 5, "the presences")
        assert r_risk.peers.promiser("risk") == "router0"
        assert r_all.peers.promiser("calibrated") == "router0"
        assert not r_all.peers._alone("risk") and r_all.peers._alone("calibrated")
        for _ in range(10):
            assert status(await nc.request(NAMES.infer("calibrated"), calibrated(0),
                                           timeout=5)) == 200
        assert set(r_risk.models) == {"risk"}  # never heard calibrated's adverts
        # risk reaches both routers' subscriptions (`plane.infer.>` and `plane.infer.risk`,
        # one queue group): each request is taken by one of them and answered once.
        answers: dict[str, list[int]] = {}

        async def on_answer(msg: Msg) -> None:
            answers.setdefault(msg.subject, []).append(status(msg))

        await nc.subscribe("_INBOX.mixed.*", cb=on_answer)
        for i in range(40):
            await nc.publish(NAMES.infer("risk"), RISK_BODY, reply=f"_INBOX.mixed.{i}")
            await asyncio.sleep(0.005)
        await wait_until(lambda: len(answers) == 40, 10, "every risk request answered")
        await asyncio.sleep(0.2)  # (a second answer would come within this)
        assert all(len(v) == 1 for v in answers.values()), answers
        took = {r.cfg.router_id: r._infer[k]._endpoint._num_requests  # type: ignore[union-attr]
                for r, k in ((r_all, ""), (r_risk, "risk"))}
        assert took["router0"] >= 10 + 1 and took["router1"] >= 1, took  # both took some


async def test_presence_says_which_models_and_a_note_goes_only_to_routers_of_its_model(
) -> None:
    sent: list[str] = []

    class Wire:
        async def publish(self, subject: str, data: bytes) -> None:
            sent.append(subject)

    p, models = peers("router1")
    p.nc = Wire()  # type: ignore[assignment]
    await p.on_note(note(Presence(router="router0", instance="a", models=("risk",))))
    assert p.serves["router0"] == RISK
    assert p.promiser("risk") == "router0" and p.promiser("calibrated") == "router1"
    assert p._alone("calibrated") and not p._alone("risk") and not p._alone()
    view = SlotView(key="n/0", node="n", k=0, subject="plane.slot.calibrated.n.0")
    ask = Ask(now_s=0.0, deadline_s=1.0, prediction=Prediction(p50_us=1, p99_us=2))
    place = Place(candidates=[view], redeemed=None)
    await p.tell_taken("calibrated", view, place, ask, "rid")
    assert sent == []  # router0 serves no calibrated: nobody to tell
    await p.tell_taken("risk", view, place, ask, "rid")
    assert sent == [NAMES.admission("risk")]
    # A router of an earlier version (no models in its presence) serves every model.
    await p.on_note(note(Presence(router="router0", instance="a")))
    assert p.serves["router0"] is None and not p._alone("calibrated")
    p.gone("router0")
    assert "router0" not in p.serves and not models
    # A router first by id that does not serve a model is not its promiser, even to itself.
    q, _ = peers("router0")
    q.models = RISK
    await q.on_note(note(Presence(router="router1", instance="b")))  # every model
    assert q.promiser("calibrated") == "router1" and q.promiser("risk") == "router0"


def test_a_presence_with_models_reads_on_a_router_that_predates_them_and_back() -> None:
    import msgspec

    class OldPresence(msgspec.Struct, frozen=True, kw_only=True, array_like=True,
                      tag="here"):
        router: str
        instance: str = ""

    new = Presence(router="r", instance="i", models=("risk",))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldPresence) == \
        OldPresence(router="r", instance="i")
    old = msgspec.msgpack.encode(OldPresence(router="r", instance="i"))
    assert admission_note_decoder.decode(old) == Presence(router="r", instance="i")


def test_plane_router_refuses_a_model_the_plane_does_not_have() -> None:
    result = CliRunner().invoke(cli, ["router", "--models", "risk,nosuch"])
    assert result.exit_code == 2
    assert "unknown model(s) nosuch" in result.output
    assert "calibrated, risk, tinylm" in result.output
