"""The protocol's part of a request on the in-process engines: vLLM's OpenAI serving layer.

:class:`OpenAIEndpoint` gives the orchestrator (:class:`~kvmeter.serving.gateway.handler.CompletionEndpoint`)
the steps vLLM's layer does (:mod:`kvmeter.serving.openai_api.layer`): the body validated into
vLLM's request model, the model checked, the prompt rendered once, the output ceilings and the
estimate; then, once admitted and dispatched, ``create_chat_completion`` / ``create_completion``
with the request bound to kvmeter's metered engine client
(:class:`~kvmeter.serving.openai_api.engine_client.BoundRequest`), which meters every
``RequestOutput`` and makes the usage event durable before vLLM's layer sends the usage chunk,
``[DONE]`` or the JSON response.

Under agent runs (the gateway holds ``agents``), a chat request that declares ``tools`` has its
tool calls decided before they reach the client (:mod:`kvmeter.serving.gateway.emitted`: a
blocked or high-risk call is withheld and a refusal or "pending approval" sentence put in its
place); the declared tools and the run's model call are checked at admission by the orchestrator.

Errors vLLM's server would also answer are answered as it does (its body, its status); kvmeter's
own refusals (authentication, body limits, quota, scheduler, idempotency, an engine failure:
503 ``engine_error``, retryable) keep kvmeter's. ``X-Request-Id`` follows vLLM: the response id
is built from the client's header (``chatcmpl-<X-Request-Id>``), and with
``enable_request_id_headers`` (the default) every answer carries ``X-Request-Id`` — the client's,
else kvmeter's request id; kvmeter's own id is always in ``x-kvmeter-request-id``, and the engine
request ids derive from it, so they stay unique when clients reuse an ``X-Request-Id``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncGenerator, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvmeter.errors import Refusal
from kvmeter.serving.engines.base import EngineError
from kvmeter.serving.engines.vllm_engine import STATS_WAIT_S
from kvmeter.serving.gateway.emitted import EmittedToolCalls
from kvmeter.serving.gateway.errors import ApiError, error_response
from kvmeter.serving.gateway.handler import (REQUEST_ID_HEADER, Admitted, ClientGone, CompletionEndpoint,
                                             Prepared)
from kvmeter.serving.gateway.replays import stored_headers
from kvmeter.serving.openai_api.engine_client import BoundRequest
from kvmeter.serving.openai_api.errors import from_error_response, from_exception, invalid_body
from kvmeter.serving.quota.idempotency import StoredResponse
from kvmeter.serving.tenancy import Principal
from kvmeter.tokens import TokenCounts

__all__ = ["OpenAIEndpoint"]

log = logging.getLogger(__name__)


class _Payload:
    """The vLLM request, its render and its plan, from admission to the answer."""

    __slots__ = ("layer", "request", "rendered", "plan", "emitted")

    def __init__(self, layer: Any, request: Any, rendered: Any, plan: Any) -> None:
        self.layer = layer
        self.request = request
        self.rendered = rendered
        self.plan = plan
        #: the emitted-tool-call gate (a chat request that declares tools, under agent runs)
        self.emitted: EmittedToolCalls | None = None


def _engine_failure(exc: BaseException) -> bool:
    """Did the engine fail the request (kvmeter's engine error, or vLLM's engine errors)?"""
    if isinstance(exc, EngineError):
        return True
    return type(exc).__name__ in ("EngineGenerateError", "EngineDeadError")


def _finish_reasons(choices: Any) -> dict[int, str]:
    """Choice index → ``finish_reason`` of an answer's (or chunk's) ``choices``, where one is set."""
    out: dict[int, str] = {}
    for c in choices if isinstance(choices, list) else ():
        if isinstance(c, dict) and isinstance(c.get("finish_reason"), str) and isinstance(c.get("index"), int):
            out[c["index"]] = c["finish_reason"]
    return out


def _event_finish_reasons(event: str) -> dict[int, str]:
    """The finish reasons in one of vLLM's SSE strings (``data: <chunk>``...); {} when none."""
    out: dict[int, str] = {}
    for line in event.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            try:
                chunk = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(chunk, dict):
                out.update(_finish_reasons(chunk.get("choices")))
    return out


class OpenAIEndpoint(CompletionEndpoint):
    """``/v1/chat/completions`` or ``/v1/completions`` through vLLM's serving layer."""

    def _id_headers(self, request: Request, request_id: str) -> dict[str, str]:
        headers = {REQUEST_ID_HEADER: request_id}
        if self.gw.openai.request_id_headers:  # vLLM's XRequestIdMiddleware: the client's, else new
            headers["x-request-id"] = request.headers.get("x-request-id", request_id)
        return headers

    def _body_refusal(self, err: ApiError) -> Refusal:
        return invalid_body(err.message, getattr(err, "loc", ("body",)))

    # -- steps 2–4 -----------------------------------------------------------------------------
    async def _prepare(self, request: Request, data: dict, principal: Principal, run_id: str) -> Prepared:
        layer = await self.gw.openai.layer()
        vreq = layer.validate(data, self.chat)
        rendered = await layer.render(vreq, self.chat)
        plan = layer.plan(vreq, rendered, self.chat, self._context_limit(principal, run_id))
        tools = getattr(vreq, "tools", None) if self.chat else None
        names = tuple(t.function.name for t in tools) if tools else ()
        prompts: tuple = ()
        if (run_id and self.gw.agents is not None) or self.gw.reprefill is not None:
            # the repeated-prompt stop's input, and the re-prefill tracker's
            ids = [ei.get("prompt_token_ids") for ei in layer.engine_inputs(rendered, self.chat)]
            prompts = tuple(ids) if all(ids) else ()
        payload = _Payload(layer, vreq, rendered, plan)
        # the model may emit calls: each is decided, when the key's policy could withhold one (else
        # vLLM's answer and stream pass through untouched, as vLLM's own server sends them)
        if names and self.gw.agents is not None and self.gw.agents.can_withhold(principal):
            payload.emitted = EmittedToolCalls(self.gw.agents, principal, run_id)
        seq_in, seq_out = plan.longest_sequence
        return Prepared(stream=bool(vreq.stream), input_tokens=plan.total_input_tokens,
                        output_tokens=plan.total_output_tokens, payload=payload, tool_names=names,
                        prompts=prompts, sequence=TokenCounts(input_tokens=seq_in, output_tokens=seq_out))

    # -- step 7 ----------------------------------------------------------------------------------
    async def _run(self, request: Request, adm: Admitted, headers: dict[str, str]) -> Response:
        gw = self.gw
        payload: _Payload = adm.prepared.payload
        grant = adm.grant
        scheduler = gw.scheduler

        def charge(new: int) -> None:
            if grant is not None:  # as on the remote path: only a dispatched request is charged
                scheduler.charge_output(grant, new)

        bound = BoundRequest(
            request_id=adm.meter.identity.request_id, engine_inputs=len(payload.plan.input_tokens),
            meter=adm.meter, charge=charge,
            priority=grant.priority if grant is not None else 0,
            finished=getattr(gw.engine, "finished", None), publish=gw.bus.publish,
            on_done=lambda outcome: self._finalize(adm, outcome, status_code=200),
            reasoning=payload.layer.reasoning_counter(payload.request, self.chat),
            stats_wait_s=STATS_WAIT_S, request=payload.request, rendered=payload.rendered,
            started=adm.engine_ids, attribution=adm.meter.identity.attribution)
        meter = adm.meter

        def before_finish() -> None:  # the protocol's last counts, just before the usage event is built
            bound.count_reasoning()
            meter.choice_finish_reasons = bound.finish_reasons()
            # the answer's id, as vLLM's layer built it (chatcmpl-/cmpl-...) and left it on the request
            meter.response_id = str(getattr(getattr(request.state, "request_metadata", None), "request_id", "") or "")

        adm.before_finish = before_finish
        # vLLM's layer decides a choice's tool_calls finish (its tool parser, tool_choice) after the
        # engine's last output, so after the usage event: the trace's RequestCompletion waits for
        # the answer's finish reasons (published by the answer's end, or below)
        adm.hold_completion = self.chat and bool(getattr(payload.request, "tools", None))
        work = payload.layer.create(payload.request, request, self.chat)
        bound.bind()  # the engine calls vLLM's layer makes inside create() are this request's
        response: Response | None = None
        try:
            if adm.prepared.stream:
                response = await self._stream(payload, bound, adm, headers, work)
            else:
                response = await self._complete(request, payload, bound, adm, headers, work)
            return response
        finally:
            bound.unbind()
            if not isinstance(response, StreamingResponse):  # a stream publishes it as it ends (_events)
                self._publish_completion(adm)

    async def _complete(self, request: Request, payload: _Payload, bound: BoundRequest, adm: Admitted,
                        headers: dict[str, str], work: Any) -> Response:
        try:
            result = await self._until_disconnect(request, work, adm)
        except ClientGone:
            await bound.aclose()
            await self._finalize(adm, "aborted", status_code=499, finish_reason="abort")
            await self._settle_idempotency(adm, None)
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 — answered as vLLM (or kvmeter, for the engine) does
            await bound.aclose()
            return await self._failed(adm, exc, headers, bound)
        layer = payload.layer
        if layer.is_error(result):
            await bound.aclose()
            return await self._refused_late(adm, from_error_response(result), headers, bound)
        if not hasattr(result, "model_dump_json"):  # a stream where none was asked for: not expected
            return await self._failed(adm, TypeError(f"unexpected answer {type(result).__name__}"), headers)
        await self._finalize(adm, "ok", status_code=200)  # normally done already, by the engine client
        body = result.model_dump_json()
        gate = payload.emitted
        answered = {c.index: c.finish_reason for c in result.choices if c.finish_reason}
        if gate is not None and any(getattr(c.message, "tool_calls", None) for c in result.choices):
            gated = await gate.response(json.loads(body))
            answered = _finish_reasons(gated.get("choices"))
            body = json.dumps(gated, ensure_ascii=False, separators=(",", ":"))
        self._publish_completion(adm, answered)
        response = Response(body, media_type="application/json", headers=headers)
        await self._settle_idempotency(adm, StoredResponse(
            200, stored_headers({**headers, "content-type": "application/json"}), bytes(response.body)))
        return response

    async def _stream(self, payload: _Payload, bound: BoundRequest, adm: Admitted, headers: dict[str, str],
                      work: Any) -> Response:
        try:
            result = await work  # the stream's generator: nothing has run on the engine yet
        except Exception as exc:  # noqa: BLE001
            await bound.aclose()
            return await self._failed(adm, exc, headers, bound)
        if payload.layer.is_error(result):
            return await self._refused_late(adm, from_error_response(result), headers, bound)

        async def on_close() -> None:
            await bound.aclose()
            await self._close_unfinished(adm)
            self._publish_completion(adm)  # (a stream that never started: else a no-op)

        if payload.emitted is not None:  # tool-call deltas held until decided (emitted.py)
            result = payload.emitted.stream(result)
        return self.streaming_response(self._events(adm, bound, result, headers), adm, headers, on_close)

    async def _events(self, adm: Admitted, bound: BoundRequest, events: AsyncIterator[str],
                      headers: dict[str, str]) -> AsyncGenerator[bytes, None]:
        """vLLM's SSE strings as bytes (kept for an idempotent replay); the usage event is made
        durable by the engine client before vLLM's layer yields the usage chunk and ``[DONE]``."""
        sent: list[bytes] | None = [] if adm.ticket is not None else None
        completed = False
        answered: dict[int, str] = {}  # each choice's finish_reason as the stream sends it
        try:
            async for event in events:
                if adm.hold_completion and '"finish_reason":"' in event:
                    answered.update(_event_finish_reasons(event))
                data = event.encode("utf-8")
                if sent is not None:
                    sent.append(data)
                yield data
            finalized = adm.finalized
            if finalized is None and bound.refused is not None and bound.unrun:
                # the engine refused it before running it: vLLM's layer sent the error event after
                # the 200 (as vLLM's own server does); a client error, as a refusal before admission
                await self._refused_unrun(adm, from_exception(bound.refused))
            elif finalized is None:  # vLLM's layer ended the stream with an error event
                if bound.failed is not None:
                    log.error("engine failed %s mid-stream: %s", adm.meter.identity.request_id, bound.failed)
                finalized = await self._finalize(adm, "error", status_code=200, finish_reason="error")
            completed = finalized is not None and finalized.outcome == "ok" and bound.failed is None
            if completed and sent is not None:
                await self._settle_idempotency(adm, StoredResponse(
                    200, stored_headers(headers), b"".join(sent), streamed=True))
        finally:
            # Closing vLLM's generator does not close the engine calls it iterates: the bound
            # request closes them, which aborts any engine request still running (the client left).
            await bound.aclose()
            await self._finalize(adm, "aborted", status_code=200, finish_reason="abort")
            self._publish_completion(adm, answered)
            if not completed:
                await self._settle_idempotency(adm, None)  # a truncated stream is never replayed

    # -- failures after admission -------------------------------------------------------------------
    async def _failed(self, adm: Admitted, exc: BaseException, headers: dict[str, str],
                      bound: BoundRequest | None = None) -> Response:
        """The engine or vLLM's layer failed an admitted request: bill what ran, answer. One the
        engine refused before running it (``bound.unrun``) is answered vLLM's 4xx at once and
        recorded as a client refusal (:meth:`_refused_unrun`)."""
        if _engine_failure(exc):
            retryable = getattr(exc, "retryable", True)
            log.error("engine failed %s: %s", adm.meter.identity.request_id, exc)
            status = 503 if retryable else 500
            await self._finalize(adm, "error", status_code=status, finish_reason="error")
            await self._settle_idempotency(adm, None)
            return error_response(ApiError(status, "the engine failed this request; retry", code="engine_error"),
                                  headers)
        err = from_exception(exc)
        if err.status_code >= 500:
            log.error("vLLM's serving layer failed %s: %s: %s", adm.meter.identity.request_id,
                      type(exc).__name__, exc)
        return await self._refused_late(adm, err, headers, bound)

    async def _refused_late(self, adm: Admitted, err: Refusal, headers: dict[str, str],
                            bound: BoundRequest | None = None) -> Response:
        """vLLM's layer answered an error after admission: finalized as an error (what the
        engine did, if anything, is billed), the reservation reconciled, the answer vLLM's —
        unless the engine refused every engine request of it before running them (vLLM's input
        processor, ``bound.unrun``): then a client refusal (:meth:`_refused_unrun`), no engine
        account awaited, nothing billed."""
        if bound is not None and bound.refused is not None and bound.unrun and err.status_code < 500:
            await self._refused_unrun(adm, err)
            return error_response(err, headers)
        if adm.finalized is not None and adm.finalized.outcome == "ok":
            log.warning("request %s: the engine finished but vLLM's layer answered %d: %s",
                        adm.meter.identity.request_id, err.status_code, err.message)
        await self._finalize(adm, "error", status_code=err.status_code, finish_reason="error")
        await self._settle_idempotency(adm, None)
        return error_response(err, headers)
