"""What a busy event loop costs tinylm's CPU decode step: the eager ops against the scripted step
(`kernels.tinylm_script`), alone and beside a thread that runs Python in bursts.

A node's slot thread generates while its event loop (token messages, pulls; a router's
decisions under `plane up`) runs in the same process. Each torch op lets the GIL go and takes
it back; when the loop holds it at that moment, the step waits. The competitor here is such a
loop: `--busy-us` of pure Python, then `--idle-us` asleep (GIL free), over and over; 0 idle is
a thread that never lets go but at Python's switch interval (5 ms), the worst case.

    .venv/bin/python benchmarks/tinylm_gil.py
    .venv/bin/python benchmarks/tinylm_gil.py --busy-us 200 --idle-us 200 --steps 2000

Prints per path: a step's p50/p99 (µs) alone and beside the competitor, and a 64-token
stream's mean step (what pulse calls TPOT) p50/p99 beside it.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from kernels.tinylm import TinyLM

PROMPT = b"The plane keeps one request per slot."


class Competitor:
    """A thread that runs Python for `busy_s`, then sleeps `idle_s`, until stopped."""

    def __init__(self, busy_s: float, idle_s: float) -> None:
        self.busy_s, self.idle_s = busy_s, idle_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            end = time.perf_counter() + self.busy_s
            n = 0
            while time.perf_counter() < end:
                n += 1
            if self.idle_s:
                time.sleep(self.idle_s)

    def __enter__(self) -> Competitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def quantiles_us(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return 1e6 * s[len(s) // 2], 1e6 * s[min(len(s) - 1, int(0.99 * len(s)))]


def time_steps(lm: TinyLM, steps: int) -> list[float]:
    """Each step's wall time, restarting the stream whenever it ends (64 tokens each)."""
    s = lm.start(PROMPT, 64)
    out: list[float] = []
    while len(out) < steps:
        t0 = time.perf_counter()
        token = lm.step(s)
        out.append(time.perf_counter() - t0)
        if token is None or s.finish is not None:
            lm.start(PROMPT, 64, state=s)
    return out


def stream_means(lm: TinyLM, streams: int) -> list[float]:
    """Per 64-token stream: (last - first token) / (tokens - 1), as pulse's TPOT."""
    s = lm.new_state()
    out = []
    for _ in range(streams):
        lm.start(PROMPT, 64, state=s)
        stamps = []
        while lm.step(s) is not None:
            stamps.append(time.perf_counter())
        if len(stamps) > 1:
            out.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return out


def row(name: str, fn: Callable[[], list[float]]) -> str:
    p50, p99 = quantiles_us(fn())
    return f"| {name} | {p50:.0f} | {p99:.0f} | {p99 / p50:.2f} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500, help="steps timed per case")
    p.add_argument("--streams", type=int, default=60, help="64-token streams per case")
    p.add_argument("--busy-us", type=float, default=150.0, help="the competitor's burst")
    p.add_argument("--idle-us", type=float, default=300.0, help="its pause (0: never)")
    args = p.parse_args()
    torch.set_num_threads(1)  # a node's CPU slot runs one thread
    paths = {"eager ops": TinyLM.from_seed(0, script=False), "scripted": TinyLM.from_seed(0)}
    for lm in paths.values():
        lm.prime(lm.new_state())  # as a slot before its first request: TorchScript compiles
        time_steps(lm, 200)
    print(f"torch {torch.__version__}; competitor: {args.busy_us:.0f} us of Python, then "
          f"{args.idle_us:.0f} us asleep\n")
    print("| path, case | p50 us | p99 us | p99/p50 |\n| --- | --- | --- | --- |")
    for name, lm in paths.items():
        steps = partial(time_steps, lm, args.steps)
        print(row(f"{name}, a step alone", steps))
        with Competitor(args.busy_us / 1e6, args.idle_us / 1e6):
            print(row(f"{name}, a step beside the loop", steps))
            print(row(f"{name}, a stream's mean step beside the loop",
                      partial(stream_means, lm, args.streams)))


if __name__ == "__main__":
    main()
