"""The node's request path under load, in several process shapes: where does a request's
time on the slot go, past the device work, and whose CPU does it cost?

Each shape serves `calibrated` on SLOTS slots; `plane pulse` offers RATES (requests/s) of
WORK_US work each, with --retry. Per shape and rate: pulse's summary; the slot's time past
the work (`compute_us - work_us` of the node's sampled "request answered" lines: the
hand-off to the slot's thread, the launch, the wait's wake-up, the hand-back, the loop's lag);
the CPU seconds of each process (from /proc) over the pulse; and each router's /metrics over
it: refusals, those refused unread because it was behind on its inbox (its CPU the limit),
its decisions' time from receipt.

Shapes:
- up: `plane up --one-process`, the whole plane in one process (router, node, its loop, its slot
  threads; `plane up` itself now runs its router in a process of its own, as split does);
- up-spin: the same with slot waits that spin (CUDA: events without blocking sync);
- split: nats-server, `plane router` and `plane node` as three processes;
- split-5ms: as split, the node with Python's own GIL switch interval (`--gil-switch-us 0`),
  against the node's 200 us;
- split-procs: as split, the node's slots over NODE_PROCS processes (`--processes`);
- split-procs-mps: the same under an NVIDIA MPS daemon of its own (nvidia-cuda-mps-control);
- split-2r, split-4r: 2 or 4 routers (`--router-id r<i>`), one node process (several,
  without MPS, take turns on the GPU: the first GPU runs of these shapes had the node over 3
  processes and measured that, not the routers).
py-spy, where installed, records `up` and `split` (pyspy_*.txt in their folders).

    python3 scripts/gpu_shapes.py                 # on a CUDA machine (~2 minutes)
    BACKEND=torch SLOTS=4 python3 scripts/gpu_shapes.py   # on a CPU, to try it
Environment: BACKEND (triton), SLOTS (15), WORK_US (2000), RATES (1000,3000), PULSE_S (4),
SHAPES (all, comma separated), NODE_PROCS (3), OUT (a temp dir: logs).
It needs only the standard library and the plane's own dependencies; nats-server is found
on PATH. On a bare GPU box install the wheels of `scripts/gpu_wheels.sh` first, as
gpu_plane.sh does (`pip install --no-index --no-deps --target /tmp/site .whl/*.whl`, then
PYTHONPATH=/tmp/site:. and PATH=/tmp/site/bin:$PATH).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the plane's own modules, where it is not installed

from plane.observe.planeview import MetricsFacts, over_interval, scrape  # noqa: E402

ALL = ("up", "up-spin", "split", "split-5ms", "split-procs", "split-procs-mps", "split-2r",
       "split-4r")
MPS_CONTROL = "nvidia-cuda-mps-control"


@dataclass(frozen=True)
class Run:
    """What to run, from the environment (the docstring's list)."""

    backend: str
    slots: int
    work_us: int
    rates: list[int]
    seconds: float
    node_procs: int
    shapes: list[str]
    out: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Run:
        return cls(
            backend=env.get("BACKEND", "triton"), slots=int(env.get("SLOTS", "15")),
            work_us=int(env.get("WORK_US", "2000")),
            rates=[int(r) for r in env.get("RATES", "1000,3000").split(",")],
            seconds=float(env.get("PULSE_S", "4")), node_procs=int(env.get("NODE_PROCS", "3")),
            shapes=[s for s in env.get("SHAPES", ",".join(ALL)).split(",") if s],
            out=Path(env.get("OUT") or tempfile.mkdtemp()))


TICK = os.sysconf("SC_CLK_TCK")

# A preamble run before `plane` in the same process (`up-spin`), then `python -m plane`.
PLANE_AFTER = "{pre}import runpy; runpy.run_module('plane', run_name='__main__', alter_sys=True)"
SPIN = ("import torch, gpu_node.partitions as p; "
        "p.CudaLane.blocking = property(lambda s: False, lambda s, v: (setattr(s, '_blocking', "
        "False), setattr(s, '_done', torch.cuda.Event(blocking=False)))); ")


def plane(*args: str, pre: str = "") -> list[str]:
    """`plane` through this interpreter (no entry point on a bare GPU box)."""
    if not pre:
        return [sys.executable, "-m", "plane", *args]
    return [sys.executable, "-c", PLANE_AFTER.format(pre=pre), *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def family(pids: list[int]) -> dict[int, str]:
    """`pids` and their descendants: pid -> a short name."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found = set(pids)
    while True:
        more = {p for p, pp in parents.items() if pp in found and p not in found}
        if not more:
            break
        found |= more
    names = {}
    for p in found:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        m = re.search(r"(?:-m plane|alter_sys=True\))\s+(\w+)", cmd)
        names[p] = m.group(1) if m else Path(cmd.split(" ", 1)[0]).name
    return names


def start(args: list[str], log: Path,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True, env=env)


def mps_start(d: Path) -> dict[str, str]:
    """An NVIDIA MPS control daemon of the shape's own (pipe and log folders under `d`): the
    environment of its clients. Without MPS, CUDA contexts of several processes take turns
    on the device; with it their kernels run side by side."""
    exe = shutil.which(MPS_CONTROL)
    if exe is None:
        raise RuntimeError(f"no {MPS_CONTROL} on PATH")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(d / "mps-pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(d / "mps-log")}
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    subprocess.run([exe, "-d"], env=env, check=True, timeout=30)
    return env


def mps_stop(d: Path) -> None:
    """Stop the daemon `mps_start(d)` started, if it did."""
    exe = shutil.which(MPS_CONTROL)
    if exe is not None and (d / "mps-pipe" / "control").exists():
        subprocess.run([exe], input=b"quit\n", timeout=30, env={
            **os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(d / "mps-pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(d / "mps-log")})


def wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m.group(1) if m.groups() else m.group(0)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"{proc.args!s:.200} did not get ready; {log}:\n"
                       + log.read_text(errors="replace")[-3000:])


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in reversed(procs):
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def shape(run: Run, name: str, d: Path
          ) -> tuple[str, list[subprocess.Popen[bytes]], list[Path], list[str]]:
    """Start `name`: its NATS URL, its processes (the router first, then the node, where
    they are apart), the logs with the node's lines, the routers' /metrics."""
    node_args = ["--model", "calibrated", "--slots", str(run.slots), "--backend", run.backend,
                 "--log-level", "info"]
    if name.startswith("up"):
        pre = {"up": "", "up-spin": SPIN}[name]
        log = d / "up.log"
        mport = free_port()
        p = start(plane("up", "--one-process", "--models", "calibrated", "--slots",
                        str(run.slots), "--backend", run.backend, "--log-level", "info",
                        "--metrics-port", str(mport), pre=pre), log)
        return (wait_for(log, r"plane is up: NATS (\S+)", p), [p], [log],
                [f"http://127.0.0.1:{mport}/metrics"])
    # split, split-5ms (the node's GIL switch interval Python's own), split-procs (the node's slots
    # over NODE_PROCS processes, -mps: under MPS), split-<n>r (n routers)
    routers = int(m.group(1)) if (m := re.fullmatch(r"split-(\d+)r", name)) else 1
    members = run.node_procs if name.startswith("split-procs") else 1
    node_env = mps_start(d) if name == "split-procs-mps" else None
    port = free_port()
    nats = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
    srv = start([nats, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(d / "js")],
                d / "nats.log")
    url = f"nats://127.0.0.1:{port}"
    wait_for(d / "nats.log", r"Server is ready", srv)
    node_log = d / "node.log"
    extra = ["--processes", str(members)] if members > 1 else []
    if name == "split-5ms":
        extra.extend(["--gil-switch-us", "0"])
    node = start(plane("node", "--nats", url, *node_args, *extra), node_log, node_env)
    end = time.monotonic() + 120
    while node_log.read_text().count("node started") < members and time.monotonic() < end:
        if node.poll() is not None:
            break
        time.sleep(0.2)
    wait_for(node_log, r"node started", node)
    procs, metrics = [], []
    for i in range(routers):
        router_log = d / f"router{i}.log"
        mport = free_port()
        procs.append(start(plane("router", "--nats", url, "--log-level", "info",
                                 "--router-id", f"r{i}", "--metrics-port", str(mport),
                                 "--metrics-host", "127.0.0.1"), router_log))
        metrics.append(f"http://127.0.0.1:{mport}/metrics")
        wait_for(router_log, r"router started", procs[-1])
    return url, [*procs, node, srv], [node_log], metrics


def profile(pid: int, out: Path, mode: str, seconds: float) -> subprocess.Popen[bytes] | None:
    """py-spy (where installed) records `pid` for the middle of a pulse, as collapsed stacks
    (one line a stack and its count: grep them). `mode`: "cpu" (the threads on a CPU),
    "idle" (every thread, waiting ones too), "gil" (the thread holding the GIL)."""
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    flags = {"cpu": "", "idle": "--idle", "gil": "--gil"}[mode]
    return subprocess.Popen(
        ["sh", "-c", f"sleep 1; exec {spy} record -p {pid} -d {max(1, int(seconds) - 2)} -r 250 "
                     f"--threads {flags} --nonblocking -f raw -o {out}"],
        stdout=subprocess.DEVNULL, stderr=(out.parent / "pyspy.err").open("ab"))


def profiles(name: str, procs: list[subprocess.Popen[bytes]], d: Path, *, first: bool,
             seconds: float) -> list[subprocess.Popen[bytes]]:
    """What to record in a shape's pulse: `up`'s process (every thread at the first rate,
    the GIL's holder at the next); `split`'s router (on CPU) and node (every thread, then
    the GIL's holder)."""
    if name == "up":
        plan = [(procs[0].pid, "up", "idle" if first else "gil")]
    elif name == "split":
        plan = [(procs[1].pid, "node", "idle" if first else "gil")]
        if first:
            plan.append((procs[0].pid, "router", "cpu"))
    else:
        return []
    return [p for pid, who, mode in plan
            if (p := profile(pid, d / f"pyspy_{who}_{mode}.txt", mode, seconds)) is not None]


def answered(logs: list[Path], since: float) -> list[dict[str, object]]:
    rows = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if '"request answered"' not in line:
                continue
            try:
                r = json.loads(line)
            except ValueError:
                continue
            ts = r.get("timestamp")
            if isinstance(ts, str):
                t = time.mktime(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
                if t + 1 < since:
                    continue
            rows.append(r)
    return rows


def router_line(f: MetricsFacts) -> str:
    """A router's /metrics over one pulse: its refusals, those refused unread because it was
    behind on its inbox (its CPU the limit: `plane.router.inbox`), and its decisions' time
    from receipt."""
    if f.error:
        return f"/metrics unreadable: {f.error}"
    return (f"refusals {f.refusals_per_s or 0:.0f}/s, refused unread (behind) "
            f"{f.refused_unread_per_s or 0:.0f}/s, decision from receipt p50/p99 "
            f"{fmt_ms(f.decision_p50_ms)}/{fmt_ms(f.decision_p99_ms)} ms")


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def q(v: list[int], p: float) -> int | None:
    v = sorted(v)
    return v[int(p * (len(v) - 1))] if v else None


def main() -> int:
    run = Run.from_env(os.environ)
    print(f"shapes: {', '.join(run.shapes)}; calibrated {run.work_us} us on {run.slots} slots "
          f"({run.backend}), {run.seconds:g} s a rate; logs in {run.out}")
    for name in run.shapes:
        d = run.out / name
        d.mkdir(parents=True, exist_ok=True)
        try:
            url, procs, logs, metrics = shape(run, name, d)
        except Exception as e:  # one shape's failure must not hide the others
            print(f"== {name}: did not start: {e}")
            mps_stop(d)
            continue
        try:
            time.sleep(1.0)
            for rate in run.rates:
                names = family([p.pid for p in procs])
                before = {p: cpu_s(p) for p in names}
                since = time.time()
                scraped = [scrape(u, 5.0) for u in metrics]
                spies = profiles(name, procs, d, first=rate == run.rates[0],
                                 seconds=run.seconds)
                pulse = subprocess.run(
                    plane("pulse", "--nats", url, "--model", "calibrated", "--duration-us",
                          str(run.work_us), "--rate", str(rate), "--retry", "--duration",
                          str(run.seconds), "--json", "--no-progress"),
                    capture_output=True, text=True, cwd=ROOT, timeout=run.seconds + 60)
                for spy in spies:
                    spy.wait()
                cpu: dict[str, float] = {}
                for p, n in names.items():
                    cpu[n] = cpu.get(n, 0.0) + cpu_s(p) - before[p]
                try:
                    s = json.loads(pulse.stdout)
                except ValueError:
                    print(f"== {name} {rate}/s: pulse failed: {pulse.stderr[-800:]}")
                    continue
                rows = answered(logs, since)
                over = [int(r["compute_us"]) - int(r["work_us"]) for r in rows  # type: ignore[call-overload]
                        if r.get("status") == 200]
                print(f"== {name} {rate}/s: ok/s {s.get('ok_per_s', 0):.0f}, refused first "
                      f"{s.get('refusal_rate', 0):.3f}, first-retry "
                      f"{s.get('first_retry_success')}, p50 {s.get('p50_ms')} ms, p99 "
                      f"{s.get('p99_ms')} ms")
                print(f"   slot time past the work (us, {len(over)} sampled): p50 "
                      f"{q(over, .5)}, p90 {q(over, .9)}, p99 {q(over, .99)}")
                print("   CPU s over the pulse: " + ", ".join(
                    f"{n} {c:.2f}" for n, c in sorted(cpu.items(), key=lambda x: -x[1])))
                for i, (u, old) in enumerate(zip(metrics, scraped, strict=True)):
                    print(f"   router {i}: " + router_line(
                        over_interval(scrape(u, 5.0), old, time.time() - since)))
        finally:
            stop(procs)
            mps_stop(d)
            shutil.rmtree(d / "js", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
