"""What a refusal costs the router's admission under overload, by slot count:
`Admission.decide` for a newcomer when every slot is busy and the promise schedule is full
(PROMISE_MAX_LINKS promises a slot), the decision most requests get past the router's limit.

    .venv/bin/python benchmarks/admission_cost.py [--slots 2,4,8,15,32] [--decisions 20000]

Pure CPU, no server, in this process: the slots of one node, each busy for 2 ms more; the
schedule filled by refusals; then `--decisions` newcomers decided one after another, the
clock moving 10 ns each (so nothing expires). Prints µs per decision (process time) and
what the decisions were. On a GPU host the router's refusals are most of its work past its
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


@click.command()
@click.option("--slots", "slot_counts", default="2,4,8,15,32", show_default=True)
@click.option("--decisions", default=20_000, show_default=True)
def main(slot_counts: str, decisions: int) -> None:
    print("| slots | open promises | µs per decision | decisions |")
    print("| --- | --- | --- | --- |")
    for n in (int(s) for s in slot_counts.split(",")):
        ms, adm = full_schedule(n)
        kinds: Counter[str] = Counter()
        t0 = time.process_time()
        for i in range(decisions):
            d = adm.decide(ms, Ask(now_s=1e-4 + i * 1e-8, deadline_s=1.0, prediction=WORK))
            kinds[f"{type(d).__name__} {d.reason.value}" if isinstance(d, Refuse)
                  else type(d).__name__] += 1
        us = (time.process_time() - t0) / decisions * 1e6
        print(f"| {n} | {len(ms.promises)} | {us:.1f} | {dict(kinds)} |")


if __name__ == "__main__":
    main()
