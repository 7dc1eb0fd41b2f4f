"""`plane top`: a live terminal view of every router and node (rich), refreshed every
`interval_s`; and the tables `plane status` prints once. What each column means and where it
comes from: `plane.observe.planeview`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from nats.aio.client import Client
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from plane.contract.subjects import Names
from plane.observe.console import console as default_console
from plane.observe.denials import Denials
from plane.observe.planeview import (
    MetricsFacts,
    ModelFacts,
    PlaneView,
    TicketReturns,
    collect,
    over_interval,
    scrape,
)


def _n(v: float | int | None, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _cycle(m: ModelFacts | None) -> str:
    """A cycle's p50/p99, or `-` when none was measured (a router's prior is no figure)."""
    if m is None or m.cycle_p50_us is None or m.cycle_p99_us is None:
        return "-"
    return f"{m.cycle_p50_us:.0f}/{m.cycle_p99_us:.0f} µs"


def _redeemed(t: TicketReturns | None) -> str:
    """Tickets redeemed of those settled, counted (`-`: none settled). Was the router's
    recent average, which starts at 100%: 18.5% after 16 tickets and none redeemed."""
    if t is None or not t.settled:
        return "-"
    return f"{t.redeemed}/{t.settled} ({100 * t.redeemed / t.settled:.0f}%)"


def routers_table(view: PlaneView) -> Table:
    t = Table(title="routers", title_justify="left", expand=False)
    # "behind": how long the router has read its inbox late (its CPU is the limit).
    for col in ("router", "model", "slots healthy/all", "busy", "promises open", "in flight",
                "cycle p50/p99", "tickets redeemed", "behind"):
        t.add_column(col, justify="left" if col in ("router", "model") else "right")
    for r in view.routers:
        first = True
        rows: list[tuple[str, ModelFacts | None]] = list(sorted(r.models.items()))
        for model, m in rows or [("-", None)]:
            t.add_row(
                r.router if first else "", model,
                "-" if m is None else f"{m.healthy}/{m.slots}",
                "-" if m is None else str(m.busy),
                _n(r.promises_open) if first else "", _n(r.in_flight) if first else "",
                _cycle(m),
                _redeemed(r.ticket_returns.get(model)),
                (_n(r.behind_ms, "{:.0f} ms") if r.behind_ms else "-") if first else "")
            first = False
    return t


def nodes_table(view: PlaneView) -> Table:
    t = Table(title="nodes", title_justify="left")
    for col in ("node", "model", "backend", "slots healthy/all", "busy", "GPU util"):
        t.add_column(col, justify="left" if col in ("node", "model", "backend") else "right")
    for n in view.nodes:
        t.add_row(n.node, n.model, n.backend, f"{n.healthy}/{n.slots}", _n(n.busy),
                  "-" if n.gpu_util_pct is None else f"{n.gpu_util_pct:.0f}%")
    return t


def slot_streams_table(view: PlaneView) -> Table:
    t = Table(title="slot streams", title_justify="left")
    for col in ("stream", "requests on slots", "leader", "replicas current/all"):
        t.add_column(col, justify="left" if col in ("stream", "leader") else "right")
    for s in view.slot_streams:
        if not s.answered:  # a node's slots are in it, and it has no leader now
            t.add_row(s.stream, "?", "none (no answer)", "?")
            continue
        t.add_row(s.stream, str(s.messages), s.leader or "-", f"{s.current}/{s.replicas}")
    return t


def metrics_table(metrics: Sequence[MetricsFacts], *, live: bool) -> Table:
    t = Table(title="metrics" + (" (over the last interval)" if live else " (since start)"),
              title_justify="left")
    # "refused unread": by a router behind on its inbox (its CPU is the limit: add a router).
    for col in ("endpoint", "refusals/s" if live else "refusals",
                "refused unread/s" if live else "refused unread", "first-retry success",
                "accepted p50/p99 ms", "decision p99 ms", "GPU util"):
        t.add_column(col, justify="left" if col == "endpoint" else "right")
    for m in metrics:
        if m.error:
            t.add_row(m.url, Text(m.error, style="red"), "", "", "", "", "")
            continue
        gpu = "  ".join(f"{k} {v:.0f}%" for k, v in sorted(m.gpu_util_pct.items())) or "-"
        t.add_row(m.url, _n(m.refusals_per_s, "{:.1f}") if live else _n(m.refusals, "{:.0f}"),
                  _n(m.refused_unread_per_s, "{:.1f}") if live
                  else _n(m.refused_unread, "{:.0f}"),
                  _pct(m.first_retry_success),
                  f"{_n(m.accepted_p50_ms, '{:.2f}')}/{_n(m.accepted_p99_ms, '{:.2f}')}",
                  _n(m.decision_p99_ms, "{:.2f}"), gpu)
    return t


def render(view: PlaneView, *, live: bool = False) -> Group:
    state = Text("healthy" if view.healthy else "UNHEALTHY",
                 style="bold green" if view.healthy else "bold red")
    verdict = Text.assemble(state, f"  ({view.took_ms:.0f} ms)  ",
                            Text("; ".join(view.problems), style="yellow"))
    if not view.connected:  # empty tables would only hide why
        return Group(verdict)
    parts: list[Table | Text] = [routers_table(view), nodes_table(view)]
    if view.slot_streams:
        parts.append(slot_streams_table(view))
    if view.metrics:
        parts.append(metrics_table(view.metrics, live=live))
        parts.append(Text("first-retry success: tickets honoured / tickets issued (a caller "
                          "that never comes back counts as a failure); cycle: placement to "
                          "done-event beyond the requested work", style="dim"))
    else:
        parts.append(Text("refusals, first-retry success, accepted p50/p99: add --metrics URL "
                          "(a router's or node's /metrics)", style="dim"))
    parts.append(verdict)
    return Group(*parts)


async def snapshot(nc: Client, names: Names, metrics_urls: Sequence[str], *,
                   timeout_s: float, denials: Denials | None = None,
                   router: str | None = None) -> PlaneView:
    """The plane's status and the given endpoints' metrics, gathered at once (`denials`,
    `router`: as `collect` takes them)."""
    view, metrics = await asyncio.gather(
        collect(nc, names, timeout_s=timeout_s, denials=denials, router=router),
        asyncio.gather(*(asyncio.to_thread(scrape, u, timeout_s) for u in metrics_urls)))
    view.metrics = list(metrics)
    return view


async def run_top(nc: Client, names: Names, metrics_urls: Sequence[str], *,
                  interval_s: float, iterations: int | None = None,
                  console: Console | None = None, denials: Denials | None = None) -> PlaneView:
    """Refresh until cancelled (Ctrl-C), or `iterations` times; returns the last view.
    `denials`: the connection's (`connect_fast`), to name what the server refuses."""
    console = console or default_console()
    last: dict[str, tuple[float, MetricsFacts]] = {}
    view = PlaneView(routers=[], nodes=[])
    with Live(render(view, live=True), console=console, auto_refresh=False) as screen:
        i = 0
        while iterations is None or i < iterations:
            started = time.monotonic()
            view = await snapshot(nc, names, metrics_urls, timeout_s=min(1.0, interval_s),
                                  denials=denials)
            now = time.monotonic()
            shown = []
            for m in view.metrics:
                prev = last.get(m.url)
                shown.append(over_interval(m, None if prev is None else prev[1],
                                           now - prev[0] if prev else 0.0))
                last[m.url] = (now, m)
            view.metrics = shown
            screen.update(render(view, live=True), refresh=True)
            i += 1
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    return view
