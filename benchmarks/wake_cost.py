"""What a wake-up costs on this machine: CPU charged to a process each time it leaves idle.

    .venv/bin/python benchmarks/wake_cost.py [--wakes 2000]

On the project's hosts (2-vCPU Firecracker microVMs) a process woken from an idle CPU is
charged far more CPU than the work it then does: the plane's per-request figures at one
caller (`benchmarks/cpu_per_request.py`) count wake-ups more than Python, and a process that
receives three messages per request, apart in time (the router: a request, its PubAck, its
done-event), pays about three wake-ups where an echo responder pays one. Measured here, with
`time.process_time` (the kernel's exact per-process runtime, not tick samples), no NATS:

- `timer, N Hz`: an asyncio (uvloop) loop whose only work is to wake N times a second
  (`asyncio.sleep(1/N)`): CPU per wake; `sleep, N Hz` the same with `time.sleep` and no
  loop (what the host charges, without asyncio's own steps);
- `ping-pong, back to back`: two processes send one byte back and forth over a socketpair
  as fast as they can (neither CPU idles): CPU per message, each side;
- `ping-pong, 1 ms apart`: the same, with the first side sleeping 1 ms between round trips
  (so both sides idle before each message): CPU per message, each side.

The difference between the last two is the price of waking from idle on the host.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import click
import uvloop
from rich.console import Console
from rich.table import Table


async def _timer_cpu_us(hz: float, wakes: int) -> float:
    await asyncio.sleep(0.2)
    t0 = time.process_time()
    for _ in range(wakes):
        await asyncio.sleep(1 / hz)
    return (time.process_time() - t0) * 1e6 / wakes


def timer_cpu_us(hz: float, wakes: int) -> float:
    """CPU µs per wake of an otherwise idle uvloop loop woken `hz` times a second."""
    return uvloop.run(_timer_cpu_us(hz, wakes))


def sleep_cpu_us(hz: float, wakes: int) -> float:
    """The same without an event loop: `time.sleep(1/hz)` in a loop."""
    t0 = time.process_time()
    for _ in range(wakes):
        time.sleep(1 / hz)
    return (time.process_time() - t0) * 1e6 / wakes


def ping_pong_cpu_us(messages: int, gap_s: float) -> tuple[float, float]:
    """CPU µs per message of (the sender, the echoing child), `gap_s` between round trips."""
    a, b = socket.socketpair()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the echoing side: reports its own CPU through the pipe
        a.close()
        t0 = time.process_time()
        for _ in range(messages):
            b.recv(1)
            b.send(b"x")
        os.write(w, f"{time.process_time() - t0}".encode())
        os._exit(0)
    b.close()
    t0 = time.process_time()
    for _ in range(messages):
        if gap_s:
            time.sleep(gap_s)
        a.send(b"x")
        a.recv(1)
    mine = time.process_time() - t0
    theirs = float(os.read(r, 64).decode())
    os.waitpid(pid, 0)
    for fd in (r, w):
        os.close(fd)
    a.close()
    return mine * 1e6 / messages, theirs * 1e6 / messages


@click.command()
@click.option("--wakes", type=int, default=2000, show_default=True,
              help="Wake-ups (or round trips) per measurement.")
def main(wakes: int) -> None:
    table = Table(title="CPU charged per wake-up, µs (time.process_time)")
    table.add_column("what")
    table.add_column("this process", justify="right")
    table.add_column("the other", justify="right")
    for hz in (50.0, 200.0):
        table.add_row(f"timer, {hz:g} Hz (idle loop)", f"{timer_cpu_us(hz, wakes // 4):.1f}", "-")
        table.add_row(f"sleep, {hz:g} Hz (no loop)", f"{sleep_cpu_us(hz, wakes // 4):.1f}", "-")
    busy = ping_pong_cpu_us(wakes * 5, 0.0)
    table.add_row("ping-pong, back to back", f"{busy[0]:.1f}", f"{busy[1]:.1f}")
    idle = ping_pong_cpu_us(wakes, 0.001)
    table.add_row("ping-pong, 1 ms apart", f"{idle[0]:.1f}", f"{idle[1]:.1f}")
    Console().print(table)
    print(f"machine: {os.uname().machine}, {os.cpu_count()} CPUs, kernel {os.uname().release}")


if __name__ == "__main__":
    main()
