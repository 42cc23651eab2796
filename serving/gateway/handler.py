"""One request's life in the gateway: authenticate → parse → render → admit → schedule →
generate → meter → record → reconcile.

The steps, in order, and what each can answer:

1. authenticate the API key ......................................... 401
   (Idempotency-Key / X-Agent-Run-Id sent twice with different values: 400)
2. read the body (media type, size cap, time limit, UTF-8, JSON object)
   and validate it .................................................... 400 / 408 / 413 / 415
   (a client that leaves mid-body: 499 in the attempt record, nothing sent)
3. check the model and render the prompt (chat template, tokens) ...... 404 / 400
4. check the context window and estimate: input tokens, output ceiling 400
   the request's declared ``tools`` under the key's tool policy ........ 403 (``tool_blocked``)
5. the agent run's model call: a stopped run, a pending approval ...... 409
   reserve quota on every level and dimension (all or nothing) ....... 429 / 402 / 400 (quota)
   then the run's repeated-prompt stop on the rendered prompt's digest (admitted calls count;
   a stop releases the reservation) .................................... 409
6. ask the scheduler (early rejection, then wait for dispatch) ........ 429 + Retry-After
7. run on the engine, streaming or not; a client that goes away aborts the engine request, and so
   does a stream's client that stops reading for ``stream_stall_timeout_s`` (the stream is cut:
   :mod:`kvmeter.serving.gateway.stall`; billed as a client that went away)
8. meter: one usage event per attempt (under its logical request's event id; one that did not
   end ``ok`` with its undelivered cause and its tier's billing of it), durable in the ledger's
   spool *before* the response completes (for a stream: before the usage chunk and ``[DONE]``)
9. reconcile the reservation to engine-true counts; release the scheduler slot.

The agent-run checks (steps 4 and 5) are :class:`~kvmeter.serving.agents.AgentRuns`' hooks, called
here when the gateway holds ``agents``; the third hook, on the tool calls the model emits, is the
protocol's (:mod:`kvmeter.serving.gateway.emitted`, on vLLM's layer's answer).

Nothing is billed for a request rejected in steps 1–6, and every failure there is answered before
the engine is touched. A refusal in steps 1–4 is published as a
:class:`~kvmeter.stats.RequestRefused`; one in steps 5–6 as an
:class:`~kvmeter.stats.AdmissionDecision`.

This module is the orchestrator: :class:`CompletionEndpoint` runs the steps, and the two ways a
request can be spoken leave it only the protocol's part (steps 2–4's validation, render and
estimate, :meth:`CompletionEndpoint._prepare`; step 7, :meth:`CompletionEndpoint._run`):

* :class:`~kvmeter.serving.gateway.openai_path.OpenAIEndpoint` — the in-process engines
  (``vllm``, ``instant``): vLLM's own OpenAI serving layer (:mod:`kvmeter.serving.openai_api`),
  so the API is vLLM's, every shape of it metered;
* :class:`~kvmeter.serving.gateway.remote_path.RemoteEndpoint` — ``--engine remote``: a
  transparent proxy to the upstream's own OpenAI server (the body validated with vLLM's request
  models, forwarded as sent; the answer the upstream's, metered from its usage).

Why this module is longer than ~600 lines: it is the one place where the steps above happen in
order, and the order is what makes metering exact on every exit path (each ``try``/``finally``
here pairs a reservation or an engine request with its record). Body reading (``body.py``),
metering (``metering.py``), tool checks (``tools.py``, ``emitted.py``) and errors (``errors.py``)
are already their own modules; what remains is the sequence itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Awaitable, Callable, Protocol, Sequence

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvmeter.aio import cancel_and_wait
from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.errors import Refusal
from kvmeter.events import Outcome, UsageEvent
from kvmeter.serving.agents import AgentRuns, prompt_digest
from kvmeter.serving.engines.base import Engine
from kvmeter.serving.engines.finished import merge_stats
from kvmeter.serving.gateway.body import CLIENT_CLOSED, InvalidJson, read_json_object, single_header
from kvmeter.serving.gateway.errors import ApiError, api_error, error_response
from kvmeter.serving.gateway.metering import RequestIdentity, RequestMeter
from kvmeter.serving.gateway.models import ServedModel, ServedModels
from kvmeter.ledger.records import AttemptRecord, AttemptStatus
from kvmeter.serving.gateway.replays import fingerprint, replay_response
from kvmeter.serving.gateway.reprefill import PrefixReuse
from kvmeter.serving.gateway.stall import SendGuard
from kvmeter.serving.quota.base import QuotaGate, QuotaRejected, Reservation, UsageEstimate
from kvmeter.serving.quota.gate import MAX_RUN_ID_CHARS
from kvmeter.serving.quota.idempotency import (MAX_KEY_CHARS, IdempotencyManager,
                                               IdempotencyTicket, StoredResponse)
from kvmeter.serving.scheduler.base import Grant, Job, Scheduler, SchedulerRejected
from kvmeter.serving.tenancy import DEFAULT_TIERS, Authenticator, Principal, TierPolicy
from kvmeter.stats import TRACE_CONTEXT_HEADERS, AdmissionDecision, RequestCompletion, RequestRefused
from kvmeter.tokens import NO_TOKENS, TokenCounts

__all__ = ["Gateway", "GatewaySettings", "UsageRecorder", "CompletionEndpoint", "Prepared", "Admitted",
           "ClientGone", "ClosingStreamingResponse", "REQUEST_ID_HEADER"]

#: kvmeter's own request id (the ledger's ``request_id``) on every completion answer.
REQUEST_ID_HEADER = "x-kvmeter-request-id"

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
        tokenize_in_thread_chars: on the remote engine's path, prompts longer than this
            (characters) are tokenized in a worker thread so the event loop keeps serving streams
            (vLLM's serving layer renders and tokenizes in its own worker threads).
        engine_account_wait_s: how long finalizing a request that ended early after reaching the
            engine (client gone, error) waits for the engine's own account of the work it did
            (:meth:`Engine.final_stats <kvmeter.serving.engines.base.Engine.final_stats>`;
            seconds, ≥ 0; vLLM gives it with its next step).
        stream_stall_timeout_s: a streamed answer whose client has read nothing for this long
            (one send blocked on the client's connection; seconds, > 0) is cut: the engine request
            is aborted, freeing its KV, and the attempt is billed as a client disconnect
            (:mod:`kvmeter.serving.gateway.stall`). ``None`` or 0: never cut.
    Raises:
        ValueError: for ``max_body_bytes`` < 1, ``body_read_timeout_s`` ≤ 0,
            ``engine_account_wait_s`` < 0 or ``stream_stall_timeout_s`` < 0.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    body_read_timeout_s: float | None = 30.0
    tokenize_in_thread_chars: int = 16_384
    engine_account_wait_s: float = 2.0
    stream_stall_timeout_s: float | None = 30.0

    def __post_init__(self) -> None:
        if self.stream_stall_timeout_s is not None:
            if not self.stream_stall_timeout_s >= 0:
                raise ValueError(f"stream_stall_timeout_s must be >= 0 (or None), got {self.stream_stall_timeout_s}")
            if self.stream_stall_timeout_s == 0:
                self.stream_stall_timeout_s = None
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not self.engine_account_wait_s >= 0:
            raise ValueError(f"engine_account_wait_s must be >= 0, got {self.engine_account_wait_s}")
        if self.body_read_timeout_s is not None and not self.body_read_timeout_s > 0:
            raise ValueError(f"body_read_timeout_s must be > 0 (or None), got {self.body_read_timeout_s}")


@dataclass(slots=True)
class Gateway:
    """Everything a request needs, wired once by the serve command (or a test).

    ``tier_policy`` gives the :class:`~kvmeter.serving.tenancy.TierPolicy` of a tier name (or
    ``None`` for an unknown one): its deadline rule sets the deadline of the scheduler ``Job``
    and its SLOs the usage event's ``slo_met``. ``kvmeter serve`` passes the tenant directory's
    (the tenants config's tiers, live across reloads); the default is the built-in tiers.

    ``openai`` is vLLM's serving layer for an in-process engine
    (:class:`~kvmeter.serving.openai_api.layer.OpenAIApi`; ``kvmeter serve`` builds it for
    ``vllm`` and ``instant``); ``None`` serves the remote engine's path.

    ``agents`` is the agent-run service (:class:`~kvmeter.serving.agents.AgentRuns`): with it, a
    request's declared tools, each model call of a run and the tool calls the model emits are
    checked (see the module docstring); ``None`` checks none of them.

    ``reprefill`` remembers the prompt blocks the engine recently computed
    (:class:`~kvmeter.serving.gateway.reprefill.PrefixReuse`): each request's prompts are probed
    at dispatch and its re-prefilled input tokens go on its ``RequestCompletion``; ``None`` (an
    engine that reports no prefix-cache hits) tracks nothing.

    ``models`` are the served models of a multi-model gateway
    (:class:`~kvmeter.serving.gateway.models.ServedModels`: an engine pool and a scheduler per
    model; ``engine`` and ``scheduler`` are then the first model's); ``None``: the one model of
    ``engine`` under ``scheduler``. :meth:`served` gives them either way.
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
    openai: Any = None
    agents: AgentRuns | None = None
    reprefill: PrefixReuse | None = None
    models: ServedModels | None = None

    def served(self) -> ServedModels:
        """The served models: :attr:`models`, or the one of :attr:`engine` under :attr:`scheduler`."""
        if self.models is None:
            self.models = ServedModels([ServedModel(self.engine.model_name, self.engine, self.scheduler)])
        return self.models

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


class ClientGone(Exception):
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


def _undelivered_cause(adm: Admitted, outcome: str) -> str:
    """Why an admitted attempt that did not end ``ok`` reached no client, as the gateway can tell:
    ``client_abandoned`` when the client disconnected (the disconnect watcher or the stream's
    response saw it) or its stream was cut because it stopped reading (``stream_stall_timeout_s``:
    the client abandoned the stream, billed as a disconnect), ``shutdown`` when the task
    finishing it is being cancelled and the client did not leave (uvicorn cancels the requests
    still running at the end of its graceful shutdown; a stream cut that way used to be recorded
    as the client's abort), else ``client_abandoned`` for ``aborted`` and ``server_failure`` for
    ``error``. ``deadline`` (a dispatched request dropped at its deadline) is never decided here,
    and no caller gives it today: the scheduler drops only queued requests, before the engine
    sees them (their attempt is ``rejected``, reason ``deadline``; no usage row).

    Call it outside a shielded cancel scope (it reads :meth:`asyncio.Task.cancelling`).
    """
    if adm.client_left or adm.stalled:
        return "client_abandoned"
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        return "shutdown"
    return "client_abandoned" if outcome == "aborted" else "server_failure"


def _bounded(value: str, max_chars: int) -> str:
    """A client-chosen header value as the attempt record keeps it: unchanged when it is within
    ``max_chars`` (the longest the gateway accepts), else ``sha256:<64 hex>`` — the request was
    refused for it, the digest still groups its retries, and the ledger's string limit (4,096
    characters) is never exceeded."""
    if len(value) <= max_chars:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


def _prompts_digest(prompts: tuple[Sequence[int], ...]) -> str:
    """:func:`~kvmeter.serving.agents.prompt_digest` of a request's prompt token ids (several
    engine inputs: of their concatenation, in order); ``""`` when none are known."""
    if not prompts:
        return ""
    ids = prompts[0] if len(prompts) == 1 else [t for p in prompts for t in p]
    try:
        return prompt_digest(ids)
    except Exception:  # noqa: BLE001 — a token id past 32 bits: no digest, the stop is skipped
        return ""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client that disconnects
    aborts the engine request at once rather than whenever the generator is garbage-collected,
    then runs ``on_close``: closing a generator that never started does not run its ``finally``
    (the client left before the first chunk was asked for), so the request is finalized there.

    With a ``guard`` (:class:`~kvmeter.serving.gateway.stall.SendGuard`) every send is measured and
    a client that stops reading is cut once one send has waited the guard's ``stall_s``:
    ``on_stall`` runs, then the body is closed as after a disconnect (the engine request aborted,
    its KV freed). The connection is then closed by the server (uvicorn logs that the application
    returned without completing the response); what was already in its write buffer is all the
    client can still read, and the answer has no ``[DONE]``.
    """

    def __init__(self, content: AsyncGenerator[bytes, None], *, on_close: Callable[[], Awaitable[None]],
                 on_disconnect: Callable[[], None] | None = None, guard: SendGuard | None = None,
                 on_stall: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._body = content  # Starlette's body_iterator, typed as the generator it is (it has aclose)
        self._on_close = on_close
        self._on_disconnect = on_disconnect
        self._guard = guard
        self._on_stall = on_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        on_disconnect = self._on_disconnect

        async def watched() -> Any:  # the client's disconnect, noted before it cancels the stream
            message = await receive()
            if message["type"] == "http.disconnect" and on_disconnect is not None:
                on_disconnect()
            return message

        try:
            if self._guard is None:
                await super().__call__(scope, watched, send)
            else:
                await self._guarded(self._guard, scope, watched, send)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self._body.aclose()
                finally:
                    await self._on_close()

    async def _guarded(self, guard: SendGuard, scope: Scope, receive: Receive, send: Send) -> None:
        """The response through ``guard``'s measured send, cut by its watchdog on a stall."""
        cut = anyio.CancelScope()
        watchdog = asyncio.ensure_future(guard.watch(cut.cancel)) if guard.stall_s is not None else None
        try:
            with cut:
                await super().__call__(scope, receive, guard.wrap(send))
        finally:
            with anyio.CancelScope(shield=True):  # the watchdog ends before the body closes
                await cancel_and_wait(watchdog)
        if guard.stalled and self._on_stall is not None:
            self._on_stall()  # before the body closes: its finalization reads the cause


@dataclass(slots=True)
class Prepared:
    """A validated request, as the protocol's part hands it to the orchestrator.

    Attributes:
        stream: answered as server-sent events.
        input_tokens: the input tokens it reserves (all its prompts).
        output_tokens: the output tokens it reserves (its ceiling: every prompt and choice).
        payload: the protocol's own state (its request object, render, engine request...).
        tool_names: the tools the request declares (``tools[].function.name``), for the tool
            policy.
        prompts: each engine input's prompt token ids (after the chat template), for the agent
            run's repeated-prompt stop and the gateway's re-prefill tracker
            (:attr:`Gateway.reprefill`); empty where they are not known or neither needs them.
        prefix_blocks: the first prompt's prefix block hashes, for an engine pool's router
            (:attr:`~kvmeter.serving.scheduler.Job.prefix_blocks`); empty without a pool.
        sequence: the longest single sequence (one prompt's tokens and its output ceiling), what
            the quota's ``max_context_tokens`` limits (:attr:`UsageEstimate.sequence
            <kvmeter.serving.quota.base.UsageEstimate>`); None: the whole request is one sequence.
        served: the model the request runs on (its engine and scheduler) on a multi-model
            gateway; None: the gateway's one engine and scheduler.
    """

    stream: bool
    input_tokens: int
    output_tokens: int
    payload: Any = None
    tool_names: tuple[str, ...] = ()
    prompts: tuple[Sequence[int], ...] = ()
    prefix_blocks: tuple[int, ...] = ()
    sequence: TokenCounts | None = None
    served: ServedModel | None = None


@dataclass(slots=True)
class Admitted:
    """State of an admitted request, carried from admission to finalization."""

    principal: Principal
    prepared: Prepared
    meter: RequestMeter
    reservation: Reservation
    ticket: IdempotencyTicket | None = None
    grant: Grant | None = None
    finalized: UsageEvent | None = None
    ticket_settled: bool = False
    watch: asyncio.Task | None = None  # the client-disconnect watcher, one per request
    attempt_write: asyncio.Future | None = None  # the admitted attempt's ledger write
    #: engine request ids handed to the engine so far (their streams were started)
    engine_ids: list[str] = field(default_factory=list)
    #: called just before the usage event is built (the protocol's last counts, e.g. reasoning)
    before_finish: Callable[[], None] | None = None
    #: the client disconnected (seen by the disconnect watcher or the stream's response)
    client_left: bool = False
    #: the stream was cut because its client stopped reading (``stream_stall_timeout_s``)
    stalled: bool = False
    #: the protocol publishes the request's :class:`RequestCompletion` itself, once its answer's
    #: finish reasons are known (:meth:`CompletionEndpoint._publish_completion`); until then
    #: finalization keeps it in :attr:`completion`
    hold_completion: bool = False
    completion: RequestCompletion | None = None
    #: the engine refused the request before running it: recorded as a refusal
    #: (:meth:`CompletionEndpoint._refused_unrun`), never finalized
    refused: bool = False

    def scheduler(self, gateway: Gateway) -> Scheduler:
        """The scheduler of the request's model (the gateway's one without ``prepared.served``)."""
        served = self.prepared.served
        return gateway.scheduler if served is None else served.scheduler

    def engine(self, gateway: Gateway) -> Engine:
        """The engine of the request's model (the gateway's one without ``prepared.served``)."""
        served = self.prepared.served
        return gateway.engine if served is None else served.engine


class CompletionEndpoint:
    """The ASGI endpoint for ``/v1/chat/completions`` (``chat=True``) or ``/v1/completions``: the
    orchestrator of a request's steps. A subclass supplies the protocol's part:
    :meth:`_prepare` (validate, render, estimate), :meth:`_run` (engine, answer) and, optionally,
    :meth:`_id_headers` and :meth:`_body_refusal`."""

    def __init__(self, gateway: Gateway, *, chat: bool) -> None:
        self.gw = gateway
        self.chat = chat
        self.endpoint = "chat.completions" if chat else "completions"

    # -- the protocol's part ---------------------------------------------------------------------
    async def _prepare(self, request: Request, data: dict, principal: Principal, run_id: str) -> Prepared:
        """Validate ``data``, check the model, render the prompt and estimate the request.

        Raises:
            Refusal: the request is refused (4xx) before anything is reserved.
        """
        raise NotImplementedError

    async def _run(self, request: Request, adm: Admitted, headers: dict[str, str]) -> Response:
        """Run the admitted request on the engine and answer it (finalizing its usage)."""
        raise NotImplementedError

    def _id_headers(self, request: Request, request_id: str) -> dict[str, str]:
        """The request-id headers of every answer: kvmeter's id as ``x-request-id`` and
        :data:`REQUEST_ID_HEADER`."""
        return {"x-request-id": request_id, REQUEST_ID_HEADER: request_id}

    def _body_refusal(self, err: ApiError) -> Refusal:
        """How a body that is not a JSON object is answered (kvmeter's error as it is)."""
        return err

    # ------------------------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        clock = self.gw.clock
        arrival = (clock.monotonic(), clock.wall())
        request_id = f"kvm-{uuid.uuid4().hex}"
        rid_header = self._id_headers(request, request_id)
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
            except ClientGone:  # left while queued: nothing ran, nothing is billed
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
            if self.gw.reprefill is not None and admitted.prepared.prompts:
                admitted.meter.prefix_probe = self.gw.reprefill.probe(admitted.prepared.prompts)
            return await self._run(request, admitted, headers)
        except BaseException as exc:
            # Cancelled (server shutdown: the client gets app.py's 503) or an unexpected error
            # (500): never leave the reservation, the scheduler slot or the idempotency ticket held.
            shutdown = isinstance(exc, asyncio.CancelledError)
            await self._close_unfinished(admitted, status_code=503 if shutdown else 500, outcome="error",
                                         cause="shutdown" if shutdown else "server_failure")
            raise
        finally:
            if admitted.watch is not None:  # a stream's response watches the client itself
                admitted.watch.cancel()

    def streaming_response(self, body: AsyncGenerator[bytes, None], adm: Admitted, headers: dict[str, str],
                           on_close: Callable[[], Awaitable[None]] | None = None) -> Response:
        """The SSE response of ``body``; closing it (the client left, it ended, or it was cut for a
        stalled reader: ``GatewaySettings.stream_stall_timeout_s``) closes ``body`` and then runs
        ``on_close`` (default: finalize the request as aborted if it did not end), then publishes
        the stream's :class:`~kvmeter.stats.StreamSendStats`."""
        gw = self.gw
        meter = adm.meter
        guard = SendGuard(gw.clock, gw.settings.stream_stall_timeout_s, held_kv_tokens=meter.kv_tokens_held)
        close = on_close or (lambda: self._close_unfinished(adm))

        def left() -> None:
            adm.client_left = True

        def stalled() -> None:
            adm.stalled = True
            log.warning("request %s (tenant %s): stream cut, its client read nothing for %.1f s "
                        "(stream_stall_timeout_s); the engine request is aborted and billed as a disconnect",
                        meter.identity.request_id, meter.identity.attribution.tenant_id, guard.stall_s)

        async def closed() -> None:
            try:
                await close()
            finally:  # after the completion: the stream's sends, as they went
                gw.bus.publish(guard.stats(meter.identity.attribution, gw.clock.wall()))

        return ClosingStreamingResponse(
            body, on_close=closed, on_disconnect=left, guard=guard, on_stall=stalled,
            media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})

    async def _attempt(self, seen: "_Seen", request_id: str, err: ApiError | None, *,
                       status: AttemptStatus | None = None, attempt: int = 1, adm: "Admitted | None" = None) -> None:
        """Record this HTTP attempt in the ledger (any outcome once the tenant is known)."""
        principal = seen.principal
        if principal is None:
            return  # 401: no tenant to attribute the attempt to
        if status is None:  # quota refusals carry their level/dimension; 429s are shedding
            status = "rejected" if err is not None and ("dimension" in err.extra or err.status == 429) else "invalid"
        ident = adm.meter.identity if adm is not None else None
        attribution = seen.attribution or principal.attribution(
            model=self.gw.served().names[0], endpoint=self.endpoint, agent_run_id=seen.agent_run_id)
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
                     seen: "_Seen") -> Admitted:
        gw = self.gw
        principal = gw.authenticate(request)
        seen.principal = principal
        seen.idempotency_key = idem = single_header(request, "idempotency-key", "Idempotency-Key",
                                                    code="invalid_idempotency_key")
        seen.agent_run_id = run_id = single_header(request, "x-agent-run-id", "X-Agent-Run-Id",
                                                   code="invalid_request")
        try:
            data = await read_json_object(request, gw.settings.max_body_bytes,
                                          timeout_s=gw.settings.body_read_timeout_s)
        except InvalidJson as err:
            raise self._body_refusal(err) from None
        # the request's attribution, built once and carried by reference from here on
        # (a multi-model gateway's: the model the body names, the default's until it is checked)
        seen.attribution = attribution = principal.attribution(
            model=gw.served().name_of(data.get("model")), endpoint=self.endpoint, agent_run_id=run_id)
        prepared = await self._prepare(request, data, principal, run_id)
        agents = gw.agents
        if agents is not None and prepared.tool_names:  # 403 before anything is reserved
            await agents.check_declared_tools(principal, run_id, prepared.tool_names)
        # the request's fingerprint: the idempotency store's check and a part of the event id
        digest = fingerprint(data, self.endpoint) if idem else ""
        ticket = await self._idempotency(principal, idem, digest)
        identity = RequestIdentity(request_id=request_id, attribution=attribution, stream=prepared.stream,
                                   idempotency_key=idem, attempt=ticket.attempt if ticket is not None else 1,
                                   fingerprint=digest)
        reserved = TokenCounts(input_tokens=prepared.input_tokens, output_tokens=prepared.output_tokens)
        meter = RequestMeter(identity, gw.clock, reserved=reserved, arrival=arrival)
        # the caller's trace context, handed on as received: the trace exporter joins it
        meter.trace_headers = tuple((k, v) for k, v in request.headers.items() if k in TRACE_CONTEXT_HEADERS)
        estimate = UsageEstimate(attribution=attribution, tokens=reserved, request_id=request_id,
                                 attempt=identity.attempt, sequence=prepared.sequence)
        try:
            if agents is not None and run_id:  # a stopped run, a pending approval: nothing is reserved
                await agents.on_model_call(principal, run_id)
            reservation = await gw.quota.reserve(principal, estimate)
            if agents is not None and run_id:
                await self._count_prompt(agents, principal, run_id, prepared, reservation)
        except BaseException as exc:
            if ticket is not None and gw.idempotency is not None:  # a ticket comes from the manager
                await gw.idempotency.abandon(ticket)  # nothing ran: a later retry may run
            if not isinstance(exc, QuotaRejected):
                raise
            self._decided(attribution, exc)
            seen.decided = True
            raise
        return Admitted(principal=principal, prepared=prepared, meter=meter, reservation=reservation,
                        ticket=ticket)

    async def _count_prompt(self, agents: AgentRuns, principal: Principal, run_id: str, prepared: Prepared,
                            reservation: Reservation) -> None:
        """The repeated-prompt stop, on an admitted model call of a run: only calls the quota
        admitted count (a call refused 429 and retried is not a loop). A refusal releases the
        reservation (nothing ran) and raises :class:`~kvmeter.serving.agents.ModelCallRefused`."""
        digest = _prompts_digest(prepared.prompts)
        if not digest:
            return
        try:
            await agents.on_model_call(principal, run_id, digest)
        except BaseException:
            await self.gw.quota.reconcile(reservation, NO_TOKENS)
            raise

    async def _idempotency(self, principal: Principal, key: str, digest: str) -> IdempotencyTicket | None:
        """Begin the attempt of ``(tenant, Idempotency-Key)`` for a request of fingerprint
        ``digest``: run it (FIRST), or raise :class:`_Replay` to answer from the earlier attempt
        (JOINED / REPLAYED)."""
        manager = self.gw.idempotency
        if not key or manager is None:
            return None
        ticket = await manager.begin(principal.tenant_id, key, fingerprint=digest)  # IdempotencyError
        if ticket.replayed:
            raise _Replay(ticket)
        return ticket

    def _context_limit(self, principal: Principal, run_id: str) -> int | None:
        """The caller's tightest quota context limit (prompt + max_tokens), or None."""
        try:
            return self.gw.quota.context_limit(principal, run_id)
        except QuotaRejected:
            return None  # e.g. the key was removed by a reload: reserve() answers it

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
    async def _dispatch(self, request: Request, adm: Admitted) -> Grant:
        gw = self.gw
        meter = adm.meter
        policy = gw.tier_policy(adm.principal.tier)
        # the tier's deadline rule, the one the simulator applies to the same request
        deadline = policy.deadline_s(meter.arrival_mono) if policy is not None else None
        attribution = meter.identity.attribution
        job = Job(request_id=meter.identity.request_id, attribution=attribution,
                  input_tokens=adm.prepared.input_tokens,
                  max_tokens=adm.prepared.output_tokens, arrival_s=meter.arrival_mono,
                  deadline_s=deadline, prefix_blocks=adm.prepared.prefix_blocks)
        try:
            scheduler = adm.scheduler(gw)
            scheduler.check_admission(job)
            grant = await self._until_disconnect(request, scheduler.acquire(job), adm)
        except SchedulerRejected as exc:
            self._decided(attribution, exc)
            raise
        self._decision(attribution, True, "admitted")
        return grant

    @staticmethod
    async def _until_disconnect(request: Request, awaitable: Any, adm: Admitted) -> Any:
        """Await ``awaitable``; raise :class:`ClientGone` (cancelling it) if the client leaves.

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
        adm.client_left = True
        work.cancel()
        try:
            await work
        except BaseException:  # noqa: BLE001 — the cancelled work's own outcome no longer matters
            pass
        raise ClientGone()

    # -- steps 8–9 ------------------------------------------------------------------------------------
    async def _finalize(self, adm: Admitted, outcome: Outcome, *, status_code: int,
                        finish_reason: str | None = None, cause: str = "") -> UsageEvent | None:
        """Record the usage event (durably), release the scheduler slot, reconcile the quota.

        Idempotent (the first call wins) and shielded from cancellation: a client that leaves
        mid-way never interrupts the ledger write. ``cause``: why an attempt that did not end
        ``ok`` reached no client (:data:`~kvmeter.events.UNDELIVERED_CAUSES`); default
        :func:`_undelivered_cause`. Returns the event, or None for a request the engine refused
        before running it (:meth:`_refused_unrun`: no usage event).
        """
        if adm.finalized is not None:
            return adm.finalized
        if adm.refused:
            return None
        cause = "" if outcome == "ok" else (cause or _undelivered_cause(adm, outcome))
        with anyio.CancelScope(shield=True):  # shielded, no deadline: it never swallows an exception
            event = await self._finalize_now(adm, outcome, status_code, finish_reason, cause)
        return event

    async def _finalize_now(self, adm: Admitted, outcome: Outcome, status_code: int,
                            finish_reason: str | None, cause: str) -> UsageEvent:
        gw = self.gw
        if outcome != "ok" and adm.engine_ids and adm.meter.engine_stats is None:
            # ended early (the engine streams are closed, so the engine was told): bill the work
            # the engine reports it did, not what reached the client
            wait = gw.settings.engine_account_wait_s
            accounts = await asyncio.gather(*(adm.engine(gw).final_stats(eid, wait) for eid in adm.engine_ids))
            reported = [a for a in accounts if a is not None]
            if len(reported) == len(accounts):
                adm.meter.engine_account(merge_stats(adm.meter.identity.request_id, [[a] for a in reported]))
        if adm.before_finish is not None:
            adm.before_finish()
        event, completion = adm.meter.finish(outcome, status_code=status_code,
                                             policy=gw.tier_policy(adm.principal.tier),
                                             finish_reason=finish_reason, cause=cause)
        adm.finalized = event
        try:
            await gw.recorder.record(event)
        except Exception:  # noqa: BLE001 — the spool is local disk; this is an operator alarm
            log.critical("usage event %s could NOT be made durable: %s", event.event_id,
                         event.to_dict(), exc_info=True)
        if adm.attempt_write is not None:
            await adm.attempt_write  # _attempt never raises (it logs)
        if adm.grant is not None:
            adm.scheduler(gw).release(adm.grant)
        await gw.quota.reconcile(adm.reservation, event.tokens)
        if adm.hold_completion:
            adm.completion = completion
        else:
            gw.bus.publish(completion)
        return event

    def _publish_completion(self, adm: Admitted, answered: dict[int, str] | None = None) -> None:
        """Publish the :class:`RequestCompletion` finalization held (``hold_completion``), once:
        ``answered`` (choice index → the ``finish_reason`` the answer sent) replaces the engine's
        reason of each choice the answer named — vLLM's layer answers ``tool_calls`` where the
        engine stopped with ``stop``. A no-op when nothing is held (not finalized, or published)."""
        adm.hold_completion = False
        held, adm.completion = adm.completion, None
        if held is None:
            return
        if answered:
            reasons = held.finish_reasons
            held.finish_reasons = tuple(answered.get(i, r) for i, r in enumerate(reasons))
        self.gw.bus.publish(held)

    async def _close_unfinished(self, adm: Admitted, *, status_code: int = 499,
                                outcome: Outcome = "aborted", cause: str = "") -> None:
        """Finalize (reconcile, release the slot, record) a request that did not end normally, and
        abandon its idempotency ticket so a retry runs. A no-op for what already ended."""
        cause = cause or _undelivered_cause(adm, outcome)  # before the shield: it reads the cancellation
        with anyio.CancelScope(shield=True):
            if adm.finalized is None:
                await self._finalize(adm, outcome, status_code=status_code,
                                     finish_reason="abort" if outcome == "aborted" else "error", cause=cause)
            await self._settle_idempotency(adm, None)

    async def _refused_unrun(self, adm: Admitted, err: Refusal) -> None:
        """The engine refused the admitted request before running it (vLLM's input processor, in
        ``AsyncLLM.add_request``): a client error, recorded as a refusal before admission is — no
        usage event (no engine work, no tokens billed), the quota reservation released, the
        scheduler slot freed, the idempotency ticket abandoned, the refusal published
        (:class:`~kvmeter.stats.RequestRefused`) and the attempt recorded ``invalid`` with the
        refusal's code (after its ``admitted`` record, which it replaces: one attempt id). A
        no-op once the request is finalized or refused."""
        if adm.finalized is not None or adm.refused:
            return
        adm.refused = True
        gw = self.gw
        with anyio.CancelScope(shield=True):
            if adm.attempt_write is not None:
                await adm.attempt_write  # _attempt never raises (it logs)
            if adm.grant is not None:
                adm.scheduler(gw).release(adm.grant)
            await gw.quota.reconcile(adm.reservation, NO_TOKENS)
            await self._settle_idempotency(adm, None)
            ident = adm.meter.identity
            gw.refused(err, self.endpoint, adm.principal)
            seen = _Seen(principal=adm.principal, idempotency_key=ident.idempotency_key,
                         agent_run_id=ident.attribution.agent_run_id, attribution=ident.attribution)
            await self._attempt(seen, ident.request_id, api_error(err), status="invalid", attempt=ident.attempt)

    async def _release_unrun(self, adm: Admitted) -> None:
        """Rejected by the scheduler: nothing ran, nothing is billed; release the reservation."""
        await self.gw.quota.reconcile(adm.reservation, NO_TOKENS)
        await self._settle_idempotency(adm, None)

    async def _settle_idempotency(self, adm: Admitted, stored: StoredResponse | None) -> None:
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
                log.exception("idempotency store failed for %s", adm.meter.identity.request_id)
