"""A node's done-events of one turn of its event loop, sent as one message, ahead of the
answers they free.

A router reads one message per done-event: at one caller per slot its socket brings it a
request, its slot publish's PubAck and a done-event for each placement. Under load a node's
slots finish together (their deliveries come in one read: at 4 closed-loop callers on 4
slots, 2.2 done-events a turn of the node's loop), so the events of one turn go to the
routers as one message (`plane.done.<model>.<node>`, a msgpack array of `DoneEvent`), and one
alone as before, on its slot's subject (`plane.done.<model>.<node>.<k>`).

What must not change is the order the routers' promises stand on (docs/design.md, "Every
request ends in exactly one answer"): a slot's ack, then its done-event, then its answer. So
the answers that a done-event frees wait with it, and the whole turn's worth goes into the
connection's buffer just before the turn's one write (`SoonFlush.before_write`): the acks,
sent as each request finished, then the done-events, then the answers, in the order they
were made. No answer waits longer than it did: the buffer was written at the end of the turn
before too.
"""

from __future__ import annotations

import structlog
from nats.aio.client import Client

from plane.contract.messages import DoneEvent, msgpack_encoder
from plane.contract.publish import append, command
from plane.contract.soon_flush import use_soon_flush
from plane.contract.subjects import Names

log = structlog.get_logger("gpu_node.done_batch")


class DoneBatch:
    """The done-events (and the answers after them) of one node's slots in this loop turn."""

    def __init__(self, nc: Client, names: Names, model: str, node: str) -> None:
        self._nc = nc
        self._soon = use_soon_flush(nc)
        self._subject = names.done_batch(model, node)
        self._events: list[DoneEvent] = []
        self._first_subject = ""  # the slot subject of the turn's first event
        self._answers: list[bytes] = []  # protocol commands (`publish.command`), in order
        self.messages = 0  # done-event messages sent (one a turn that had any)
        self.events = 0  # done-events sent in them

    def send(self, ev: DoneEvent, slot_subject: str, answer: bytes = b"") -> None:
        """`ev`, from the slot whose done-event subject is `slot_subject`, at the end of this
        turn, and `answer` (a command, or nothing) after it."""
        if not self._events:
            self._soon.before_write(self._flush)
            self._first_subject = slot_subject
        self._events.append(ev)
        if answer:
            self._answers.append(answer)

    def _flush(self) -> None:
        events, answers = self._events, self._answers
        self._events, self._answers = [], []
        if len(events) == 1:
            cmd = command(self._nc, self._first_subject, msgpack_encoder.encode(events[0]), None)
        else:
            cmd = command(self._nc, self._subject, msgpack_encoder.encode(events), None)
        lost = not append(self._nc, cmd)
        self.messages += 1
        self.events += len(events)
        for answer in answers:
            lost = not append(self._nc, answer) or lost
        if lost:  # as nats-py's publish would have raised: closed, or its buffer full
            log.warning("done-events or answers dropped: the connection is closed or its "
                        "reconnect buffer full", events=len(events), answers=len(answers))
