"""Per-request metering: the clock readings and token counts that become a usage event.

A :class:`RequestMeter` follows one admitted request from gateway arrival to its end, on an
injected clock. It measures what the client experiences (TTFT, inter-token latency, end-to-end),
integrates the KV cache the request holds over time, and at the end produces the
:class:`~kvmeter.events.UsageEvent` (billing) and the :class:`~kvmeter.stats.RequestCompletion`
(stats on the bus).

Token counts follow the metering rules (docs/ARCHITECTURE.md, "Metering rules"): the engine's own
account of the request when it gave one — vLLM's finished stats on the final delta, or, for a
request that ended early (client gone, timeout, error), the account of kvmeter's scheduler hook
that the gateway awaits from :meth:`Engine.final_stats <kvmeter.serving.engines.base.Engine.final_stats>`
and hands to :meth:`RequestMeter.engine_account`: the input tokens the engine had taken in (a
prefill cut partway bills the part it ran) and the tokens it generated, ``token_source``
``engine_hooks``. Without one (an engine without hooks), the engine-true counts carried by the
outputs the frontend received (``token_source`` ``frontend``); a request that ended before its
first output then bills no tokens: the frontend cannot prove the prefill happened. An attempt that
did not complete carries its cause (:data:`~kvmeter.events.UNDELIVERED_CAUSES`, decided by the
gateway) and whether its tier bills that work (:meth:`RequestMeter.finish`). Reasoning
tokens (a part of the output) are what the protocol's reasoning parser counted
(:attr:`RequestMeter.reasoning_tokens`; 0 without one). A request probed at dispatch for recently
computed prefixes (:attr:`RequestMeter.prefix_probe`) settles the probe with those counts at the
end: its re-prefilled input tokens (:mod:`kvmeter.serving.gateway.reprefill`) go on the completion.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvmeter.attribution import Attribution
from kvmeter.clock import Clock
from kvmeter.events import DEFAULT_UNDELIVERED_BILLING, Outcome, UsageEvent, event_id_for
from kvmeter.serving.engines.base import EngineOutput
from kvmeter.serving.gateway.reprefill import PrefixProbe
from kvmeter.serving.tenancy.tiers import TierPolicy
from kvmeter.stats import EngineRequestStats, RequestCompletion, RequestPhase
from kvmeter.tokens import NO_TOKENS, TokenCounts

__all__ = ["RequestMeter", "RequestIdentity"]


@dataclass(frozen=True, slots=True)
class RequestIdentity:
    """Which logical request, and which attempt of it, a request is — fixed at admission.

    Attributes:
        request_id: kvmeter's request id of this attempt.
        attribution: who is billed and what for (built once from the principal; carried here by
            reference into the usage event and the completion stats).
        stream: whether the response is streamed.
        idempotency_key: the client's ``Idempotency-Key``, or ``""``.
        attempt: 1 for the first attempt of the logical request.
        fingerprint: with an ``Idempotency-Key``, the request's fingerprint (SHA-256 hex of the
            endpoint and the canonical body, :func:`~kvmeter.serving.gateway.replays.fingerprint`):
            part of the event id, so the key reused with another body is another logical request.
    """

    request_id: str
    attribution: Attribution
    stream: bool
    idempotency_key: str = ""
    attempt: int = 1
    fingerprint: str = ""


class RequestMeter:
    """Clock readings and counts of one request.

    Args:
        identity: the request's identity and attribution.
        clock: injected clock (monotonic for durations, wall for timestamps).
        reserved: what admission reserved: the input as tokenized by the gateway and the output
            reservation (``max_tokens``).
        arrival: ``(monotonic, wall)`` readings at gateway arrival; default: now.
    """

    def __init__(self, identity: RequestIdentity, clock: Clock, *, reserved: TokenCounts = NO_TOKENS,
                 arrival: tuple[float, float] | None = None) -> None:
        self.identity = identity
        self._clock = clock
        self.arrival_mono, self.arrival_wall = arrival or (clock.monotonic(), clock.wall())
        self.reserved = reserved
        self.dispatch_mono: float | None = None
        self.first_token_mono: float | None = None
        self._last_token_mono: float | None = None
        self._last_kv_mono: float | None = None
        self.itls_s: list[float] = []
        self.kv_token_seconds = 0.0
        self.input_tokens = 0          # engine-true, from outputs
        self.cached_input_tokens = 0
        self.output_tokens = 0
        self.outputs_seen = 0
        self.engine_stats: EngineRequestStats | None = None
        self.finish_reason: str | None = None
        #: output tokens that were reasoning (set by the protocol's reasoning parser; ⊆ output)
        self.reasoning_tokens = 0
        #: the answer's ``id``, set by the protocol once known ("": unknown)
        self.response_id = ""
        #: each choice's finish reason in the answer's order, set by the protocol (None: the
        #: choice did not finish; empty: one choice, the request's finish reason)
        self.choice_finish_reasons: tuple[str | None, ...] = ()
        #: the request's W3C trace-context headers as received (``(name, value)`` pairs)
        self.trace_headers: tuple[tuple[str, str], ...] = ()
        #: the event's ``token_source`` where the engine gave no account, when the protocol knows
        #: better than ``frontend`` (the remote proxy: ``estimate`` when no upstream usage covers
        #: the counts)
        self.token_source: str | None = None
        #: the request's blocks and warm prefixes, probed at dispatch when the gateway tracks
        #: prefix reuse (None: it does not); settled in :meth:`finish`
        self.prefix_probe: PrefixProbe | None = None
        self._event_id: str | None = None

    def event_id(self) -> str:
        """The logical request's deterministic event id: tenant + Idempotency-Key + the request's
        fingerprint, or tenant + request id without a key (:func:`~kvmeter.events.event_id_for`)."""
        if self._event_id is None:
            ident = self.identity
            tenant = ident.attribution.tenant_id
            if ident.idempotency_key:
                self._event_id = event_id_for(tenant, ident.idempotency_key, ident.fingerprint)
            else:
                self._event_id = event_id_for(tenant, ident.request_id)
        return self._event_id

    def dispatched(self) -> None:
        """The scheduler released the request to the engine."""
        now = self._clock.monotonic()
        self.dispatch_mono = now
        self._last_kv_mono = now

    def on_output(self, out: EngineOutput) -> int:
        """Account one engine delta; returns the number of new output tokens in it."""
        now = self._clock.monotonic()
        # KV held since the last reading: the prompt being prefilled until the first output,
        # then prompt + generated tokens.
        held = (self.input_tokens + self.output_tokens) if self.outputs_seen else out.num_input_tokens
        if self._last_kv_mono is not None:
            self.kv_token_seconds += held * (now - self._last_kv_mono)
        self._last_kv_mono = now
        new = max(0, out.num_output_tokens - self.output_tokens)
        self.outputs_seen += 1
        self.input_tokens = out.num_input_tokens
        self.cached_input_tokens = min(out.num_cached_input_tokens, out.num_input_tokens)
        self.output_tokens = out.num_output_tokens
        if new:
            if self.first_token_mono is None:
                self.first_token_mono = now
            elif self._last_token_mono is not None:
                gap = (now - self._last_token_mono) / new
                self.itls_s.extend([gap] * new)
            self._last_token_mono = now
        if out.finished:
            self.finish_reason = out.finish_reason
            self.engine_stats = out.stats
            self._last_kv_mono = None  # the engine frees the request's KV blocks at its last step
        return new

    def kv_tokens_held(self) -> int:
        """Tokens the request holds in the engine's KV cache now, as the gateway last saw them
        (the same hold :attr:`kv_token_seconds` integrates): 0 before dispatch and once the engine
        finished it; its reserved input tokens until its first output; then prompt + generated."""
        if self._last_kv_mono is None:
            return 0
        return (self.input_tokens + self.output_tokens) if self.outputs_seen else self.reserved.input_tokens

    def engine_account(self, stats: EngineRequestStats | None) -> None:
        """The engine's own account of a request that ended early (``None``: it gave none).

        It decides the counts :meth:`finish` bills, as the stats of a finished request's last
        delta do. Ignored when the last delta already carried the engine's stats.
        """
        if stats is not None and self.engine_stats is None:
            self.engine_stats = stats

    # -- the end -------------------------------------------------------------------------------
    def finish(self, outcome: Outcome, *, status_code: int, policy: TierPolicy | None = None,
               finish_reason: str | None = None, cause: str = "") -> tuple[UsageEvent, RequestCompletion]:
        """Close the meter and build the usage event and completion stats.

        Args:
            outcome: ``ok``, ``aborted`` or ``error``.
            status_code: HTTP status the client got.
            policy: the request's tier, whose SLOs decide ``slo_met`` (goodput,
                :meth:`~kvmeter.serving.tenancy.tiers.TierPolicy.meets_slo`; ``None`` when the tier
                promises nothing, or a request that did not complete with a first token: False),
                and whose :meth:`~kvmeter.serving.tenancy.tiers.TierPolicy.undelivered` decides
                whether undelivered work is billed (``None``: the default policy).
            finish_reason: overrides the engine's (``abort`` / ``error``).
            cause: for an outcome other than ``ok``, why the work reached no client (one of
                :data:`~kvmeter.events.UNDELIVERED_CAUSES`); ``""`` for ``ok``. Not given:
                ``client_abandoned`` for ``aborted``, ``server_failure`` for ``error``.
        Raises:
            ValueError: a cause with ``ok``.
            KeyError: an unknown cause.
        """
        billing = ""
        if outcome == "ok":
            if cause:
                raise ValueError(f"an ok outcome has no undelivered cause, got {cause!r}")
        else:
            cause = cause or ("client_abandoned" if outcome == "aborted" else "server_failure")
            billing = policy.undelivered(cause) if policy is not None else DEFAULT_UNDELIVERED_BILLING[cause]
        now_mono = self._clock.monotonic()
        now_wall = self._clock.wall()
        stats = self.engine_stats
        if self._last_kv_mono is not None and self.outputs_seen:
            self.kv_token_seconds += (self.input_tokens + self.output_tokens) * (now_mono - self._last_kv_mono)
            self._last_kv_mono = now_mono
        if stats is not None:  # the engine's account: finished, or freed early (computed tokens)
            tokens = stats.tokens
            source = "engine_hooks"
        elif self.outputs_seen:
            tokens = TokenCounts(input_tokens=self.input_tokens, cached_input_tokens=self.cached_input_tokens,
                                 output_tokens=self.output_tokens)
            source = self.token_source or "frontend"
        else:
            tokens = NO_TOKENS
            source = self.token_source or "frontend"
        reasoning = min(max(0, self.reasoning_tokens), tokens.output_tokens)
        if reasoning != tokens.reasoning_tokens:  # the reasoning parser's count, a part of the output
            tokens = dataclasses.replace(tokens, reasoning_tokens=reasoning)
        ident = self.identity
        timed = stats if stats is not None and stats.phase_times_measured else None
        gateway_queue = (self.dispatch_mono - self.arrival_mono) if self.dispatch_mono is not None else None
        queue_s = None if gateway_queue is None else gateway_queue + (timed.queued_s if timed else 0.0)
        ttft = (self.first_token_mono - self.arrival_mono) if self.first_token_mono is not None else None
        itl_mean = sum(self.itls_s) / len(self.itls_s) if self.itls_s else None
        e2e = now_mono - self.arrival_mono
        reason = finish_reason or self.finish_reason or ("abort" if outcome == "aborted" else "error")
        event = UsageEvent(
            event_id=self.event_id(), request_id=ident.request_id, attribution=ident.attribution,
            outcome=outcome, finish_reason=reason, arrival_ts=self.arrival_wall, finish_ts=now_wall,
            tokens=tokens, reserved=self.reserved, idempotency_key=ident.idempotency_key,
            status_code=status_code, stream=ident.stream, queue_s=queue_s, ttft_s=ttft,
            prefill_s=timed.prefill_s if timed else None, decode_s=timed.decode_s if timed else None,
            e2e_s=e2e, itl_mean_s=itl_mean, kv_token_seconds=self.kv_token_seconds,
            token_source=source, attempt=ident.attempt,
            preemptions=stats.preemptions if stats else 0, undelivered_cause=cause, undelivered_billing=billing)
        slo_met: bool | None = None
        if policy is not None and policy.has_slo:
            slo_met = outcome == "ok" and ttft is not None and policy.meets_slo(ttft, itl_mean)
        completion_stats = RequestCompletion(
            attribution=ident.attribution, outcome=outcome, tokens=tokens,
            ttft_s=ttft, itls_s=self.itls_s, e2e_s=e2e, queue_s=gateway_queue or 0.0,
            slo_met=slo_met, wall_ts=now_wall, stream=ident.stream,
            phases=self._phases(queue_s, ttft, e2e, tokens.output_tokens), response_id=self.response_id,
            finish_reasons=tuple(r or reason for r in self.choice_finish_reasons) or (reason,),
            trace_headers=self.trace_headers,
            reprefill_input_tokens=self.prefix_probe.settle(tokens) if self.prefix_probe is not None else 0)
        return event, completion_stats

    def _phases(self, queue_s: float | None, ttft: float | None, e2e: float,
                output_tokens: int) -> tuple[RequestPhase, ...]:
        """The request's queue, prefill and decode phases in seconds from arrival (see
        :class:`~kvmeter.stats.RequestPhase`): queue ends at dispatch plus the engine's own
        waiting-queue time (``queue_s``; never after the first token), or at the end for a request
        never dispatched; prefill runs to the first token, decode to the last."""
        end_queue = e2e if queue_s is None else min(queue_s, e2e if ttft is None else ttft)
        phases = [RequestPhase("queue", 0.0, max(0.0, end_queue))]
        if ttft is not None:
            phases.append(RequestPhase("prefill", phases[0].end_s, max(phases[0].end_s, ttft)))
            if output_tokens >= 2 and self._last_token_mono is not None:
                last = max(ttft, min(e2e, self._last_token_mono - self.arrival_mono))
                phases.append(RequestPhase("decode", ttft, last))
        return tuple(phases)

