"""The simulator's per-step records: :class:`~kvmeter.stats.EngineStepShares`, the same records
the vLLM adapter publishes (:mod:`kvmeter.collectors.vllm_step_shares` defines each quantity), one
per engine step, on the simulated clock; and :func:`step_stats`, a completed step's (or
segment's) :class:`~kvmeter.stats.EngineStepStats` with the fields the vLLM engine hooks fill —
both :class:`~.engine.SimEngine` and :class:`~.publish.SimPublisher` publish these.

Per step and per (tenant, tier) of the replica's running requests (the requests running when the
step was planned, after its preemptions and admissions — vLLM's ``Scheduler.running`` after
``schedule``):

* a request with a chunk in the step has ``c`` scheduled tokens; they are **prefill** when the
  chunk starts inside the prompt (``computed`` before the step ``< input_tokens``: a recompute after
  a preemption starts at 0 and so is prefill, its chunks past the prompt are decode — vLLM's rule),
  else **decode**; it holds ``computed + c`` KV positions once the step has run (prefix-cache hits
  included);
* a decoding request schedules 1 token (**decode**) and holds its whole context once the step has
  run (prompt + fed-back outputs, the token just scheduled included);
* a request still in prefill that got no chunk (the token budget ran out) schedules nothing and
  holds the KV it has computed.

So over a request's life its prefill tokens sum to ``input − cached`` and its decode tokens to
``output − 1`` when it was never preempted (its first token comes from its last prefill chunk),
as on the real engine. Every quantity is the replica's own: the token sums of the records of a
segment equal the :class:`~.replica.StepOutcome`'s ``prefill_tokens + decode_tokens``.

**A decode-only segment of k steps gives k records**, one per step: step ``i`` (1..k) lasts the
cost model's ``i``-th step time and ends at the segment's start + the first ``i`` step times; each
decoding request holds one KV position more than at step ``i − 1``. No request finishes or joins
inside a segment (it ends at the first finish), so the per-step records are exact, not an average.
``wall_ts`` is the step's end on the simulated clock plus the caller's wall offset (the
simulation's :class:`~kvmeter.clock.ManualClock` wall at virtual 0).

Cost: only when a sink is set; one pass over the running requests per planned step or segment,
then O(tenants) per step of the segment (``bench/simulator/RESULTS.md``, "Per-step records").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvmeter.stats import EngineStepShares, EngineStepStats, TenantStepShare

if TYPE_CHECKING:  # pragma: no cover
    from .replica import SimReplica, SimRequest, StepOutcome

__all__ = ["segment_shares", "step_stats", "step_itls"]


def step_itls(out: "StepOutcome") -> list[float]:
    """The inter-token latencies of a completed step, one per token generated after a request's
    first (as vLLM's ``inter_token_latencies_iter``): each decode token's latency is its step's
    duration (the segment's mean step time for a segment); a first token after a preemption's
    recompute gets its gap since the request's previous token."""
    itls = [out.duration_s / out.steps] * out.decode_tokens
    extra = out.itl_count - out.decode_tokens  # first tokens after a preemption's recompute
    if extra > 0:
        itls += [(out.itl_sum_s - out.duration_s / out.steps * out.decode_tokens) / extra] * extra
    return itls


def step_stats(rep: "SimReplica", out: "StepOutcome", *, prefix_queries0: int, prefix_hits0: int,
               wall_ts: float, with_itls: bool = True) -> EngineStepStats:
    """The :class:`~kvmeter.stats.EngineStepStats` of the step (or segment) ``out`` that ``rep``
    just completed, with vLLM's meanings: KV watermark (used ÷ total blocks, evictable cached
    blocks excluded: :meth:`~.replica.SimReplica.load`), blocks and block size, running and waiting
    requests now, preemptions, prefix-cache queried and hit tokens since ``prefix_queries0`` /
    ``prefix_hits0`` (the cache's counters before the step), scheduled tokens, batch size
    (running + finished), prompt tokens of the requests that got their first token, output tokens,
    engine-side TTFTs and (``with_itls``) :func:`step_itls` — one float per decode token, which a
    long segment may not want built."""
    load = rep.load()
    return EngineStepStats(
        wall_ts=wall_ts, engine_idx=rep.idx, kv_watermark_ratio=load.kv_watermark_ratio,
        kv_blocks_total=rep.total_blocks, kv_block_size_tokens=rep.B, num_running=load.num_running,
        num_waiting=load.num_waiting, num_preempted=len(out.preempted),
        prefix_cache_queries_tokens=rep.cache.queries_tokens - prefix_queries0,
        prefix_cache_hits_tokens=rep.cache.hits_tokens - prefix_hits0,
        batch_size=load.num_running + len(out.finished), scheduled_tokens=out.scheduled_tokens,
        input_tokens=sum(r.input_tokens for r in out.first_tokens), output_tokens=out.generated_tokens,
        ttfts_s=[r.engine_ttft_s() for r in out.first_tokens], itls_s=step_itls(out) if with_itls else [])


def segment_shares(rep: "SimReplica", chunks: Sequence[tuple["SimRequest", int]], steps: int,
                   step_ends_s: Sequence[float], *, wall_offset_s: float = 0.0) -> list[EngineStepShares]:
    """The records of the step or segment ``rep`` is about to complete (module docstring).

    Args:
        rep: the replica, its state still that of the segment's start (call before applying it).
        chunks: the step's prefill chunks ``(request, tokens)`` (``[]`` for a decode-only segment;
            a step with chunks is one step).
        steps: the segment's steps (≥ 1; 1 when ``chunks``).
        step_ends_s: each step's end, virtual seconds, ``steps`` values, increasing; the first
            step starts at ``rep.now``.
        wall_offset_s: added to each end for ``wall_ts`` (epoch seconds at virtual 0).
    Returns:
        ``steps`` records, in time order, tenants sorted by (tenant, tier).
    Raises:
        ValueError: ``steps`` < 1, ``len(step_ends_s)`` ≠ ``steps``, or chunks with ``steps`` > 1.
    """
    if steps < 1 or len(step_ends_s) != steps or (chunks and steps != 1):
        raise ValueError(f"a segment of {steps} steps needs {steps} step ends (got {len(step_ends_s)}) "
                         "and at most one step with chunks")
    chunk_of = {id(req): c for req, c in chunks}
    S = rep.S
    # (tenant, tier) → [prefill, chunk decode, KV at the step's end excluding decode growth,
    #                   running requests, decoding requests, prefill ids]
    acc: dict[tuple[str, str], list] = {}
    for req in rep._slot_req:
        if req is None:
            continue
        key = (req.tenant_id, req.tier)
        a = acc.get(key)
        if a is None:
            a = acc[key] = [0, 0, 0, 0, 0, []]
        a[3] += 1
        c = chunk_of.get(id(req))
        if c is not None:
            if req.computed < req.input_tokens:
                a[0] += c
                a[5].append(req.request_id)
            else:
                a[1] += c
            a[2] += req.computed + c
        elif req.decoding:
            a[4] += 1
            slot = req.slot
            a[2] += int(rep._ctx0[slot]) + S - int(rep._s0[slot])
        else:
            a[2] += req.computed
    keys = sorted(acc)
    out: list[EngineStepShares] = []
    prev = rep.now
    for i in range(1, steps + 1):
        end = float(step_ends_s[i - 1])
        tenants = tuple(
            TenantStepShare(tenant_id=k[0], tier=k[1], prefill_tokens=a[0], decode_tokens=a[1] + a[4],
                            kv_tokens=a[2] + a[4] * i, requests=a[3],
                            prefill_request_ids=tuple(sorted(a[5])))
            for k in keys for a in (acc[k],))
        out.append(EngineStepShares(wall_ts=end + wall_offset_s, engine_idx=rep.idx,
                                    duration_s=max(0.0, end - prev), tenants=tenants))
        prev = end
    return out
