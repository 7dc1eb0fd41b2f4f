"""Every builder in `plane/contract/subjects.py` against the contract: each documented name
is checked against the text of `docs/design.md` (so code and design page cannot drift apart
unseen), each wildcard against the subjects it must and must not cover, and a completeness
check fails when a builder is added without a test here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plane.contract.subjects import (
    ROUTER_QUEUE_GROUP,
    Header,
    InvalidToken,
    Names,
    advert_key,
    check_token,
    config_key,
)

DESIGN = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()

# The placeholders of the design page's subject table, and the values the builders get.
ARGS = {"model": "risk", "node": "n1", "k": "3", "id": "r1", "stream": "tx", "i": "2"}

# (builder, its arguments (None: a property), the name as docs/design.md writes it)
Case = tuple[str, tuple[object, ...] | None, str]
DOCUMENTED: list[Case] = [
    ("infer", ("risk",), "plane.infer.<model>"),
    ("slot", ("risk", "n1", 3), "plane.slot.<model>.<node>.<k>"),
    ("slots_all", (), "plane.slot.>"),
    ("done", ("risk", "n1", 3), "plane.done.<model>.<node>.<k>"),
    ("done_batch", ("risk", "n1"), "plane.done.<model>.<node>"),
    ("admission", ("risk",), "plane.admission.<model>"),
    ("admission", ("_routers",), "plane.admission._routers"),  # presence notes
    ("router_infer", ("r1", "risk"), "plane.router.<id>.infer.<model>"),
    ("health", ("n1",), "plane.health.<node>"),
    ("events", ("tx",), "plane.events.<stream>"),
    ("dead_letter", ("tx",), "plane.dead.<stream>"),
    ("scored", ("tx",), "plane.scored.<stream>"),
    ("caught_up", ("tx",), "plane.caughtup.<stream>"),
    ("router_status", ("r1",), "plane.router.<id>.status"),
    ("router_meter", ("r1",), "plane.router.<id>.meter"),
    ("node_status", ("n1",), "plane.node.<node>.status"),
    ("node_answered", ("n1",), "plane.node.<node>.answered"),
    ("router_answered", ("r1",), "plane.router.<id>.answered"),
    ("fault", ("n1",), "plane.fault.<node>"),
    ("cancel", ("n1", 3), "plane.cancel.<node>.<k>"),
    ("slots_stream", None, "PLANE_SLOTS"),
    ("slot_shard_stream", (2,), "PLANE_SLOTS_<i>"),
    ("nodes_bucket", None, "PLANE_NODES"),
    ("config_bucket", None, "PLANE_CONFIG"),
    ("features_bucket", None, "PLANE_FEATURES"),
]

# Names the design page does not write out, pinned here: a durable consumer renamed is a new
# consumer (the old one is orphaned with its position), a service renamed drops out of
# operators' `$SRV` queries, a stream renamed loses its data.
PINNED: list[Case] = [
    ("events_stream", None, "PLANE_EVENTS"),
    ("slot_consumer", ("risk", "n1", 3), "slot_risk_n1_3"),
    ("features_consumer", ("tx",), "features_tx"),
    ("scorer_consumer", ("tx",), "scorer_tx"),
    ("caught_up_key", ("tx",), "_caughtup.tx"),
    ("router_service", None, "plane-router"),
    ("node_service", None, "plane-node"),
]

# (wildcard builder, its arguments, subjects it must cover, subjects it must not)
N = Names()
WILDCARDS: list[tuple[str, tuple[str, ...], list[str], list[str]]] = [
    ("infer_all", (), [N.infer("risk"), N.infer("calibrated")],
     [N.router_infer("r1", "risk"), N.slot("risk", "n1", 0)]),
    ("router_infer_all", ("r1",), [N.router_infer("r1", "risk")],
     [N.router_infer("r2", "risk"), N.router_status("r1"), N.infer("risk")]),
    ("slots_all", (), [N.slot("risk", "n1", 0), N.slot("calibrated", "n2", 7)],
     [N.done("risk", "n1", 0)]),
    ("slots_numbered", (3,), [N.slot("risk", "n1", 3), N.slot("calibrated", "n2", 3)],
     [N.slot("risk", "n1", 13), N.slot("risk", "n1", 33), N.done("risk", "n1", 3)]),
    ("node_slots", ("n1",), [N.slot("risk", "n1", 0), N.slot("calibrated", "n1", 12)],
     [N.slot("risk", "n2", 0), N.done("risk", "n1", 0)]),
    ("done_all", (), [N.done("risk", "n1", 0), N.done_batch("risk", "n1")],
     [N.slot("risk", "n1", 0)]),
    ("done_model", ("risk",),
     [N.done("risk", "n1", 0), N.done("risk", "n2", 7), N.done_batch("risk", "n1")],
     [N.done("calibrated", "n1", 0), N.done_batch("calibrated", "n1"), N.slot("risk", "n1", 0)]),
    ("admission_all", (), [N.admission("risk"), N.admission("_routers")],
     [N.infer("risk"), N.router_infer("r1", "risk"), N.router_status("r1")]),
    ("health_all", (), [N.health("n1"), N.health("n2")], [N.node_status("n1")]),
    ("node_cancels", ("n1",), [N.cancel("n1", 0), N.cancel("n1", 12)],
     [N.cancel("n2", 0), N.infer("risk")]),
    ("cancel_all", (), [N.cancel("n1", 0), N.cancel("n2", 5)],
     [N.infer("risk"), N.slot("risk", "n1", 0)]),
    ("events_all", (), [N.events("tx")], [N.dead_letter("tx"), N.scored("tx")]),
    ("dead_letter_all", (), [N.dead_letter("tx")], [N.events("tx"), N.scored("tx")]),
    ("scored_all", (), [N.scored("tx")], [N.events("tx"), N.dead_letter("tx")]),
    ("caught_up_all", (), [N.caught_up("tx")], [N.events("tx"), N.scored("tx")]),
]

OTHER_TESTS = {"infer_model_of", "slot_streams", "is_done_batch"}  # tested below on their own


def fill(template: str, prefix: str = "plane") -> str:
    """The documented name with its placeholders filled in (and another prefix, if asked)."""
    name = re.sub(r"<(\w+)>", lambda m: ARGS[m.group(1)], template)
    if prefix != "plane":
        name = re.sub(r"^plane(?=[._-])", prefix, name)
        name = re.sub(r"^PLANE(?=_)", prefix.replace(".", "_").upper(), name)
    return name


def build(names: Names, builder: str, args: tuple[object, ...] | None) -> str:
    attr = getattr(names, builder)
    return str(attr if args is None else attr(*args))


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or token not in ("*", s[i]):
            return False
    return len(p) == len(s)


@pytest.mark.parametrize(("builder", "args", "documented"), DOCUMENTED,
                         ids=[d for _, _, d in DOCUMENTED])
def test_builder_gives_the_name_design_md_documents(
    builder: str, args: tuple[object, ...] | None, documented: str,
) -> None:
    assert f"`{documented}`" in DESIGN, f"docs/design.md no longer documents `{documented}`"
    assert build(Names(), builder, args) == fill(documented)


@pytest.mark.parametrize(("builder", "args", "name"), PINNED, ids=[n for _, _, n in PINNED])
def test_builder_gives_its_pinned_name(
    builder: str, args: tuple[object, ...] | None, name: str,
) -> None:
    assert build(Names(), builder, args) == name


@pytest.mark.parametrize(("builder", "args", "documented"), DOCUMENTED + PINNED,
                         ids=[d for _, _, d in DOCUMENTED + PINNED])
def test_builder_uses_the_prefix(
    builder: str, args: tuple[object, ...] | None, documented: str,
) -> None:
    assert build(Names("acme"), builder, args) == fill(documented, prefix="acme")


@pytest.mark.parametrize(("builder", "args", "covers", "misses"), WILDCARDS,
                         ids=[w for w, *_ in WILDCARDS])
def test_wildcard_covers_its_family_and_nothing_else(
    builder: str, args: tuple[str, ...], covers: list[str], misses: list[str],
) -> None:
    pattern = getattr(N, builder)(*args)
    assert [s for s in covers if not matches(pattern, s)] == [], pattern
    assert [s for s in misses if matches(pattern, s)] == [], pattern


def test_every_builder_is_tested_here() -> None:
    public = {n for n in dir(Names) if not n.startswith("_") and n != "prefix"}
    tested = {b for b, *_ in DOCUMENTED + PINNED + WILDCARDS} | OTHER_TESTS
    assert public - tested == set(), "a builder without a test in tests/test_subjects.py"


def test_infer_model_of_inverts_both_request_subjects() -> None:
    for n in (Names(), Names("acme.eu")):
        assert n.infer_model_of(n.infer("risk")) == "risk"
        assert n.infer_model_of(n.router_infer("r1", "risk")) == "risk"
        # A raw, invalid model part comes back as sent, for the caller to refuse with a 400.
        assert n.infer_model_of(f"{n.prefix}.infer.a.b") == "a.b"


def test_is_done_batch_tells_a_nodes_batch_from_a_slots_event() -> None:
    for n in (Names(), Names("acme.eu")):
        assert n.is_done_batch(n.done_batch("risk", "n1"))
        assert not n.is_done_batch(n.done("risk", "n1", 3))


def test_slot_streams_are_the_shared_one_and_every_shard() -> None:
    n = Names("acme.eu")
    assert n.slot_streams() == ("ACME_EU_SLOTS", *(f"ACME_EU_SLOTS_{i}" for i in range(5)))
    assert n.slot_shard_stream(4) in n.slot_streams()


def test_prefix_with_dots_gives_upper_snake_streams_and_dashed_services() -> None:
    n = Names("acme.eu-1")
    assert n.infer("risk") == "acme.eu-1.infer.risk"
    assert n.slots_stream == "ACME_EU_1_SLOTS"
    assert n.router_service == "acme-eu-1-router"
    with pytest.raises(InvalidToken, match="invalid prefix name"):
        Names("acme.*")


@pytest.mark.parametrize("bad", ["a.b", "*", ">", "", "a b", "x" * 65, "ü", "risk\n"])
def test_tokens_reject_injection(bad: str) -> None:
    with pytest.raises(InvalidToken, match="invalid model name"):
        check_token("model", bad)
    with pytest.raises(InvalidToken):
        Names().infer(bad)


@pytest.mark.parametrize(("args", "documented"), [
    (("deadline_ms", "risk"), "deadline_ms.<model>"), (("slots", "n1"), "slots.<node>"),
    (("probe_ms",), "probe_ms"), (("freshness_ms",), "freshness_ms")])
def test_config_key_gives_the_live_setting_design_md_documents(
    args: tuple[str, ...], documented: str,
) -> None:
    assert f"`{documented}`" in DESIGN, f"docs/design.md no longer documents `{documented}`"
    assert config_key(*args) == fill(documented)


def test_advert_key() -> None:
    assert advert_key("n1", "risk") == "n1.risk"


def test_router_queue_group_is_the_designs() -> None:
    assert f"queue group `{ROUTER_QUEUE_GROUP}`" in DESIGN


# Headers the design page need not list: NATS micro's own error headers, which the plane sets
# as the NATS micro protocol defines them. Any other header must be documented there.
NOT_OURS = {"Nats-Service-Error", "Nats-Service-Error-Code"}


def test_every_header_is_documented_in_design_md() -> None:
    headers = {v for k, v in vars(Header).items() if k.isupper()}
    missing = {h for h in headers - NOT_OURS if f"`{h}`" not in DESIGN}
    assert missing == set(), f"headers docs/design.md does not document: {sorted(missing)}"
