"""What a refusal costs the router's admission under overload, by slot count:
`Admission.decide` for a newcomer when every slot is busy and the promise schedule is full
(PROMISE_MAX_LINKS promises a slot), the decision most requests get past the router's limit.

    .venv/bin/python benchmarks/admission_cost.py [--slots 2,4,8,15,32] [--decisions 20000]

Pure CPU, no server, in this process: the slots of one node, each busy for 2 ms more; the
schedule filled by refusals; then `--decisions` newcomers decided one after another, the
clock moving 10 ns each (so nothing expires). Prints µs per decision (`decide` alone) and
what the decisions were. With `--churn` the load is 2x overload as it runs instead: the clock
moves half a slot's share of the work between newcomers (two newcomers a completion), and
before every second one the slot that frees first takes the first promise in the book (its
holder placed, the promise kept), so that the book and the slots change as they do under
overload; only `decide` is timed. On a GPU host the router's refusals are most of its work past its
limit (BENCHMARKS.md, "GPU", second session), and this grows with the slots.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plane.contract.budget import Prediction
from plane.contract.messages import NodeAdvert, SlotAdvert
from plane.contract.subjects import Names
from plane.router.admission import PROMISE_MAX_LINKS, Admission, Ask, Refuse
from plane.router.occupancy import ModelSlots

NAMES = Names()
WORK = Prediction(p50_us=2_000, p99_us=2_600)


def full_schedule(slots: int) -> tuple[ModelSlots, Admission]:
    ms = ModelSlots(model="calibrated")
    ms.apply_advert(NodeAdvert(node="n", model="calibrated", backend="triton", at_ms=0, slots=[
        SlotAdvert(k=k, subject=NAMES.slot("calibrated", "n", k), healthy=True)
        for k in range(slots)]), NAMES, 0.0)
    for i, view in enumerate(ms.slots.values()):
        view.occupy(0.0, f"r{i}", 0.002 + i * 1e-4, 0.003 + i * 1e-4)
    adm = Admission("r")
    for _ in range(PROMISE_MAX_LINKS * slots + 1):
        adm.decide(ms, Ask(now_s=1e-4, deadline_s=1.0, prediction=WORK))
    return ms, adm


def complete(ms: ModelSlots, adm: Admission, now_s: float, i: int) -> None:
    """The slot that frees first does, and takes the first promise's holder (or stays free)."""
    view = min(ms.slots.values(), key=lambda v: v.expected_free_s if v.busy else -1.0)
    view.finished(now_s, view.request_id or "")
    first = next(iter(ms.promises), None)
    if first is not None:
        adm.forget(ms, first, tell=False, kept=True)
        view.occupy(now_s, f"h{i}", WORK.p50_us / 1e6, WORK.p99_us / 1e6)


@click.command()
@click.option("--slots", "slot_counts", default="2,4,8,15,32", show_default=True)
@click.option("--decisions", default=20_000, show_default=True)
@click.option("--churn", is_flag=True, help="2x overload as it runs (see above)")
def main(slot_counts: str, decisions: int, churn: bool) -> None:
    print("| slots | open promises | µs per decision | decisions |")
    print("| --- | --- | --- | --- |")
    for n in (int(s) for s in slot_counts.split(",")):
        ms, adm = full_schedule(n)
        kinds: Counter[str] = Counter()
        step_s = WORK.p50_us / 1e6 / n / 2 if churn else 1e-8
        spent = 0.0
        for i in range(decisions):
            now = 1e-4 + i * step_s
            if churn and i % 2 == 0:
                complete(ms, adm, now, i)
            ask = Ask(now_s=now, deadline_s=now + 1.0, prediction=WORK)
            t0 = time.perf_counter()
            d = adm.decide(ms, ask)
            spent += time.perf_counter() - t0
            kinds[f"{type(d).__name__} {d.reason.value}" if isinstance(d, Refuse)
                  else type(d).__name__] += 1
        us = spent / decisions * 1e6
        print(f"| {n} | {len(ms.promises)} | {us:.1f} | {dict(kinds)} |")


if __name__ == "__main__":
    main()
