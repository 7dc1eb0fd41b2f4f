"""Streams on `tinylm`: issue 14's targets, measured on this machine.

    .venv/bin/python benchmarks/streams.py [--duration 30] [--slots 2] [--backend torch]
                                           [--max-tokens 64] [--deadline-ms 1000]
                                           [--capacity-s 10] [--cancel-trials 30]
                                           [--json PATH]

What runs, in order (each plane is `plane up --models tinylm` as its own process on an
embedded nats-server; this process is the caller, reading every stream with a plain NATS
subscription on its inbox, as `plane pulse --stream` does):

1. the bare kernel loop, before any plane starts: the same generation (`--max-tokens`
   greedy tokens of the default prompt) on one slot's state, one thread, timed as pulse
   times a stream (first token to last token over tokens - 1): the per-token time with no
   messaging at all;
2. a plane of `--slots` slots: the capacity, closed loop (one caller per slot, each asking
   for its next stream when the previous one ends), streams/s and tokens/s; then one caller
   alone for a few seconds (the plane's unloaded TPOT, set against the bare loop's);
3. open loop, Poisson arrivals at 0.9x and at 2x the capacity for --duration s each, with
   retries (Retry-After-Ms, tickets; TTFT budget --deadline-ms; the plane's own stream
   deadline): accepted TTFT p99/p50, TPOT p99/p50, accepted streams that ended within their
   deadline, first-retry success;
4. a plane of one slot, once its node has settled (its first second answers through the
   broker's API): a long stream runs; once it has streamed a few tokens it is cancelled
   (an empty message with its Plane-Request-Id on the start's Plane-Cancel-Subject) and a
   next stream is asked for at once, again at once when refused (with the refusal's ticket),
   until one starts: cancel publish -> that stream's first token, --cancel-trials times (and,
   to see where the time goes, cancel -> the cancelled stream's `end`, and the TTFT of the
   next stream's attempt that was let in).

Targets (issue 14): TTFT p99/p50 <= 1.8 and TPOT p99/p50 <= 1.5 at both loads; >= 99.9% of
accepted streams within their deadline; >= 99.5% first-retry success; cancel -> next first
token <= one token step (the bare loop's p50) + 5 ms, judged on the median of the trials (the
p99 is printed beside it); the plane's unloaded TPOT p50 <= 1.5x the bare loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec

BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_node.standing import SETTLE_S  # noqa: E402
from plane.contract.backoff import RetryPolicy  # noqa: E402
from plane.contract.config import ConnectOptions  # noqa: E402
from plane.contract.embedded import EmbeddedNats  # noqa: E402
from plane.contract.lifecycle import run  # noqa: E402
from plane.contract.messages import TinyLMRequest  # noqa: E402
from plane.contract.quantiles import quantile  # noqa: E402
from plane.contract.subjects import Header  # noqa: E402
from plane.pulse.bodies import TINYLM_PROMPT  # noqa: E402
from plane.pulse.runner import LoadConfig  # noqa: E402
from plane.pulse.stream_outcome import StreamOutcome  # noqa: E402
from plane.pulse.stream_runner import Capacity, closed_loop, run_streams  # noqa: E402
from plane.pulse.stream_summary import (  # noqa: E402
    MAX_TPOT_RATIO,
    MAX_TTFT_RATIO,
    MIN_FIRST_RETRY,
    MIN_WITHIN_DEADLINE,
    StreamSummary,
    summarize_streams,
)
from plane.pulse.stream_target import StreamCall, StreamSpec, StreamTarget  # noqa: E402

CANCEL_MARGIN_MS = 5.0  # the target: one token step + this
MAX_OVERHEAD = 1.5  # the plane's TPOT over the bare loop's
SOLO_S = 5.0  # one caller alone: the unloaded TPOT
LONG_TOKENS = 200  # the stream that is cancelled: far from done when it is
CANCEL_AFTER_TOKENS = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=30.0, help="s per open-loop load")
    # What a CPU node serving tinylm runs by default (gpu_node.node.Node.default_slots): one
    # slot per core the loop, broker, router and load generator do not need.
    p.add_argument("--slots", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--backend", default="torch", help="the node's backend (torch: CPU)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--deadline-ms", type=int, default=1000, help="TTFT budget sent")
    p.add_argument("--capacity-s", type=float, default=10.0, help="s of closed loop")
    p.add_argument("--cancel-trials", type=int, default=30)
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    return p.parse_args(argv)


# -- 1. the bare kernel loop ---------------------------------------------------------------
def bare_loop(max_tokens: int, backend: str, streams: int = 30) -> dict[str, float]:
    """Per-token ms of the kernel alone, as pulse measures a stream's TPOT, and one step's."""
    import torch

    from kernels.tinylm import TinyLM

    torch.set_num_threads(1)  # a node's CPU slot runs one thread
    device = "cuda" if backend == "triton" else "cpu"
    lm = TinyLM.from_seed(0, device, use_kernel=backend == "triton")
    state = lm.new_state()
    lm.prime(state)  # as a slot before its first request (TorchScript's compiles)
    tpots, steps, prefills = [], [], []
    for i in range(streams + 1):  # the first warms up and is dropped
        t0 = time.perf_counter()
        lm.start(TINYLM_PROMPT.encode(), max_tokens, 0.0, 0, state=state)
        t1 = time.perf_counter()
        times = []
        while lm.step(state) is not None:
            times.append(time.perf_counter())
        if i == 0 or len(times) < 2:
            continue
        prefills.append(t1 - t0)
        tpots.append((times[-1] - times[0]) / (len(times) - 1))
        steps += [b - a for a, b in itertools.pairwise(times)]
    return {"tpot_p50_ms": 1000 * quantile(tpots, 0.5),
            "step_p50_ms": 1000 * quantile(steps, 0.5),
            "step_p99_ms": 1000 * quantile(steps, 0.99),
            "prefill_p50_ms": 1000 * quantile(prefills, 0.5)}


# -- the plane -------------------------------------------------------------------------------
@contextlib.contextmanager
def plane_up(url: str, slots: int, backend: str) -> Iterator[None]:
    proc = subprocess.Popen(
        [str(BIN / "plane"), "up", "--nats", url, "--models", "tinylm", "--slots", str(slots),
         "--backend", backend, "--log-level", "warning"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        while "Ctrl-C" not in (line := proc.stdout.readline()):
            if not line:
                raise RuntimeError("plane up exited before it was ready")
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.asynccontextmanager
async def plane(slots: int, backend: str, spec: StreamSpec) -> AsyncIterator[StreamTarget]:
    async with EmbeddedNats() as srv:
        with plane_up(srv.url, slots, backend):
            async with StreamTarget(ConnectOptions(url=srv.url, name="bench-streams"),
                                    spec) as target:
                yield target


# -- 4. cancel -> next first token -----------------------------------------------------------
async def first_token_or_end(call: StreamCall, timeout_s: float = 10.0) -> None:
    waits = [asyncio.ensure_future(call.first_token.wait()),
             asyncio.ensure_future(call.done.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def cancel_trial(target: StreamTarget, long_body: bytes, next_body: bytes
                       ) -> dict[str, float]:
    # The stream to cancel: asked for until the (idle) slot takes it.
    while True:
        _, a = await target.begin(long_body, {})
        await first_token_or_end(a)
        if a.token_t:
            break
        await asyncio.sleep(0.01)
    while len(a.token_t) < CANCEL_AFTER_TOKENS and not a.done.is_set():
        await asyncio.sleep(0.0005)
    t_cancel = time.monotonic()
    await target.cancel(a)
    polls, ticket = 0, None
    while True:
        polls += 1
        if time.monotonic() - t_cancel > 10:
            raise RuntimeError("no stream started within 10 s of a cancel: is the slot stuck?")
        headers = {Header.ATTEMPT: str(min(polls, 10_000))}
        if ticket:
            headers[Header.TICKET] = ticket
        b_sent = time.monotonic()
        _, b = await target.begin(next_body, headers)
        await first_token_or_end(b)
        if b.token_t:
            break
        ticket = b.headers.get(Header.TICKET) or ticket
    await asyncio.wait_for(b.done.wait(), 10)
    await asyncio.wait_for(a.done.wait(), 10)
    end = a.reader.end
    return {"cancel_to_next_first_token_ms": 1000 * (b.token_t[0] - t_cancel),
            "cancel_to_end_ms": 1000 * ((a.end_t or t_cancel) - t_cancel),
            "next_ttft_ms": 1000 * (b.token_t[0] - b_sent),  # of the poll let in
            "polls": polls, "cancelled": float(end is not None
                                               and end.finish_reason == "cancelled")}


# -- the report ------------------------------------------------------------------------------
def judged(name: str, value: float | None, bound: float, at_most: bool) -> dict[str, Any]:
    met = None if value is None else (value <= bound if at_most else value >= bound)
    return {"target": name, "value": value, "bound": bound, "met": met}


def fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.2f}%" if pct else f"{v:.2f}"


async def main() -> None:
    args = parse_args()
    body = msgspec.json.encode(TinyLMRequest(prompt=TINYLM_PROMPT, max_tokens=args.max_tokens))
    long_body = msgspec.json.encode(TinyLMRequest(prompt=TINYLM_PROMPT,
                                                  max_tokens=LONG_TOKENS))
    bare = await asyncio.to_thread(bare_loop, args.max_tokens, args.backend)
    spec = StreamSpec(deadline_ms=args.deadline_ms, policy=RetryPolicy())
    loads: dict[float, StreamSummary] = {}
    solo: list[StreamOutcome] = []
    async with plane(args.slots, args.backend, spec) as target:
        cap: Capacity = await closed_loop(target, body, callers=args.slots,
                                          seconds=args.capacity_s)
        await closed_loop(target, body, callers=1, seconds=SOLO_S, keep=solo)
        for factor in (0.9, 2.0):
            load = LoadConfig(rate=factor * cap.streams_per_s, duration_s=args.duration,
                              concurrency=4096)
            r = await run_streams(target, body, load, seed=args.seed)
            loads[factor] = summarize_streams(
                r.outcomes, target=f"{factor}x", rate=load.rate, duration_s=load.duration_s,
                elapsed_s=r.elapsed_s, deadline_ms=args.deadline_ms, stream_deadline_ms=None,
                dropped=r.dropped, after_final=r.after_final)
    solo_summary = summarize_streams(solo, target="solo", rate=0, duration_s=SOLO_S,
                                     elapsed_s=SOLO_S, deadline_ms=args.deadline_ms,
                                     stream_deadline_ms=None)
    trials = []
    async with plane(1, args.backend, StreamSpec(deadline_ms=args.deadline_ms)) as target:
        # A node's first second answers through the broker's API (gpu_node.standing:
        # SETTLE_S, ~1.2 ms more per answer here): the trials time a running node, not that.
        await asyncio.sleep(SETTLE_S)
        for _ in range(args.cancel_trials):
            trials.append(await cancel_trial(target, long_body, body))
            await asyncio.sleep(0.05)
    c2f = [t["cancel_to_next_first_token_ms"] for t in trials]
    c2e = [t["cancel_to_end_ms"] for t in trials]
    next_ttft = [t["next_ttft_ms"] for t in trials]
    plane_tpot = solo_summary.tpot.p50_ms
    overhead = None if plane_tpot is None else plane_tpot / bare["tpot_p50_ms"]
    cancel_bound = bare["step_p50_ms"] + CANCEL_MARGIN_MS

    checks = []
    for f, s in loads.items():
        checks += [
            judged(f"{f}x: accepted TTFT p99/p50 <= {MAX_TTFT_RATIO}", s.ttft_p99_over_p50,
                   MAX_TTFT_RATIO, True),
            judged(f"{f}x: TPOT p99/p50 <= {MAX_TPOT_RATIO}", s.tpot_p99_over_p50,
                   MAX_TPOT_RATIO, True),
            judged(f"{f}x: accepted within deadline >= {100 * MIN_WITHIN_DEADLINE:.1f}%",
                   s.within_deadline_share, MIN_WITHIN_DEADLINE, False),
            judged(f"{f}x: first-retry success >= {100 * MIN_FIRST_RETRY:.1f}%",
                   s.first_retry_success, MIN_FIRST_RETRY, False),
        ]
    checks += [
        judged(f"cancel -> next first token p50 <= step + {CANCEL_MARGIN_MS:g} ms "
               f"({cancel_bound:.2f} ms)", quantile(c2f, 0.5), cancel_bound, True),
        judged(f"plane TPOT p50 <= {MAX_OVERHEAD}x the bare loop's", overhead, MAX_OVERHEAD,
               True),
    ]

    import torch

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, torch {torch.__version__}; tinylm on {args.slots} "
          f"{args.backend} slots, {args.max_tokens} tokens per stream (greedy), TTFT budget "
          f"{args.deadline_ms} ms, {args.duration:.0f} s per load, seed {args.seed}")
    print(f"bare kernel loop: TPOT p50 {bare['tpot_p50_ms']:.3f} ms, step p50 "
          f"{bare['step_p50_ms']:.3f} ms p99 {bare['step_p99_ms']:.3f} ms, prefill p50 "
          f"{bare['prefill_p50_ms']:.3f} ms")
    print(f"capacity (closed loop, {args.slots} callers): {cap.streams_per_s:.1f} streams/s, "
          f"{cap.tokens_per_s:.0f} tokens/s ({cap.refused} refusals on the way)")
    print(f"one caller alone: TPOT p50 {fmt(plane_tpot)} ms, TTFT p50 "
          f"{fmt(solo_summary.ttft.p50_ms)} ms ({fmt(overhead)}x the bare loop's TPOT)")
    print(f"cancel -> next first token: p50 {quantile(c2f, 0.5):.2f} ms, p99 "
          f"{quantile(c2f, 0.99):.2f} ms, max {max(c2f):.2f} ms; cancel -> its end p50 "
          f"{quantile(c2e, 0.5):.2f} ms, the next stream's own TTFT p50 "
          f"{quantile(next_ttft, 0.5):.2f} ms; {sum(t['cancelled'] for t in trials):.0f}/"
          f"{len(trials)} ended `cancelled`, polls p50 "
          f"{quantile([t['polls'] for t in trials], 0.5):.0f}\n")
    print("| load | offered/s | streams | accepted | TTFT p50 ms | TTFT p99 ms | p99/p50 | "
          "TPOT p50 ms | TPOT p99 ms | p99/p50 | tokens/s | refused at first try | "
          "first-retry success | mean retries | within deadline |")
    print("| --- " * 15 + "|")
    for f, s in loads.items():
        print(f"| {f}x | {s.rate:.1f} | {s.sent} | {s.accepted} | {fmt(s.ttft.p50_ms)} | "
              f"{fmt(s.ttft.p99_ms)} | {fmt(s.ttft_p99_over_p50)} | {fmt(s.tpot.p50_ms)} | "
              f"{fmt(s.tpot.p99_ms)} | {fmt(s.tpot_p99_over_p50)} | {s.tokens_per_s:.0f} | "
              f"{fmt(s.refusal_rate, True)} | {fmt(s.first_retry_success, True)} | "
              f"{fmt(s.mean_retries)} | {fmt(s.within_deadline_share, True)} |")
    print()
    for c in checks:
        mark = {True: "x", False: " ", None: "-"}[c["met"]]
        print(f"- [{mark}] {c['target']}: {fmt(c['value'])}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "machine": {"arch": platform.machine(), "cores": os.cpu_count(),
                        "python": platform.python_version(), "torch": torch.__version__},
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "bare_loop": bare, "capacity": {**msgspec.to_builtins(cap),
                                            "streams_per_s": cap.streams_per_s,
                                            "tokens_per_s": cap.tokens_per_s},
            "solo": msgspec.to_builtins(solo_summary),
            "loads": {f"{f}x": msgspec.to_builtins(s) for f, s in loads.items()},
            "cancel_trials": trials, "checks": checks}, indent=1) + "\n")


if __name__ == "__main__":
    run(main())
