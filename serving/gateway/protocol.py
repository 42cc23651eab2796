"""The OpenAI-compatible request schemas and response shapes kvmeter serves.

Requests are validated strictly (``"max_tokens": "10"`` is a type error, as on OpenAI's API).
Unknown fields are ignored, except parameters kvmeter cannot honour (``n`` > 1, ``tools``,
``logprobs``, non-text ``response_format``, ``max_completion_tokens`` on ``/v1/completions``):
those are rejected with 400 rather than silently dropped, since a silent downgrade is worse than
an error.

vLLM extensions accepted: ``min_tokens``, ``ignore_eos`` (used by trace replays to hold an output to
its trace length).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler,
                      field_validator)
from pydantic_core import PydanticCustomError

from kvmeter.serving.gateway.errors import ApiError
from kvmeter.tokens import TokenCounts

__all__ = [
    "ChatCompletionRequest", "CompletionRequest", "parse_request", "usage_block",
    "MAX_STOP_SEQUENCES", "MAX_TOKENS_CEILING", "SEED_MIN", "SEED_MAX",
]

#: OpenAI accepts up to 4 stop sequences.
MAX_STOP_SEQUENCES = 4
#: Absolute ceiling on max_tokens before the context check (rejects absurd values early).
MAX_TOKENS_CEILING = 1 << 24
#: ``seed`` range: a signed 64-bit integer, as vLLM's own OpenAI server accepts (the engine seeds a
#: torch generator with it; a larger value fails inside the engine, after admission).
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 63) - 1


def _one_of(what: str):
    """A wrap validator for a union field: any failure becomes one message saying what the field
    accepts (pydantic's own names the union member it tried first, e.g. ``prompt.constrained-str:
    Input should be a valid string`` for a list of bad token ids)."""

    def validate(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_union", f"must be {what}") from None

    return classmethod(validate)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    _content = field_validator("content", mode="wrap")(
        _one_of('a string or a list of {"type": "text", "text": ...} parts'))

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: Annotated[str, Field(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1  # strict: true is not 1
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    user: str | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_CEILING)] = 0
    ignore_eos: bool = False

    # wrap validators run before the after-validator defined below (definition order)
    _stop_type = field_validator("stop", mode="wrap")(
        _one_of(f"a string or a list of at most {MAX_STOP_SEQUENCES} strings"))

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions`` body (the subset kvmeter serves)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None

    def output_ceiling(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` body: one prompt, as text or token ids."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = 16  # OpenAI's default
    echo: Literal[False] = False

    _prompt = field_validator("prompt", mode="wrap")(
        _one_of("a non-empty string or a non-empty list of token ids (integers, 0 ≤ id < vocab size)"))

    def output_ceiling(self) -> int | None:
        return self.max_tokens


_UNSUPPORTED = {
    "tools": "tool calling is not supported by this gateway",
    "functions": "function calling is not supported by this gateway",
    "tool_choice": "tool calling is not supported by this gateway",
    "logprobs": "logprobs are not supported by this gateway",
    "top_logprobs": "logprobs are not supported by this gateway",
    "best_of": "best_of is not supported; send one request per completion",
    "suffix": "suffix is not supported",
}


#: Chat-only parameters refused on ``/v1/completions``. OpenAI's legacy completions API has no
#: ``max_completion_tokens`` (only ``max_tokens``) and answers an unrecognized argument with a 400,
#: so an OpenAI-compatible client expects a refusal, not an alias. Ignoring it (as this gateway
#: used to, and as vLLM does with a warning) silently runs to ``max_tokens`` (default 16) instead
#: of the ceiling the client asked for; honouring it as an alias would make ``max_tokens`` and it
#: disagree with no rule OpenAI defines. So any non-null value is a 400 pointing at ``max_tokens``.
_CHAT_ONLY = {
    "max_completion_tokens": "max_completion_tokens is a chat completions parameter; "
                             "/v1/completions takes max_tokens",
}


def _reject_unsupported(data: dict[str, Any], chat: bool = True) -> None:
    if not chat:
        for key, why in _CHAT_ONLY.items():
            if data.get(key) is not None:  # null is "not set", as OpenAI reads it
                raise ApiError(400, why, param=key, code="unsupported_parameter")
    for key, why in _UNSUPPORTED.items():
        value = data.get(key)
        if value in (None, False, [], 0) or (key == "best_of" and type(value) is int and value == 1):
            continue
        raise ApiError(400, why, param=key, code="unsupported_parameter")
    fmt = data.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(400, "only response_format {\"type\": \"text\"} is supported",
                       param="response_format", code="unsupported_parameter")


def _check_text(value: Any, where: str) -> None:
    """Reject lone surrogates (valid JSON escapes, but not text a tokenizer can encode)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{where} contains an invalid Unicode surrogate", param=where,
                           code="invalid_encoding") from None


def parse_request(data: dict[str, Any], kind: type[_Sampling]) -> Any:
    """Validate a parsed JSON object as ``kind``.

    Raises:
        ApiError: 400 naming the first offending field (``param``) and why: ``invalid_value`` for
            a wrong type or range (``max_tokens`` / ``max_completion_tokens``: an integer from 1
            to ``MAX_TOKENS_CEILING``), ``unsupported_parameter`` for what kvmeter cannot honour
            (``max_completion_tokens`` on ``/v1/completions`` included).
    """
    _reject_unsupported(data, chat=issubclass(kind, ChatCompletionRequest))
    if "n" in data:
        n = data["n"]
        if type(n) is not int:  # a JSON true is not 1
            raise ApiError(400, f"invalid n: must be an integer, got {_json_type(n)}", param="n",
                           code="invalid_value")
        if n != 1:
            raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_parameter")
    try:
        req = kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = first.get("msg")
        # a union field's error already says what the field accepts: "prompt must be ..."
        message = f"{loc} {msg}" if first.get("type") == "invalid_union" else f"invalid {loc or 'request'}: {msg}"
        raise ApiError(400, message, param=loc or None, code="invalid_value") from None
    if isinstance(req, ChatCompletionRequest):
        for i, m in enumerate(req.messages):
            _check_text(m.text(), f"messages.{i}.content")
    elif isinstance(req.prompt, str):
        _check_text(req.prompt, "prompt")
    for s in req.stop_list():
        _check_text(s, "stop")
    return req


def _json_type(value: Any) -> str:
    """The JSON type name of a parsed JSON value (for messages; never the value itself)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def usage_block(tokens: TokenCounts) -> dict[str, Any]:
    """OpenAI ``usage`` object of ``tokens`` — the one place kvmeter writes OpenAI's wire names:
    input → ``prompt_tokens``, cached input → ``prompt_tokens_details.cached_tokens``, output →
    ``completion_tokens``, reasoning → ``completion_tokens_details.reasoning_tokens``."""
    return {
        "prompt_tokens": tokens.input_tokens,
        "completion_tokens": tokens.output_tokens,
        "total_tokens": tokens.total_tokens,
        "prompt_tokens_details": {"cached_tokens": tokens.cached_input_tokens},
        "completion_tokens_details": {"reasoning_tokens": tokens.reasoning_tokens},
    }
