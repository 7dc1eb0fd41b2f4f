"""OpenAI's request and answer bodies, as far as the plane speaks them
(`plane.gateway.openai_compat`): msgspec Structs, decoded and encoded at the HTTP edge, and
the schemas of `/openapi.json`. A request's fields not named here are ignored (OpenAI
clients send many); a field the plane cannot honour is named by `unsupported()`."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from plane.contract.errors import BadRequest
from plane.contract.messages import TINYLM_CONTEXT, TINYLM_DEFAULT_MAX_TOKENS


# -- what OpenAI clients send (fields not named here are ignored) ------------------------------
class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    type: str


# Every field OpenAI's schema marks nullable is `| None`, null meaning "not given" (its
# default): `{"n": null}` from a client that fills every field was a 400 "Expected `int`,
# got `null`".
class _Asked(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool | None = None  # None: False
    stream_options: StreamOptions | None = None
    n: int | None = None  # None: 1
    stop: str | list[str] | None = None
    # Asked of the answer's content or its tokens: the plane cannot honour them, and an
    # answer that ignored them would look like one that did (a JSON-mode caller would get
    # text that is not JSON): each is a 400 that names it, unless it asks for nothing.
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> list[str]:
        out = ["n (only 1)"] if self.n not in (None, 1) else []
        return out + [name for name, bad in (
            ("stop", bool(self.stop)), ("logit_bias", bool(self.logit_bias)),
            ("response_format (only text)", self.response_format is not None
             and self.response_format.type != "text")) if bad]

    def tokens(self) -> int | None:
        """The most tokens to generate, as the caller asked (None: the plane's default)."""
        return self.max_tokens

    def tokens_field(self) -> str:
        """The name of the field `tokens` came from, for an error about it."""
        return "max_tokens"

    def prompt_is(self, n: int) -> str:
        """What the prompt of `n` UTF-8 bytes is, in the caller's terms."""
        return f"the prompt is {n} UTF-8 bytes"

    def too_long(self, prompt: str) -> str | None:
        """Why `prompt` (as rendered) and the tokens asked for do not fit tinylm's context,
        in the caller's own fields (None: they fit). The plane would say it of `$.prompt`,
        a field a chat caller never sent."""
        n = len(prompt.encode())
        tokens = self.tokens() or TINYLM_DEFAULT_MAX_TOKENS
        if n + tokens <= TINYLM_CONTEXT:
            return None
        fix = f"shorten it by at least {n + tokens - TINYLM_CONTEXT} bytes"
        if n < TINYLM_CONTEXT:
            fix += f" or ask for at most {TINYLM_CONTEXT - n} tokens ({self.tokens_field()})"
        return (f"this model's context is {TINYLM_CONTEXT} tokens (one per UTF-8 byte); "
                f"{self.prompt_is(n)}, and {tokens} are to be generated: {fix}")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


class CompletionRequest(_Asked, frozen=True, kw_only=True):
    # Absent or null: OpenAI's default, `<|endoftext|>` ("as if from the beginning of a new
    # document"). tinylm starts every prompt with its END token, its document boundary, so
    # that is the empty prompt here (`{"prompt": null}` from the `openai` package's
    # `prompt=None` was a 400, and so was a body without it). OpenAI also takes token ids (a
    # list of ints, or of lists of them): read here so that the answer says what to send
    # instead (`unsupported`) rather than msgspec's "Expected `str`, got `int`" (tinylm's
    # tokens are the prompt's UTF-8 bytes, not the ids of OpenAI's tokenizers).
    prompt: str | list[str | int | list[int]] | None = None
    echo: bool | None = None  # None: False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if isinstance(self.prompt, list):
            if not all(isinstance(p, str) for p in self.prompt):
                out.append("prompt as token ids (tinylm reads text: give the prompt as a "
                           "string, or a list of one string)")
            elif len(self.prompt) != 1:
                out.append("prompt as a list of other than one string")
        return out + [name for name, bad in (
            ("echo", bool(self.echo)), ("logprobs", self.logprobs is not None),
            ("best_of", self.best_of not in (None, 1)), ("suffix", bool(self.suffix))) if bad]

    def render(self) -> str:
        """The prompt (after `unsupported`, which refuses a list of other than one); none
        given: the empty prompt, generation from the document boundary alone."""
        if self.prompt is None:
            return ""
        if isinstance(self.prompt, str):
            return self.prompt
        first = self.prompt[0]
        assert isinstance(first, str), "refused by `unsupported`"
        return first


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None


# OpenAI's roles: any other is a 400 that names these (a typo would otherwise be rendered into
# the prompt as it came).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:  # msgspec reports it at its path, `$.messages[i]`
            raise ValueError(f"role must be one of {', '.join(map(repr, CHAT_ROLES))}, "
                             f"got {self.role!r}")

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise BadRequest("only text content parts are supported")
        return "".join(p.text or "" for p in self.content)


class ChatRequest(_Asked, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if not self.messages:
            out.append("an empty messages list")
        return out + [name for name, bad in (
            ("logprobs", bool(self.logprobs)), ("top_logprobs", bool(self.top_logprobs)),
            ("tools", bool(self.tools)), ("functions", bool(self.functions)),
            # With no tools, "auto" and "none" ask for nothing.
            ("tool_choice", self.tool_choice not in (None, "none", "auto")),
            ("function_call", self.function_call not in (None, "none", "auto"))) if bad]

    def prompt_is(self, n: int) -> str:
        return (f"the messages are {n} UTF-8 bytes as its prompt (a `role: content` line "
                "each, then `assistant:`)")

    def render(self) -> str:
        """One prompt for a model without a chat template: a `role: content` line per
        message, then the assistant's turn."""
        return "".join(f"{m.role}: {m.text()}\n" for m in self.messages) + "assistant:"

    def tokens(self) -> int | None:
        """`max_completion_tokens`, OpenAI's name now, before the older `max_tokens`."""
        return self.max_tokens if self.max_completion_tokens is None else (
            self.max_completion_tokens)

    def tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


class PlaneBody(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The `tinylm` request the plane gets: only what the caller gave (the plane's defaults
    apply to the rest; the router validates it all)."""

    prompt: str
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    top_p: float | None = None


# -- what they get back -------------------------------------------------------------------
class OpenAIUsage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage | None = None


class AssistantMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str = "assistant"
    content: str
    refusal: None = None


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage


class Delta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatChunk(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: OpenAIUsage | None = None


class OpenAIError(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(msgspec.Struct, frozen=True, kw_only=True):
    error: OpenAIError


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "plane"


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
