"""`tinylm` on a node: one model per process, one generation state per slot, and the loop
that runs a whole generation on the slot's thread.

The loop runs prefill and every token step in that one thread, with no trip to the event
loop in between: each token goes out through `emit` (for a stream, a hand-off that wakes the
loop only when it is not already awake: `gpu_node.streaming.TokenPipe`). Before each step it
reads two things the event loop may set: `Stop.reason` (a cancel, a caller gone, a withdrawn
slot) and the deadline, so that a stream stops within one token step of either.

Backends as for `risk` (gpu_node/compute.py): `torch` runs the torch path on the CPU,
`interpret` the Triton decode-attention kernel in the interpreter, `triton` the compiled
kernel on the slot's CUDA lane. Each slot's `GenState` is made once; a token allocates no
tensor (kernels/tinylm.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_node.faults import WatchedRunner
from kernels.tinylm import TinyLM
from plane.contract.errors import ConfigError
from plane.contract.messages import TINYLM_CONTEXT, StreamFinish, TinyLMRequest
from plane.contract.models import ModelSpec

LaneContext = Callable[[], contextlib.AbstractContextManager[Any]]
Emit = Callable[[int], None]  # one token (a byte value), from the generation thread

# What a token step and a prefill are expected to take at most, before any is measured (the
# health supervisor calls a step that runs past its expectation a miss; see gpu_node/health).
FLOOR_STEP_S = 0.005
PRIOR_STEP_S = {"torch": 0.001, "interpret": 0.05, "triton": 0.001}
STEP_MARGIN = 4.0  # expectation: this many times the recent mean step
PREFILL_PER_BYTE_MARGIN_S = 0.0005
# A CPU slot's model leaves the CPU's caches while the slot idles (the host's other work
# takes them): a prefill after 30 ms idle took 1.6 ms against 0.9 back to back, and 0.9 again
# when warmed (`benchmarks/tinylm_tokens.py --max-tokens 64 --gap-ms 30 --warm-every-ms 5`):
# the spread of time to first token at 0.9x. So for WARM_FOR_S after each generation, the
# slot's thread runs a one-token generation every WARM_EVERY_S it idles (~0.3 ms: 6% of a
# core while it does, at most ~15 ms of CPU per idle spell), then stops (an idle plane
# sleeps; at 0.9x most gaps between streams are far shorter). Only the CPU's torch path: a
# GPU's clocks are the device settings' business, the interpreter is for checking.
WARM_EVERY_S = 0.005
WARM_FOR_S = 0.25


class Stop:
    """Set by the event loop, read by the generation thread before each step: a plain
    attribute (one assignment is atomic under the GIL), no lock on the token path."""

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason: StreamFinish | None = None


class Progress:
    """Written by the generation thread, read by the event loop: how far a generation got, so
    that a stream the loop ends before the thread returns still reports its phases (the router
    learns its per-token rates, and how much of max_tokens streams use, from them). Each is
    one assignment (atomic under the GIL); `done` pairs the tokens with their decode time."""

    __slots__ = ("done", "prefill_us")

    def __init__(self) -> None:
        self.prefill_us = 0  # 0: the prefill has not finished
        self.done = (0, 0)  # (tokens produced, µs of token steps for them)

    def so_far(self, finish: StreamFinish, prompt_tokens: int) -> GenResult | None:
        """The generation's phases as far as it got (None before its prefill finished), as
        the result it will not return in time (no text: the caller has what was sent)."""
        if not self.prefill_us:
            return None
        tokens, decode_us = self.done
        return GenResult(finish=finish, prompt_tokens=prompt_tokens, tokens=tokens,
                         prefill_us=self.prefill_us, decode_us=decode_us, text=b"")


@dataclass(frozen=True, slots=True)
class GenResult:
    finish: StreamFinish  # stop | length | cancelled | deadline
    prompt_tokens: int
    tokens: int  # produced
    prefill_us: int  # start(): the prompt through the model
    decode_us: int  # every token step after it
    text: bytes  # what was produced

    @property
    def work_us(self) -> int:
        """The device (here: thread) time the generation took: what the router's per-token
        rates are learned from."""
        return self.prefill_us + self.decode_us


class Generation:
    """The node's one `TinyLM` (weights from the node's seed) on its backend's device."""

    def __init__(self, lm: TinyLM, backend_name: str) -> None:
        if lm.config.context != TINYLM_CONTEXT:
            raise ConfigError(
                f"tinylm: the model's context is {lm.config.context}, the plane's contract "
                f"(plane.contract.messages.TINYLM_CONTEXT) says {TINYLM_CONTEXT}; routers "
                "would admit requests the model cannot hold: build both from one release")
        self.lm = lm
        self.backend_name = backend_name

    @classmethod
    def for_backend(cls, backend_name: str, device: torch.device | None,
                    seed: int = 0) -> Generation:
        """`torch`: the torch path on the CPU; `interpret`: the kernel in Triton's interpreter
        (CPU); `triton`: the compiled kernel on `device`."""
        if backend_name == "torch":
            lm = TinyLM.from_seed(seed, "cpu", use_kernel=False)
        elif backend_name == "interpret":
            lm = TinyLM.from_seed(seed, "cpu", use_kernel=True)
        else:
            lm = TinyLM.from_seed(seed, device or torch.device("cuda"), use_kernel=True)
        return cls(lm, backend_name)

    def _ready(self) -> None:
        """Made on the default stream, read from the slots' streams: finished first."""
        if self.lm.device.type == "cuda":
            torch.cuda.synchronize(self.lm.device)

    def make_slot(self, lane: LaneContext) -> SlotGenerator:
        gen = SlotGenerator(self.lm, lane, PRIOR_STEP_S.get(self.backend_name, 0.001))
        self._ready()  # the weights and this slot's state
        gen.warm_up()
        return gen


def generation_for(spec: ModelSpec, backend: Any, seed: int) -> Generation | None:
    """The node's generation model when its model generates (decided once, at start)."""
    if spec.request_type is not TinyLMRequest:
        return None
    return Generation.for_backend(backend.name, getattr(backend, "device", None), seed)


class SlotGenerator:
    """One slot's generation state (KV cache and workspace, made once) and the loop."""

    def __init__(self, lm: TinyLM, lane: LaneContext, prior_step_s: float) -> None:
        self.lm = lm
        self.state = lm.new_state()
        self._lane = lane
        self._text = bytearray(lm.config.context)  # the request's bytes out, reused
        self.mean_step_s = prior_step_s  # of recent generations: what a step is expected to take
        self._warms = lm.device.type == "cpu" and not lm.use_kernel  # see WARM_EVERY_S
        # The first token is handed on before the decode that feeds it back where that decode
        # runs on this thread (CPU, the interpreter): a step sooner to the caller's first
        # token. Not the later ones: they go out gathered (TOKEN_GAP_S) whatever their order,
        # and the event loop's work for each, done while the decode runs, stretched the
        # decode: stream TPOT p99/p50 1.91 against 1.45 at 0.9x (benchmarks/streams.py, five
        # pairs). On CUDA the decode is only queued: the token goes after it.
        self._first_early = lm.device.type != "cuda"
        self._used_s = 0.0  # monotonic: when the last generation (or warming) ended
        self._warm_until_s = 0.0
        self.warmings = 0  # one-token generations run to keep warm (tests, benchmarks)
        # How a decode step runs (for the log): launches, "a CUDA graph per token" (warm_up),
        # or on the torch path one TorchScript call per token, else eager ops.
        self.decode_path = lm.decode_path

    def warm_up(self) -> None:
        """Short generations (`TinyLM.prime`), so that compiling (Triton's, TorchScript's, or
        the interpreter's rewrite) happens before the slot takes its first request, and a
        broken lane fails here. Then, on CUDA, the decode step captured as a graph on the
        slot's lane (`decode_path` says which)."""
        with self._lane():
            self.lm.prime(self.state)
            self.decode_path = self.lm.capture(self.state)

    def keep_warm(self) -> float | None:
        """The slot thread's idle hook (`gpu_node.slot_thread`): within WARM_FOR_S of the last
        generation, one short generation once the slot has idled WARM_EVERY_S; how long to
        wait before the next (None: not until a generation has run)."""
        now = time.monotonic()
        if not self._warms or now >= self._warm_until_s:
            return None
        since = now - self._used_s
        if since < WARM_EVERY_S:
            return WARM_EVERY_S - since
        try:
            with self._lane():
                self.lm.warm(self.state)
        except Exception:  # a broken lane: the next request fails and says so
            self._warms = False
            return None
        self.warmings += 1
        self._used_s = time.monotonic()
        return WARM_EVERY_S

    def generate(self, req: TinyLMRequest, stop: Stop, deadline_s: float,
                 watch: WatchedRunner, emit: Emit | None = None,
                 progress: Progress | None = None) -> GenResult:
        """Run `req` to its end on this (the slot's) thread: prefill, then token
        steps until the model stops, max_tokens, `stop.reason` or the monotonic `deadline_s`.
        Each step is announced to `watch` (health: a step that hangs is a miss; injected
        faults), each token handed to `emit`, and how far it got kept in `progress`."""
        lm, s, text = self.lm, self.state, self._text
        prompt = req.prompt_bytes
        produced = 0
        finish: StreamFinish | None = None
        t0 = time.perf_counter_ns()
        t1 = t0
        try:
            with self._lane():
                if stop.reason is not None:
                    finish = stop.reason
                else:
                    watch.begin(max(FLOOR_STEP_S, len(prompt) * PREFILL_PER_BYTE_MARGIN_S))
                    lm.start(prompt, req.max_tokens, req.temperature, req.seed, top_p=req.top_p,
                             state=s)
                t1 = time.perf_counter_ns()
                if progress is not None and finish is None:  # the prefill ran
                    progress.prefill_us = max(1, (t1 - t0) // 1000)
                expected_s = max(FLOOR_STEP_S, STEP_MARGIN * self.mean_step_s)
                while finish is None:
                    if stop.reason is not None:
                        finish = stop.reason
                        break
                    if time.monotonic() >= deadline_s:
                        finish = StreamFinish.DEADLINE
                        break
                    watch.begin(expected_s)
                    token = lm.next_token(s)
                    if token is None:
                        break
                    text[produced] = token
                    produced += 1
                    early = produced == 1 and self._first_early
                    if emit is not None and early:
                        emit(token)  # out before its decode, a whole step on a CPU
                    lm.advance(s, token)
                    if progress is not None:
                        progress.done = (produced, (time.perf_counter_ns() - t1) // 1000)
                    if emit is not None and not early:
                        emit(token)
                    if s.finish is not None:
                        break
        finally:
            watch.end()
        t2 = time.perf_counter_ns()
        if finish is None:
            finish = StreamFinish(s.finish or "stop")
        if produced:
            self.mean_step_s = 0.8 * self.mean_step_s + 0.2 * (t2 - t1) / 1e9 / produced
        self._used_s = time.monotonic()
        self._warm_until_s = self._used_s + WARM_FOR_S
        return GenResult(finish=finish, prompt_tokens=len(prompt), tokens=produced,
                         prefill_us=(t1 - t0) // 1000, decode_us=(t2 - t1) // 1000,
                         text=bytes(text[:produced]))
