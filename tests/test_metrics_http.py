"""The /metrics server: where it listens, as bound, and a stop that does not wait for its
poll."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from plane.contract.metrics import PlaneMetrics, serve_metrics

# Its stop, from a server that has just started (socketserver's poll: up to 0.5 s before).
STOPS_WITHIN_S = 0.25


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


@pytest.mark.parametrize(("host", "bound", "url_host"), [
    ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("127.0.0.2", "127.0.0.2", "127.0.0.2"),  # loopback, not 127.0.0.1: said as it is
    ("localhost", "127.0.0.1", "127.0.0.1"),  # a name: the address it bound
    ("0.0.0.0", "0.0.0.0", "0.0.0.0"),  # every address: said so
])
def test_the_server_says_where_it_listens_and_stops_at_once(host: str, bound: str,
                                                            url_host: str) -> None:
    with serve_metrics(PlaneMetrics(), 0, host) as where:
        assert where is not None
        assert (where.host, where.url) == (bound, f"http://{url_host}:{where.port}/metrics")
        assert "plane_" in _scrape(f"http://{where.reachable_at()}:{where.port}/metrics")
        t0 = time.monotonic()
    took_s = time.monotonic() - t0
    assert took_s < STOPS_WITHIN_S, f"the metrics server took {took_s:.2f} s to stop"
    with pytest.raises(OSError), socket.create_connection((where.reachable_at(), where.port),
                                                          timeout=1):
        pass  # closed


def test_an_ipv6_address_is_bracketed_in_the_url() -> None:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with serve_metrics(PlaneMetrics(), 0, "::1") as where:
        assert where is not None and where.url == f"http://[::1]:{where.port}/metrics"
        assert "plane_" in _scrape(where.url)
