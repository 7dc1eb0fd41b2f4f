"""The /metrics HTTP server's address as bound, and its stop without a poll's wait.

prometheus_client serves /metrics in a thread running socketserver's `serve_forever`, which
looks for a stop request between waits of half a second (its poll interval): `shutdown()`
waited up to 0.5 s for it, in every process that serves /metrics, and `plane up` waits for
its router's process before its own (an idle `plane up --metrics-port` took ~0.7 s to exit
where it took ~0.2 s without). A shorter interval would wake the thread, and take the
interpreter's lock from the event loop, many times a second for nothing: `stop` wakes the
loop once instead, with a connection of its own to the server.

`Bound` is where the server listens as the socket says (`plane up`'s banner printed
127.0.0.1 whatever `--metrics-host` bound; found from outside).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

STOP_WITHIN_S = 5.0
KNOCK_EVERY_S = 0.02


@dataclass(frozen=True)
class Bound:
    host: str  # as bound: an address, never a name (`localhost` binds 127.0.0.1)
    port: int

    @classmethod
    def of(cls, server: WSGIServer) -> Bound:
        return cls(str(server.server_address[0]), int(server.server_address[1]))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def reachable_at(self) -> str:
        """An address that reaches the server from this host (a wildcard's loopback)."""
        address = ipaddress.ip_address(self.host)
        if address.is_unspecified:
            return "::1" if address.version == 6 else "127.0.0.1"
        return self.host


def stop(server: WSGIServer, thread: threading.Thread, bound: Bound) -> None:
    """Stop `server`'s `serve_forever` in `thread` now, not at its next poll, and close it.
    `shutdown()` asks the loop to stop and waits; a connection wakes the loop's wait (a
    knock before the ask lands is served and missed: knocked again)."""
    asking = threading.Thread(target=server.shutdown, name="metrics-stop", daemon=True)
    asking.start()
    t_end = time.monotonic() + STOP_WITHIN_S
    while asking.is_alive() and time.monotonic() < t_end:
        _knock(bound)
        asking.join(KNOCK_EVERY_S)
    server.server_close()
    thread.join(timeout=max(0.0, t_end - time.monotonic()))


def _knock(bound: Bound) -> None:
    with contextlib.suppress(OSError):
        socket.create_connection((bound.reachable_at(), bound.port), timeout=0.5).close()
