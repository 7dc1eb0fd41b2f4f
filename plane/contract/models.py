"""The models the plane ships, as specs: how to decode and validate a request body, what a
request's predicted work is, and the default deadline. The router validates with these before
anything reaches a slot; the node decodes with the same decoders."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from plane.contract.errors import BadRequest
from plane.contract.messages import (
    TINYLM_CONTEXT,
    CalibratedRequest,
    RiskRequest,
    TinyLMRequest,
)
from plane.contract.subjects import MSGPACK

# The device computes in float32: a larger magnitude would become inf there.
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    request_type: type[msgspec.Struct]
    json_decoder: msgspec.json.Decoder[Any]
    msgpack_decoder: msgspec.msgpack.Decoder[Any]
    streams: bool = False  # may be asked to answer as a stream (docs/design.md "Streams")

    def decode(self, body: bytes, content_type: str | None) -> Any:
        """Decode and validate a request body; raise `BadRequest` saying what is wrong."""
        try:
            if content_type == MSGPACK:
                req = self.msgpack_decoder.decode(body)
            else:
                req = self.json_decoder.decode(body)
        except msgspec.ValidationError as exc:
            # Read as msgpack, a JSON body is a small integer: say how it was read.
            how = f" (read as msgpack: Content-Type {MSGPACK})" if content_type == MSGPACK else ""
            raise BadRequest(f"invalid {self.name} request{how}: {exc}") from None
        except msgspec.DecodeError as exc:
            kind = "msgpack" if content_type == MSGPACK else "JSON"
            raise BadRequest(f"request body is not valid {kind}: {exc}") from None
        except RecursionError:  # nested past the interpreter's depth (no model takes that)
            raise BadRequest(f"invalid {self.name} request: nested too deeply") from None
        if isinstance(req, RiskRequest) and not all(
            math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in req.features
        ):
            raise BadRequest(
                "invalid risk request: features must be finite numbers within float32 range "
                f"(|x| <= {FLOAT32_MAX:.3e}; no NaN/inf)"
            )
        if isinstance(req, TinyLMRequest):
            n = len(req.prompt_bytes)
            if n + req.max_tokens > TINYLM_CONTEXT:
                # "At most 0 tokens" is no advice: a prompt that fills the context (the
                # bytes count, not the characters: "é" is two) can only be shortened.
                fix = (f"ask for at most {TINYLM_CONTEXT - n} tokens or shorten the prompt"
                       if n < TINYLM_CONTEXT else
                       f"shorten the prompt to at most {TINYLM_CONTEXT - 1} UTF-8 bytes")
                raise BadRequest(
                    f"invalid tinylm request: the prompt's {n} bytes plus max_tokens "
                    f"{req.max_tokens} exceed the context of {TINYLM_CONTEXT}; {fix}")
        return req

    def work_us(self, req: Any) -> int:
        """The requested device work that is part of the input (0 when the model has none):
        the budget model predicts service time as work plus the slot's measured overhead."""
        return int(req.duration_us) if isinstance(req, CalibratedRequest) else 0

    def tokens(self, req: Any) -> tuple[int, int] | None:
        """A generation's (prompt tokens, max tokens out), what its slot time is predicted
        from (rates learned online); None for a model that does not generate."""
        if isinstance(req, TinyLMRequest):
            return len(req.prompt_bytes), req.max_tokens
        return None


def _spec(name: str, t: type[msgspec.Struct], *, streams: bool = False) -> ModelSpec:
    return ModelSpec(name, t, msgspec.json.Decoder(t), msgspec.msgpack.Decoder(t), streams)


MODELS: dict[str, ModelSpec] = {
    "risk": _spec("risk", RiskRequest),
    "calibrated": _spec("calibrated", CalibratedRequest),
    "tinylm": _spec("tinylm", TinyLMRequest, streams=True),
}


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise BadRequest(f"unknown model {name!r}; this plane serves: {known}") from None
