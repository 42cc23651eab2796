"""Per-tenant shares of the engine's scheduled work on the real vLLM CPU engine: the per-step
records (:class:`~kvmeter.stats.EngineStepShares`) recompute the totals the engine reports per
request — prefill tokens summed over the steps = input − cached tokens, decode tokens = output − 1
(the last token is sampled, never fed back), both per tenant — and vLLM's own per-step output
token count (``IterationStats.num_generation_tokens``) = decode tokens + one per request."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from kvmeter.attribution import Attribution
from kvmeter.serving.engines.base import EngineRequest
from kvmeter.stats import EngineStepShares, EngineStepStats

pytestmark = [pytest.mark.engine]


def _ids(engine, n: int, tag: str | None = None) -> list[int]:
    tag = tag or uuid.uuid4().hex[:6]
    ids = engine.tokenizer.encode(" ".join(f"{tag}{i}" for i in range(n)))[:n]
    assert len(ids) == n
    return ids


def _request(ids: list[int], n_out: int, tenant: str, tier: str) -> EngineRequest:
    return EngineRequest(request_id=f"share-{uuid.uuid4().hex}", prompt_token_ids=ids, max_tokens=n_out,
                         min_tokens=n_out, temperature=0.0, attribution=Attribution(tenant, tier=tier))


async def _final_stats(engine, request: EngineRequest):
    last = None
    async for out in engine.generate(request):
        last = out
    assert last is not None and last.finished and last.stats is not None
    return last.stats


async def test_step_shares_recompute_the_engines_totals_per_tenant(vllm_engine):
    bus = vllm_engine.test_bus
    shares: list[EngineStepShares] = []
    steps: list[EngineStepStats] = []
    unsubscribe = [bus.subscribe(EngineStepShares, shares.append), bus.subscribe(EngineStepStats, steps.append)]
    try:
        shared = _ids(vllm_engine, 600)  # t1's two requests share a prefix: the second hits the cache
        requests = [_request(shared + _ids(vllm_engine, 100), 6, "t1", "paid"),
                    _request(shared + _ids(vllm_engine, 80), 9, "t1", "paid"),
                    _request(_ids(vllm_engine, 300), 12, "t2", "free")]
        first = await _final_stats(vllm_engine, requests[0])
        second, other = await asyncio.gather(_final_stats(vllm_engine, requests[1]),
                                             _final_stats(vllm_engine, requests[2]))
    finally:
        for off in unsubscribe:
            off()
    assert second.tokens.cached_input_tokens > 0, "the shared prefix was not served from the cache"

    by_tenant: dict[str, list[float]] = {}
    for step in shares:
        for t in step.tenants:
            acc = by_tenant.setdefault(t.tenant_id, [0, 0, 0.0])
            acc[0] += t.prefill_tokens
            acc[1] += t.decode_tokens
            acc[2] += t.kv_tokens * step.duration_s
    expected = {"t1": [sum(s.tokens.input_tokens - s.tokens.cached_input_tokens for s in (first, second)),
                       sum(s.tokens.output_tokens - 1 for s in (first, second))],
                "t2": [other.tokens.input_tokens - other.tokens.cached_input_tokens, other.tokens.output_tokens - 1]}
    assert {tenant: acc[:2] for tenant, acc in by_tenant.items()} == expected
    assert all(acc[2] > 0 for acc in by_tenant.values())  # KV token-seconds
    assert {(t.tenant_id, t.tier) for s in shares for t in s.tenants} == {("t1", "paid"), ("t2", "free")}
    # vLLM's own count of generated tokens, per step, against the rows: decode + the first tokens
    assert sum(s.output_tokens for s in steps) == sum(e[1] for e in expected.values()) + 3
    assert sum(s.scheduled_tokens for s in steps) == sum(s.scheduled_tokens for s in shares)
    # every request is named, by kvmeter's id, in its tenant's prefill ids of at least one step (the
    # cache-hit one too: vLLM recomputes a prompt's last token) — the interference read finds a
    # request's engine by it
    named = {(t.tenant_id, rid) for s in shares for t in s.tenants for rid in t.prefill_request_ids}
    assert named == {(r.attribution.tenant_id, r.request_id) for r in requests}
