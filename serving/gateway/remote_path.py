"""The protocol's part of a request on ``--engine remote``: kvmeter's own request models and
response shapes over the remote engine.

The in-process engines run vLLM's OpenAI serving layer
(:mod:`kvmeter.serving.gateway.openai_path`); the remote engine keeps the gateway's earlier path
until it becomes a transparent metering proxy that forwards the body and meters the upstream's
answer. Here requests are validated strictly (``"max_tokens": "10"`` is a type error, as on
OpenAI's API); unknown fields are ignored, except parameters this path cannot honour (``n`` > 1,
``tools``, ``logprobs``, non-text ``response_format``, ``max_completion_tokens`` on
``/v1/completions``): those are 400s rather than silent drops. vLLM extensions accepted:
``min_tokens``, ``ignore_eos``. The prompt is tokenized with the model's tokenizer and chat
template (the remote engine's), the engine's deltas are metered here, and the answers are built
in the OpenAI shapes below.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from typing import Annotated, Any, AsyncIterator, Literal

import anyio
import orjson
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler,
                      field_validator)
from pydantic_core import PydanticCustomError
from starlette.requests import Request
from starlette.responses import Response

from kvmeter.events import UsageEvent
from kvmeter.serving.engines.base import EngineError, EngineOutput, EngineRequest
from kvmeter.serving.gateway.body import json_type
from kvmeter.serving.gateway.errors import ApiError, error_response
from kvmeter.serving.gateway.handler import Admitted, ClientGone, CompletionEndpoint, Prepared
from kvmeter.serving.gateway.replays import stored_headers
from kvmeter.serving.quota.idempotency import StoredResponse
from kvmeter.serving.tenancy import Principal
from kvmeter.tokens import TokenCounts

__all__ = [
    "RemoteEndpoint", "ChatCompletionRequest", "CompletionRequest", "parse_request", "usage_block",
    "MAX_STOP_SEQUENCES", "MAX_TOKENS_CEILING", "SEED_MIN", "SEED_MAX",
]

log = logging.getLogger(__name__)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"

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
            raise ApiError(400, f"invalid n: must be an integer, got {json_type(n)}", param="n",
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


def usage_block(tokens: TokenCounts) -> dict[str, Any]:
    """OpenAI ``usage`` object of ``tokens`` — the one place kvmeter writes OpenAI's wire names
    (on the in-process engines vLLM's serving layer writes its own): input → ``prompt_tokens``,
    cached input → ``prompt_tokens_details.cached_tokens``, output → ``completion_tokens``,
    reasoning → ``completion_tokens_details.reasoning_tokens``."""
    return {
        "prompt_tokens": tokens.input_tokens,
        "completion_tokens": tokens.output_tokens,
        "total_tokens": tokens.total_tokens,
        "prompt_tokens_details": {"cached_tokens": tokens.cached_input_tokens},
        "completion_tokens_details": {"reasoning_tokens": tokens.reasoning_tokens},
    }


class _Payload:
    __slots__ = ("body", "engine_request")

    def __init__(self, body: "ChatCompletionRequest | CompletionRequest", engine_request: EngineRequest) -> None:
        self.body = body
        self.engine_request = engine_request


class RemoteEndpoint(CompletionEndpoint):
    """``/v1/chat/completions`` or ``/v1/completions`` on the remote engine (see the module)."""

    def __init__(self, gateway: Any, *, chat: bool) -> None:
        super().__init__(gateway, chat=chat)
        self._kind = ChatCompletionRequest if chat else CompletionRequest

    async def _prepare(self, request: Request, data: dict, principal: Principal, run_id: str) -> Prepared:
        body = parse_request(data, self._kind)
        engine = self.gw.engine
        if body.model != engine.model_name:
            raise ApiError(404, f"The model '{body.model}' does not exist; this server serves "
                                f"'{engine.model_name}'", param="model", code="model_not_found")
        prompt_ids = await self._tokenize(body)
        max_tokens = self._output_budget(body, len(prompt_ids), self._context_limit(principal, run_id))
        engine_request = EngineRequest(
            request_id="", prompt_token_ids=prompt_ids, max_tokens=max_tokens,
            min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, temperature=body.temperature,
            top_p=body.top_p, stop=body.stop_list(), seed=body.seed)
        return Prepared(stream=body.stream, input_tokens=len(prompt_ids), output_tokens=max_tokens,
                        payload=_Payload(body, engine_request),
                        prompts=(prompt_ids,) if run_id else ())  # the run's repeated-prompt stop

    async def _run(self, request: Request, adm: Admitted, headers: dict[str, str]) -> Response:
        engine_request = adm.prepared.payload.engine_request
        engine_request.request_id = adm.meter.identity.request_id
        engine_request.attribution = adm.meter.identity.attribution  # the engine stamps its stats
        adm.meter.response_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{engine_request.request_id}"  # the answer's id
        if adm.grant is not None:
            engine_request.priority = adm.grant.priority
        if adm.prepared.stream:
            return self.streaming_response(self._stream(adm, headers), adm, headers)
        return await self._complete(request, adm, headers)

    async def _tokenize(self, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
        tokenizer = self.gw.engine.tokenizer
        if isinstance(body, ChatCompletionRequest):
            messages = body.chat()
            size = sum(len(m["content"]) for m in messages)
            call = lambda: tokenizer.encode_chat(messages)  # noqa: E731
        elif isinstance(body.prompt, list):
            vocab = tokenizer.vocab_size
            bad = next((t for t in body.prompt if t >= vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})",
                               param="prompt", code="invalid_value")
            return list(body.prompt)
        else:
            text = body.prompt
            size = len(text)
            call = lambda: tokenizer.encode(text, add_special_tokens=True)  # noqa: E731
        try:
            if size > self.gw.settings.tokenize_in_thread_chars:
                ids = await anyio.to_thread.run_sync(call)
            else:
                ids = call()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization", param="prompt",
                           code="invalid_value")
        return ids

    def _output_budget(self, body: ChatCompletionRequest | CompletionRequest, input_tokens: int,
                       context_limit: int | None = None) -> int:
        """The output ceiling: the request's ``max_tokens``, else what the context window leaves —
        the engine's window or, when tighter, the caller's quota ``max_context_tokens`` (a request
        without ``max_tokens`` is not refused for a reservation it never asked for; at least 1
        token, so a prompt over the quota limit is refused by the quota, naming its level).

        Raises:
            ApiError: 400 ``context_length_exceeded`` when prompt (+ max_tokens) does not fit the
                engine's window.
        """
        window = self.gw.engine.max_model_len
        requested = body.output_ceiling()
        ceiling_param = ("max_completion_tokens" if isinstance(body, ChatCompletionRequest)
                         and body.max_completion_tokens is not None else "max_tokens")
        if input_tokens >= window:
            raise ApiError(400, f"This model's maximum context length is {window} tokens. However, "
                                f"your prompt is {input_tokens} tokens, leaving no room for output.",
                           param="messages" if self.chat else "prompt", code="context_length_exceeded")
        if requested is None:
            budget = window - input_tokens
            if context_limit is not None and context_limit < window:
                budget = max(1, context_limit - input_tokens)
        else:
            if input_tokens + requested > window:
                raise ApiError(400, f"This model's maximum context length is {window} tokens. However, "
                                    f"you requested {input_tokens + requested} tokens ({input_tokens} "
                                    f"in the prompt, {requested} in the completion). Please reduce the "
                                    f"prompt or {ceiling_param}.",
                               param=ceiling_param, code="context_length_exceeded")
            budget = requested
        if body.min_tokens > budget:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) exceeds the output budget ({budget})",
                           param="min_tokens", code="invalid_value")
        return budget

    # -- step 7, non-streaming ---------------------------------------------------------------------
    async def _complete(self, request: Request, adm: Admitted, headers: dict[str, str]) -> Response:
        texts: list[str] = []

        async def collect() -> None:
            async with aclosing(self._engine_stream(adm)) as outputs:
                async for out in outputs:
                    if out.new_text:
                        texts.append(out.new_text)

        try:
            await self._until_disconnect(request, collect(), adm)
        except ClientGone:
            await self._finalize(adm, "aborted", status_code=499, finish_reason="abort")
            await self._settle_idempotency(adm, None)
            return Response(status_code=499)
        except EngineError as exc:
            log.error("engine failed %s: %s", adm.meter.identity.request_id, exc)
            await self._finalize(adm, "error", status_code=503 if exc.retryable else 500,
                                 finish_reason="error")
            await self._settle_idempotency(adm, None)
            err = ApiError(503 if exc.retryable else 500, "the engine failed this request; retry",
                           code="engine_error")
            return error_response(err, headers)
        event = await self._finalize(adm, "ok", status_code=200)
        response = Response(orjson.dumps(self._full_response(adm, "".join(texts), event)),
                            media_type="application/json", headers=headers)
        await self._settle_idempotency(adm, StoredResponse(
            200, stored_headers({**headers, "content-type": "application/json"}), bytes(response.body)))
        return response

    # -- step 7, streaming ---------------------------------------------------------------------------
    async def _stream(self, adm: Admitted, headers: dict[str, str]) -> AsyncIterator[bytes]:
        created = int(self.gw.clock.wall())
        include_usage = adm.prepared.payload.body.include_usage()
        outputs = self._engine_stream(adm)
        sent: list[bytes] | None = [] if adm.ticket is not None else None  # kept for replays
        completed = False
        try:
            first = True
            async for out in outputs:
                if out.new_text or first or out.finished:
                    chunk = _sse(self._chunk(adm, created, out, first, include_usage))
                    if sent is not None:
                        sent.append(chunk)
                    yield chunk
                    first = False
            event = await self._finalize(adm, "ok", status_code=200)
            tail = (_sse(self._usage_chunk(adm, created, event)) if include_usage else b"") + _DONE
            if sent is not None:
                sent.append(tail)
                await self._settle_idempotency(adm, StoredResponse(
                    200, stored_headers(headers), b"".join(sent), streamed=True))
            completed = True
            yield tail
        except EngineError as exc:
            log.error("engine failed %s mid-stream: %s", adm.meter.identity.request_id, exc)
            await self._finalize(adm, "error", status_code=200, finish_reason="error")
            yield _sse(ApiError(503 if exc.retryable else 500, "the engine failed this request",
                                code="engine_error").body())
            yield _DONE
        finally:
            # Closing the engine stream aborts the engine request if it is still running (the
            # client went away: GeneratorExit at a yield, or cancellation at an await).
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
            await self._finalize(adm, "aborted", status_code=200, finish_reason="abort")
            if not completed:
                await self._settle_idempotency(adm, None)  # a truncated stream is never replayed

    async def _engine_stream(self, adm: Admitted) -> AsyncIterator[EngineOutput]:
        """The engine's deltas, metered and charged to the scheduler as they arrive. Closing this
        iterator early closes the engine's, which aborts the engine request."""
        engine_request = adm.prepared.payload.engine_request
        stream = self.gw.engine.generate(engine_request)
        adm.engine_ids.append(engine_request.request_id)
        try:
            async for out in stream:
                new = adm.meter.on_output(out)
                if new and adm.grant is not None:
                    self.gw.scheduler.charge_output(adm.grant, new)
                yield out
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()  # type: ignore[attr-defined]

    # -- response shapes ----------------------------------------------------------------------------
    def _usage(self, event: UsageEvent) -> dict[str, Any]:
        return usage_block(event.tokens)

    def _full_response(self, adm: Admitted, text: str, event: UsageEvent) -> dict[str, Any]:
        rid = adm.meter.identity.request_id
        created = int(self.gw.clock.wall())
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": event.finish_reason, "logprobs": None}
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
                    "model": event.attribution.model, "choices": [choice], "usage": self._usage(event)}
        choice = {"index": 0, "text": text, "finish_reason": event.finish_reason, "logprobs": None}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                "model": event.attribution.model, "choices": [choice], "usage": self._usage(event)}

    def _chunk(self, adm: Admitted, created: int, out: EngineOutput, first: bool,
               include_usage: bool) -> dict[str, Any]:
        rid = adm.meter.identity.request_id
        reason = out.finish_reason if out.finished else None
        if self.chat:
            delta: dict[str, Any] = {"content": out.new_text}
            if first:
                delta["role"] = "assistant"
            chunk = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
                     "model": self.gw.engine.model_name,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}
        else:
            chunk = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                     "model": self.gw.engine.model_name,
                     "choices": [{"index": 0, "text": out.new_text, "finish_reason": reason,
                                  "logprobs": None}]}
        if include_usage:
            chunk["usage"] = None  # OpenAI: only the final usage chunk carries totals
        return chunk

    def _usage_chunk(self, adm: Admitted, created: int, event: UsageEvent) -> dict[str, Any]:
        rid = adm.meter.identity.request_id
        return {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": created, "model": event.attribution.model, "choices": [], "usage": self._usage(event)}
