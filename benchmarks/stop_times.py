"""How long the plane's commands take to stop, as a user stops them, and what a request
running then gets.

    python benchmarks/stop_times.py up-idle --runs 3            # Ctrl-C an idle `plane up`
    python benchmarks/stop_times.py up-idle --runs 3 --metrics  # ... with --metrics-port 0
    python benchmarks/stop_times.py up-running --runs 3         # ... a 1.5 s request running
    python benchmarks/stop_times.py node-idle --runs 3          # SIGTERM an idle `plane node`
    python benchmarks/stop_times.py up-killed --runs 3          # SIGKILL `plane up`: its router
    python benchmarks/stop_times.py up-killed --external        # ... on a server of one's own

A Ctrl-C is SIGINT to the process group, as a terminal sends it (`plane up` runs as the
leader of a group of its own here). Times are from the signal to the exit of `plane up` or
`plane node` (`up-killed`: of `plane up`'s router process, which outlives it), and for a
request running, each answer's time from its send (sent once the node has settled). `--src DIR`
runs the plane of another checkout (its `plane` package first on PYTHONPATH), for a before
and after on one host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import nats

from gpu_node.standing import SETTLE_S
from plane.contract.embedded import EmbeddedNats

PLANE = str(Path(sys.executable).parent / "plane")
RUNNING_MS = 1500  # the request running at the stop (`*-running`, `up-killed`)


def _env(src: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _until_up(proc: subprocess.Popen[str]) -> str:
    """`plane up`'s NATS URL, once it says Ctrl-C stops it."""
    assert proc.stdout is not None
    url = ""
    for line in proc.stdout:
        if m := re.match(r"plane is up: NATS (\S+)", line):
            url = m.group(1)
        if "Ctrl-C" in line:
            return url
    raise RuntimeError("plane up ended before it was up")


def _router_pid(pid: int) -> int:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=True).stdout
    return next(int(line.split()[0]) for line in out.splitlines() if "plane.router_child" in line)


def _gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] == "Z"
    except OSError:
        return True


class Running:
    """One `calibrated` request of RUNNING_MS sent to `url`, in a thread of its own; its
    answers (status, reason, ms from the send) gathered for `listen_s`."""

    def __init__(self, url: str, listen_s: float) -> None:
        self.answers: list[tuple[str | None, str | None, int]] = []
        self.sent = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(url, listen_s),))
        self._thread.start()
        self.sent.wait(10)

    async def _run(self, url: str, listen_s: float) -> None:
        async def quiet(exc: Exception) -> None:
            pass

        nc = await nats.connect(url, allow_reconnect=False, error_cb=quiet)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("plane.infer.calibrated",
                         json.dumps({"duration_us": RUNNING_MS * 1000}).encode(), reply=inbox,
                         headers={"Plane-Deadline-Ms": str(RUNNING_MS + 10_000)})
        await nc.flush()
        t_sent = time.monotonic()
        self.sent.set()
        t_end = time.monotonic() + listen_s
        while (left := t_end - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:  # the time is up, or the server gone
                break
            h = msg.headers or {}
            self.answers.append((h.get("Plane-Status"), h.get("Plane-Reason"),
                                 round((time.monotonic() - t_sent) * 1000)))
        if not nc.is_closed:
            await nc.close()

    def result(self) -> list[tuple[str | None, str | None, int]]:
        self._thread.join()
        return self.answers


def up(kind: str, args: argparse.Namespace, nats_url: str | None) -> str:
    extra = ["--metrics-port", "0"] if args.metrics else []
    extra += ["--nats", nats_url] if nats_url else []
    with subprocess.Popen([PLANE, "up", "--models", args.models, "--log-level", "warning",
                           *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, env=_env(args.src), start_new_session=True) as proc:
        try:
            url = _until_up(proc)
            if kind != "up-idle":  # past the node's first second (`gpu_node.standing`), when
                time.sleep(SETTLE_S + 0.5)  # it answers through the broker, as after a restart
            running = Running(url, RUNNING_MS / 1000 + 8) if kind != "up-idle" else None
            time.sleep(0.5 if running else 1.0)  # placed and running; or settled
            router = _router_pid(proc.pid)
            t0 = time.monotonic()
            if kind == "up-killed":
                proc.kill()
                while not _gone(router) and time.monotonic() - t0 < 60:
                    time.sleep(0.005)
                what = "its router's process gone"
            else:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(60)
                what = f"plane up exited {proc.returncode}"
            took_s = time.monotonic() - t0
            answers = f", answers {running.result()}" if running else ""
            return f"{took_s:.3f} s to {what}{answers}"
        finally:
            if proc.poll() is None:
                proc.kill()


def node(args: argparse.Namespace, nats_url: str) -> str:
    with subprocess.Popen([PLANE, "node", "--nats", nats_url, "--model", "calibrated",
                           "--slots", "2", "--log-level", "info"], stderr=subprocess.PIPE,
                          text=True, env=_env(args.src)) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "node started" in line:
                break
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t_stopped = None
        for line in proc.stderr:
            if "node stopped" in line:
                t_stopped = time.monotonic()
        proc.wait(60)
        took_s = time.monotonic() - t0
        stopping = f" (stopped after {t_stopped - t0:.3f} s)" if t_stopped else ""
        return f"{took_s:.3f} s to plane node exited {proc.returncode}{stopping}"


def one(args: argparse.Namespace, nats_url: str | None) -> str:
    if args.kind == "node-idle":
        assert nats_url is not None
        return node(args, nats_url)
    return up(args.kind, args, nats_url)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["up-idle", "up-running", "up-killed", "node-idle"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default="risk,calibrated,tinylm")
    parser.add_argument("--metrics", action="store_true", help="plane up --metrics-port 0")
    parser.add_argument("--external", action="store_true",
                        help="plane up --nats URL of a server of this script's own")
    parser.add_argument("--src", help="run the plane of this checkout")
    args = parser.parse_args()
    external = args.external or args.kind == "node-idle"
    async with EmbeddedNats() as server:
        times = []
        for i in range(args.runs):
            url = server.url if external else None
            line = await asyncio.to_thread(one, args, url)
            print(f"run {i}: {line}", flush=True)
            times.append(float(line.split()[0]))
        print(f"{args.kind}: median {statistics.median(times):.3f} s over {args.runs} runs")


if __name__ == "__main__":
    asyncio.run(main())
