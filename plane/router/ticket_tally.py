"""How many of a router's tickets were redeemed, per model: counted, not averaged.

The router decides whether promises pin slot time from an exponential average of redeemed
tickets (`Admission.redemption`), which starts at 1 and moves a tenth of the way per ticket
settled: after 16 tickets and none redeemed it still read 18.5%, and `plane status` showed
that as "tickets redeemed" while first-retry success (from /metrics) said 0.0%. This is the
count `plane status` and `plane top` show instead: tickets settled since the router started,
each once, as redeemed (its holder came back, on time or late) or a no-show (it lapsed and
nobody came back for it while the router still knew it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TicketTally:
    redeemed: int = 0
    no_shows: int = 0

    def settled(self, *, redeemed: bool) -> None:
        """A ticket's holder came back (`redeemed`), or its promise lapsed without it."""
        if redeemed:
            self.redeemed += 1
        else:
            self.no_shows += 1

    def came_after_all(self) -> None:
        """A holder came back after its ticket lapsed (counted a no-show then): redeemed,
        late, and no longer a no-show."""
        self.no_shows = max(0, self.no_shows - 1)
        self.redeemed += 1

    def as_dict(self) -> dict[str, int]:
        """What the router's status endpoint says (`ticket_returns.<model>`)."""
        return {"redeemed": self.redeemed, "no_shows": self.no_shows}
