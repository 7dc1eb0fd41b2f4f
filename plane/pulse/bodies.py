"""Default request bodies for `plane pulse`: a valid body for each shipped model."""

from __future__ import annotations

import json

import msgspec

from plane.contract.errors import ConfigError
from plane.contract.messages import FEATURES, CalibratedRequest, RiskRequest

DEFAULT_DURATION_US = 1000


def default_body(model: str, *, duration_us: int = DEFAULT_DURATION_US) -> bytes:
    """risk: 32 numbers; calibrated: `{"duration_us": duration_us}`; others need --body."""
    if model == "risk":
        features = [round(0.01 * ((7 * i) % 31) - 0.15, 3) for i in range(FEATURES)]
        return msgspec.json.encode(RiskRequest(features=features))
    if model == "calibrated":
        return msgspec.json.encode(CalibratedRequest(duration_us=duration_us))
    raise ConfigError(f"no default body for model {model!r}: pass --body JSON")


def body_from_option(raw: str | None, model: str, duration_us: int) -> bytes:
    """--body as given (checked to be JSON), else the model's default body."""
    if raw is None:
        return default_body(model, duration_us=duration_us)
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--body is not valid JSON: {exc}") from None
    return raw.encode()
