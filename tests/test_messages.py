"""Wire messages: decoding, validation, and the schema-evolution rule (an old reader accepts
a newer message with fields it does not know)."""

import math

import msgspec
import pytest

from plane.contract.errors import BadRequest
from plane.contract.messages import DoneEvent, NodeAdvert, SlotAdvert, advert_decoder, done_decoder
from plane.contract.models import model_spec
from plane.contract.subjects import MSGPACK


def test_old_reader_accepts_new_advert() -> None:
    class NodeAdvertV2(msgspec.Struct, kw_only=True):
        node: str
        model: str
        backend: str
        slots: list[SlotAdvert]
        at_ms: int
        gpu_uuid: str = "GPU-1"  # a field this reader has never heard of

    new = msgspec.json.encode(NodeAdvertV2(node="n", model="risk", backend="torch",
                                           slots=[SlotAdvert(k=0, subject="s")], at_ms=1))
    old = advert_decoder.decode(new)
    assert isinstance(old, NodeAdvert) and old.slots[0].subject == "s"


def test_old_reader_accepts_new_done_event() -> None:
    # DoneEvent is array-like: new fields are appended at the end.
    wire = msgspec.msgpack.encode(["rid", "n", "tinylm", 1, 200, 350, "r0", 0, 16,
                                   5, 7, 40, 90, True, "future-field"])
    ev = done_decoder.decode(wire)
    assert isinstance(ev, DoneEvent) and ev.service_us == 350 and ev.sms == 16
    assert (ev.prompt_tokens, ev.tokens, ev.prefill_us, ev.decode_us) == (5, 7, 40, 90)
    assert ev.cut


def test_new_reader_accepts_old_done_event() -> None:
    """A node from before `sms` was appended: the field takes its default."""
    wire = msgspec.msgpack.encode(["rid", "n", "risk", 1, 200, 350, "r0", 0])
    ev = done_decoder.decode(wire)
    assert isinstance(ev, DoneEvent) and ev.sms == 0 and not ev.cut


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{", "not valid JSON"),
        (b'{"features": [1, 2]}', "length >= 32"),
        (b'{"features": ["a"' + b', "a"' * 31 + b"]}", "Expected `float`"),
        (b'{"features": [1e999' + b", 1" * 31 + b"]}", "out of range"),
        (b'{"features": [NaN' + b", 1" * 31 + b"]}", "not valid JSON"),
        (b'{"featurez": []}', "unknown field"),
        (b"[]", "Expected `object`"),
    ],
)
def test_risk_validation(body: bytes, fragment: str) -> None:
    with pytest.raises(BadRequest) as info:
        model_spec("risk").decode(body, None)
    assert fragment in str(info.value)


def test_msgpack_bodies_and_nan() -> None:
    spec = model_spec("risk")
    ok = spec.decode(msgspec.msgpack.encode({"features": [0.5] * 32}), MSGPACK)
    assert ok.features[0] == 0.5
    with pytest.raises(BadRequest, match="finite"):
        spec.decode(msgspec.msgpack.encode({"features": [math.nan] * 32}), MSGPACK)


def test_a_json_body_sent_as_msgpack_is_told_how_it_was_read() -> None:
    """Read as msgpack, `{"features": ...}` is the integer 123 ('{'): "Expected `object`, got
    `int`" alone sent the caller looking at its JSON (found from outside)."""
    with pytest.raises(BadRequest, match=r"read as msgpack: Content-Type application/msgpack"):
        model_spec("risk").decode(b'{"features": [0.5]}', MSGPACK)


def test_calibrated_bounds() -> None:
    spec = model_spec("calibrated")
    assert spec.work_us(spec.decode(b'{"duration_us": 1500}', None)) == 1500
    for bad in (b'{"duration_us": -1}', b'{"duration_us": 10000001}', b'{"duration_us": 1.5}'):
        with pytest.raises(BadRequest):
            spec.decode(bad, None)


def test_a_tinylm_prompt_past_the_context_is_told_what_would_fit() -> None:
    """The context counts UTF-8 bytes (200 "é" are 400): the advice is a number of tokens
    while some fit, and a shorter prompt once the prompt alone fills the context."""
    spec = model_spec("tinylm")
    with pytest.raises(BadRequest, match=r"250 bytes plus max_tokens 10 .* at most 6 tokens"):
        spec.decode(msgspec.json.encode({"prompt": "a" * 250, "max_tokens": 10}), None)
    with pytest.raises(BadRequest, match=r"400 bytes .* shorten the prompt to at most 255 UTF-8"):
        spec.decode(msgspec.json.encode({"prompt": "é" * 200, "max_tokens": 1}), None)
    assert spec.decode(msgspec.json.encode({"prompt": "é" * 127, "max_tokens": 2}), None)


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(BadRequest, match="calibrated, risk"):
        model_spec("nope")
