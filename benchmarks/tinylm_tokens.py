"""Per-token time of `tinylm` on one slot: how steady is a token step, and what does a prompt
cost before the first one.

    .venv/bin/python benchmarks/tinylm_tokens.py [--device cpu] [--streams 20]
                                                 [--prompt-bytes 16] [--max-tokens 240]
                                                 [--temperature 0.8] [--threads 1] [--kernel]
                                                 [--wait-us 0] [--gap-ms 0]
                                                 [--warm-every-ms 0]

What runs: `--streams` generations back to back on one slot's state (its buffers made once,
as a node's slot does), after one warm-up stream that is dropped. Each `step()` is timed on
the monotonic clock; a step returns only once its logits are on the host (on CUDA it waits
for the device), so the clock reads finished work. A step that samples the last token runs
no decode step and is left out. Prints p50/p99/max of the per-token µs overall and by
position in the context (steady means those barely move), the spread of each stream's mean
per-token time (what a promise timed to a stream's end has to predict: the plane's router
learns it from done-events), the prefill (`start`) µs, and tokens/s.

`--wait-us` sleeps that long in each step, as a step that waits on a device does (the host
part stays the CPU's): with it, the spread left is the host's, not the kernel's. `--gap-ms`
idles between streams, as a slot between callers does; with `--warm-every-ms W` the gap is
spent as a CPU node's slot spends it (`gpu_node.generation.SlotGenerator.keep_warm`): a
one-token generation each W ms, so the prefill after it shows what keeping warm buys.

`--kernel` uses the Triton decode-attention kernel: compiled on CUDA, or the CPU
interpreter under TRITON_INTERPRET=1 (slow: for checking, not timing). Without it, the torch
path runs: the CPU `torch` backend's, and the reference the kernel is measured against.
Imports only torch and numpy besides the repo's kernels, so it also runs on a bare GPU box.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.tinylm import END, GenState, TinyLM, TinyLMWeights

POSITION_BANDS = 4  # per-token percentiles by quarter of the context


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--streams", type=int, default=20, help="timed streams (default 20)")
    p.add_argument("--prompt-bytes", type=int, default=16, help="prompt length (default 16)")
    p.add_argument("--max-tokens", type=int, default=240, help="tokens per stream (default 240)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: one slot, one core)"
    )
    p.add_argument("--kernel", action="store_true", help="the Triton kernel path")
    p.add_argument("--wait-us", type=int, default=0, help="sleep per step (a device's wait)")
    p.add_argument("--gap-ms", type=float, default=0.0, help="idle between streams")
    p.add_argument("--warm-every-ms", type=float, default=0.0,
                   help="in each gap, a one-token generation this often (as a CPU slot does)")
    return p.parse_args(argv)


def pct(samples_us: np.ndarray) -> str:
    p50, p99 = np.percentile(samples_us, [50, 99])
    return f"p50 {p50:8.1f} us  p99 {p99:8.1f} us  max {samples_us.max():8.1f} us"


def idle(lm: TinyLM, state: GenState, gap_s: float, warm_every_s: float) -> None:
    """Idle `gap_s`; with `warm_every_s`, run the slot's keep-warm generation that often."""
    end = time.perf_counter() + gap_s
    while (left := end - time.perf_counter()) > 0:
        if not warm_every_s or left <= warm_every_s:
            time.sleep(left)
            return
        time.sleep(warm_every_s)
        lm.warm(state)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # The stop token is masked out, so every stream runs its full length and every position
    # of the band it covers is measured (a real stream can stop early).
    w = TinyLMWeights.from_seed(0)
    no_end = dataclasses.replace(w, head_bias=w.head_bias.index_fill(0, torch.tensor(END), -1e9))
    lm = TinyLM(no_end, device, use_kernel=args.kernel)
    context = lm.config.context
    if args.prompt_bytes + args.max_tokens > context:
        print(f"--prompt-bytes + --max-tokens must fit the context ({context})", file=sys.stderr)
        return 2
    state = lm.new_state()
    lm.prime(state)  # as a slot before its first request (TorchScript's compiles)
    prompt = bytes(range(97, 97 + 26)) * (args.prompt_bytes // 26 + 1)
    prompt = prompt[: args.prompt_bytes]

    steps_us: list[float] = []
    positions: list[int] = []
    prefill_us: list[float] = []
    stream_means_us: list[float] = []
    t_all = 0
    for stream in range(args.streams + 1):  # stream 0 warms up and is dropped
        t0 = time.perf_counter_ns()
        lm.start(prompt, args.max_tokens, args.temperature, seed=stream, state=state)
        t1 = time.perf_counter_ns()
        stream_start = t0
        decode_ns, decode_steps = 0, 0
        while True:
            pos = state.pos
            t_step = time.perf_counter_ns()
            if args.wait_us:
                time.sleep(args.wait_us / 1e6)
            token = lm.step(state)
            elapsed = time.perf_counter_ns() - t_step
            if token is None or state.finish is not None:
                break  # the last token runs no decode step
            decode_ns, decode_steps = decode_ns + elapsed, decode_steps + 1
            if stream:
                steps_us.append(elapsed / 1e3)
                positions.append(pos)
        if stream:
            prefill_us.append((t1 - t0) / 1e3)
            stream_means_us.append(decode_ns / max(1, decode_steps) / 1e3)
            t_all += time.perf_counter_ns() - stream_start
        if args.gap_ms:
            idle(lm, state, args.gap_ms / 1e3, args.warm_every_ms / 1e3)

    steps, where = np.array(steps_us), np.array(positions)
    path = "kernel" if args.kernel else "torch"
    print(
        f"tinylm on {device} ({path} path, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}): {args.streams} streams x {args.max_tokens} tokens, prompt "
        f"{args.prompt_bytes} B, temperature {args.temperature}, wait {args.wait_us} us per "
        f"step, {args.gap_ms} ms between streams"
        + (f", warmed every {args.warm_every_ms} ms" if args.warm_every_ms else "")
    )
    print(f"  per token    {pct(steps)}  ({steps.size} steps)")
    band = context // POSITION_BANDS
    for lo in range(0, context, band):
        here = steps[(where >= lo) & (where < lo + band)]
        if here.size:
            print(f"  pos {lo:3d}-{lo + band - 1:3d} {pct(here)}")
    means = np.array(stream_means_us)
    m50, m90 = np.percentile(means, [50, 90])
    print(f"  stream mean  p50 {m50:8.1f} us  p90 {m90:8.1f} us  max {means.max():8.1f} us  "
          f"(p90/p50 {m90 / m50:.2f}, max/p50 {means.max() / m50:.2f}; {means.size} streams)")
    print(f"  prefill      {pct(np.array(prefill_us))}  ({args.prompt_bytes + 1} tokens)")
    tokens = args.streams * args.max_tokens
    print(f"  {tokens / (t_all / 1e9):,.0f} tokens/s on one slot, prefill included")
    return 0


if __name__ == "__main__":
    sys.exit(main())
