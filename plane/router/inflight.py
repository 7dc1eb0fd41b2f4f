"""The router's book of requests it placed and has not seen finish: the router owns their
deadline. When a node goes silent past the deadline (or dies), the router takes the slot
message (see `plane.contract.ownership`) and, only if the take succeeds, answers 504 (or 503)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import structlog
from nats.js import JetStreamContext

from plane.contract.messages import Reason, Status
from plane.contract.ownership import NOT_ANSWERED, Take, attempt_id, placement_id, take
from plane.contract.recent import RecentIds
from plane.contract.subjects import Header

log = structlog.get_logger("plane.router.inflight")

# Attempts answered without the broker's word, remembered for a node's question: a message
# lands late by a failover's seconds, and such answers are rare.
ANSWERED_UNSURE_KEPT = 4096


class InFlight(msgspec.Struct):
    request_id: str
    model: str
    reply: str
    node: str
    key: str
    placed_s: float  # monotonic, when the router began publishing it
    tenant: str  # who sent it (metering, fair shares)
    subject: str
    stream: str
    deadline_s: float
    answer_by_s: float
    seq: int | None = None
    placing: bool = True  # the publish has not returned yet: not ours to resolve
    resolving: bool = False
    max_tokens: int = 0  # a generation's (what its done-event's tokens are a share of)
    received_s: float = 0.0  # monotonic, when the router received it (0: not known)
    streams: bool = False  # a stream: its done-event comes at its end, not its answer
    attempt: str = "1"  # `Plane-Attempt` as on the slot message: the caller's, made unique
    instance: str = ""  # the node's process when placed (`track`): only it can say it answered


Answer = Callable[[InFlight, Status, Reason, str], Awaitable[None]]


class InFlightBook:
    def __init__(
        self, js: JetStreamContext, *, answer: Answer, freed: Callable[[InFlight], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        asked: Callable[[InFlight, str, bool], Awaitable[bool | None]],
        instance_of: Callable[[str], str] = lambda node: "",
    ) -> None:
        self._js = js
        self._instance_of = instance_of  # a node id's process now (`Instances.token`)
        self._asked = asked
        self._answer = answer
        self._freed = freed
        self._spawn = spawn
        self.entries: dict[str, InFlight] = {}  # by slot key: depth one makes it unique
        # Attempts answered without the broker's word (`Take.UNKNOWN`): a node that takes
        # such a message later asks (`plane.contract.ownership`).
        self.answered_unsure = RecentIds(size=ANSWERED_UNSURE_KEPT)

    def __len__(self) -> int:
        return len(self.entries)

    def track(self, fl: InFlight) -> InFlight:
        fl.instance = self._instance_of(fl.node)
        self.entries[fl.key] = fl
        return fl

    def untrack(self, fl: InFlight) -> None:
        if self.entries.get(fl.key) is fl:
            del self.entries[fl.key]

    @staticmethod
    def placed(fl: InFlight, seq: int | None) -> None:
        fl.seq, fl.placing = seq, False

    def done(self, key: str, request_id: str, status: int) -> None:
        fl = self.entries.get(key)
        if fl is None or fl.request_id != request_id:
            return
        if status == NOT_ANSWERED:
            self._resolve(fl, Status.DEADLINE, Reason.DEADLINE,
                          "the slot finished after the deadline", node_alive=True)
        elif not fl.resolving:
            del self.entries[key]

    def node_dead(self, node: str, why: str) -> None:
        for fl in list(self.entries.values()):
            if fl.node == node and not fl.placing:
                self._resolve(fl, Status.UNAVAILABLE, Reason.UNHEALTHY,
                              f"node {node} failed mid-request ({why}): retry elsewhere",
                              node_alive=False)

    def tick(self, now_s: float) -> None:
        for fl in list(self.entries.values()):
            if not fl.placing and not fl.resolving and now_s > fl.answer_by_s:
                self._resolve(fl, Status.DEADLINE, Reason.DEADLINE,
                              "the deadline passed with no answer from the node",
                              node_alive=True)

    def _resolve(self, fl: InFlight, status: Status, reason: Reason, text: str, *,
                 node_alive: bool) -> None:
        if fl.resolving:
            return
        fl.resolving = True
        self._spawn(self._take_and_answer(fl, status, reason, text, node_alive))

    async def _take_and_answer(self, fl: InFlight, status: Status, reason: Reason,
                               text: str, node_alive: bool) -> None:
        try:
            seq = fl.seq if fl.seq is not None else await self._find(fl)
            if seq is not None:
                # Take first, while the message is surely still there (its TTL outlives the
                # deadline by a second): a slow question below cannot let it expire.
                outcome = await take(self._js, fl.stream, seq)
            else:
                # The publish's outcome was unknown and the message is not there: either it
                # never landed (nobody else will answer) or a node took it and its done-event
                # was lost; the node is asked below.
                outcome = Take.UNKNOWN
            attempt = attempt_id(fl.request_id, fl.attempt)
            if outcome is Take.GONE:
                # Taken by its node, which answers; or lost by the broker (a server that
                # restarted with its memory stream empty): then the node finds it gone too
                # and stays silent. So a live node is asked: it has its claim on record
                # before it answers (by attempt: a sequence may be reused by a stream made
                # anew), and only its "no" is taken for one. A dead or silent one cannot
                # say: it took the message and its answer went with its done-event, or
                # neither did (kept silent, as before).
                if not node_alive or await self._asked(fl, attempt, node_alive) is not False:
                    log.info("node answered first", request_id=fl.request_id, node=fl.node)
                    return
                # Recorded before we answer: a node whose take went through while our
                # question overtook it asks us before it answers (as for UNKNOWN below).
                self.answered_unsure.add(attempt)
                log.warning("slot message gone and its node did not answer it (the broker "
                            "lost it?); answering", request_id=fl.request_id, node=fl.node)
                await self._answer(fl, status, reason, text)
                return
            # Ours now, but a node whose ack and done-event were lost (its broker died) may
            # have answered before the deadline all the same: it remembers, so ask. A node
            # presumed dead is asked once, briefly; a live one patiently (our own server may
            # be failing over). Without a sequence (the publish's outcome unknown), by the
            # attempt: the message may have landed and been answered all the same.
            asked = placement_id(fl.stream, seq) if seq is not None else attempt
            if await self._asked(fl, asked, node_alive):
                log.info("node says it answered", request_id=fl.request_id, node=fl.node)
                return
            if outcome is Take.UNKNOWN:
                # The message may yet reach a node (it lands late): that node asks us first.
                self.answered_unsure.add(attempt)
                log.warning("broker could not say who answers; answering", node=fl.node,
                            request_id=fl.request_id)
            await self._answer(fl, status, reason, text)
        finally:
            self.untrack(fl)
            self._freed(fl)

    async def _find(self, fl: InFlight) -> int | None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                msg = await self._js.get_last_msg(fl.stream, fl.subject)
            h = msg.headers or {}
            # Ours by its attempt too: a caller may give two requests one id.
            if h.get(Header.REQUEST_ID) == fl.request_id and h.get(Header.ATTEMPT) == fl.attempt:
                return int(msg.seq or 0) or None
        return None
