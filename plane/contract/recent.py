"""Ids answered lately, bounded: a node's (placements and attempts it answered, so a router
taking over a deadline can ask "did you answer it?" when the node's ack and done-event were
lost) and a router's (attempts it answered without the broker's word, so a node that takes
such a message later can ask it the same; `plane.contract.ownership`)."""

from __future__ import annotations

from collections import OrderedDict


class RecentIds:
    """At most `size` ids, oldest forgotten first. A node adds two per answer (placement and
    attempt): 131,072 keep ~11 s of a node answering 6,000/s (an H200's), longer than a
    router's takeover takes to ask (its take's retries, 5 s, then its question, 2 s), ~20
    MB; 65,536 kept ~5 s there."""

    def __init__(self, size: int = 131_072) -> None:
        self._size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._ids[key] = None
        if len(self._ids) > self._size:
            self._ids.popitem(last=False)

    def seen(self, key: str) -> bool:
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)
