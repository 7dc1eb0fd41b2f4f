"""The models the plane ships, as specs: how to decode and validate a request body, what a
request's predicted work is, and the default deadline. The router validates with these before
anything reaches a slot; the node decodes with the same decoders."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from plane.contract.errors import BadRequest
from plane.contract.messages import CalibratedRequest, RiskRequest
from plane.contract.subjects import MSGPACK

# The device computes in float32: a larger magnitude would become inf there.
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    request_type: type[msgspec.Struct]
    json_decoder: msgspec.json.Decoder[Any]
    msgpack_decoder: msgspec.msgpack.Decoder[Any]

    def decode(self, body: bytes, content_type: str | None) -> Any:
        """Decode and validate a request body; raise `BadRequest` saying what is wrong."""
        try:
            if content_type == MSGPACK:
                req = self.msgpack_decoder.decode(body)
            else:
                req = self.json_decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"invalid {self.name} request: {exc}") from None
        except msgspec.DecodeError as exc:
            kind = "msgpack" if content_type == MSGPACK else "JSON"
            raise BadRequest(f"request body is not valid {kind}: {exc}") from None
        if isinstance(req, RiskRequest) and not all(
            math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in req.features
        ):
            raise BadRequest(
                "invalid risk request: features must be finite numbers within float32 range "
                f"(|x| <= {FLOAT32_MAX:.3e}; no NaN/inf)"
            )
        return req

    def work_us(self, req: Any) -> int:
        """The requested device work that is part of the input (0 when the model has none):
        the budget model predicts service time as work plus the slot's measured overhead."""
        return int(req.duration_us) if isinstance(req, CalibratedRequest) else 0


def _spec(name: str, t: type[msgspec.Struct]) -> ModelSpec:
    return ModelSpec(name, t, msgspec.json.Decoder(t), msgspec.msgpack.Decoder(t))


MODELS: dict[str, ModelSpec] = {
    "risk": _spec("risk", RiskRequest),
    "calibrated": _spec("calibrated", CalibratedRequest),
}


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise BadRequest(f"unknown model {name!r}; this plane serves: {known}") from None
