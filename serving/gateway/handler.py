"""One request's life in the gateway: authenticate → parse → tokenize → admit → schedule →
generate → meter → record → reconcile.

The steps, in order, and what each can answer:

1. authenticate the API key ......................................... 401
   (Idempotency-Key / X-Agent-Run-Id sent twice with different values: 400)
2. read the body (media type, size cap, time limit, UTF-8, JSON object)
   and validate it .................................................... 400 / 408 / 413 / 415
   (a client that leaves mid-body: 499 in the attempt record, nothing sent)
3. check the model and tokenize with the model's chat template ........ 404 / 400
4. check the context window (prompt + max_tokens) ..................... 400 context_length_exceeded
5. reserve quota on every level and dimension (all or nothing) ....... 429 / 402 / 400 (quota)
6. ask the scheduler (early rejection, then wait for dispatch) ........ 429 + Retry-After
7. run on the engine, streaming or not; a client that goes away aborts the engine request
8. meter: one usage event per logical request, durable in the ledger's spool *before* the
   response completes (for a stream: before the usage chunk and ``[DONE]``)
9. reconcile the reservation to engine-true counts; release the scheduler slot.

Nothing is billed for a request rejected in steps 1–6, and every failure there is answered before
the engine is touched. A refusal in steps 1–4 is published as a
:class:`~kvmeter.stats.RequestRefused`; one in steps 5–6 as an
:class:`~kvmeter.stats.AdmissionDecision`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.errors import Refusal
from kvmeter.events import UsageEvent
from kvmeter.serving.engines.base import Engine, EngineError, EngineOutput, EngineRequest
from kvmeter.serving.gateway.body import CLIENT_CLOSED, read_json_object, single_header
from kvmeter.serving.gateway.errors import ApiError, api_error, error_response
from kvmeter.serving.gateway.metering import RequestIdentity, RequestMeter
from kvmeter.serving.gateway.protocol import (ChatCompletionRequest, CompletionRequest,
                                              parse_request, usage_block)
from kvmeter.ledger.records import AttemptRecord
from kvmeter.serving.gateway.replays import fingerprint, replay_response, stored_headers
from kvmeter.serving.quota.base import QuotaGate, QuotaRejected, Reservation, UsageEstimate
from kvmeter.serving.quota.gate import MAX_RUN_ID_CHARS
from kvmeter.serving.quota.idempotency import (MAX_KEY_CHARS, IdempotencyManager,
                                               IdempotencyTicket, StoredResponse)
from kvmeter.serving.scheduler.base import Grant, Job, Scheduler, SchedulerRejected
from kvmeter.serving.tenancy import DEFAULT_TIERS, Authenticator, Principal, TierPolicy
from kvmeter.stats import AdmissionDecision, RequestRefused
from kvmeter.tokens import NO_TOKENS, TokenCounts

__all__ = ["Gateway", "GatewaySettings", "UsageRecorder", "CompletionEndpoint"]

log = logging.getLogger(__name__)


class UsageRecorder(Protocol):
    """Where usage events and attempts go (the ledger). Both return once the record is durable."""

    async def record(self, event: UsageEvent) -> None: ...

    async def record_attempt(self, attempt: AttemptRecord) -> None: ...


@dataclass(slots=True)
class GatewaySettings:
    """Gateway limits.

    Attributes:
        max_body_bytes: largest request body accepted (413 above it).
        body_read_timeout_s: longest a request body may take to arrive once the gateway starts
            reading it (seconds, > 0; 408 ``request_timeout`` after it; None: no limit).
        tokenize_in_thread_chars: prompts longer than this (characters) are tokenized in a worker
            thread so the event loop keeps serving streams.
    Raises:
        ValueError: for ``max_body_bytes`` < 1 or ``body_read_timeout_s`` ≤ 0.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    body_read_timeout_s: float | None = 30.0
    tokenize_in_thread_chars: int = 16_384

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.body_read_timeout_s is not None and not self.body_read_timeout_s > 0:
            raise ValueError(f"body_read_timeout_s must be > 0 (or None), got {self.body_read_timeout_s}")


@dataclass(slots=True)
class Gateway:
    """Everything a request needs, wired once by the serve command (or a test).

    ``tier_policy`` gives the :class:`~kvmeter.serving.tenancy.TierPolicy` of a tier name (or
    ``None`` for an unknown one): its deadline rule sets the deadline of the scheduler ``Job``
    and its SLOs the usage event's ``slo_met``. ``kvmeter serve`` passes the tenant directory's
    (the tenants config's tiers, live across reloads); the default is the built-in tiers.
    """

    engine: Engine
    authenticator: Authenticator
    quota: QuotaGate
    scheduler: Scheduler
    recorder: UsageRecorder
    bus: StatsBus = field(default_factory=StatsBus)
    clock: Clock = SYSTEM_CLOCK
    settings: GatewaySettings = field(default_factory=GatewaySettings)
    tier_policy: Callable[[str], TierPolicy | None] = DEFAULT_TIERS.get
    idempotency: IdempotencyManager | None = None

    def authenticate(self, request: Request) -> Principal:
        """Principal of the request's ``Authorization: Bearer`` key (or ``x-api-key``).

        Raises:
            Refusal: :class:`~kvmeter.serving.tenancy.AuthError` (401) for a missing or unknown key
                (the key never appears in the message); :class:`ApiError` 401 for a malformed
                ``Authorization`` header, 400 when ``Authorization`` or ``x-api-key`` is sent more
                than once with different values (picking one could bill the request to the wrong
                tenant).
        """
        header = single_header(request, "authorization", "Authorization", code="invalid_api_key")
        key: str | None = None
        if header:
            scheme, _, value = header.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise ApiError(401, "Authorization header must be 'Bearer <API key>'",
                               code="invalid_api_key")
            key = value.strip()
        else:
            key = single_header(request, "x-api-key", "x-api-key", code="invalid_api_key") or None
        return self.authenticator.authenticate(key)

    def refused(self, err: Refusal, endpoint: str, principal: Principal | None = None) -> None:
        """Publish the refusal ``err`` of a request that got no admission decision (see
        :class:`~kvmeter.stats.RequestRefused`; ``endpoint`` is one of its
        ``REFUSAL_ENDPOINTS``)."""
        self.bus.publish(RequestRefused(
            status_code=err.status_code, code=err.code or "", endpoint=endpoint,
            attribution=principal.attribution(endpoint=endpoint) if principal is not None else None,
            wall_ts=self.clock.wall()))


class _ClientGone(Exception):
    """The client disconnected before the response was ready."""


class _Replay(Exception):
    """Answer from an earlier attempt of the same Idempotency-Key."""

    def __init__(self, ticket: IdempotencyTicket) -> None:
        super().__init__("idempotent replay")
        self.ticket = ticket


@dataclass(slots=True)
class _Seen:
    """What the request revealed before it failed or was admitted (for the attempt record)."""

    principal: Principal | None = None
    idempotency_key: str = ""
    agent_run_id: str = ""
    attribution: Attribution | None = None  # built once the run id header is read
    decided: bool = False  # an AdmissionDecision was published (quota or scheduler refusal)


def _bounded(value: str, max_chars: int) -> str:
    """A client-chosen header value as the attempt record keeps it: unchanged when it is within
    ``max_chars`` (the longest the gateway accepts), else ``sha256:<64 hex>`` — the request was
    refused for it, the digest still groups its retries, and the ledger's string limit (4,096
    characters) is never exceeded."""
    if len(value) <= max_chars:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client that disconnects
    aborts the engine request at once rather than whenever the generator is garbage-collected,
    then runs ``on_close``: closing a generator that never started does not run its ``finally``
    (the client left before the first chunk was asked for), so the request is finalized there."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.body_iterator.aclose()  # type: ignore[union-attr]
                finally:
                    await self._on_close()


@dataclass(slots=True)
class _Admitted:
    """State of an admitted request, carried from admission to finalization."""

    principal: Principal
    body: ChatCompletionRequest | CompletionRequest
    engine_request: EngineRequest
    meter: RequestMeter
    reservation: Reservation
    ticket: IdempotencyTicket | None = None
    grant: Grant | None = None
    finalized: UsageEvent | None = None
    ticket_settled: bool = False
    watch: asyncio.Task | None = None  # the client-disconnect watcher, one per request
    attempt_write: asyncio.Future | None = None  # the admitted attempt's ledger write


class CompletionEndpoint:
    """The ASGI endpoint for ``/v1/chat/completions`` (``chat=True``) or ``/v1/completions``."""

    def __init__(self, gateway: Gateway, *, chat: bool) -> None:
        self.gw = gateway
        self.chat = chat
        self.endpoint = "chat.completions" if chat else "completions"
        self._kind = ChatCompletionRequest if chat else CompletionRequest

    # ------------------------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        clock = self.gw.clock
        arrival = (clock.monotonic(), clock.wall())
        request_id = f"kvm-{uuid.uuid4().hex}"
        rid_header = {"x-request-id": request_id}
        seen = _Seen()
        try:
            admitted = await self._admit(request, request_id, arrival, seen)
        except Refusal as refusal:
            err = api_error(refusal)
            if err.status == CLIENT_CLOSED:  # left mid-body: nobody to answer, nothing ran
                log.info("request %s: %s", request_id, err.message)
                await self._attempt(seen, request_id, err, status="error")
                return Response(status_code=CLIENT_CLOSED)
            if not seen.decided:
                self.gw.refused(err, self.endpoint, seen.principal)
            await self._attempt(seen, request_id, err)
            return error_response(err, rid_header)
        except _Replay as replay:
            await self._attempt(seen, request_id, None, status="replayed", attempt=replay.ticket.attempt)
            try:
                return replay_response(replay.ticket)
            except ApiError as unreplayable:
                self.gw.refused(unreplayable, self.endpoint, seen.principal)
                return error_response(unreplayable, rid_header)
        headers = {**rid_header, **admitted.reservation.headers}
        try:
            try:
                admitted.grant = await self._dispatch(request, admitted)
            except SchedulerRejected as exc:
                await self._release_unrun(admitted)
                err = api_error(exc)
                await self._attempt(seen, request_id, err, adm=admitted)
                return error_response(err, headers)
            except _ClientGone:  # left while queued: nothing ran, nothing is billed
                await self._close_unfinished(admitted, status_code=499)
                await self._attempt(seen, request_id, ApiError(499, "client closed the request while queued",
                                                               code="client_disconnected"),
                                    status="error", adm=admitted)
                return Response(status_code=499)
            # the attempt record becomes durable while the engine works; _finalize waits for it,
            # so it is durable before the response completes (one fsync less on the critical path)
            admitted.attempt_write = asyncio.ensure_future(
                self._attempt(seen, request_id, None, status="admitted", adm=admitted))
            admitted.meter.dispatched()
            if admitted.body.stream:
                return _ClosingStreamingResponse(
                    self._stream(admitted, headers), on_close=lambda: self._close_unfinished(admitted),
                    media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})
            return await self._complete(request, admitted, headers)
        except BaseException as exc:
            # Cancelled (server shutdown: the client gets app.py's 503) or an unexpected error
            # (500): never leave the reservation, the scheduler slot or the idempotency ticket held.
            status = 503 if isinstance(exc, asyncio.CancelledError) else 500
            await self._close_unfinished(admitted, status_code=status, outcome="error")
            raise
        finally:
            if admitted.watch is not None:  # a stream's response watches the client itself
                admitted.watch.cancel()

    async def _attempt(self, seen: "_Seen", request_id: str, err: ApiError | None, *,
                       status: str | None = None, attempt: int = 1, adm: "_Admitted | None" = None) -> None:
        """Record this HTTP attempt in the ledger (any outcome once the tenant is known)."""
        principal = seen.principal
        if principal is None:
            return  # 401: no tenant to attribute the attempt to
        if status is None:  # quota refusals carry their level/dimension; 429s are shedding
            status = "rejected" if err is not None and ("dimension" in err.extra or err.status == 429) else "invalid"
        ident = adm.meter.identity if adm is not None else None
        attribution = seen.attribution or principal.attribution(
            model=self.gw.engine.model_name, endpoint=self.endpoint, agent_run_id=seen.agent_run_id)
        run_id = _bounded(attribution.agent_run_id, MAX_RUN_ID_CHARS)
        if run_id != attribution.agent_run_id:  # headers as sent: a refused over-long one is kept
            attribution = dataclasses.replace(attribution, agent_run_id=run_id)  # as a digest (_bounded)
        record = AttemptRecord(
            attribution=attribution, request_id=request_id, status=status, ts=self.gw.clock.wall(),
            event_id=adm.meter.event_id() if adm is not None else "",
            reason=(err.code or "error") if err is not None else status,
            status_code=err.status if err is not None else 200,
            idempotency_key=_bounded(seen.idempotency_key, MAX_KEY_CHARS),
            reserved=adm.reservation.reserved if adm and status == "admitted" else NO_TOKENS,
            attempt=ident.attempt if ident is not None else attempt,
            level=err.extra.get("level", "") if err is not None else "",
            dimension=err.extra.get("dimension", "") if err is not None else "")
        try:
            await self.gw.recorder.record_attempt(record)
        except Exception:  # noqa: BLE001 — attempts are reconciliation detail, never fatal
            log.exception("could not record attempt %s", request_id)

    # -- steps 1–5 ------------------------------------------------------------------------------
    async def _admit(self, request: Request, request_id: str, arrival: tuple[float, float],
                     seen: "_Seen") -> _Admitted:
        gw = self.gw
        principal = gw.authenticate(request)
        seen.principal = principal
        seen.idempotency_key = idem = single_header(request, "idempotency-key", "Idempotency-Key",
                                                    code="invalid_idempotency_key")
        seen.agent_run_id = run_id = single_header(request, "x-agent-run-id", "X-Agent-Run-Id",
                                                   code="invalid_request")
        # the request's attribution, built once and carried by reference from here on
        seen.attribution = attribution = principal.attribution(
            model=gw.engine.model_name, endpoint=self.endpoint, agent_run_id=run_id)
        data = await read_json_object(request, gw.settings.max_body_bytes,
                                      timeout_s=gw.settings.body_read_timeout_s)
        body = parse_request(data, self._kind)
        engine = gw.engine
        if body.model != engine.model_name:
            raise ApiError(404, f"The model '{body.model}' does not exist; this server serves "
                                f"'{engine.model_name}'", param="model", code="model_not_found")
        prompt_ids = await self._tokenize(body)
        max_tokens = self._output_budget(body, len(prompt_ids), self._context_limit(principal, run_id))
        ticket = await self._idempotency(principal, idem, data)
        identity = RequestIdentity(request_id=request_id, attribution=attribution, stream=body.stream,
                                   idempotency_key=idem, attempt=ticket.attempt if ticket is not None else 1)
        reserved = TokenCounts(input_tokens=len(prompt_ids), output_tokens=max_tokens)
        meter = RequestMeter(identity, gw.clock, reserved=reserved, arrival=arrival)
        estimate = UsageEstimate(attribution=attribution, tokens=reserved, request_id=request_id,
                                 attempt=identity.attempt)
        try:
            reservation = await gw.quota.reserve(principal, estimate)
        except BaseException as exc:
            if ticket is not None:
                await gw.idempotency.abandon(ticket)  # nothing ran: a later retry may run
            if not isinstance(exc, QuotaRejected):
                raise
            self._decided(attribution, exc)
            seen.decided = True
            raise
        engine_request = EngineRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
            min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, temperature=body.temperature,
            top_p=body.top_p, stop=body.stop_list(), seed=body.seed, attribution=attribution)
        return _Admitted(principal=principal, body=body, engine_request=engine_request, meter=meter,
                         reservation=reservation, ticket=ticket)

    async def _idempotency(self, principal: Principal, key: str, data: dict) -> IdempotencyTicket | None:
        """Begin the attempt of ``(tenant, Idempotency-Key)``: run it (FIRST), or raise
        :class:`_Replay` to answer from the earlier attempt (JOINED / REPLAYED)."""
        manager = self.gw.idempotency
        if not key or manager is None:
            return None
        ticket = await manager.begin(principal.tenant_id, key,
                                     fingerprint=fingerprint(data, self.endpoint))  # IdempotencyError
        if ticket.replayed:
            raise _Replay(ticket)
        return ticket

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

    def _context_limit(self, principal: Principal, run_id: str) -> int | None:
        """The caller's tightest quota context limit (prompt + max_tokens), or None."""
        try:
            return self.gw.quota.context_limit(principal, run_id)
        except QuotaRejected:
            return None  # e.g. the key was removed by a reload: reserve() answers it

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

    def _decision(self, attribution: Attribution, admitted: bool, reason: str, level: str = "",
                  dimension: str = "", status: int = 200) -> None:
        self.gw.bus.publish(AdmissionDecision(
            attribution=attribution, admitted=admitted, reason=reason,
            level=level, dimension=dimension, status_code=status, wall_ts=self.gw.clock.wall()))

    def _decided(self, attribution: Attribution, refusal: QuotaRejected | SchedulerRejected) -> None:
        """Publish the admission decision of a quota or scheduler refusal."""
        self._decision(attribution, False, refusal.code or "", refusal.level, refusal.dimension,
                       refusal.status_code)

    # -- step 6 ---------------------------------------------------------------------------------
    async def _dispatch(self, request: Request, adm: _Admitted) -> Grant:
        gw = self.gw
        meter = adm.meter
        policy = gw.tier_policy(adm.principal.tier)
        # the tier's deadline rule, the one the simulator applies to the same request
        deadline = policy.deadline_s(meter.arrival_mono) if policy is not None else None
        attribution = meter.identity.attribution
        job = Job(request_id=adm.engine_request.request_id, attribution=attribution,
                  input_tokens=len(adm.engine_request.prompt_token_ids),
                  max_tokens=adm.engine_request.max_tokens, arrival_s=meter.arrival_mono,
                  deadline_s=deadline)
        try:
            gw.scheduler.check_admission(job)
            grant = await self._until_disconnect(request, gw.scheduler.acquire(job), adm)
        except SchedulerRejected as exc:
            self._decided(attribution, exc)
            raise
        adm.engine_request.priority = grant.priority
        self._decision(attribution, True, "admitted")
        return grant

    @staticmethod
    async def _until_disconnect(request: Request, awaitable: Any, adm: _Admitted) -> Any:
        """Await ``awaitable``; raise :class:`_ClientGone` (cancelling it) if the client leaves.

        One watcher task per request serves every wait (queue, then engine); ``handle`` cancels it.
        """
        work = asyncio.ensure_future(awaitable)
        watch = adm.watch
        if watch is None:
            watch = adm.watch = asyncio.ensure_future(_wait_for_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()
            raise
        if work in done:
            return work.result()
        work.cancel()
        try:
            await work
        except BaseException:  # noqa: BLE001 — the cancelled work's own outcome no longer matters
            pass
        raise _ClientGone()

    # -- step 7, non-streaming ---------------------------------------------------------------------
    async def _complete(self, request: Request, adm: _Admitted, headers: dict[str, str]) -> Response:
        texts: list[str] = []

        async def collect() -> None:
            async with aclosing(self._engine_stream(adm)) as outputs:
                async for out in outputs:
                    if out.new_text:
                        texts.append(out.new_text)

        try:
            await self._until_disconnect(request, collect(), adm)
        except _ClientGone:
            await self._finalize(adm, "aborted", status_code=499, finish_reason="abort")
            await self._settle_idempotency(adm, None)
            return Response(status_code=499)
        except EngineError as exc:
            log.error("engine failed %s: %s", adm.engine_request.request_id, exc)
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
    async def _stream(self, adm: _Admitted, headers: dict[str, str]) -> AsyncIterator[bytes]:
        created = int(self.gw.clock.wall())
        include_usage = adm.body.include_usage()
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
            log.error("engine failed %s mid-stream: %s", adm.engine_request.request_id, exc)
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

    async def _engine_stream(self, adm: _Admitted) -> AsyncIterator[EngineOutput]:
        """The engine's deltas, metered and charged to the scheduler as they arrive. Closing this
        iterator early closes the engine's, which aborts the engine request."""
        stream = self.gw.engine.generate(adm.engine_request)
        try:
            async for out in stream:
                new = adm.meter.on_output(out)
                if new and adm.grant is not None:
                    self.gw.scheduler.charge_output(adm.grant, new)
                yield out
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()  # type: ignore[attr-defined]

    # -- steps 8–9 ------------------------------------------------------------------------------------
    async def _finalize(self, adm: _Admitted, outcome: str, *, status_code: int,
                        finish_reason: str | None = None) -> UsageEvent:
        """Record the usage event (durably), release the scheduler slot, reconcile the quota.

        Idempotent (the first call wins) and shielded from cancellation: a client that leaves
        mid-way never interrupts the ledger write.
        """
        if adm.finalized is not None:
            return adm.finalized
        with anyio.CancelScope(shield=True):
            return await self._finalize_now(adm, outcome, status_code, finish_reason)

    async def _finalize_now(self, adm: _Admitted, outcome: str, status_code: int,
                            finish_reason: str | None) -> UsageEvent:
        gw = self.gw
        event, completion = adm.meter.finish(outcome, status_code=status_code,
                                             policy=gw.tier_policy(adm.principal.tier),
                                             finish_reason=finish_reason)
        adm.finalized = event
        try:
            await gw.recorder.record(event)
        except Exception:  # noqa: BLE001 — the spool is local disk; this is an operator alarm
            log.critical("usage event %s could NOT be made durable: %s", event.event_id,
                         event.to_dict(), exc_info=True)
        if adm.attempt_write is not None:
            await adm.attempt_write  # _attempt never raises (it logs)
        if adm.grant is not None:
            gw.scheduler.release(adm.grant)
        await gw.quota.reconcile(adm.reservation, event.tokens)
        gw.bus.publish(completion)
        return event

    async def _close_unfinished(self, adm: _Admitted, *, status_code: int = 499,
                                outcome: str = "aborted") -> None:
        """Finalize (reconcile, release the slot, record) a request that did not end normally, and
        abandon its idempotency ticket so a retry runs. A no-op for what already ended."""
        with anyio.CancelScope(shield=True):
            if adm.finalized is None:
                await self._finalize(adm, outcome, status_code=status_code,
                                     finish_reason="abort" if outcome == "aborted" else "error")
            await self._settle_idempotency(adm, None)

    async def _release_unrun(self, adm: _Admitted) -> None:
        """Rejected by the scheduler: nothing ran, nothing is billed; release the reservation."""
        await self.gw.quota.reconcile(adm.reservation, NO_TOKENS)
        await self._settle_idempotency(adm, None)

    async def _settle_idempotency(self, adm: _Admitted, stored: StoredResponse | None) -> None:
        """Store a complete response for replays, or abandon the attempt (the next retry runs)."""
        manager, ticket = self.gw.idempotency, adm.ticket
        if manager is None or ticket is None or adm.ticket_settled:
            return
        adm.ticket_settled = True
        with anyio.CancelScope(shield=True):
            try:
                if stored is None:
                    await manager.abandon(ticket)
                else:
                    await manager.complete(ticket, stored)
            except Exception:  # noqa: BLE001 — a lost replay is not worth failing the response
                log.exception("idempotency store failed for %s", adm.engine_request.request_id)

    # -- response shapes ----------------------------------------------------------------------------
    def _usage(self, event: UsageEvent) -> dict[str, Any]:
        return usage_block(event.tokens)

    def _full_response(self, adm: _Admitted, text: str, event: UsageEvent) -> dict[str, Any]:
        rid = adm.engine_request.request_id
        created = int(self.gw.clock.wall())
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": event.finish_reason, "logprobs": None}
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
                    "model": event.attribution.model, "choices": [choice], "usage": self._usage(event)}
        choice = {"index": 0, "text": text, "finish_reason": event.finish_reason, "logprobs": None}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                "model": event.attribution.model, "choices": [choice], "usage": self._usage(event)}

    def _chunk(self, adm: _Admitted, created: int, out: EngineOutput, first: bool,
               include_usage: bool) -> dict[str, Any]:
        rid = adm.engine_request.request_id
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

    def _usage_chunk(self, adm: _Admitted, created: int, event: UsageEvent) -> dict[str, Any]:
        rid = adm.engine_request.request_id
        return {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": created, "model": event.attribution.model, "choices": [], "usage": self._usage(event)}
