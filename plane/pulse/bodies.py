"""Default request bodies for `plane pulse`: a valid body for each shipped model."""

from __future__ import annotations

import json

import msgspec

from plane.contract.errors import ConfigError
from plane.contract.messages import FEATURES, CalibratedRequest, RiskRequest, TinyLMRequest

DEFAULT_DURATION_US = 1000
# tinylm: greedy, so that every stream of a run is the same length (this prompt and seed never
# sample the end token before 64 tokens): TPOT and slot time stay comparable stream to stream.
TINYLM_PROMPT = "Once upon a time"
DEFAULT_MAX_TOKENS = 64


def default_body(model: str, *, duration_us: int = DEFAULT_DURATION_US,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> bytes:
    """risk: 32 numbers; calibrated: `{"duration_us": duration_us}`; tinylm: a greedy
    generation of `max_tokens`; others need --body."""
    if model == "tinylm":
        return msgspec.json.encode(TinyLMRequest(prompt=TINYLM_PROMPT, max_tokens=max_tokens))
    if model == "risk":
        features = [round(0.01 * ((7 * i) % 31) - 0.15, 3) for i in range(FEATURES)]
        return msgspec.json.encode(RiskRequest(features=features))
    if model == "calibrated":
        return msgspec.json.encode(CalibratedRequest(duration_us=duration_us))
    raise ConfigError(f"no default body for model {model!r}: pass --body JSON")


def body_from_option(raw: str | None, model: str, duration_us: int,
                     max_tokens: int = DEFAULT_MAX_TOKENS) -> bytes:
    """--body as given (checked to be JSON), else the model's default body."""
    if raw is None:
        return default_body(model, duration_us=duration_us, max_tokens=max_tokens)
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--body is not valid JSON: {exc}") from None
    return raw.encode()
