"""The router: admission onto depth-one slots (see docs/architecture.md).

`service` is the process's life and its control plane (node heartbeats, done-events, the
watchdog); `requests` is the path of one request (decide, place, refuse); the rest are its
parts: `admission` decides (pure), `promises` schedules refusals' tickets (pure),
`occupancy` is the router's view of the slots, `parking` holds ticket holders until a slot
frees, `calls` calls holders back to a slot that frees, `inflight` answers for a node that
died or went silent, `peers` keeps several routers on one schedule, `slot_publish` carries
slot publishes and their PubAcks.

Nothing outside this package imports its parts; the composition root imports `Router`.
"""

from plane.router.service import Router, router_connection

__all__ = ["Router", "router_connection"]
