"""The other routers, as notes arrive: who makes promises, promises booked from another
router, and two routers that share an id (a deployment mistake) reported."""

import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import structlog

from plane.contract.messages import (
    AdmissionNote,
    Presence,
    PromiseGone,
    PromiseMade,
    SlotTaken,
    admission_note_decoder,
    msgpack_encoder,
)
from plane.contract.subjects import Names
from plane.router.admission import Admission
from plane.router.occupancy import ModelSlots
from plane.router.peers import Peers


def peers(router_id: str = "router1") -> tuple[Peers, dict[str, ModelSlots]]:
    models: dict[str, ModelSlots] = {}

    def model(m: str) -> ModelSlots:
        return models.setdefault(m, ModelSlots(model=m))

    nc: Any = None  # on_note and promiser never publish
    return Peers(nc, Names(), router_id, Admission(router_id), model), models


def note(n: AdmissionNote) -> Any:
    return SimpleNamespace(data=msgpack_encoder.encode(n), subject="plane.admission.x", reply="")


async def test_the_first_router_by_id_heard_lately_makes_promises() -> None:
    p, _ = peers("router1")
    assert p.promiser() == "router1"  # alone
    await p.on_note(note(Presence(router="router0", instance="a")))
    assert p.promiser() == "router0"
    p.seen_s["router0"] -= 10  # not heard from for longer than GONE_S
    assert p.promiser() == "router1"


async def test_a_router_found_gone_stops_making_promises_at_once_and_comes_back_when_heard(
) -> None:
    p, _ = peers("router1")
    await p.on_note(note(Presence(router="router0", instance="a")))
    assert p.promiser() == "router0"
    p.gone("router0")  # a forward to it found no responder
    assert p.promiser() == "router1" and p._alone()
    p.gone("router7")  # never heard of: nothing to drop
    await p.on_note(note(Presence(router="router0", instance="b")))  # it was only away
    assert p.promiser() == "router0" and not p._alone()


async def test_a_promise_made_elsewhere_is_booked_here_and_dropped_when_kept() -> None:
    p, models = peers()
    due_ms = int(time.time() * 1000) + 50
    await p.on_note(note(PromiseMade(router="router0", model="calibrated", ticket="router0-7",
                                     due_ms=due_ms, expires_ms=due_ms + 50, service_us=20_000)))
    ms = models["calibrated"]
    [promise] = list(ms.promises)
    assert promise.foreign and 0.03 < promise.due_s - time.monotonic() < 0.07
    await p.on_note(note(SlotTaken(router="router0", model="calibrated", ticket="router0-7",
                                   slot="n/0", service_us=20_000, p99_us=30_000)))
    assert not list(ms.promises) and "router0-7" not in p.admission.foreign


async def test_two_routers_with_one_id_are_reported() -> None:
    p, _ = peers("router0")
    with structlog.testing.capture_logs() as logs:
        await p.on_note(note(Presence(router="router0", instance=p.instance)))
        assert not logs  # our own announcement
        await p.on_note(note(Presence(router="router0", instance="someone-else")))
    assert logs and "--router-id" in logs[0]["event"] and logs[0]["log_level"] == "error"


def test_notes_are_a_tagged_union_on_the_wire() -> None:
    """Each kind of note decodes to its own type (the tag is the first array element), and a
    note of an unknown kind is refused, not read as another."""
    for n in (Presence(router="r", instance="i"),
              PromiseMade(router="r", model="m", ticket="t", due_ms=1, expires_ms=2,
                          service_us=3),
              PromiseGone(router="r", model="m", ticket="t"),
              SlotTaken(router="r", model="m", slot="n/0", service_us=1, p99_us=2)):
        wire = msgpack_encoder.encode(n)
        assert admission_note_decoder.decode(wire) == n
    with pytest.raises(msgspec.ValidationError):
        admission_note_decoder.decode(msgpack_encoder.encode(["nope", "r", ""]))
