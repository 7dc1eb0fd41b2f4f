"""A CPU slot keeps its model warm while it idles (gpu_node/generation.py, WARM_EVERY_S): its
thread runs a one-token generation now and then, for a while after each real one, and never
while a call runs; the next generation's text is what it would have been without it; and it
stops, so that an idle plane sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

import gpu_node.generation as generation
from gpu_node.generation import Generation, SlotGenerator, Stop
from gpu_node.slot_thread import SlotThread
from plane.contract.messages import TinyLMRequest
from tests.plane_fixtures import wait_until


class _Watch:
    """What `generate` tells the health supervisor (nothing watches here)."""

    def begin(self, expected_s: float) -> None:
        pass

    def end(self) -> None:
        pass


def _generate(gen: SlotGenerator, req: TinyLMRequest) -> bytes:
    return gen.generate(req, Stop(), time.monotonic() + 30, _Watch()).text  # type: ignore[arg-type]


async def test_the_idle_hook_runs_between_calls_on_the_slots_thread() -> None:
    ran: list[str] = []
    left = [5]

    def idle() -> float | None:
        if left[0] == 0:
            return None  # then wait for a call with no timeout
        left[0] -= 1
        ran.append(threading.current_thread().name)
        return 0.001

    t = SlotThread("slot-idle-0", idle=idle)
    assert await t.run(lambda: 1) == 1
    await wait_until(lambda: left[0] == 0, 5, "the idle hook to run five times")
    assert set(ran) == {"slot-idle-0"}
    assert await t.run(lambda: 2) == 2  # a call still runs after the hook said "wait"
    t.shutdown()


def test_a_cpu_slot_hands_the_first_token_on_before_feeding_it_back() -> None:
    """On a CPU the decode that feeds a token back is a whole step of the slot's thread: the
    first token goes to the stream (`emit`) before it, a step sooner (time to first token,
    and cancel -> the next stream's first token); the others after theirs (see
    SlotGenerator); the text is the model's own."""
    lm = Generation.for_backend("torch", None, seed=3)
    gen = lm.make_slot(contextlib.nullcontext)
    req = TinyLMRequest(prompt="abc", max_tokens=16)
    at_emit: list[tuple[int, int]] = []  # (token, the model's position when it was handed on)
    result = gen.generate(req, Stop(), time.monotonic() + 30, _Watch(),  # type: ignore[arg-type]
                          lambda token: at_emit.append((token, gen.state.pos)))
    s = lm.lm.start(b"abc", 16)
    assert result.text == bytes(iter(lambda: lm.lm.step(s), None))  # `step`'s text
    assert bytes(t for t, _ in at_emit) == result.text and len(at_emit) == 16
    prefilled = len(b"abc") + 1  # END begins every sequence
    # The first while the model still stands where it will be fed back in; each later one
    # once fed back (the last never is: nothing comes after it).
    assert [pos for _, pos in at_emit] == (
        [prefilled] + [prefilled + i + 1 for i in range(1, 15)] + [prefilled + 15])


async def test_a_cpu_slot_warms_after_a_generation_then_stops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation, "WARM_FOR_S", 0.3)
    gen = Generation.for_backend("torch", None, seed=3).make_slot(contextlib.nullcontext)
    req = TinyLMRequest(prompt="keep me warm", max_tokens=24, temperature=0.8, seed=11)
    cold = await asyncio.to_thread(_generate, gen, req)
    t = SlotThread("slot-warm-0", idle=gen.keep_warm)
    try:
        assert await t.run(_generate, gen, req) == cold
        await wait_until(lambda: gen.warmings >= 3, 5, "the slot to warm while it idles")
        # The state it warms is the slot's own: the next generation must not notice.
        assert await t.run(_generate, gen, req) == cold
        await asyncio.sleep(0.4)  # past WARM_FOR_S since the last generation
        stopped_at = gen.warmings
        await asyncio.sleep(0.1)
        assert gen.warmings == stopped_at, "it went on warming an idle slot"
    finally:
        t.shutdown()

