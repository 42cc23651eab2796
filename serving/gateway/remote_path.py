"""The protocol's part of a request on ``--engine remote``: a transparent, metering proxy.

The upstream is an OpenAI-compatible server (vLLM's, normally); it answers the whole API itself —
tools, ``n``, logprobs, structured outputs, every sampling parameter, prompt lists, ``echo`` —
so kvmeter writes no request or response shapes of its own here. For each request, after the
orchestrator's authentication and body checks (:mod:`kvmeter.serving.gateway.handler`):

1. **Validate** the body with vLLM's own request models
   (:func:`~kvmeter.serving.openai_api.layer.validate_request`: vLLM's 400 for what its server
   would refuse, kvmeter's two refusals: ``max_completion_tokens`` on ``/v1/completions`` and
   ``use_beam_search``) and check the model (vLLM's 404 for another name; no name: the served
   one); the sampling parameters as vLLM checks them (:func:`_sampling_check`). Nothing reaches
   the upstream before these pass.
2. **Check the context window and estimate** for the quota's reservation: the prompt's tokens with
   the model's tokenizer (the chat template with the request's ``tools``; each prompt of a
   completion), held to the model's window — the engine's ``max_model_len`` (the config's, per
   pool under ``engine.models``, else what the upstream's ``/v1/models`` reports; the one
   kvmeter's ``/v1/models`` advertises) — with vLLM's own checks (:func:`_window_check`): a
   prompt past it (or filling it) and a ``max_tokens`` past it are vLLM 0.32's 400s, before
   admission and billed nothing, whatever the upstream would have done (its window may be larger,
   or it may check nothing). Too long is a 400, never a truncation. The output ceiling is ``n`` ×
   Σ per prompt vLLM's ``get_max_tokens``: ``min(max_tokens, window − prompt)`` (without
   ``max_tokens`` on a chat: what the window leaves, or, when tighter, what the caller's quota
   ``max_context_tokens`` leaves, as the in-process path sets it).
3. After admission and dispatch, **forward the body as the client sent it** (re-serialized JSON:
   the same values) to the same route of the upstream, with the client's ``X-Request-Id`` (else
   kvmeter's request id). Never a larger output ceiling than was reserved: a ``max_tokens`` (or
   ``max_completion_tokens``) past what the prompt leaves of the window goes as that — what vLLM
   lowers it to itself (for a completion of several prompts, what the shortest leaves; vLLM
   lowers each) —, and a chat without one under a tighter quota ``max_context_tokens`` gets
   ``max_tokens`` = what that limit leaves. Without either, nothing is added (the upstream's
   default: what its window leaves, or its model's generation config's). kvmeter also changes
   one thing more: a streamed request without
   ``stream_options.include_usage`` gets it, so the upstream reports its own counts, and
   :class:`~kvmeter.serving.gateway.upstream.ClientView` takes out of the stream what that added
   (the usage chunk; the ``system_fingerprint`` that vLLM then moves onto it is put back on each
   choice's last chunk) — the client sees what it would without kvmeter. kvmeter does not add
   ``continuous_usage_stats``: usage on every chunk would have to be cut out of every chunk.
4. **Answer with the upstream's answer unchanged** — status, body, stream — with kvmeter's headers
   (``x-kvmeter-request-id``, the reservation's ``x-ratelimit-*``; ``content-type`` and
   ``x-request-id`` are the upstream's when it sends them).
5. **Meter** from the upstream's usage (:class:`~kvmeter.serving.gateway.upstream.AnswerReader`:
   the final usage block, else running usage, else the streamed text's tokens, ``token_source``
   ``estimate``). A stream's usage event is durable before the client gets ``[DONE]`` (or the
   final usage chunk it asked for).

Failures: an upstream 4xx goes to the client as it is (status, body); the request is billed 0
(the upstream reports no usage for it) and the reservation released. An upstream 5xx is a 502,
an upstream that cannot be reached a 503 (``upstream_error``, retryable), both billed 0. A stream
that breaks after it started (the upstream's connection, a stream without ``[DONE]``) ends with
an error event and ``[DONE]``, billed what it streamed (estimated). A client that leaves closes
the upstream's response, which a vLLM server turns into an engine abort.

Under agent runs, a chat request that declares ``tools`` has the tool calls the model emits
decided before they reach the client (:mod:`kvmeter.serving.gateway.emitted`), as on the
in-process engines.

The tier's engine priority — the scheduler's grant, as the in-process engines get it — goes to the
upstream in vLLM's ``X-Vllm-Priority`` header (vLLM's ``PRIORITY_HEADER``, which its serving layer
reads before the body's ``priority``), so the body stays as sent and the client's own ``priority``
is overridden by the tier's, as on the in-process path. It orders the upstream's queue when the
upstream runs with ``--scheduling-policy priority`` (vLLM ignores it under ``fcfs``).

Not forwarded: the client's own headers other than ``X-Request-Id`` (the upstream gets the
engine's API key, never the client's).
"""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from typing import Any, AsyncGenerator, AsyncIterator, Sequence, cast

import anyio
import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from kvmeter.errors import Refusal
from kvmeter.serving.engines.base import EngineError, EngineOutput, Tokenizer
from kvmeter.serving.engines.pool import EnginePool
from kvmeter.serving.engines.remote import RemoteEngine
from kvmeter.serving.gateway.emitted import EmittedToolCalls
from kvmeter.serving.gateway.errors import ApiError, error_response
from kvmeter.serving.gateway.handler import REQUEST_ID_HEADER, Admitted, ClientGone, CompletionEndpoint, Prepared
from kvmeter.serving.gateway.replays import stored_headers
from kvmeter.serving.gateway.upstream import DONE, UNKNOWN, AnswerReader, ClientView
from kvmeter.serving.openai_api.errors import from_exception, invalid_body
from kvmeter.serving.openai_api.layer import request_kind, validate_request
from kvmeter.serving.quota.idempotency import StoredResponse
from kvmeter.serving.scheduler.router import prefix_block_hashes
from kvmeter.serving.tenancy import Principal
from kvmeter.tokens import TokenCounts

__all__ = ["RemoteEndpoint", "chat_prompt_ids"]

log = logging.getLogger(__name__)

#: Upstream response headers the client gets (besides kvmeter's own).
_PASSED_HEADERS = ("content-type", "x-request-id")


def _text_parts(content: Any) -> Any:
    """A message's content as a chat template reads it: a list of text parts joined by newlines
    (what vLLM does for templates that take a string); anything else unchanged."""
    if isinstance(content, list):
        texts = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "\n".join(texts)
    return content


def _template_message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    out = {**message, "content": _text_parts(message.get("content"))}
    calls = message.get("tool_calls")
    if isinstance(calls, list):  # templates read the arguments as an object, as vLLM hands them over
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
                except ValueError:
                    pass
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[Any], tools: Any = None) -> list[int]:
    """kvmeter's count of a chat's prompt: the model's chat template over ``messages`` (content
    parts joined, tool-call arguments as objects) and ``tools``, with the generation prompt, as
    token ids. An estimate (the upstream's own render is what it bills); when the template cannot
    render the messages, the ids of their text.
    """
    hf = getattr(tokenizer, "hf", None)
    rendered = [_template_message(m) for m in messages]
    if hf is not None and getattr(hf, "chat_template", None):
        try:
            text = hf.apply_chat_template(rendered, tools=tools or None, add_generation_prompt=True, tokenize=False)
            if isinstance(text, str):
                return tokenizer.encode(text)
        except Exception:  # noqa: BLE001 — jinja errors of all kinds: fall back to the text
            pass
    parts = [m.get("content") for m in rendered if isinstance(m, dict)]
    text = "\n".join(p for p in parts if isinstance(p, str))
    if tools:
        text += "\n" + json.dumps(tools, ensure_ascii=False)
    return tokenizer.encode(text)


class _Payload:
    """The forwarded body and what the bill needs, from admission to the answer."""

    __slots__ = ("body", "strip_usage", "input_tokens", "single_prompt", "choices", "emitted")

    def __init__(self, body: bytes, strip_usage: bool, input_tokens: int, single_prompt: bool, choices: int) -> None:
        self.body = body
        self.strip_usage = strip_usage
        self.input_tokens = input_tokens
        self.single_prompt = single_prompt
        self.choices = choices  # n × prompts: the choices the answer will hold
        self.emitted: EmittedToolCalls | None = None


def _upstream_headers(resp: httpx.Response, headers: dict[str, str]) -> dict[str, str]:
    out = dict(headers)
    for name in _PASSED_HEADERS:
        value = resp.headers.get(name)
        if value is not None:
            out[name] = value
    return out


def _parse(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            return json.loads(data)  # e.g. an integer past 64 bits
        except ValueError:
            return None


async def _sse_events(resp: httpx.Response) -> AsyncGenerator[tuple[bytes, Any], None]:
    """The upstream's server-sent events: each event's bytes (its lines and the blank line that
    ends it) and its parsed ``data`` (:data:`DONE` for ``[DONE]``; None when not JSON or none)."""
    lines: list[str] = []
    data: list[str] = []
    async for line in resp.aiter_lines():
        if line:
            lines.append(line)
            if line.startswith("data:"):
                data.append(line[6:] if line.startswith("data: ") else line[5:])
            continue
        if lines:
            yield _event(lines, data)
            lines, data = [], []
    if lines:
        yield _event(lines, data)


def _event(lines: list[str], data: list[str]) -> tuple[bytes, Any]:
    raw = ("\n".join(lines) + "\n\n").encode("utf-8")
    if not data:
        return raw, None
    text = "\n".join(data)
    return raw, DONE if text.strip() == DONE else _parse(text.encode("utf-8"))


def _window_check(vreq: Any, prompts: Sequence[Sequence[int]], window: int) -> list[int]:
    """The context-window checks vLLM's server makes before it runs a request, made here before
    admission with vLLM's own code, so the upstream is never sent (nor the quota asked to reserve
    for) what does not fit ``window`` (the engine's ``max_model_len``: the config's, else the
    upstream's ``/v1/models``) — even when the upstream's own window is larger or it checks nothing.

    ``prompts``: kvmeter's token ids of each prompt (an empty one: ``prompt_embeds`` or none,
    which vLLM's answer decides). Returns each prompt's length after the request's
    ``truncate_prompt_tokens`` (vLLM's truncation).

    Raises:
        OpenAIError: vLLM 0.32's 400s, as its server words them: ``max_tokens`` (or
            ``max_completion_tokens``) past the window ("max_tokens=M cannot be greater than
            max_model_len=N. Please request fewer output tokens.", its ``TokenizeParams``); a
            prompt past it ("This model's maximum context length is N tokens. However, your prompt
            contains P input tokens, which exceeds this limit even without any output tokens. ...",
            param ``input_tokens``); a prompt that fills it, leaving no room for one output token
            (its engine's input processor). A ``max_tokens`` that fits the window but not what the
            prompt leaves of it is no error: vLLM's ``get_max_tokens`` lowers it to that.
    """
    from types import SimpleNamespace

    from vllm.v1.engine.input_processor import InputProcessor

    # what the two checks read of vLLM's model config and input processor
    model_config = SimpleNamespace(max_model_len=window, runner_type="generate")
    processor = SimpleNamespace(skip_prompt_length_check=False, model_config=model_config,
                                supports_mm_inputs=False, mm_encoder_cache_size=0)
    lengths = []
    try:
        params = vreq.build_tok_params(model_config)  # max_tokens past the window
        for ids in prompts:
            if not ids:
                lengths.append(0)
                continue
            kept = len(params._validate_tokens(None, list(ids)))  # truncation, then the prompt's length
            InputProcessor._validate_prompt_len(processor, kept, "decoder")  # type: ignore[arg-type]
            lengths.append(kept)
    except Exception as exc:  # noqa: BLE001 — vLLM's VLLMValidationError / ValueError: its 400
        raise from_exception(exc) from None
    return lengths


def _sampling_check(vreq: Any, window: int, asked: int | None, lengths: Sequence[int]) -> None:
    """The sampling parameters checked as vLLM's server checks them — its ``SamplingParams``, built
    by the request's ``to_sampling_params`` with the output ceiling its ``get_max_tokens`` gives
    (the shortest prompt's: the largest) — as the in-process path does
    (:meth:`~kvmeter.serving.openai_api.layer.OpenAILayer.plan`). The engine's own checks that
    need the upstream's settings (``max_logprobs``, ...) stay the upstream's.

    Raises:
        OpenAIError: vLLM's 400 ("max_tokens must be at least 1, got -1.", "n must be at least 1,
            got 0.", "temperature must be non-negative, ...", "top_p must be in (0, 1], ...").
    """
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    try:
        ceiling = max((get_max_tokens(window, asked, p, {}) for p in lengths), default=1)
        vreq.to_sampling_params(ceiling, {})
    except Exception as exc:  # noqa: BLE001 — vLLM's VLLMValidationError / ValueError: its 400
        raise from_exception(exc) from None


class RemoteEndpoint(CompletionEndpoint):
    """``/v1/chat/completions`` or ``/v1/completions`` proxied to the remote engine's upstream (see
    the module)."""

    def __init__(self, gateway: Any, *, chat: bool) -> None:
        super().__init__(gateway, chat=chat)
        self.path = "/v1/chat/completions" if chat else "/v1/completions"
        request_kind(chat)  # vLLM's request model, imported (seconds: torch) before the first request
        from vllm.entrypoints.generate.base.serving import PRIORITY_HEADER

        #: the header vLLM's serving layer reads the engine priority from (before the body's)
        self.priority_header = PRIORITY_HEADER
        #: the upstream's system_fingerprint, learnt from its usage chunks (see ClientView)
        self.fingerprint: Any = UNKNOWN

    def _id_headers(self, request: Request, request_id: str) -> dict[str, str]:
        # as vLLM's --enable-request-id-headers: the client's X-Request-Id, else one of ours
        return {REQUEST_ID_HEADER: request_id, "x-request-id": request.headers.get("x-request-id", request_id)}

    def _body_refusal(self, err: ApiError) -> Refusal:
        return invalid_body(err.message, getattr(err, "loc", ("body",)))

    # -- steps 2–4 -----------------------------------------------------------------------------
    async def _prepare(self, request: Request, data: dict, principal: Principal, run_id: str) -> Prepared:
        vreq = validate_request(dict(data), self.chat)  # (vLLM's validators fill in the dict they get)
        stream = bool(vreq.stream)
        strip_usage = stream and not (vreq.stream_options is not None and vreq.stream_options.include_usage)
        # vLLM's server: no name is the served model; another name its 404 naming the served ones
        served = self.gw.served().get(vreq.model)
        engine = served.engine
        window = engine.max_model_len
        prompts = await self._prompt_ids(data, engine.tokenizer)
        lengths = _window_check(vreq, prompts, window)  # vLLM's 400s for what does not fit the window
        n = int(vreq.n or 1)
        fields = vreq.__dict__  # (reading max_tokens as an attribute warns it is deprecated)
        key = "max_completion_tokens" if self.chat and fields.get("max_completion_tokens") is not None \
            else "max_tokens"
        sent = fields.get(key)
        asked = sent
        context_limit = self._context_limit(principal, run_id)
        if asked is None and context_limit is not None and context_limit < window and lengths:
            # what the in-process path sets (OpenAILayer.plan): the ceiling the quota's limit leaves
            asked = max(1, min(context_limit - p for p in lengths))
        _sampling_check(vreq, window, asked, lengths)  # vLLM's 400s for the sampling parameters
        ceilings = [self._ceiling(asked, p, window) for p in lengths]
        forwarded = data
        cap = min(asked, max(ceilings)) if asked is not None and ceilings else sent
        if cap != sent:
            # never more than what is reserved: the ceiling vLLM itself would clamp max_tokens to
            # (get_max_tokens), or the quota's limit's (see the module docstring, step 3)
            forwarded = {**forwarded, key: cap}
        if strip_usage:  # (see the module docstring, step 3)
            options = data.get("stream_options")
            forwarded = {**forwarded, "stream_options": {**(options if isinstance(options, dict) else {}),
                                                         "include_usage": True}}
        body = json.dumps(forwarded, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        input_tokens = sum(lengths)
        tools = getattr(vreq, "tools", None) if self.chat else None
        names = tuple(t.function.name for t in tools) if tools else ()
        payload = _Payload(body, strip_usage, input_tokens, single_prompt=len(prompts) == 1,
                           choices=n * len(prompts))
        agents = self.gw.agents
        if names and agents is not None and agents.can_withhold(principal):
            payload.emitted = EmittedToolCalls(agents, principal, run_id)
        blocks = prefix_block_hashes(prompts[0]) if isinstance(engine, EnginePool) and prompts else ()
        seq_in, seq_out = max(zip(lengths, ceilings, strict=True), key=sum, default=(0, 0))
        return Prepared(stream=stream, input_tokens=input_tokens, output_tokens=n * sum(ceilings), payload=payload,
                        tool_names=names, prompts=tuple(prompts) if run_id and all(prompts) else (),
                        prefix_blocks=blocks, sequence=TokenCounts(input_tokens=seq_in, output_tokens=seq_out),
                        served=served)

    @staticmethod
    def _ceiling(asked: int | None, prompt_tokens: int, window: int) -> int:
        """One prompt's output ceiling, as vLLM's ``get_max_tokens`` computes it: ``max_tokens``
        up to what the model's ``window`` leaves; without it, what the window leaves (at least 1)."""
        room = max(1, window - prompt_tokens)
        if asked is None:
            return room
        return min(max(0, asked), room)

    async def _prompt_ids(self, data: dict, tokenizer: Tokenizer) -> list[list[int]]:
        """kvmeter's token ids of each prompt (one for a chat) with the model's ``tokenizer``, for
        the estimate."""
        if self.chat:
            messages = data.get("messages") or []
            tools = data.get("tools")
            size = sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict))
            return [await self._tokenize(size, lambda: chat_prompt_ids(tokenizer, messages, tools))]
        prompt = data.get("prompt")
        if isinstance(prompt, str):
            return [await self._tokenize(len(prompt), lambda: tokenizer.encode(prompt, add_special_tokens=True))]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt:
            out: list[list[int]] = []
            for p in prompt:
                if isinstance(p, str):
                    out.append(await self._tokenize(len(p), lambda t=p: tokenizer.encode(t, add_special_tokens=True)))
                else:
                    out.append([t for t in p if isinstance(t, int)] if isinstance(p, list) else [])
            return out
        return [[]]  # prompt_embeds, or none (vLLM's answer decides)

    async def _tokenize(self, size: int, call: Any) -> list[int]:
        if size > self.gw.settings.tokenize_in_thread_chars:
            return await anyio.to_thread.run_sync(call)
        return call()

    # -- step 7 ----------------------------------------------------------------------------------
    async def _run(self, request: Request, adm: Admitted, headers: dict[str, str]) -> Response:
        payload: _Payload = adm.prepared.payload
        tokenizer = adm.engine(self.gw).tokenizer
        reader = AnswerReader(lambda text: len(tokenizer.encode(text)), payload.input_tokens,
                              single_prompt=payload.single_prompt)
        answered = False  # the upstream accepted the request (a 200): its counts bill

        def source() -> None:  # the event's token_source and each choice's finish reason, on every exit path
            adm.meter.token_source = "estimate" if answered and not reader.exact() else "frontend"
            # as the upstream answered them (tool_calls included), one per choice (traces)
            adm.meter.choice_finish_reasons = tuple(reader.finish_reasons.get(i) for i in range(payload.choices))

        adm.before_finish = source
        send_headers = {"content-type": "application/json",
                        "x-request-id": request.headers.get("x-request-id") or adm.meter.identity.request_id,
                        # the tier's engine priority, the scheduler's grant (see the module docstring)
                        self.priority_header: str(adm.grant.priority if adm.grant is not None else 0)}
        try:
            resp = await self._until_disconnect(request, self._open(adm, payload.body, send_headers), adm)
        except ClientGone:
            await self._finalize(adm, "aborted", status_code=499, finish_reason="abort")
            await self._settle_idempotency(adm, None)
            return Response(status_code=499)
        except EngineError as exc:
            return await self._upstream_failed(adm, exc, headers)
        if resp.status_code != 200:
            return await self._upstream_refused(request, adm, resp, headers)
        answered = True
        out_headers = _upstream_headers(resp, headers)
        if adm.prepared.stream and resp.headers.get("content-type", "").startswith("text/event-stream"):
            view = ClientView(payload.strip_usage, self.fingerprint)

            async def on_close() -> None:
                with anyio.CancelScope(shield=True):
                    await resp.aclose()
                await self._close_unfinished(adm)

            events = self._relay(adm, resp, reader, view, out_headers)
            return self.streaming_response(events, adm, out_headers, on_close)
        return await self._complete(request, adm, resp, reader, out_headers)

    async def _open(self, adm: Admitted, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """Send the request upstream: to the remote engine, or to the replica of an engine pool
        that the scheduler's grant names — and, when that replica cannot be reached (nothing was
        done there), to another one the scheduler moves the grant to (``failover``), until one
        answers or none is left (:mod:`kvmeter.serving.engines.pool`)."""
        engine = adm.engine(self.gw)
        if not isinstance(engine, EnginePool):
            # the app serves this path for the remote engines only
            return await cast(RemoteEngine, engine).open(self.path, body, headers)
        grant = adm.grant
        while True:
            replica = grant.engine_idx if grant is not None else 0
            try:
                return await engine.open(self.path, body, headers, replica=replica)
            except EngineError as exc:
                moved = adm.scheduler(self.gw).reroute(grant) if exc.retryable and grant is not None else None
                if moved is None:
                    raise
                log.warning("request %s: %s; failing over to %s", adm.meter.identity.request_id, exc,
                            engine.names[moved])

    def _replica_name(self, adm: Admitted) -> str:
        """The engine pool's replica the request runs on (its URL), or "" without a pool."""
        engine = adm.engine(self.gw)
        if isinstance(engine, EnginePool) and adm.grant is not None:
            return engine.names[adm.grant.engine_idx]
        return ""

    def _progress(self, adm: Admitted, reader: AnswerReader, finished: bool = False) -> None:
        """The meter (and the scheduler's charge) follow the reader's counts (until the event is built)."""
        if adm.finalized is not None:
            return
        tokens = reader.tokens()
        new = adm.meter.on_output(EngineOutput(
            new_token_ids=(), new_text="", num_output_tokens=tokens.output_tokens,
            num_input_tokens=tokens.input_tokens, num_cached_input_tokens=tokens.cached_input_tokens,
            finished=finished, finish_reason=(reader.finish_reason() or "stop") if finished else None))
        adm.meter.reasoning_tokens = tokens.reasoning_tokens
        if new and adm.grant is not None:
            adm.scheduler(self.gw).charge_output(adm.grant, new)

    async def _complete(self, request: Request, adm: Admitted, resp: httpx.Response, reader: AnswerReader,
                        headers: dict[str, str]) -> Response:
        try:
            raw = await self._until_disconnect(request, resp.aread(), adm)
        except ClientGone:
            return await self._client_left_before_the_answer(adm, resp)
        except httpx.HTTPError as exc:
            await resp.aclose()
            broke = EngineError(f"the upstream's answer broke off ({type(exc).__name__}: {exc})")
            return await self._upstream_failed(adm, broke, headers)
        body = _parse(raw)
        if not isinstance(body, dict):
            return await self._upstream_failed(adm, EngineError("the upstream answered 200 with a body that is not "
                                                                "a JSON object"), headers)
        reader.on_answer(body)
        if isinstance(body.get("id"), str):
            adm.meter.response_id = body["id"]  # the upstream's answer id (traces' gen_ai.response.id)
        if isinstance(body.get("system_fingerprint"), str):
            self.fingerprint = body["system_fingerprint"]
        self._progress(adm, reader, finished=True)
        await self._finalize(adm, "ok", status_code=200)
        gate = adm.prepared.payload.emitted
        if gate is not None and any((c.get("message") or {}).get("tool_calls") for c in body.get("choices") or ()
                                    if isinstance(c, dict)):
            raw = json.dumps(await gate.response(body), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        response = Response(raw, status_code=200, headers=headers)
        await self._settle_idempotency(adm, StoredResponse(200, stored_headers(headers), raw))
        return response

    async def _relay(self, adm: Admitted, resp: httpx.Response, reader: AnswerReader, view: ClientView,
                     headers: dict[str, str]) -> AsyncGenerator[bytes, None]:
        """The upstream's events to the client (through ``view``, and the emitted-tool-call gate
        when there is one), metered as they pass; the usage event is made durable before the
        client gets ``[DONE]`` or the final usage chunk."""
        payload: _Payload = adm.prepared.payload
        sent: list[bytes] | None = [] if adm.ticket is not None else None
        completed = False
        upstream = self._client_events(adm, resp, reader, view)
        events = upstream if payload.emitted is None else self._gated(payload.emitted, upstream)
        try:
            async for data in events:
                if sent is not None:
                    sent.append(data)
                yield data
            completed = adm.finalized is not None and adm.finalized.outcome == "ok"
            if completed and sent is not None:
                await self._settle_idempotency(adm, StoredResponse(200, stored_headers(headers), b"".join(sent),
                                                                   streamed=True))
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()
                if events is not upstream:
                    await upstream.aclose()
                await resp.aclose()  # the client left: a vLLM upstream aborts the request
            await self._finalize(adm, "aborted", status_code=200, finish_reason="abort")
            if not completed:
                await self._settle_idempotency(adm, None)  # a truncated stream is never replayed

    @staticmethod
    async def _gated(gate: EmittedToolCalls, events: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        async def texts() -> AsyncGenerator[str, None]:
            async for data in events:
                yield data.decode("utf-8")

        async with aclosing(gate.stream(texts())) as gated:
            async for text in gated:
                yield text.encode("utf-8")

    async def _client_events(self, adm: Admitted, resp: httpx.Response, reader: AnswerReader,
                             view: ClientView) -> AsyncGenerator[bytes, None]:
        payload: _Payload = adm.prepared.payload
        broke: str | None = None
        try:
            async with aclosing(_sse_events(resp)) as upstream:
                async for raw, data in upstream:
                    reader.on_event(data)
                    if not adm.meter.response_id and isinstance(data, dict) and isinstance(data.get("id"), str):
                        adm.meter.response_id = data["id"]  # the upstream's answer id (traces)
                    if data == DONE or (isinstance(data, dict) and not data.get("choices") and reader.final is not None
                                        and reader.all_finished(payload.choices)):
                        await self._end(adm, reader)  # durable before [DONE] / the usage chunk leaves
                    elif isinstance(data, dict):
                        self._progress(adm, reader)
                    for out in view.event(raw, data):
                        yield out
                    self.fingerprint = view.fingerprint
                    if data == DONE:
                        return
        except httpx.HTTPError as exc:
            broke = f"the upstream's stream broke off ({type(exc).__name__}: {exc})"
            replica = self._replica_name(adm)
            if replica:  # a replica of a pool whose connection broke: down until it answers again
                broke = f"replica {replica}: {broke}"
                cast(EnginePool, adm.engine(self.gw)).mark_down(replica, broke)
        if broke is None:
            broke = "the upstream's stream ended before [DONE]"
        log.error("request %s: %s", adm.meter.identity.request_id, broke)
        self._progress(adm, reader)
        await self._finalize(adm, "error", status_code=200, finish_reason="error")
        for out in view.release():
            yield out
        yield b"data: " + orjson.dumps(ApiError(502, broke, code="upstream_error").body()) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def _end(self, adm: Admitted, reader: AnswerReader) -> None:
        """The stream's end (``[DONE]``, or the final usage chunk once every choice finished)."""
        if adm.finalized is not None:
            return
        if reader.error is not None:  # the upstream's own error event: forwarded, billed what ran
            self._progress(adm, reader)
            await self._finalize(adm, "error", status_code=200, finish_reason="error")
            return
        self._progress(adm, reader, finished=True)
        await self._finalize(adm, "ok", status_code=200)

    # -- failures ------------------------------------------------------------------------------------
    async def _client_left_before_the_answer(self, adm: Admitted, resp: httpx.Response) -> Response:
        """The client went away while the upstream's whole answer was being read: close the upstream
        response, record the attempt as aborted (499) and settle its idempotency key as unanswered."""
        with anyio.CancelScope(shield=True):
            await resp.aclose()
        await self._finalize(adm, "aborted", status_code=499, finish_reason="abort")
        await self._settle_idempotency(adm, None)
        return Response(status_code=499)

    async def _upstream_refused(self, request: Request, adm: Admitted, resp: httpx.Response,
                                headers: dict[str, str]) -> Response:
        """A non-200 answer: a 4xx goes to the client as it is; a 5xx is a 502."""
        try:
            raw = await self._until_disconnect(request, resp.aread(), adm)
        except ClientGone:
            return await self._client_left_before_the_answer(adm, resp)
        except httpx.HTTPError:
            raw = b""
        finally:
            await resp.aclose()
        if resp.status_code >= 500:
            body = _parse(raw)
            err = body.get("error") if isinstance(body, dict) else None
            said = err.get("message") if isinstance(err, dict) else raw[:200].decode("utf-8", "replace")
            return await self._upstream_failed(adm, EngineError(f"the upstream answered {resp.status_code}: {said}"),
                                               headers)
        await self._finalize(adm, "error", status_code=resp.status_code, finish_reason="error")
        await self._settle_idempotency(adm, None)
        return Response(raw, status_code=resp.status_code, headers=_upstream_headers(resp, headers))

    async def _upstream_failed(self, adm: Admitted, exc: EngineError, headers: dict[str, str]) -> Response:
        """No usable answer: 503 when the upstream could not be reached (retry), else 502."""
        status = 503 if exc.retryable else 502
        log.error("request %s: %s", adm.meter.identity.request_id, exc)
        await self._finalize(adm, "error", status_code=status, finish_reason="error")
        await self._settle_idempotency(adm, None)
        return error_response(ApiError(status, str(exc), code="upstream_error"), headers)
