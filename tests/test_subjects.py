import pytest

from plane.subjects import InvalidToken, Names, advert_key, check_token, config_key


def test_every_builder_uses_the_prefix() -> None:
    n = Names("acme")
    assert n.infer("risk") == "acme.infer.risk"
    assert n.infer_all() == "acme.infer.>"
    assert n.infer_model_of("acme.infer.risk") == "risk"
    assert n.slot("risk", "n1", 3) == "acme.slot.risk.n1.3"
    assert n.slots_all() == "acme.slot.>"
    assert n.node_slots("n1") == "acme.slot.*.n1.*"
    assert n.done("risk", "n1", 3) == "acme.done.risk.n1.3"
    assert n.done_all() == "acme.done.>"
    assert n.health("n1") == "acme.health.n1"
    assert n.health_all() == "acme.health.*"
    assert n.events("tx") == "acme.events.tx"
    assert n.dead_letter("tx") == "acme.dead.tx"
    assert n.router_status("r1") == "acme.router.r1.status"
    assert n.node_status("n1") == "acme.node.n1.status"
    assert n.fault("n1") == "acme.fault.n1"
    assert n.slots_stream == "ACME_SLOTS"
    assert n.slot_stream_for("n1") == "ACME_SLOTS"
    assert n.nodes_bucket == "ACME_NODES"
    assert n.config_bucket == "ACME_CONFIG"
    assert n.slot_consumer("risk", "n1", 3) == "slot_risk_n1_3"


def test_default_prefix_matches_the_design() -> None:
    n = Names()
    assert n.infer("calibrated") == "plane.infer.calibrated"
    assert n.slots_stream == "PLANE_SLOTS"


@pytest.mark.parametrize("bad", ["a.b", "*", ">", "", "a b", "x" * 65, "ü"])
def test_tokens_reject_injection(bad: str) -> None:
    with pytest.raises(InvalidToken, match="invalid model name"):
        check_token("model", bad)
    with pytest.raises(InvalidToken):
        Names().infer(bad)


def test_keys() -> None:
    assert advert_key("n1", "risk") == "n1.risk"
    assert config_key("deadline_ms", "risk") == "deadline_ms.risk"
    assert config_key("probe_ms") == "probe_ms"


def test_router_queue_group_is_the_designs() -> None:
    from plane.subjects import ROUTER_QUEUE_GROUP

    assert ROUTER_QUEUE_GROUP == "plane-routers"
