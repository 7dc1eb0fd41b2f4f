"""The other routers of a plane: who is there, which of them makes the promises, and what each
tells the others so that they keep one schedule.

Routers share one queue group, so any of them may take any request. Two routers that each
made their own promises would now and then promise the same slot time (neither has heard of
the other's latest), and one of the two holders would find no slot. So the first router by id
of those alive makes every promise; the others place what fits now and forward the rest to it
(see `Router._forward`). Every router tells the others, on `<prefix>.admission.<model>`, the
promises it makes and drops and the slots it takes, and books theirs in its own schedule. A
router that has heard no other for `GONE_S` tells nobody: a plane with one router pays nothing.
A router that a forward finds gone (no responder on its subject) is dropped at once.

Routers may serve some models only (`RouterConfig.models`; each says which in its presence):
then each of the above is per model. A model's promises are made by the first by id of the
routers that serve it, and a router tells (and hears) only the routers that serve the
models it does: routers split by model pay nothing for each other.

One router per id: a router refuses to start while another live router has its id (their
tickets and forwarded requests would reach both), and waits for one that is stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.config import serves_model
from plane.contract.errors import IdentityInUse
from plane.contract.identity import answers, new_instance
from plane.contract.messages import (
    AdmissionNote,
    Presence,
    PromiseGone,
    PromiseMade,
    SlotTaken,
    admission_note_decoder,
    msgpack_encoder,
)
from plane.contract.models import MODELS
from plane.contract.subjects import Names
from plane.router.admission import Admission, Ask, Place
from plane.router.occupancy import ModelSlots, SlotView
from plane.router.promises import Promise

log = structlog.get_logger("plane.router.peers")

ANNOUNCE_S = 1.0  # each router says it is there this often ...
GONE_S = 3.0  # ... and one not heard from for this long is gone
PRESENCE = "_routers"  # the subject token of the announcements (no model is named so)
ASKED_S = 0.5  # how long a starting router waits for a router with its id to answer
STOPPING_WAIT_S = 10.0  # a router stopping under our id has this long to go (its stop: 5 s)


class Peers:
    def __init__(self, nc: Client, names: Names, router_id: str, admission: Admission,
                 model: Callable[[str], ModelSlots],
                 models: frozenset[str] | None = None) -> None:
        self.nc = nc
        self.names = names
        self.router_id = router_id
        self.admission = admission
        self._model = model  # the router's ModelSlots for a model (made on first use)
        self.models = models  # those this router serves (None: every one)
        self.seen_s: dict[str, float] = {}  # other routers, when each last spoke
        self.serves: dict[str, frozenset[str] | None] = {}  # other routers' models (None: all)
        self._last_heard_s = -math.inf
        self._announced_s = -math.inf
        self.instance = new_instance()
        self._clash_logged_s = -math.inf

    def promiser(self, model: str) -> str:
        """The router that makes `model`'s promises: the first by id of those that serve it
        and were heard from lately (we, when none does: a request for it reached us)."""
        return self._first(model)

    def leader(self) -> str:
        """The first by id of all the routers heard from lately, whatever they serve: the one
        that does the plane's chores no two should do at once (`Router._spread_leaders`)."""
        return self._first(None)

    def _first(self, model: str | None) -> str:
        """The first by id of the routers heard from lately (us included) that serve `model`
        (None: any); us when none does."""
        if not self.seen_s:
            return self.router_id  # alone (the usual case: asked per request)
        now = time.monotonic()
        mine = [self.router_id] if model is None or serves_model(self.models, model) else []
        return min([*mine, *(r for r in self.seen_s if self._heard(r, now)
                             and (model is None or self._serving(r, model)))],
                   default=self.router_id)

    def _heard(self, router: str, now: float) -> bool:
        """Another router heard from within `GONE_S`."""
        return now - self.seen_s.get(router, -math.inf) <= GONE_S

    def _serving(self, router: str, model: str) -> bool:
        """Whether another router serves `model` (as its last presence said; one not yet
        heard announce, or of an earlier version, serves every model)."""
        return serves_model(self.serves.get(router), model)

    def calls_elsewhere(self, maker: str, model: str) -> bool:
        """Whether another router calls the holders of `maker`'s promises for `model`
        (`Plane-Wake`): the maker while it is heard from; once it is gone, the model's
        promiser, unless that is us. (A gone maker's holders were told a late fallback:
        uncalled, they came back late.)"""
        return (self._heard(maker, time.monotonic())
                or self.promiser(model) != self.router_id)

    def gone(self, router: str) -> None:
        """Nobody listens on `router`'s own subject (a forward to it found no responder): it
        stopped or died. Taken for gone now, not `GONE_S` after its last word, so the next
        router by id makes the promises from the next request on instead of each one first
        trying a router that is not there. One that was only out of reach for a moment is
        back with its next announcement (`ANNOUNCE_S`)."""
        if self.seen_s.pop(router, None) is None:
            return
        self.serves.pop(router, None)
        self._last_heard_s = max(self.seen_s.values(), default=-math.inf)
        log.warning("a router no longer listens: taken for gone", router=self.router_id,
                    gone=router, leader=self.leader())

    async def announce_if_due(self, now_s: float) -> None:
        if now_s - self._announced_s >= ANNOUNCE_S:
            self._announced_s = now_s
            await self._send(PRESENCE, self._presence())

    def _presence(self) -> Presence:
        return Presence(router=self.router_id, instance=self.instance,
                        models=tuple(sorted(self.models)) if self.models is not None else None)

    async def ensure_id_free(self, wait_s: float = STOPPING_WAIT_S) -> None:
        """Before the router listens to anything: raise `IdentityInUse` if another live
        router has our id; wait, up to `wait_s`, for one that is stopping (a rolling
        restart) to go.

        A router with our id answers our status subject (no responder, the usual case, says
        so at once). If one does, we ask on the presence subject: a live one answers there; a
        stopping one has stopped listening, and we wait until its status endpoint is gone."""
        status = self.names.router_status(self.router_id)
        if not await answers(self.nc, status, ASKED_S):
            return
        asked = msgpack_encoder.encode(self._presence())
        if await answers(self.nc, self.names.admission(PRESENCE), ASKED_S, asked):
            raise IdentityInUse(
                f"router id {self.router_id!r} is in use by another running router: give "
                "this router another --router-id, or stop the other one first",
                kind="router", ident=self.router_id)
        log.warning("a router with this id is stopping: waiting for it to go",
                    router=self.router_id, up_to_s=wait_s)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        while await answers(self.nc, status, ASKED_S):
            if loop.time() >= give_up:
                raise IdentityInUse(
                    f"router id {self.router_id!r}: a router with this id still answers after "
                    f"{wait_s:.0f} s: stop it, or use another --router-id",
                    kind="router", ident=self.router_id)
            await asyncio.sleep(0.1)

    async def on_note(self, msg: Msg) -> None:
        """Another router made or dropped a promise, or took a slot: book it here too."""
        try:
            note = admission_note_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("bad admission note ignored", subject=msg.subject)
            return
        if note.router == self.router_id:
            if note.instance and note.instance != self.instance:
                self._clash(note.instance)
                if msg.reply:  # a router starting with our id asks: we are here, live
                    await self._send(PRESENCE, self._presence(), subject=msg.reply)
            return
        now = time.monotonic()
        if now - self.seen_s.get(note.router, -math.inf) > GONE_S:
            # A router new to us (just started): announce ourselves at the watchdog's next
            # tick rather than within a second, so that it hears us before it places
            # anything (a router that has heard no other tells nobody what it takes).
            self._announced_s = -math.inf
        self._last_heard_s = self.seen_s[note.router] = now
        match note:
            case Presence():
                self.serves[note.router] = (frozenset(note.models) if note.models is not None
                                            else None)
                return
            case PromiseMade() if note.model in MODELS:
                mono_of = time.monotonic() - time.time()  # wall seconds -> our monotonic ones
                self.admission.adopt(self._model(note.model), Promise(
                    ticket=note.ticket, due_s=note.due_ms / 1000 + mono_of,
                    expires_s=note.expires_ms / 1000 + mono_of,
                    service_s=note.service_us / 1e6, wake=note.wake,
                    told_s=note.told_ms / 1000 + mono_of if note.told_ms else 0.0,
                    maker=note.router))
            case PromiseGone() if note.model in MODELS:
                self.admission.drop(self._model(note.model), note.ticket)
            case SlotTaken() if note.model in MODELS:
                ms = self._model(note.model)
                if note.ticket is not None:
                    self.admission.drop(ms, note.ticket)
                view = ms.slots.get(note.slot)
                if view is None or view.was_done(note.request_id):
                    return
                view.peer_took_s = now  # also while a placement of ours on it settles
                if view.request_id is None:
                    view.occupy(now, None, note.service_us / 1e6, note.p99_us / 1e6)

    async def tell(self) -> None:
        """Tell the others the promises made and dropped since we last did."""
        notes = self.admission.take_notes()
        if not notes or self._alone():
            return
        wall_of = time.time() - time.monotonic()  # our monotonic seconds -> wall seconds
        for n in notes:
            if self._alone(n.model):
                continue
            p = n.promise
            await self._send(n.model, PromiseMade(
                router=self.router_id, model=n.model, ticket=p.ticket,
                due_ms=int((p.due_s + wall_of) * 1000),
                expires_ms=int((p.expires_s + wall_of) * 1000),
                service_us=int(p.service_s * 1e6), wake=p.wake,
                told_ms=int((p.told_s + wall_of) * 1000) if p.told_s else 0) if n.made
                else PromiseGone(
                router=self.router_id, model=n.model, ticket=p.ticket))

    async def tell_taken(self, model: str, view: SlotView, place: Place, ask: Ask,
                         request_id: str) -> None:
        """Tell the others the promises changed and the slot we just took, and by whom."""
        await self.tell()
        if self._alone(model):
            return
        await self._send(model, SlotTaken(
            router=self.router_id, model=model, slot=view.key,
            ticket=place.redeemed.ticket if place.redeemed is not None else None,
            service_us=ask.prediction.expected_us, p99_us=ask.prediction.p99_us,
            request_id=request_id))

    def _alone(self, model: str | None = None) -> bool:
        """No other router heard from lately (that serves `model`): nobody to tell (nothing
        on the hot path)."""
        now = time.monotonic()
        if now - self._last_heard_s > GONE_S:
            return True
        return model is not None and not any(
            self._heard(r, now) and self._serving(r, model) for r in self.seen_s)

    def _clash(self, other: str) -> None:
        now = time.monotonic()
        if now - self._clash_logged_s >= 10.0:
            self._clash_logged_s = now
            log.error("another router has this router's id: their tickets and promises will "
                      "clash; give each router a distinct --router-id",
                      router=self.router_id, other_instance=other)

    async def _send(self, model: str, note: AdmissionNote, subject: str = "") -> None:
        # A note that cannot go out (the connection is down) is lost, not an error: a peer
        # hears the next one; a promise it missed expires by itself.
        with contextlib.suppress(Exception):
            await self.nc.publish(subject or self.names.admission(model),
                                  msgpack_encoder.encode(note))
