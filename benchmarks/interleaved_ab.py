"""Two versions of the plane, closed loop, interleaved: for a before/after on a noisy host.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/interleaved_ab.py --base /tmp/base [--rounds 3] [--seconds 6]

On a shared 2-core host the speed of the same code can move by 2x within minutes, so one run
of each version, one after the other, says little. This alternates them: each round runs the
base tree, then this one, each as its own process (`PYTHONPATH` set to that tree) that
starts a plane the way `benchmarks/cpu_per_request.py` does (`plane_system`: its own
nats-server, `plane router` and `plane node` processes, 4 `calibrated` slots, 0 µs), warms
it with 1,000 requests, and measures a closed loop of 1 caller and then of 4 callers for
`--seconds` each (its `measure`: answered/s, p50, CPU µs per request of router, node and
nats-server from /proc, and the router's and node's over nats-server's, which takes out
the host's speed). The base tree needs `benchmarks/cpu_per_request.py` with
`plane_system` and `measure` (commit 9574c71 or later). Prints one table row per run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent

# Run in the tree under test (its own benchmarks/ and plane/ on sys.path).
MEASURE = """
import asyncio, json, sys, tempfile
from pathlib import Path
from benchmarks.cpu_per_request import Load, Size, measure, plane_system

async def main(seconds):
    body = json.dumps({"duration_us": 0}).encode()
    async with plane_system(Path(tempfile.mkdtemp()), body, slots=4, deadline_ms=1000) as p:
        await measure(p, body, Load("warm-up", callers=4), Size(1000, 0.0))
        out = {}
        for callers in (1, 4):
            await asyncio.sleep(1)
            m = await measure(p, body, Load(f"closed {callers}", callers=callers),
                              Size(None, seconds))
            out[callers] = {"ok_per_s": m.ok_per_s, "p50_ms": m.p50_ms, "cpu_us": m.cpu_us}
    print(json.dumps(out))

asyncio.run(main(float(sys.argv[1])))
"""


def _run(tree: Path, seconds: float) -> dict[str, dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(seconds)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300 + 4 * seconds,
                          check=False)
    if done.returncode != 0:
        raise click.ClickException(f"the run in {tree} failed:\n{done.stderr[-2000:]}")
    result: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _row(name: str, r: int, out: dict[str, dict[str, object]]) -> str:
    cells = []
    for callers in ("1", "4"):
        m = out[callers]
        cpu = m["cpu_us"]
        assert isinstance(cpu, dict)
        # Each process's CPU over nats-server's in the same run: nats-server's work per
        # request is the same for both trees, so the ratio takes out the host's speed,
        # which moves by up to 2x within minutes here.
        ns = float(cpu["nats-server"]) or 1.0
        cells += [f"{m['ok_per_s']:.0f}", f"{m['p50_ms']:.3f}",
                  f"{cpu['router']:.0f} / {cpu['node']:.0f} / {cpu['nats-server']:.0f}",
                  f"{cpu['router'] / ns:.2f} / {cpu['node'] / ns:.2f}"]
    return f"| {name} | {r} | " + " | ".join(cells) + " |"


@click.command()
@click.option("--base", required=True, type=click.Path(exists=True, file_okay=False,
                                                       path_type=Path),
              help="The other tree (a git worktree of the commit to compare with).")
@click.option("--rounds", default=3, show_default=True)
@click.option("--seconds", default=6.0, show_default=True, help="Per load and run.")
def main(base: Path, rounds: int, seconds: float) -> None:
    """Two versions of the plane, closed loop, interleaved."""
    print(f"base {base.resolve()} against {REPO}; {rounds} rounds, {seconds:g} s per load")
    print("| tree | round | 1 caller: answered/s | p50 ms | router / node / nats-server µs "
          "| router / node ÷ nats-server | 4 callers: answered/s | p50 ms "
          "| router / node / nats-server µs | router / node ÷ nats-server |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in range(1, rounds + 1):
        for name, tree in (("base", base.resolve()), ("this", REPO)):
            print(_row(name, r, _run(tree, seconds)), flush=True)


if __name__ == "__main__":
    main()
