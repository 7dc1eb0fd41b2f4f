"""Admission and tickets as pure logic: successive refusals get successive free times, a
ticket holder gets its slot ahead of newcomers, and a promise that cannot meet the deadline is
never made."""

import heapq
import random
from collections import Counter

import pytest
from msgspec.structs import replace

from plane.contract.budget import Prediction, ServiceWindow, fits, predict
from plane.contract.messages import NodeAdvert, Reason, SlotAdvert, Status
from plane.contract.subjects import Names
from plane.router.admission import (
    CALL_TRIP_MAX_AGE_S,
    CALLERS_MAX,
    NEWCOMER_PARK_SLACK_S,
    PROMISE_MAX_LINKS,
    STANDING_CYCLES,
    STANDING_LINKS,
    Admission,
    Ask,
    Park,
    Place,
    Refuse,
)
from plane.router.caller import again_record
from plane.router.fairness import FairShare
from plane.router.occupancy import ModelSlots
from plane.router.promises import (
    ON_TIME_SLACK_S,
    TAIL_FRESH_S,
    Promise,
    PromiseBook,
    next_start,
    simulate,
    would_delay,
)

NAMES = Names()
MS10 = Prediction(p50_us=10_000, p99_us=11_000)
MS200 = Prediction(p50_us=200_000, p99_us=200_000)


def slots(n: int, healthy: bool = True) -> ModelSlots:
    ms = ModelSlots(model="calibrated")
    ms.apply_advert(NodeAdvert(node="n", model="calibrated", backend="torch", at_ms=0, slots=[
        SlotAdvert(k=k, subject=NAMES.slot("calibrated", "n", k), healthy=healthy)
        for k in range(n)]), NAMES, 0.0)
    return ms


def busy_until(ms: ModelSlots, *free_at_s: float) -> None:
    for view, t in zip(ms.slots.values(), free_at_s, strict=True):
        view.occupy(0.0, "ours", t, t)


def ask(now: float, deadline_s: float = 1.0, ticket: str | None = None,
        pred: Prediction = MS10, caller: str = "", retry: bool = False) -> Ask:
    return Ask(now_s=now, deadline_s=now + deadline_s, prediction=pred, ticket=ticket,
               caller=caller, retry=retry or ticket is not None)


def test_free_slot_is_placed() -> None:
    ms, adm = slots(2), Admission("r")
    d = adm.decide(ms, ask(0.0))
    assert isinstance(d, Place) and len(d.candidates) == 2 and d.redeemed is None


def test_successive_refusals_get_successive_free_times() -> None:
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.010, 0.020)
    waits = []
    for _ in range(4):
        d = adm.decide(ms, ask(0.0))
        assert isinstance(d, Refuse) and d.status == Status.BUSY and d.reason == Reason.BUSY
        assert d.ticket is not None
        waits.append(d.retry_after_ms)
    # slot A frees at 10 ms, slot B at 20 ms; each promise then holds its slot for the
    # predicted p50 (10 ms); holders are told to come 1 ms early (their trip back) and are
    # parked if their slot has not freed yet.
    assert waits == [9, 19, 19, 29]
    assert len(adm.tickets) == 4


def test_ticket_holder_goes_ahead_of_newcomers() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    first = adm.decide(ms, ask(0.0))
    assert isinstance(first, Refuse) and first.ticket
    # The slot frees at 10 ms. A newcomer at 10 ms would collide with the promise: refused.
    ms.slots["n/0"].busy = False
    newcomer = adm.decide(ms, ask(0.0101))
    assert isinstance(newcomer, Refuse) and newcomer.retry_after_ms is not None
    assert newcomer.retry_after_ms >= 9
    holder = adm.decide(ms, ask(0.0101, ticket=first.ticket))
    assert isinstance(holder, Place) and holder.redeemed is not None
    adm.redeemed(ms, holder.redeemed, 0.0101)
    assert first.ticket not in adm.tickets


def test_newcomer_that_fits_before_the_promise_is_placed() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.050)
    promise = adm.decide(ms, ask(0.0))
    assert isinstance(promise, Refuse) and promise.retry_after_ms == 49
    ms.slots["n/0"].busy = False  # freed early, at 5 ms
    short = Prediction(p50_us=1_000, p99_us=2_000)
    d = adm.decide(ms, ask(0.005, pred=short))
    assert isinstance(d, Place)


def test_no_promise_beyond_the_deadline() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.100)
    d = adm.decide(ms, ask(0.0, deadline_s=0.050))
    assert isinstance(d, Refuse) and d.reason == Reason.DEADLINE and d.ticket is None
    assert d.retry_after_ms == 99
    assert not adm.tickets


@pytest.mark.parametrize(("came_s", "kept"), [(0.040, True), (0.090, False)])
def test_a_holder_is_judged_by_when_it_came_not_when_the_router_got_to_it(
        came_s: float, kept: bool) -> None:
    """A router behind its inbox decides a request long after it came: a holder that came
    while its promise held is still its holder (ahead of newcomers), one that came after it
    lapsed goes as a newcomer."""
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    first = adm.decide(ms, ask(0.0))
    assert isinstance(first, Refuse) and first.ticket
    expires_s = adm.tickets[first.ticket].expires_s
    assert came_s < expires_s < 0.090 if kept else expires_s < came_s
    ms.slots["n/0"].busy = False
    late = replace(ask(0.120, ticket=first.ticket), came_s=came_s)  # decided 30-80 ms after
    d = adm.decide(ms, late)
    assert isinstance(d, Place)
    assert (d.redeemed is not None) is kept
    assert adm.stats["ticket-valid" if kept else "ticket-late"] == 1
    assert first.ticket not in adm.tickets or kept


def test_unredeemed_promise_expires() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    first = adm.decide(ms, ask(0.0))
    assert isinstance(first, Refuse)
    ms.slots["n/0"].busy = False
    # The holder never comes; past due + tolerance the slot goes to a newcomer.
    d = adm.decide(ms, ask(0.070))
    assert isinstance(d, Place)
    assert first.ticket not in adm.tickets


def test_no_healthy_slot_is_503() -> None:
    d = Admission("r").decide(slots(2, healthy=False), ask(0.0))
    assert isinstance(d, Refuse) and d.status == Status.UNAVAILABLE
    assert d.reason == Reason.NO_CAPACITY


def test_slots_whose_streams_are_silent_are_passed_over_and_said_so() -> None:
    """A slot stream that answered no publish (no leader): its slots are not placed on until
    an advert after the silence; when every slot is silent, the 503 says why."""
    ms = slots(2)
    ms.slots["n/0"].stream = "PLANE_SLOTS_0"
    ms.slots["n/1"].stream = "PLANE_SLOTS_1"
    assert ms.silence("PLANE_SLOTS_0", until_s=1.0) == 1
    d = Admission("r").decide(ms, Ask(now_s=0, deadline_s=1, prediction=MS10))
    assert isinstance(d, Place) and [v.k for v in d.candidates] == [1]
    ms.silence("PLANE_SLOTS_1", until_s=1.0)
    d = Admission("r").decide(ms, Ask(now_s=0, deadline_s=1, prediction=MS10))
    assert isinstance(d, Refuse) and d.status is Status.UNAVAILABLE
    assert d.reason is Reason.UNHEALTHY and "answer no publish" in d.message
    advert = NodeAdvert(node="n", model="calibrated", backend="torch", at_ms=0, slots=[
        SlotAdvert(k=k, subject=NAMES.slot("calibrated", "n", k), stream=f"PLANE_SLOTS_{k}")
        for k in range(2)])
    ms.apply_advert(advert, NAMES, 0.5)  # within the silence: still passed over
    assert ms.healthy_count() == 0 and ms.silent_count() == 2
    ms.apply_advert(advert, NAMES, 1.0)  # after it: tried again
    assert ms.healthy_count() == 2 and ms.silent_count() == 0


def test_work_longer_than_the_deadline_is_refused_at_once() -> None:
    d = Admission("r").decide(slots(2), ask(0.0, deadline_s=0.005))
    assert isinstance(d, Refuse) and d.reason == Reason.DEADLINE and "raise" in d.message


def test_avoided_node_goes_last() -> None:
    ms = slots(1)
    ms.apply_advert(NodeAdvert(node="m", model="calibrated", backend="torch", at_ms=0,
                               slots=[SlotAdvert(k=0, subject=NAMES.slot("calibrated", "m", 0))]),
                    NAMES, 0.0)
    d = Admission("r").decide(ms, Ask(now_s=0, deadline_s=1, prediction=MS10, avoid_node="n"))
    assert isinstance(d, Place) and d.candidates[0].node == "m" and d.candidates[-1].node == "n"


def test_free_slots_another_router_placed_on_last_are_offered_after_ours() -> None:
    """Two routers see the same slots free (their done-events): each offers first the ones
    whose last request it placed itself, so that they take different slots instead of racing
    for the same one; a slot nobody placed on yet counts as ours."""
    ms = slots(4)
    views = list(ms.slots.values())
    for v, placer in zip(views, ("r", "other", "r", "other"), strict=True):
        v.finished(0.0, f"req-{v.k}", placer)
    for i in range(4):
        ms.rr = i
        for me, first in (("r", {0, 2}), ("other", {1, 3})):
            d = Admission(me).decide(ms, Ask(now_s=0.001, deadline_s=1, prediction=MS10))
            assert isinstance(d, Place)
            assert {v.k for v in d.candidates[:2]} == first, (me, d.candidates)
            assert len(d.candidates) == 4
    views[1].placer = ""
    d = Admission("r").decide(ms, Ask(now_s=0.001, deadline_s=1, prediction=MS10))
    assert isinstance(d, Place) and d.candidates[-1].k == 3


def test_free_slots_are_offered_round_robin_and_busy_ones_never() -> None:
    """Each decision starts its candidates one slot further on (load spreads over equal
    slots); a busy slot is no candidate, a healthy slot taken by another router's request
    (ours unknown) is once its p50 has passed, an unhealthy one never."""
    ms = slots(4)
    views = list(ms.slots.values())
    views[1].occupy(0.0, "ours", 0.010, 0.011)
    views[2].occupy(0.0, None, 0.010, 0.011)
    views[3].healthy = False
    adm = Admission("r")
    for now in (0.001, 0.002):
        d = adm.decide(ms, Ask(now_s=now, deadline_s=1, prediction=MS10))
        assert isinstance(d, Place) and [v.k for v in d.candidates] == [0]
    d = adm.decide(ms, Ask(now_s=0.0105, deadline_s=1, prediction=MS10))
    assert isinstance(d, Place) and sorted(v.k for v in d.candidates) == [0, 2]
    starts = []
    for i in range(4):
        ms.rr = i
        d = adm.decide(ms, Ask(now_s=0.0105, deadline_s=1, prediction=MS10))
        assert isinstance(d, Place)
        starts.append(d.candidates[0].k)
    assert starts.count(0) == 2 and starts.count(2) == 2, starts


def test_service_window_percentiles(rng) -> None:  # type: ignore[no-untyped-def]
    w = ServiceWindow(size=1000, prior_us=5)
    assert (w.p50_us, w.p99_us) == (5, 5)
    samples = [rng.randint(100, 200) for _ in range(990)] + [5000] * 10
    rng.shuffle(samples)
    for s in samples:
        w.add(s)
    w.add(150)  # forces a refresh at some point; the window holds the last 1000
    assert 140 <= w.p50_us <= 160
    assert 200 <= w.p99_us <= 5000
    p = predict(w, work_us=1000)
    assert p.p50_us == 1000 + w.p50_us
    assert fits(p.p99_us, p.p99_us) and not fits(p.p99_us, p.p99_us - 1)


def test_service_window_is_current_after_every_sample_and_every_expiry(rng) -> None:  # type: ignore[no-untyped-def]
    """Its percentiles and mean are those of the samples it holds (the last `size`, none older
    than `max_age_s`), after each change: checked against sorting them again."""
    w = ServiceWindow(size=50, prior_us=7, max_age_s=0.5)
    held: list[tuple[float, int]] = []
    for i in range(2000):
        now = i / 50  # 50 samples span 1 s: expiry drops about half
        v = rng.randint(0, 5000) if i % 300 < 250 else 10 * i  # with rising runs
        w.add(v, now)
        held = [*held, (now, v)][-50:]
        if i % 7 == 0:
            gone = w.expire(now)
            kept = [(t, x) for t, x in held if t >= now - 0.5]
            assert gone == len(held) - len(kept)
            held = kept
        s = sorted(x for _, x in held)
        n = len(s)
        assert (w.count, w.mean_us) == (n, sum(s) // n)
        assert (w.p50_us, w.p90_us, w.p99_us) == (
            s[(n - 1) // 2], s[min(n - 1, 90 * n // 100)], s[min(n - 1, 99 * n // 100)]), i
    assert w.expire(100.0) == len(held) and (w.p50_us, w.p99_us, w.mean_us) == (7, 7, 7)


def test_holder_whose_slot_is_about_to_free_is_parked_not_refused() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    first = adm.decide(ms, ask(0.0))
    assert isinstance(first, Refuse) and first.retry_after_ms == 9
    # Back at 9 ms, the slot still runs (frees at 10 ms): wait for it, do not refuse.
    d = adm.decide(ms, ask(0.009, ticket=first.ticket))
    assert isinstance(d, Park) and d.until_s > 0.010


def test_no_shows_stop_pinning_slot_time() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    now = 0.0
    for _ in range(40):  # callers that never come back
        d = adm.decide(ms, ask(now))
        assert isinstance(d, Refuse)
        now += 0.1  # each promise lapses; after LAPSED_KEEP_S its holder is a no-show
    assert adm.redemption["calibrated"] < 0.5
    ms.slots["n/0"].busy = False
    last = adm.decide(ms, ask(now))
    # Free slot, no pinned promises left: a newcomer is placed at once.
    assert isinstance(last, Place)


def test_tickets_nobody_redeems_do_not_pile_up() -> None:
    """Callers that never come back: once promises stop pinning, the tickets still handed out
    lapse too (they used to be kept for ever: router memory grew with every refusal)."""
    ms, adm = slots(1), Admission("r")
    now = 0.0
    for _ in range(2000):
        busy_until(ms, now + 0.010)  # always busy: another caller's request runs
        assert isinstance(adm.decide(ms, ask(now)), Refuse)
        now += 0.01
    assert adm.redemption["calibrated"] < 0.5
    open_tickets = len(adm.tickets) + len(adm._unpinned) + len(adm._lapsed)
    assert open_tickets < 100, open_tickets


# -- pooled promises ----------------------------------------------------------------------------


def test_schedule_gives_each_promise_the_earliest_free_slot() -> None:
    promises = [Promise(ticket=t, due_s=d, expires_s=1.0, service_s=0.010)
                for t, d in (("a", 0.009), ("b", 0.019), ("c", 0.019))]
    starts, after = simulate([0.010, 0.020], promises, 0.0)
    assert starts == {"a": 0.010, "b": 0.020, "c": 0.020}
    assert sorted(after) == [0.030, 0.030]
    assert next_start([0.010, 0.020], promises, 0.0) == 0.030


def test_a_holder_is_served_by_whichever_slot_frees_first() -> None:
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.010, 0.020)
    first = adm.decide(ms, ask(0.0))
    assert isinstance(first, Refuse) and first.retry_after_ms == 9  # timed to slot 0
    # Slot 0 overruns; slot 1 frees early, at 11 ms. The promise is kept there.
    ms.slots["n/1"].release(0.011)
    d = adm.decide(ms, ask(0.011, ticket=first.ticket))
    assert isinstance(d, Place) and d.redeemed is not None
    assert [v.key for v in d.candidates] == ["n/1"]


def test_a_late_holder_does_not_keep_a_present_one_waiting() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    late = adm.decide(ms, ask(0.0))
    on_time = adm.decide(ms, ask(0.0))
    assert isinstance(late, Refuse) and isinstance(on_time, Refuse)
    assert (late.retry_after_ms, on_time.retry_after_ms) == (9, 19)
    ms.slots["n/0"].release(0.010)
    # At 19 ms the first holder has not come back (its promise still stands for newcomers).
    newcomer = adm.decide(ms, ask(0.019))
    assert isinstance(newcomer, Refuse)
    d = adm.decide(ms, ask(0.019, ticket=on_time.ticket))
    assert isinstance(d, Place)


def test_parked_holders_go_in_due_order() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    a = adm.decide(ms, ask(0.0))
    b = adm.decide(ms, ask(0.0))
    assert isinstance(a, Refuse) and isinstance(b, Refuse)
    parked = adm.decide(ms, ask(0.009, ticket=a.ticket))
    assert isinstance(parked, Park) and parked.holder.parked
    ms.slots["n/0"].release(0.0105)
    # The later holder finds the slot free, but the earlier one is here and waiting.
    d = adm.decide(ms, ask(0.0105, ticket=b.ticket))
    assert isinstance(d, Park)
    d = adm.decide(ms, Ask(now_s=0.0106, deadline_s=1.0, prediction=MS10, ticket=a.ticket,
                           park_until_s=parked.until_s))
    assert isinstance(d, Place) and d.redeemed is not None and d.redeemed.ticket == a.ticket


def test_a_parked_holder_whose_window_closes_gets_a_new_promise() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    a = adm.decide(ms, ask(0.0))
    assert isinstance(a, Refuse)
    parked = adm.decide(ms, ask(0.009, ticket=a.ticket))
    assert isinstance(parked, Park)
    later = parked.until_s + 0.001
    d = adm.decide(ms, Ask(now_s=later, deadline_s=1.0, prediction=MS10, ticket=a.ticket,
                           park_until_s=parked.until_s), may_park=False)
    assert isinstance(d, Refuse) and d.ticket is not None and d.ticket != a.ticket
    assert a.ticket not in adm.tickets and adm.stats["holder-refused-after-park"] == 1


def test_a_parked_holder_refused_at_its_deadline_leaves_no_promise_behind() -> None:
    """A holder parks until its deadline no longer leaves room for the work; then the budget
    check refuses it (`deadline`: it will not come back). Its promise must go: left parked
    in the book, it kept the next holder from a free slot."""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.010, 0.010)
    a = adm.decide(ms, ask(0.0, deadline_s=0.030))
    b = adm.decide(ms, ask(0.0))
    c = adm.decide(ms, ask(0.0))
    assert isinstance(a, Refuse) and isinstance(b, Refuse) and isinstance(c, Refuse)
    assert c.ticket is not None
    # Both slots are taken again before a's holder is back: it parks, to its deadline at most.
    busy_until(ms, 0.050, 0.060)
    parked = adm.decide(ms, Ask(now_s=0.009, deadline_s=0.030, prediction=MS10,
                                ticket=a.ticket))
    assert isinstance(parked, Park) and parked.until_s <= 0.030 - 0.011 + 1e-9
    d = adm.decide(ms, Ask(now_s=parked.until_s + 0.001, deadline_s=0.030, prediction=MS10,
                           ticket=a.ticket, park_until_s=parked.until_s))
    assert isinstance(d, Refuse) and d.reason == Reason.DEADLINE and d.ticket is None
    assert a.ticket not in adm.tickets
    assert all(p.ticket != a.ticket for p in ms.promises)
    # A slot frees: the next holder, due first now, takes it at once.
    ms.slots["n/0"].release(0.050)
    d = adm.decide(ms, ask(0.050, ticket=b.ticket))
    assert isinstance(d, Place) and d.redeemed is not None and d.redeemed.ticket == b.ticket


def test_no_promise_a_holder_as_late_as_most_would_miss() -> None:
    """Holders have come back 8 ms after their due time: a promise due closer than that to
    the last start its deadline allows is refused at once (`deadline`), not made to fail."""
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    now = 0.0
    for _ in range(20):  # holders that come back 8 ms late (and are placed)
        r = adm.decide(ms, ask(now))
        assert isinstance(r, Refuse) and r.ticket is not None
        back = now + r.retry_after_ms / 1000 + 0.008
        ms.slots["n/0"].release(back)
        d = adm.decide(ms, ask(back, ticket=r.ticket))
        assert isinstance(d, Place)
        ms.slots["n/0"].occupy(back, "ours", 0.010, 0.011)
        now = back
    assert adm.lateness["calibrated"].p99_us >= 8000
    # The slot frees in 10 ms; the work takes 11 ms at the p99. A 30 ms deadline leaves a
    # latest start at 19 ms: due at ~9 ms + 8 ms late fits. A 25 ms one does not.
    ok = adm.decide(ms, ask(now, deadline_s=0.030))
    assert isinstance(ok, Refuse) and ok.reason == Reason.BUSY and ok.ticket is not None
    adm.forget(ms, adm.tickets[ok.ticket])
    late = adm.decide(ms, ask(now, deadline_s=0.025))
    assert isinstance(late, Refuse) and late.reason == Reason.DEADLINE and late.ticket is None


def test_no_promise_a_start_as_late_as_most_would_miss() -> None:
    """Holders come back on time, but the work ahead of them runs 7 ms past the schedule's
    prediction and they start (the broker takes them) that much after the start they were
    promised: a promise due closer than that to the last start its deadline allows is
    refused at once (`deadline`), not made to fail on the holder's return."""
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    now = 0.0
    for _ in range(20):
        r = adm.decide(ms, ask(now))
        assert isinstance(r, Refuse) and r.ticket is not None
        back = now + r.retry_after_ms / 1000  # on time: the slot has not freed yet
        parked = adm.decide(ms, ask(back, ticket=r.ticket))
        assert isinstance(parked, Park)
        freed = back + 0.007
        ms.slots["n/0"].release(freed)
        d = adm.decide(ms, replace(ask(freed, ticket=r.ticket), park_until_s=parked.until_s))
        assert isinstance(d, Place) and d.redeemed is not None
        adm.redeemed(ms, d.redeemed, freed)
        ms.slots["n/0"].occupy(freed, "ours", 0.010, 0.011)
        now = freed
    assert adm.lateness["calibrated"].p99_us <= 1000
    assert adm.slips["calibrated"].p99_us(0.010, 0.010, now) >= 7000
    # The slot frees in 10 ms; the work takes 11 ms at the p99. A 30 ms deadline leaves a
    # latest start at 19 ms: due at ~10 ms + 7 ms late fits. A 25 ms one does not (counted
    # from the holders' return alone, it would: ~10 ms + 1 ms).
    ok = adm.decide(ms, ask(now, deadline_s=0.030))
    assert isinstance(ok, Refuse) and ok.reason == Reason.BUSY and ok.ticket is not None
    adm.forget(ms, adm.tickets[ok.ticket])
    late = adm.decide(ms, ask(now, deadline_s=0.025))
    assert isinstance(late, Refuse) and late.reason == Reason.DEADLINE and late.ticket is None


def test_a_router_that_does_not_make_the_promises_delegates_them_after_a_lost_race_too(
) -> None:
    """Every slot a router tried was taken under it (another router put a request there
    first). Deciding again, it promises nothing where another router makes the promises: its
    refusal says `delegate` (the request goes to the promiser), as a newcomer's does; it
    gave tickets of its own there, for slot time the promiser gave out too."""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.010, 0.020)
    d = adm.decide(ms, ask(0.0), may_promise=False)
    assert isinstance(d, Refuse) and d.delegate and d.ticket is None
    lost = adm.after_lost_race(ms, ask(0.0), 0.0, may_promise=False)
    assert isinstance(lost, Refuse)
    assert lost.delegate and lost.ticket is None and lost.reason == Reason.BUSY
    assert not adm.tickets and not ms.promises
    # The promiser itself gives a ticket there.
    own = adm.after_lost_race(ms, ask(0.0), 0.0)
    assert isinstance(own, Refuse) and not own.delegate
    assert own.ticket is not None and own.ticket in adm.tickets


def test_a_router_that_does_not_promise_leaves_free_slots_to_the_holders_about_to_start(
) -> None:
    """Where another router makes the promises, a newcomer here takes a slot that looks free
    only while the free slots outnumber that router's holders about to start (parked, called,
    or due before the newcomer's p99 is over): else it goes to the promiser (`delegate`),
    whose view of its holders is not a note's trip behind. A promise due later than that does
    not hold a slot back."""
    ms, adm, now = slots(3), Admission("r"), 1.0
    next(iter(ms.slots.values())).occupy(now, "ours", 0.020, 0.020)  # two free slots
    for i, due in enumerate((0.001, 0.005)):
        adm.adopt(ms, Promise(ticket=f"other-{i}", due_s=now + due, expires_s=now + 1,
                              service_s=0.010))
    d = adm.decide(ms, ask(now), may_promise=False)  # two due within 11 ms: both slots
    assert isinstance(d, Refuse) and d.delegate and d.ticket is None
    assert adm.stats["newcomer-delegated"] == 1
    adm.drop(ms, "other-1")
    adm.adopt(ms, Promise(ticket="other-2", due_s=now + 0.100, expires_s=now + 1,
                          service_s=0.010))
    d = adm.decide(ms, ask(now), may_promise=False)  # one due soon, one slot to spare
    assert isinstance(d, Place) and len(d.candidates) == 2
    assert adm.stats["newcomer-delegated"] == 1
    # The promiser decides as before: the free slots against its whole schedule.
    d = adm.decide(ms, ask(now))
    assert isinstance(d, Place)


def test_after_a_lost_race_the_slots_that_look_free_and_were_not_tried_are_tried_each_once(
) -> None:
    """Slot A was taken under us; slot B looks free: B is tried at once (the caller told to
    come back instead, with no ticket, found it gone). B tried already (in this round or one
    before), and the caller is told to come back in a p50, as before."""
    ms, adm = slots(2), Admission("r")
    a, b = ms.slots.values()
    lost = adm.after_lost_race(ms, ask(0.0), 0.0, tried=[a])
    assert isinstance(lost, Place) and lost.candidates == [b] and lost.redeemed is None
    again = adm.after_lost_race(ms, ask(0.0), 0.0, tried=[a, b])
    assert isinstance(again, Refuse) and again.reason == Reason.BUSY
    assert again.ticket is None and again.retry_after_ms == 10
    # A holder's placement lost: its promise goes with the next try (kept when it is
    # placed), or its start counts as slipped to now.
    held = Promise(ticket="r-0123456789abcdef", due_s=0.0, expires_s=1.0, service_s=0.010,
                   issued_s=-0.030, promised_s=-0.020)
    kept = adm.after_lost_race(ms, ask(0.0), 0.0, tried=[a], holder=held)
    assert isinstance(kept, Place) and kept.redeemed is held
    for _ in range(20):
        assert isinstance(adm.after_lost_race(ms, ask(0.0), 0.0, tried=[a, b], holder=held),
                          Refuse)
    assert 19_999 <= adm.slips["calibrated"].p99_us(0.020, 0.010, 0.0) <= 20_000


def test_promises_stop_at_the_horizon_with_an_overloaded_refusal() -> None:
    """Past PROMISE_MAX_LINKS promises a slot the refusal is final and says why: the plane is
    overloaded, not the caller's deadline (1 s here, which the next start would meet)."""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.010, 0.010)
    for _ in range(PROMISE_MAX_LINKS * 2):
        d = adm.decide(ms, ask(0.0))
        assert isinstance(d, Refuse) and d.reason == Reason.BUSY and d.ticket
    d = adm.decide(ms, ask(0.0))
    assert isinstance(d, Refuse) and d.reason == Reason.OVERLOADED and d.ticket is None
    assert d.status == Status.BUSY and "overloaded" in d.message and "elsewhere" in d.message
    assert d.retry_after_ms is not None and 0 < d.retry_after_ms < 1000


def test_the_promise_horizon_counts_healthy_slots_only() -> None:
    """Three slots, one unhealthy: the other two hold PROMISE_MAX_LINKS promises each, no
    more (the count the free-slot scan makes as it goes)."""
    ms, adm = slots(3), Admission("r")
    busy_until(ms, 0.010, 0.010, 0.010)
    list(ms.slots.values())[2].healthy = False
    for _ in range(PROMISE_MAX_LINKS * 2):
        d = adm.decide(ms, ask(0.0))
        assert isinstance(d, Refuse) and d.reason == Reason.BUSY and d.ticket
    d = adm.decide(ms, ask(0.0))
    assert isinstance(d, Refuse) and d.reason == Reason.OVERLOADED and d.ticket is None


STANDING_S = STANDING_CYCLES * MS10.p50_us / 1e6  # 0.16 s for 10 ms work


def _promise(adm: Admission, ms: ModelSlots, now: float) -> Refuse:
    d = adm.decide(ms, ask(now))
    assert isinstance(d, Refuse)
    return d


def test_a_chain_that_does_not_drain_keeps_fewer_promises() -> None:
    """Overload that lasts: once the book has held more than one promise a slot for
    STANDING_CYCLES service times, a slot keeps STANDING_LINKS promises, not
    PROMISE_MAX_LINKS; the others are told `overloaded` at once, and a ticket is given again
    as soon as the book is below the new depth."""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.5, 0.5)  # long past the window: the promises do not lapse meanwhile
    for _ in range(2 * STANDING_LINKS + 2):
        assert _promise(adm, ms, 0.0).ticket
    # Within the window a burst may still take the full depth.
    assert _promise(adm, ms, STANDING_S / 2).ticket
    assert len(ms.promises) == 2 * STANDING_LINKS + 3 < 2 * PROMISE_MAX_LINKS
    assert adm.depth(ms, STANDING_S / 2) == PROMISE_MAX_LINKS
    assert adm.depth(ms, STANDING_S * 1.1) == STANDING_LINKS  # what the router's gauge says
    assert adm.promise_room(ms, STANDING_S / 2, 2) == 2 * PROMISE_MAX_LINKS
    assert adm.promise_room(ms, STANDING_S * 1.1, 2) == 2 * STANDING_LINKS
    d = _promise(adm, ms, STANDING_S * 1.1)
    assert d.reason == Reason.OVERLOADED and d.ticket is None
    assert f"already has {STANDING_LINKS} callers promised" in d.message
    # A caller on call (a stream that gave an inbox) is called when a slot really frees: it
    # does not pay the schedule's error, and keeps the full depth.
    on_call = adm.decide(ms, replace(ask(STANDING_S * 1.1), wake="_INBOX.me",
                                     first_p99_us=1_000))
    assert isinstance(on_call, Refuse) and on_call.ticket
    # A holder refused again (its slot not free by the end of its wait) keeps a place: its
    # new promise replaces its old one, while the book comes down to the standing depth.
    holder = next(iter(ms.promises))
    again = adm.decide(ms, replace(ask(STANDING_S * 1.1), ticket=holder.ticket), may_park=False)
    assert isinstance(again, Refuse) and again.ticket and again.ticket != holder.ticket
    assert len(ms.promises) > 2 * STANDING_LINKS
    # Holders redeemed down to below the standing depth: a ticket again, one at a time.
    while len(ms.promises) >= 2 * STANDING_LINKS:
        adm.forget(ms, next(iter(ms.promises)))
    assert _promise(adm, ms, STANDING_S * 1.2).ticket
    assert _promise(adm, ms, STANDING_S * 1.2).reason == Reason.OVERLOADED


def test_a_tenants_share_of_the_promises_is_of_the_depth_in_force() -> None:
    """Two tenants of equal weight: each is guaranteed half the promises the slots may hold
    now (`promise_room`, as the router asks `FairShare`). While the chain stands that is half
    of STANDING_LINKS a slot, so the heavy tenant is refused at that, and the light one still
    finds its half free; at the full depth the heavy one could hold more."""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.5, 0.5)
    fair = FairShare(weight=lambda t: 1)
    for t in ("heavy", "light"):
        fair.asked("calibrated", t, 1e6, 0.0)
        fair.placed("calibrated", t, 10_000, 0.0)
    for _ in range(2 * STANDING_LINKS + 2):  # the book stands past the window
        _promise(adm, ms, 0.0)
    now = STANDING_S * 1.1
    half = adm.promise_room(ms, now, 2) // 2
    assert half == STANDING_LINKS < PROMISE_MAX_LINKS
    for i in range(half):
        fair.promised("calibrated", "heavy", f"h{i}", 1.0)
    over = fair.over_share("calibrated", "heavy", now, 2e6, adm.promise_room(ms, now, 2))
    assert over is not None
    assert fair.over_share("calibrated", "light", now, 2e6, adm.promise_room(ms, now, 2)) is None
    # Of the full depth (a burst within the window) the heavy tenant's half is not used up.
    assert fair.over_share("calibrated", "heavy", STANDING_S / 2, 2e6,
                           adm.promise_room(ms, STANDING_S / 2, 2)) is None


def test_a_chain_that_drains_keeps_its_full_depth() -> None:
    """Bursts below capacity: a book that came down to one promise a slot within the window
    may grow to PROMISE_MAX_LINKS a slot again."""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.5, 0.5)
    for _ in range(2 * STANDING_LINKS + 2):
        assert _promise(adm, ms, 0.0).ticket
    while len(ms.promises) > 1:  # redeemed: the chain drained
        adm.forget(ms, next(iter(ms.promises)))
    assert _promise(adm, ms, STANDING_S * 0.9).ticket  # sees the drained book
    later = STANDING_S * 1.5  # past the window from the start, within it from the drain
    while len(ms.promises) < 2 * PROMISE_MAX_LINKS:
        assert _promise(adm, ms, later).ticket
    assert _promise(adm, ms, later).reason == Reason.OVERLOADED
    while ms.promises:  # all redeemed, then quiet: the full depth again
        adm.forget(ms, next(iter(ms.promises)))
    assert adm.depth(ms, later + 10 * STANDING_S) == PROMISE_MAX_LINKS


def test_late_holders_are_not_no_shows() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    tickets = []
    for _ in range(3):
        d = adm.decide(ms, ask(0.0))
        assert isinstance(d, Refuse) and d.ticket
        tickets.append(d.ticket)
    ms.slots["n/0"].release(0.010)
    # Every promise lapses (a caller's process stalled) ...
    assert isinstance(adm.decide(ms, ask(0.2)), Place)
    # ... each lapse counted a no-show (0.9, 0.81, 0.73) ...
    assert abs(adm.redemption["calibrated"] - 0.729) < 1e-9
    # ... and the holders all come back, late: they are late, not no-shows, and the average
    # comes back up with them.
    for t in tickets:
        adm.decide(ms, ask(0.3, ticket=t))
    adm.decide(ms, ask(5.0))  # long after: nothing left to count as a no-show
    assert adm.stats["ticket-late"] == 3 and adm.redemption["calibrated"] > 0.8
    busy_until(ms, 5.010)
    pinned = adm.decide(ms, ask(5.0))
    assert isinstance(pinned, Refuse) and pinned.ticket in adm.tickets  # promises still pin


def test_the_ticket_tally_counts_each_ticket_once_where_the_average_starts_at_one() -> None:
    """`plane status` showed the average as "tickets redeemed": 18.5% after 16 tickets and
    none redeemed (0.9^16). The tally says 0 of 16; a holder back after its lapse turns its
    no-show into a redemption, counted once."""
    ms, adm = slots(1), Admission("r")
    tickets: list[str] = []
    now = 0.0
    while len(tickets) < 16:  # as many as the book takes at once, then they lapse
        busy_until(ms, now + 0.010)
        d = adm.decide(ms, ask(now))
        assert isinstance(d, Refuse)
        if d.ticket:
            tickets.append(d.ticket)
            continue
        ms.slots["n/0"].release(now + 0.010)
        now += 1.0
        adm.tidy(ms, now)  # every promise lapsed, nobody came
    ms.slots["n/0"].release(now + 0.010)
    now += 1.0
    adm.tidy(ms, now)
    assert abs(adm.redemption["calibrated"] - 0.9 ** 16) < 1e-9  # 18.5%
    assert adm.ticket_tally["calibrated"].as_dict() == {"redeemed": 0, "no_shows": 16}
    adm.decide(ms, ask(now + 0.1, ticket=tickets[-1]))  # one comes back, late
    assert adm.ticket_tally["calibrated"].as_dict() == {"redeemed": 1, "no_shows": 15}


def test_promises_pinned_for_callers_who_stopped_coming_back_let_the_slots_go() -> None:
    """One caller resending without its tickets filled the book with promises: both slots
    idled through the chain (2 x 200 ms, 16 promises: 1.6 s) and every caller was refused
    `overloaded` (found from outside). Once the no-shows bring the average under
    MIN_REDEMPTION, the promises still pinned stop holding slot time: a newcomer takes a
    free slot at once."""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.2, 0.2)
    now, made = 0.0, 0
    while True:  # the flooder: a newcomer every 5 ms, never back
        d = adm.decide(ms, ask(now, deadline_s=3.0, pred=MS200))
        assert isinstance(d, Refuse)
        if d.reason is Reason.OVERLOADED:
            break
        made += 1
        now += 0.005
    assert made >= 2 * 3 and len(ms.promises) == made  # the book is full
    # The slots free; the chain's promises come due and lapse one by one, nobody back.
    ms.slots["n/0"].release(0.2)
    ms.slots["n/1"].release(0.2)
    placed_at = None
    while now < 3.0 and placed_at is None:
        now += 0.005
        d = adm.decide(ms, ask(now, deadline_s=3.0, pred=MS200))
        if isinstance(d, Place):
            placed_at = now
    assert placed_at is not None and adm.stats["promise-unpinned"] > 0
    # Placed as soon as seven lapses (about one a slot cycle) stop the pinning, not at the
    # end of the chain.
    assert placed_at < made * 0.2 / 2, (placed_at, made)


def test_callers_who_never_come_back_unpin_their_own_tickets_not_others() -> None:
    """A burst of HTTP callers through the gateway (one connection, never back) and NATS
    callers who come back at their time with their tickets, on one model: the no-shows stop
    pinning the gateway's tickets, and only its. Averaged per model, they unpinned every
    caller's, and the NATS callers were told overlapping times 130-205 ms out, six of seven
    refused again on their return (found from outside)."""
    ms, adm = slots(1), Admission("r")
    now = 0.0
    busy_until(ms, 0.010)
    for _ in range(12):  # the gateway's callers: refused, never back
        assert isinstance(adm.decide(ms, ask(now, caller="gw")), Refuse)
        now += 0.1  # each promise lapses (the slot is busy again each time)
        busy_until(ms, now + 0.010)
    assert not adm.pins("calibrated", "gw") and adm.pins("calibrated", "js")
    assert adm.redemption["calibrated"] < 0.5  # the model's average (plane status) says so
    # Four NATS callers at once: successive times, each a promise that pins slot time.
    told = []
    for _ in range(4):
        d = adm.decide(ms, ask(now, caller="js"))
        assert isinstance(d, Refuse) and d.ticket in adm.tickets, d
        assert d.retry_after_ms is not None
        told.append(d.retry_after_ms)
    assert told == sorted(told) and told[-1] - told[0] >= 3 * 9, told
    # A gateway caller now: an estimate only (no slot time held for it).
    gw = adm.decide(ms, ask(now, caller="gw"))
    assert isinstance(gw, Refuse) and gw.ticket not in adm.tickets
    # A caller nobody can name ("") keeps its own record: untouched by either.
    assert adm.pins("calibrated", "")


def test_a_caller_that_retries_once_keeps_its_first_tickets_pinned() -> None:
    """A caller that retries a refusal once comes back for every ticket given to a first
    attempt and for none given to a retry (refused for its tenant's share first, then busy).
    Judged together, the retries' no-shows unpinned its first tickets: their holders, back on
    time, found no slot held and were refused again (two tenants at 2x: 31-71% of first
    retries served, found from outside). Judged apart, the first tickets stay pinned."""
    ms, adm = slots(1), Admission("r")
    now = 0.0
    for _ in range(12):
        busy_until(ms, now + 0.010)
        first = adm.decide(ms, ask(now, caller="c"))
        assert isinstance(first, Refuse) and first.ticket in adm.tickets, first
        assert first.retry_after_ms is not None
        for _ in range(2):  # retries refused with tickets it never comes back for
            d = adm.decide(ms, ask(now, caller="c", retry=True))
            assert isinstance(d, Refuse) and d.ticket, d
        back = now + first.retry_after_ms / 1000
        ms.slots["n/0"].busy = False  # the slot's done-event came as the holder is back
        d = adm.decide(ms, ask(back, ticket=first.ticket, caller="c"))
        assert isinstance(d, Place) and d.redeemed is not None, d
        adm.redeemed(ms, d.redeemed, back)
        now = back + 0.3  # the retries' tickets lapse
        adm.tidy(ms, now)
    assert adm.pins("calibrated", "c")
    assert not adm.pins("calibrated", again_record("c"))  # its retries' tickets: estimates
    tally = adm.ticket_tally["calibrated"]
    assert (tally.redeemed, tally.no_shows) == (12, 24), tally  # every no-show still counted


def test_a_waiting_newcomers_promise_that_lapses_is_no_no_show() -> None:
    """A newcomer parked for a slot about to free holds a promise of its own, but was handed
    no ticket: its lapse (a loop that lagged past it) is nobody's no-show (it was counted
    one, against its caller's record and the tally)."""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.002, 0.008)
    d = adm.decide(ms, ask(0.0, caller="c"))
    assert isinstance(d, Park) and d.holder.newcomer
    adm.tidy(ms, 5.0)  # long past its window: it lapses
    assert d.holder.ticket not in adm.tickets
    assert ("calibrated", "c") not in adm.by_caller and "calibrated" not in adm.redemption


def test_callers_that_come_once_and_never_back_start_the_next_unpinned() -> None:
    """A caller the router has no record of starts where callers' first tickets stand:
    callers that each open a connection for one request and never come back (each a new
    caller, each starting at 1) kept their tickets pinned for ever (found in review)."""
    ms, adm = slots(1), Admission("r")
    now = 0.0
    busy_until(ms, 0.010)
    for i in range(12):
        assert isinstance(adm.decide(ms, ask(now, caller=f"once-{i}")), Refuse)
        now += 0.1
        busy_until(ms, now + 0.010)
    assert not adm.pins("calibrated", "someone-new")
    d = adm.decide(ms, ask(now, caller="someone-new"))
    assert isinstance(d, Refuse) and d.ticket not in adm.tickets  # an estimate, no slot time
    # A caller that comes back earns its own record: pinned after a few tickets redeemed.
    redeemed = 0
    while not adm.pins("calibrated", "regular") and redeemed < 10:
        adm._count("calibrated", "regular", redeemed=True)
        redeemed += 1
    assert 1 < redeemed <= 6, redeemed
    assert not adm.pins("calibrated", "someone-else")  # the others' start is unchanged


def test_the_callers_kept_are_bounded() -> None:
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.010)
    for i in range(CALLERS_MAX + 50):
        adm._count("calibrated", f"c{i}", redeemed=False)
    assert len(adm.by_caller) == CALLERS_MAX
    assert ("calibrated", "c0") not in adm.by_caller  # the least recently counted went


def test_a_slot_past_its_predicted_end_is_promised_later_as_its_overrun_grows() -> None:
    """Cold streams ran 3x their prediction, and holders were promised `now` (the slot's
    predicted end had passed) again and again: one was refused four times in 35 ms. Past its
    p50 end a slot is predicted to run on for half of what is left to its p99 end or of its
    overrun so far, whichever is longer; past its p99 end too, for as long again as it has
    overrun: the promises back off as the overrun grows, doubling while a stall lasts."""
    waits = []
    for now in (0.020, 0.040, 0.080):
        ms, adm = slots(1), Admission("r")
        busy_until(ms, 0.010)  # predicted to end at 10 ms (p50 and p99), still running
        d = adm.decide(ms, ask(now))
        assert isinstance(d, Refuse) and d.retry_after_ms is not None
        waits.append(d.retry_after_ms)
    assert 4 <= waits[0] < waits[1] < waits[2], waits
    # Overran by 30 and 70 ms: as long again (less the holder's trip back, RETURN_LEAD_S).
    assert waits[1] >= 28 and waits[2] >= 68, waits


def test_within_its_p99_an_overdue_slot_is_given_half_past_it_as_long_again() -> None:
    """Predicted to end at 10 ms (p50), 40 ms (p99): at 30 ms, half of the longer of what
    is left to the p99 end (10 ms) and the overrun (20 ms); at 50 ms, past the p99 end, as
    long again as the overrun (40 ms). A later promise within the p99 would leave a slot
    that frees on time idle; a shorter one past it burns a caller's attempts in a stall."""
    view = slots(1).slots["n/0"]
    view.occupy(0.0, "ours", expected_s=0.010, p99_s=0.040)
    assert view.free_time(0.005) == 0.010
    assert view.free_time(0.030) == pytest.approx(0.040)
    assert view.free_time(0.050) == pytest.approx(0.090)


def test_a_slot_taken_by_someone_else_frees_itself_after_its_p50() -> None:
    """Taken by a request not ours (the broker said so): free again at its p50, not its p99
    (no done-event comes when what the broker saw was the last request's ack settling)."""
    ms = slots(1)
    view = ms.slots["n/0"]
    view.occupy(0.0, None, expected_s=0.010, p99_s=0.020)  # the broker said: taken
    assert not view.is_free(0.009) and view.free_time(0.009) == 0.010
    assert view.is_free(0.011) and ms.busy_count(0.011) == 0
    view.occupy(0.0, "ours", expected_s=0.010, p99_s=0.020)  # ours: the in-flight book owns it
    assert not view.is_free(0.5)


def test_a_newcomer_whose_caller_would_not_come_back_waits_for_a_slot_about_to_free() -> None:
    """Callers that never retry (promises do not pin): a refusal leaves the slot idle until
    the next arrival, so a newcomer waits (parked) for a slot predicted to free within a
    quarter of the p50, holding it; one later than that is refused at once."""
    ms, adm = slots(2), Admission("r")
    adm.by_caller[("calibrated", "")] = 0.0
    busy_until(ms, 0.002, 0.008)
    d = adm.decide(ms, ask(0.0))
    assert isinstance(d, Park) and d.holder.pinned and d.holder.parked
    assert d.until_s <= 0.0 + MS10.p50_us / 1e6
    # The next newcomer does not take the slot the parked one holds: the other frees in
    # 8 ms, past the window (2.5 ms), so it is refused at once (an estimate, no slot time).
    n = adm.decide(ms, ask(0.0))
    assert isinstance(n, Refuse) and n.reason == Reason.BUSY
    assert adm.tickets.keys() == {d.holder.ticket}
    # The slot frees: the parked newcomer is placed, its promise kept.
    ms.slots["n/0"].release(0.002)
    placed = adm.decide(ms, Ask(now_s=0.002, deadline_s=1.0, prediction=MS10,
                                ticket=d.holder.ticket, park_until_s=d.until_s))
    assert isinstance(placed, Place) and placed.redeemed is d.holder


def test_a_newcomer_that_says_how_long_it_waits_waits_for_its_start_within_it() -> None:
    """`Plane-Wait-Ms` (`Ask.wait_s`): a burst larger than the slots waits, each parked for
    its own start in the schedule (the slots' successive free times), while that start is
    within its wait (counted from when it came) and its deadline; the next is refused at
    once, with its ticket, as without a wait. A wait never keeps one past its wait."""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.008, 0.009)
    wait = replace(ask(0.0), wait_s=0.030, came_s=0.0)
    parked: list[Park] = []
    while isinstance(d := adm.decide(ms, wait), Park):
        parked.append(d)
    assert isinstance(d, Refuse) and d.ticket is not None and d.reason == Reason.BUSY
    starts = sorted(p.holder.due_s for p in parked)
    assert starts == pytest.approx([0.008, 0.009, 0.018, 0.019, 0.028, 0.029])
    # Each waits until its wait ends, whatever the spread (its slot may run late).
    assert all(p.holder.due_s <= p.until_s == pytest.approx(0.030) for p in parked)
    assert adm.stats["newcomer-waits"] == 6
    # Without a wait, the same burst: refused at once (the slots free in 8 and 9 ms, past a
    # quarter of the p50), a ticket each.
    ms2, adm2 = slots(2), Admission("r")
    busy_until(ms2, 0.008, 0.009)
    r = adm2.decide(ms2, ask(0.0))
    assert isinstance(r, Refuse) and r.ticket is not None
    # A deadline the start would miss (its p99 after it): refused, not parked.
    ms3, adm3 = slots(1), Admission("r")
    busy_until(ms3, 0.008)
    late = replace(ask(0.0, deadline_s=0.015), wait_s=0.030, came_s=0.0)
    assert isinstance(adm3.decide(ms3, late), Refuse)
    # A start that leaves no room for a holder's lateness (3 ms before any came back) but
    # fits the deadline: a newcomer that waits here is not late, so it waits.
    ms4, adm4 = slots(1), Admission("r")
    busy_until(ms4, 0.008)
    tight = replace(ask(0.0, deadline_s=0.0195), wait_s=0.030, came_s=0.0)
    assert isinstance(adm4.decide(ms4, tight), Park)
    # A wait shorter than a slot about to free (2 ms, within the quarter of the p50 every
    # newcomer may wait for): the caller said 1 ms, so it is not kept 2: refused at once.
    ms5, adm5 = slots(1), Admission("r")
    busy_until(ms5, 0.002)
    assert isinstance(adm5.decide(ms5, ask(0.0)), Park)  # no wait said: it waits
    ms5, adm5 = slots(1), Admission("r")
    busy_until(ms5, 0.002)
    brief = replace(ask(0.0), wait_s=0.001, came_s=0.0)
    assert isinstance(adm5.decide(ms5, brief), Refuse)
    # The first slot frees: the newcomer parked first is placed on it, its promise kept.
    ms.slots["n/0"].release(0.008)
    first = min(parked, key=lambda p: p.holder.due_s)
    placed = adm.decide(ms, Ask(now_s=0.008, deadline_s=1.0, prediction=MS10,
                                ticket=first.holder.ticket, park_until_s=first.until_s))
    assert isinstance(placed, Place) and placed.redeemed is first.holder


def test_a_newcomer_whose_caller_comes_back_waits_for_a_slot_about_to_free_briefly() -> None:
    """Callers that retry (promises pin): a refusal would cost the caller a trip and leave
    the slot idle for as long as its holder is late, so a newcomer waits for a slot predicted
    to free within a quarter of the p50 too, but only until that slot's predicted end plus
    its spread to the p90 and a millisecond (no 8 ms floor, as a holder gets): a slot that
    runs long gets it a ticket soon, not after a wait as long as the work."""
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.002)
    d = adm.decide(ms, ask(0.0))
    assert isinstance(d, Park) and d.holder.pinned and d.holder.parked
    assert d.until_s == pytest.approx(0.002 + NEWCOMER_PARK_SLACK_S)
    # The slot runs on past the window: refused with a ticket, to come back.
    late = adm.decide(ms, Ask(now_s=d.until_s, deadline_s=1.0, prediction=MS10,
                              ticket=d.holder.ticket, park_until_s=d.until_s), may_park=False)
    assert isinstance(late, Refuse) and late.reason == Reason.BUSY
    assert late.ticket is not None and late.ticket in adm.tickets
    # A slot that frees later than a quarter of the p50: a ticket at once.
    ms2, adm2 = slots(1), Admission("r")
    busy_until(ms2, 0.004)
    r = adm2.decide(ms2, ask(0.0))
    assert isinstance(r, Refuse) and r.ticket is not None and r.ticket in adm2.tickets


def test_promises_nobody_comes_back_for_do_not_refuse_the_next_newcomers() -> None:
    """Callers that never retry (the cluster test's ledger, `hey`) at 150/s of 3 ms on 6
    slots: after a 100 ms stall in which every slot was busy and arrivals were refused with
    promises, the plane serves newcomers again as soon as the slots free. (Each promise used
    to keep its slot time from newcomers for its whole late tolerance, 50 ms: the refused
    newcomers' promises pinned more, and the plane refused 40% for half a second.)"""
    ms, adm = slots(6), Admission("r")
    work = Prediction(p50_us=3_000, p99_us=4_000)
    views = list(ms.slots.values())
    frees: dict[str, float] = {}  # slot -> when its request ends
    stall_end = 0.100
    for v in views:
        v.occupy(0.0, None, stall_end, stall_end)  # the stall: all busy for 100 ms
    refused_after_stall = placed = 0
    for i in range(90):  # 0.6 s of arrivals, 150/s (no-shows are counted later)
        now = i / 150
        for v in views:
            if v.key in frees and frees[v.key] <= now:
                v.release(frees.pop(v.key))
            elif v.busy and v.request_id is None and now >= stall_end:
                v.release(stall_end)
        d = adm.decide(ms, ask(now, pred=work))
        if isinstance(d, Place):
            view = d.candidates[0]
            view.occupy(now, f"q{i}", 0.003, 0.004)
            frees[view.key] = now + 0.003
            placed += 1
        else:
            assert isinstance(d, Refuse) and d.ticket is not None
            refused_after_stall += now > stall_end + 0.010
    assert refused_after_stall == 0, (refused_after_stall, placed, adm.stats)


def test_a_holder_of_short_work_is_told_the_predicted_time_and_called_if_its_slot_frees_early(
        ) -> None:
    """Short work (10 ms) beside a call's trip (2 ms before any was measured): a holder that
    gave an inbox is told the predicted time, as one without (not the p99 end of the work
    ahead: it is not on call). Its slot frees 9 ms early: it is called, due at once,
    newcomers are kept off the slot, and it takes the slot when it comes."""
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.030)
    one = adm.decide(ms, replace(ask(0.0), wake="_INBOX.me"))
    assert isinstance(one, Refuse) and one.retry_after_ms == 29 and "called" not in one.message
    ms.slots["n/0"].release(0.020)
    called = adm.slot_for(ms, 0.020)
    assert called is not None and called.ticket == one.ticket and called.wake == "_INBOX.me"
    assert called.due_s == 0.020 and called.called_s == 0.020
    assert adm.slot_for(ms, 0.020) is None  # nobody left to call
    assert isinstance(adm.decide(ms, ask(0.021)), Refuse)  # a newcomer
    back = adm.decide(ms, ask(0.022, ticket=one.ticket))
    assert isinstance(back, Place) and back.redeemed is called
    # Freed within WAKE_LEAD_S of the time it was told: not called, it comes anyway.
    ms2, adm2 = slots(1), Admission("r")
    busy_until(ms2, 0.030)
    two = adm2.decide(ms2, replace(ask(0.0), wake="_INBOX.me"))
    assert isinstance(two, Refuse)
    ms2.slots["n/0"].release(0.0285)
    p = adm2.slot_for(ms2, 0.0285)
    assert p is not None and p.ticket == two.ticket and not p.called_s


def test_short_work_is_not_put_on_call_and_old_trips_are_forgotten() -> None:
    """A holder is on call (told a late fallback) only when a call's trip (2 ms before any
    was measured) is at most a tenth of its work: 30 ms is, 5 ms is not. Trips
    measured under a load that passed (5 ms here) age out after CALL_TRIP_MAX_AGE_S, back to
    the prior."""
    five = Prediction(p50_us=5_000, p99_us=6_000)
    thirty = Prediction(p50_us=30_000, p99_us=40_000)
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.030)
    d = adm.decide(ms, replace(ask(0.0, pred=five), wake="_INBOX.me"))
    assert isinstance(d, Refuse) and d.retry_after_ms == 29 and "called" not in d.message
    def on_call(pred: Prediction, now: float) -> bool:
        return adm._on_call("calibrated", replace(ask(now, pred=pred), wake="_INBOX.me"))

    assert on_call(thirty, 0.0) and not on_call(five, 0.0)
    assert not adm._on_call("calibrated", ask(0.0, pred=thirty))  # no inbox: nobody to call
    trips = adm._call_trip("calibrated")
    for _ in range(10):
        trips.add(5_000, 0.0)  # slow trips: 30 ms work is not put on call either
    assert not on_call(thirty, 1.0)
    assert on_call(thirty, 0.5 + CALL_TRIP_MAX_AGE_S)


def test_a_holder_without_an_inbox_keeps_its_turn_and_the_next_slot_calls_the_next() -> None:
    """The first in line has no inbox: the first slot to free is counted as its (its timer
    brings it; nobody is called over it), and the second calls the holder after it. (A
    plane that held the second slot back for the first holder called nobody at all while
    that one never came back: the Node.js test.)"""
    ms, adm = slots(2), Admission("r")
    busy_until(ms, 0.030, 0.030)
    plain = adm.decide(ms, ask(0.0, pred=Prediction(p50_us=30_000, p99_us=31_000)))
    on_call = adm.decide(ms, replace(ask(0.0, pred=Prediction(p50_us=30_000, p99_us=40_000)),
                                     wake="_INBOX.me"))
    assert isinstance(plain, Refuse) and isinstance(on_call, Refuse)
    assert plain.retry_after_ms == 29 and "called" in on_call.message
    first, second = list(ms.promises)
    assert first.ticket == plain.ticket and second.ticket == on_call.ticket
    ms.slots["n/0"].release(0.030)
    assert adm.slot_for(ms, 0.030) is first and not first.called_s  # its own timer
    ms.slots["n/1"].release(0.031)
    assert adm.slot_for(ms, 0.031) is second and second.called_s == 0.031
    assert adm.slot_for(ms, 0.032) is None  # nobody left
    foreign = Promise(ticket="other-1", due_s=0.050, expires_s=0.1, service_s=0.01,
                      wake="_INBOX.x")
    ms3, adm3 = slots(1), Admission("r")
    adm3.adopt(ms3, foreign)  # another router's: that router calls its holders
    assert adm3.slot_for(ms3, 0.0) is foreign and not foreign.called_s


def test_a_call_is_told_to_the_other_routers_and_brings_their_copy_forward() -> None:
    """A called holder may come back through any router: the promiser tells the others its
    promise is due now, and their copy moves up, so their newcomers leave the slot to it."""
    ms, adm = slots(1), Admission("a")
    busy_until(ms, 0.030)
    d = adm.decide(ms, replace(ask(0.0), wake="_INBOX.me"))
    assert isinstance(d, Refuse) and d.ticket
    adm.take_notes()
    (p,) = ms.promises
    peer_ms, peer = slots(1), Admission("b")
    busy_until(peer_ms, 0.030)
    peer.adopt(peer_ms, Promise(ticket=p.ticket, due_s=p.due_s, expires_s=p.expires_s,
                                service_s=p.service_s))
    assert adm.slot_for(ms, 0.020) is p and p.due_s == 0.020
    (note,) = adm.take_notes()
    assert note.made and note.promise is p
    peer.adopt(peer_ms, Promise(ticket=p.ticket, due_s=0.020, expires_s=p.expires_s,
                                service_s=p.service_s))
    (copy,) = peer_ms.promises
    assert copy.foreign and copy.due_s == 0.020 and len(peer.foreign) == 1
    peer.adopt(peer_ms, Promise(ticket=p.ticket, due_s=0.025, expires_s=p.expires_s,
                                service_s=p.service_s))  # never moved back
    assert copy.due_s == 0.020


def test_a_holder_on_call_is_told_the_late_end_and_called_when_its_slot_frees() -> None:
    """Long work (100 ms, p99 150 ms) beside a call's trip (2 ms before any was measured): a
    holder with an inbox is told to come (its fallback) when the work ahead has run on past
    its predicted end by the longest of its spread to the p99, its expected time and the
    wait to that end, so that it does not come while that work runs and wait for it; the
    slot freeing at its mean calls it, and it is placed as it comes, newcomers kept off
    meanwhile. A holder without an inbox is told the usual time."""
    long = Prediction(p50_us=100_000, p99_us=150_000)
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.100)
    plain = adm.decide(ms, ask(0.0, pred=long))
    assert isinstance(plain, Refuse) and plain.retry_after_ms is not None
    ms_b, adm_b = slots(1), Admission("r")
    busy_until(ms_b, 0.100)
    on_call = adm_b.decide(ms_b, replace(ask(0.0, pred=long), wake="_INBOX.me"))
    assert isinstance(on_call, Refuse) and on_call.retry_after_ms is not None
    late_by_ms = max(long.p99_us - long.expected_us, long.expected_us, 100_000) / 1000
    assert 100 + late_by_ms - 1 <= on_call.retry_after_ms <= 100 + late_by_ms + 1
    assert on_call.retry_after_ms > plain.retry_after_ms + 99
    # Second in line, its start 200 ms away: told at least as long again past it (a chain of
    # predictions slips the more, the longer it is).
    ms_c, adm_c = slots(1), Admission("r")
    busy_until(ms_c, 0.100)
    first, behind = (adm_c.decide(ms_c, replace(ask(0.0, pred=long), wake=f"_INBOX.{i}"))
                     for i in range(2))
    assert isinstance(first, Refuse) and first.retry_after_ms == on_call.retry_after_ms
    assert isinstance(behind, Refuse) and behind.retry_after_ms is not None
    assert 399 <= behind.retry_after_ms <= 401
    assert "or when called" in on_call.message
    (promise,) = ms_b.promises
    ms_b.slots["n/0"].release(0.101)  # the work ahead ends at about its mean
    assert adm_b.slot_for(ms_b, 0.101) is promise and promise.called_s == 0.101
    assert isinstance(adm_b.decide(ms_b, ask(0.102, pred=long)), Refuse)  # a newcomer
    back = adm_b.decide(ms_b, ask(0.1025, ticket=on_call.ticket, pred=long))
    assert isinstance(back, Place) and back.redeemed is promise
    # Its lateness is counted from the call (1.5 ms), not from the time it was told.
    assert adm_b.call_trips["calibrated"].count == 1
    assert 1499 <= adm_b.lateness["calibrated"].p50_us <= 1500  # float seconds to µs


def _plain_schedule(free_s: list[float], promises: list[Promise], now_s: float
                    ) -> dict[str, float]:
    """The schedule as the module's docstring states it, step by step: the reference."""
    heap = [max(now_s, t) for t in free_s]
    heapq.heapify(heap)
    starts = {}
    for p in promises:
        start = max(heapq.heappop(heap), p.start_floor(now_s))
        starts[p.ticket] = start
        heapq.heappush(heap, start + p.service_s)
    return starts


def _plain_would_delay(free_s: list[float], promises: list[Promise], now_s: float,
                       hold_s: float) -> bool:
    before = _plain_schedule(free_s, promises, now_s)
    taken = sorted(free_s)
    taken[0] = now_s + hold_s
    after = _plain_schedule(taken, promises, now_s)
    return any(after[p.ticket] > max(before[p.ticket], max(now_s, p.due_s) + ON_TIME_SLACK_S)
               + 1e-9 for p in promises)


def test_the_fast_schedule_agrees_with_the_plain_one() -> None:
    """`simulate`, `next_start` and `would_delay` (which stops as soon as its answer is known)
    give what the plain step-by-step schedule gives, over random slots and promises."""
    rng = random.Random(7)
    answers = Counter()
    for _ in range(20_000):
        now = rng.choice([0.0, 0.003, 0.01])
        free = [round(rng.uniform(0, 0.03), rng.choice([3, 4, 6]))
                for _ in range(rng.randint(1, 8))]
        free[rng.randrange(len(free))] = now - rng.choice([0.0, 0.001])  # one slot idle
        service = rng.choice([0.001, 0.005, None])
        promises = [Promise(ticket=str(i), due_s=d, expires_s=1.0, parked=rng.random() < 0.1,
                            service_s=service or round(rng.uniform(0.0005, 0.01), 4))
                    for i, d in enumerate(sorted(rng.uniform(0, 0.03)
                                                 for _ in range(rng.randint(0, 20))))]
        starts, _ = simulate(free, promises, now)
        assert starts == _plain_schedule(free, promises, now)
        ends = sorted(max(now, t) for t in free)
        for p in promises:
            heapq.heapreplace(ends, max(ends[0], p.start_floor(now)) + p.service_s)
        assert next_start(free, promises, now) == ends[0]
        hold = rng.choice([0.0005, 0.002, 0.011])
        fast = would_delay(free, promises, now, hold)
        assert fast == _plain_would_delay(free, promises, now, hold), (free, promises, hold)
        answers[fast] += 1
    assert min(answers.values()) > 5_000  # both answers well covered


def test_the_promise_book_runs_its_schedule_again_only_when_it_must() -> None:
    """`PromiseBook.next_start` gives what `next_start` gives: at one moment, exactly, through
    promises added at the end (run through the kept tail alone), added in the middle, kept or
    expired (run again), and over another number of slots; a moment more than TAIL_FRESH_S
    later, it runs the book again and sees the slots as they are then."""
    rng = random.Random(11)
    for _ in range(300):
        now = rng.choice([0.0, 0.004])
        free = [rng.uniform(0, 0.02) for _ in range(rng.randint(1, 6))]
        book = PromiseBook()
        for i in range(rng.randint(0, 12)):
            book.add(Promise(ticket=f"a{i}", due_s=rng.uniform(0, 0.03), expires_s=1.0,
                             service_s=rng.uniform(0.0005, 0.005)))
        for step in range(12):
            assert book.next_start(free, now) == next_start(free, list(book), now)
            last = max((p.due_s for p in book), default=now)
            match rng.choice(["end", "middle", "keep", "expire", "slots"]):
                case "end":
                    book.add(Promise(ticket=f"e{step}", due_s=last + rng.uniform(0, 0.003),
                                     expires_s=1.0, service_s=rng.uniform(0.0005, 0.005)))
                case "middle":
                    book.add(Promise(ticket=f"m{step}", due_s=rng.uniform(0, last),
                                     expires_s=1.0, service_s=0.002))
                case "keep" if len(book):
                    book.remove(rng.choice(list(book)))
                case "expire" if len(book):
                    victim = rng.choice(list(book))
                    book.expires_at(victim, now - 0.001)
                    assert book.expire(now) == [victim]
                case "slots":
                    free = [*free, now]
    book = PromiseBook()
    book.add(Promise(ticket="x", due_s=0.0, expires_s=1.0, service_s=0.002))
    assert book.next_start([0.001], 0.0) == 0.003
    # Within TAIL_FRESH_S the slot's own move (it freed early) is left out; after, seen.
    assert book.next_start([0.0], TAIL_FRESH_S / 2) == 0.003
    later = 2 * TAIL_FRESH_S
    assert book.next_start([later], later) == later + 0.002
    # A promise kept (its holder placed on the slot now) leaves the tail: the slot time the
    # schedule gave it is that placement's. As it would be run again with the slot taken:
    book.add(Promise(ticket="y", due_s=later, expires_s=1.0, service_s=0.002))
    assert book.next_start([later], later) == later + 0.004
    x = next(iter(book))
    book.remove(x, kept=True)  # x's holder placed on the slot, free until now
    taken = [later + 0.002]  # the slot, busy with x now
    assert book.next_start(taken, later) == next_start(taken, list(book), later)


def test_the_promise_book_expires_each_promise_once_its_time_has_passed() -> None:
    """`expire` skips the book until its earliest expiry (it runs on every decision); an
    expiry moved earlier through `expires_at`, or added later, is still seen in time."""
    book = PromiseBook()

    def promise(ticket: str, due_s: float, expires_s: float) -> Promise:
        return Promise(ticket=ticket, due_s=due_s, expires_s=expires_s, service_s=0.001)

    a, b, c = promise("a", 0.010, 0.060), promise("b", 0.020, 0.070), promise("c", 0.030, 0.080)
    for p in (a, b, c):
        book.add(p)
    assert book.expire(0.050) == [] and len(book) == 3
    book.expires_at(c, 0.055)  # moved earlier than every other
    assert book.expire(0.056) == [c]
    assert [p.ticket for p in book] == ["a", "b"]
    late = promise("d", 0.005, 0.058)  # added with the earliest expiry now
    book.add(late)
    assert book.expire(0.059, spare=late) == []  # its holder came in time: kept
    assert book.expire(0.059) == [late]
    assert book.expire(0.065) == [a]
    assert book.expire(0.075) == [b] and len(book) == 0
    assert book.expire(1.0) == []


def test_a_holder_on_call_is_called_a_trip_ahead_of_its_slots_predicted_end() -> None:
    """Work long beside a call's trip: the holder on call is called one trip before the busy
    slot's predicted end (so it comes as the slot frees, not a trip after), brought forward
    to due now; the slot's free then counts as its without a second call, and it is placed
    as it comes, newcomers kept off meanwhile. Called only once, and only a holder that is
    first in line, on call, not for a stream, and not told to come as soon anyway."""
    long = Prediction(p50_us=100_000, p99_us=150_000)
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.100)
    d = adm.decide(ms, replace(ask(0.0, pred=long), wake="_INBOX.me"))
    assert isinstance(d, Refuse) and d.ticket is not None
    (p,) = ms.promises
    assert p.ahead and p.due_s > 0.098
    adm.take_notes()
    assert adm.call_ahead(ms, 0.098, 0.002) is p
    assert p.called_s == 0.098 and p.due_s == 0.098 and adm.stats["holder-called-ahead"] == 1
    assert [n.made for n in adm.take_notes()] == [True]  # the other routers book it due now
    assert adm.call_ahead(ms, 0.0985, 0.002) is None  # called already
    ms.slots["n/0"].release(0.100)
    assert adm.slot_for(ms, 0.100) is p and p.called_s == 0.098  # its slot: no second call
    assert adm.stats["holder-called"] == 0
    assert isinstance(adm.decide(ms, ask(0.1005, pred=long)), Refuse)  # a newcomer
    back = adm.decide(ms, ask(0.101, ticket=d.ticket, pred=long))
    assert isinstance(back, Place) and back.redeemed is p
    assert adm.call_trips["calibrated"].count == 1  # the trip is counted from the call

    # Come before its slot frees: it waits for it, parked.
    ms2, adm2 = slots(1), Admission("r")
    busy_until(ms2, 0.100)
    d2 = adm2.decide(ms2, replace(ask(0.0, pred=long), wake="_INBOX.me"))
    assert isinstance(d2, Refuse) and adm2.call_ahead(ms2, 0.098, 0.002) is not None
    assert isinstance(adm2.decide(ms2, ask(0.0995, ticket=d2.ticket, pred=long)), Park)

    # Not called ahead: a stream's holder (its slot's end is a guess), one without an inbox,
    # and anyone behind a first in line that is neither (that one gets the slot that frees).
    for pred_ask in (replace(ask(0.0, pred=long), wake="_INBOX.s", first_p99_us=5_000,
                             end_deadline_s=1.0),
                     ask(0.0, pred=long)):
        ms3, adm3 = slots(1), Admission("r")
        busy_until(ms3, 0.100)
        first = adm3.decide(ms3, pred_ask)
        assert isinstance(first, Refuse) and first.ticket is not None
        second = adm3.decide(ms3, replace(ask(0.0, pred=long), wake="_INBOX.me"))
        assert isinstance(second, Refuse) and second.ticket is not None
        assert [q.ahead for q in ms3.promises] == [False, True]
        assert adm3.call_ahead(ms3, 0.098, 0.002) is None
        assert all(not q.called_s for q in ms3.promises)
    # Told to come within the trip anyway: left to come.
    ms4, adm4 = slots(1), Admission("r")
    busy_until(ms4, 0.100)
    adm4.decide(ms4, replace(ask(0.0, pred=long), wake="_INBOX.me"))
    (p4,) = ms4.promises
    assert adm4.call_ahead(ms4, p4.back_s - 0.001, 0.002) is None
