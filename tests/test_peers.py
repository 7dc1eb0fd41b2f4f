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
from plane.router.occupancy import ModelSlots, SlotView
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
    assert p.promiser("calibrated") == "router1"  # alone
    await p.on_note(note(Presence(router="router0", instance="a")))
    assert p.promiser("calibrated") == "router0"
    p.seen_s["router0"] -= 10  # not heard from for longer than GONE_S
    assert p.promiser("calibrated") == "router1"


async def test_a_router_found_gone_stops_making_promises_at_once_and_comes_back_when_heard(
) -> None:
    p, _ = peers("router1")
    await p.on_note(note(Presence(router="router0", instance="a")))
    assert p.promiser("calibrated") == "router0"
    p.gone("router0")  # a forward to it found no responder
    assert p.promiser("calibrated") == "router1" and p._alone()
    p.gone("router7")  # never heard of: nothing to drop
    await p.on_note(note(Presence(router="router0", instance="b")))  # it was only away
    assert p.promiser("calibrated") == "router0" and not p._alone()


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


async def test_a_gone_makers_holder_on_call_is_called_by_the_next_promiser_only() -> None:
    """The maker's note carries its holder's inbox and when it was told to come back. While
    the maker is heard from, it calls its holders and the others only book the slot for them;
    once it is gone, the router that makes the promises now calls them when their slot frees
    (told a late fallback, uncalled they came back late), and a third router does not."""
    due_ms = int(time.time() * 1000) + 20
    made = PromiseMade(router="router0", model="calibrated", ticket="router0-7", due_ms=due_ms,
                       expires_ms=due_ms + 2_000, service_us=20_000, wake="_INBOX.holder",
                       told_ms=due_ms + 1_000)
    called: dict[str, bool] = {}
    for me in ("router1", "router2"):
        p, models = peers(me)
        p.admission.called_elsewhere = p.calls_elsewhere  # as the router wires it
        await p.on_note(note(Presence(router="router1", instance="r1")))  # r2 hears r1
        await p.on_note(note(made))
        ms = models["calibrated"]
        [promise] = list(ms.promises)
        assert promise.foreign and promise.maker == "router0"
        assert promise.wake == "_INBOX.holder"
        assert 0.9 < promise.told_s - time.monotonic() < 1.1
        assert p.admission.slot_for(ms, time.monotonic()) is promise
        assert not promise.called_s  # router0 is there: it calls its holder itself
        promise.slotted = False
        p.seen_s["router0"] -= 10  # not heard from for longer than GONE_S
        assert p.admission.slot_for(ms, time.monotonic()) is promise
        called[me] = bool(promise.called_s)
    assert called == {"router1": True, "router2": False}


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
              PromiseMade(router="r", model="m", ticket="t", due_ms=1, expires_ms=2,
                          service_us=3, wake="_INBOX.x", told_ms=4),
              PromiseGone(router="r", model="m", ticket="t"),
              SlotTaken(router="r", model="m", slot="n/0", service_us=1, p99_us=2)):
        wire = msgpack_encoder.encode(n)
        assert admission_note_decoder.decode(wire) == n
    with pytest.raises(msgspec.ValidationError):
        admission_note_decoder.decode(msgpack_encoder.encode(["nope", "r", ""]))


def test_a_promise_note_with_an_inbox_reads_on_a_router_that_predates_it_and_back() -> None:
    """`wake` and `told_ms` trail the note with defaults: a router without them reads a new
    note (the fields it knows), and a new router reads an old one (no inbox: not called)."""

    class OldMade(msgspec.Struct, frozen=True, array_like=True, tag="made"):
        """The note as routers before `wake` sent it: its fields in their wire order."""

        model: str
        ticket: str
        due_ms: int
        expires_ms: int
        service_us: int
        router: str
        instance: str = ""

    new = PromiseMade(router="r", model="m", ticket="t", due_ms=1, expires_ms=2, service_us=3,
                      wake="_INBOX.x", told_ms=4)
    old = msgspec.msgpack.decode(msgpack_encoder.encode(new), type=OldMade)
    assert (old.ticket, old.due_ms, old.service_us, old.router) == ("t", 1, 3, "r")
    back = admission_note_decoder.decode(msgpack_encoder.encode(old))
    assert isinstance(back, PromiseMade) and back.wake is None and back.told_ms == 0


async def test_a_slot_taken_note_that_comes_after_its_requests_end_leaves_the_slot_free(
) -> None:
    """Another router tells that it took a slot once its publish is acknowledged; a short
    request's done-event can reach us first. Marked busy then, the slot looked taken until
    its p50 had passed, and a closed loop of one caller per slot over two routers saw 1-3%
    false refusals. A note for a request whose done-event came is ignored; one for a request
    still running (or from a router that sends no request id) marks the slot busy."""
    p, models = peers()
    ms = models.setdefault("calibrated", ModelSlots(model="calibrated"))
    view = ms.slots["n/0"] = SlotView(key="n/0", node="n", k=0, subject="s")
    now = time.monotonic()
    view.finished(now, "req-1")  # the done-event first
    await p.on_note(note(SlotTaken(router="router0", model="calibrated", slot="n/0",
                                   service_us=50_000, p99_us=60_000, request_id="req-1")))
    assert view.is_free(time.monotonic())
    await p.on_note(note(SlotTaken(router="router0", model="calibrated", slot="n/0",
                                   service_us=50_000, p99_us=60_000, request_id="req-2")))
    assert not view.is_free(time.monotonic())
    view.finished(time.monotonic(), "req-2")
    await p.on_note(note(SlotTaken(router="router0", model="calibrated", slot="n/0",
                                   service_us=50_000, p99_us=60_000)))  # an older router's
    assert not view.is_free(time.monotonic())


def test_a_slot_taken_note_with_a_request_id_reads_on_a_router_that_predates_it_and_back(
) -> None:
    """`request_id` trails the note with a default: a router without it reads a new note,
    and a new router reads an old one (no id: the slot is marked busy, as before)."""

    class OldTaken(msgspec.Struct, frozen=True, array_like=True, tag="took"):
        """The note as routers before `request_id` sent it: its fields in their wire order."""

        model: str
        slot: str
        service_us: int
        p99_us: int
        ticket: str | None
        router: str
        instance: str = ""

    new = SlotTaken(router="r", model="m", slot="n/0", service_us=1, p99_us=2, ticket="t",
                    request_id="req-1")
    old = msgspec.msgpack.decode(msgpack_encoder.encode(new), type=OldTaken)
    assert (old.slot, old.service_us, old.router, old.ticket) == ("n/0", 1, "r", "t")
    back = admission_note_decoder.decode(msgpack_encoder.encode(old))
    assert isinstance(back, SlotTaken) and back.request_id is None and back.ticket == "t"
    assert admission_note_decoder.decode(msgpack_encoder.encode(new)) == new
