"""SimEngine behind the Engine boundary, on virtual time."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.serving.engines.base import EngineError, EngineRequest
from kvmeter.serving.simulator import RooflineCostModel, SimEngine, get_accelerator, get_model
from kvmeter.stats import EngineStepStats


def _engine(bus=None, gpu="cpu"):
    clock = ManualClock()
    cost = RooflineCostModel(get_model("smollm2-135m"), get_accelerator(gpu))
    return SimEngine(cost, clock=clock, bus=bus), clock


async def test_generate_streams_exactly_max_tokens_with_engine_true_counts():
    bus = StatsBus()
    steps: list[EngineStepStats] = []
    bus.subscribe(EngineStepStats, steps.append)
    eng, clock = _engine(bus)
    await eng.start()
    ids = eng.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    outs = [o async for o in eng.generate(EngineRequest("r1", ids, max_tokens=7))]
    await eng.shutdown()
    assert sum(len(o.new_token_ids) for o in outs) == 7
    assert [o.num_output_tokens for o in outs] == list(range(1, 8))
    last = outs[-1]
    assert last.finished and last.finish_reason == "length" and last.num_input_tokens == len(ids)
    assert last.stats.tokens.output_tokens == 7 and last.stats.tokens.input_tokens == len(ids)
    assert clock.monotonic() == pytest.approx(last.stats.e2e_s)   # virtual time = the step times
    assert len(steps) == 7 and steps[0].ttfts_s and steps[0].kv_blocks_total == eng.replica.total_blocks


async def test_closing_the_stream_early_aborts_the_request_and_frees_its_kv():
    eng, _ = _engine()
    await eng.start()
    gen = eng.generate(EngineRequest("r1", [1] * 200, max_tokens=50))
    first = await gen.__anext__()
    assert first.num_output_tokens == 1 and eng.load().num_running == 1
    await gen.aclose()
    assert eng.load().num_running == 0 and eng.replica.used_blocks() == 0
    await eng.shutdown()


async def test_bad_requests_raise_engine_errors():
    eng, _ = _engine()
    with pytest.raises(EngineError, match="start"):
        await eng.generate(EngineRequest("r", [1], max_tokens=1)).__anext__()
    await eng.start()
    with pytest.raises(EngineError, match="context window"):
        await eng.generate(EngineRequest("r", [1] * 8000, max_tokens=500)).__anext__()
    with pytest.raises(EngineError):
        await eng.generate(EngineRequest("r", [], max_tokens=5)).__anext__()
    with pytest.raises(ValueError):
        eng.tokenizer.encode_chat([{"content": "no role"}])
    assert eng.tokenizer.decode(eng.tokenizer.encode("héllo")) == "héllo"
    await eng.shutdown()


async def test_concurrent_streams_share_steps_continuous_batching():
    eng, clock = _engine(gpu="h100")   # memory-bound decode: a batch costs about one request
    await eng.start()

    async def run(i: int) -> float:
        async for _ in eng.generate(EngineRequest(f"r{i}", [1] * 100, max_tokens=20)):
            pass
        return clock.monotonic()

    t_batched = max(await asyncio.gather(*(run(i) for i in range(8))))
    await eng.shutdown()
    eng2, clock2 = _engine(gpu="h100")
    await eng2.start()
    async for _ in eng2.generate(EngineRequest("solo", [1] * 100, max_tokens=20)):
        pass
    await eng2.shutdown()
    assert t_batched < 2 * clock2.monotonic()   # 8 requests batched ≪ 8 × one request


async def test_step_stats_count_scheduled_prompt_and_generated_tokens_like_vllm():
    bus = StatsBus()
    steps: list[EngineStepStats] = []
    bus.subscribe(EngineStepStats, steps.append)
    eng, clock = _engine(bus)
    await eng.start()

    async def run(rid: str, n_input: int, n_out: int) -> None:
        async for _ in eng.generate(EngineRequest(rid, [1] * n_input, max_tokens=n_out)):
            pass

    await asyncio.gather(run("a", 300, 5), run("b", 120, 9))
    await eng.shutdown()
    # every prompt token is scheduled once (no preemption here), every output token but the one a
    # prefill samples is a decode token: scheduled = prompts + outputs − first tokens
    assert sum(s.scheduled_tokens for s in steps) == 300 + 120 + (5 - 1) + (9 - 1)
    assert sum(s.output_tokens for s in steps) == 5 + 9
    # vLLM counts a request's whole prompt in the step that samples its first token
    # (both prompts fit the first step's 4,096-token budget, so both sample a token there)
    assert [s.input_tokens for s in steps] == [420] + [0] * (len(steps) - 1)
    assert len(steps[0].ttfts_s) == 2 and not any(s.ttfts_s for s in steps[1:])
    # one ITL per token after a request's first, each the length of the step that produced it
    # (the engine is never idle here, so a step lasts from the previous step's stats to its own)
    assert [len(s.itls_s) for s in steps] == [0] + [2] * 4 + [1] * 4
    for prev, s in itertools.pairwise(steps):
        assert s.itls_s == pytest.approx([s.wall_ts - prev.wall_ts] * len(s.itls_s), abs=1e-6)  # epoch floats


async def test_step_shares_are_published_per_step_by_tenant_and_tier_while_someone_listens():
    from kvmeter.attribution import Attribution
    from kvmeter.stats import EngineStepShares

    bus = StatsBus()
    eng, clock = _engine(bus)
    await eng.start()

    async def run(rid: str, tenant: str, tier: str, n_in: int, n_out: int) -> None:
        req = EngineRequest(rid, [1] * n_in, max_tokens=n_out, attribution=Attribution(tenant, tier=tier))
        async for _ in eng.generate(req):
            pass

    await run("r0", "acme", "enterprise", 50, 3)  # nobody subscribed yet: no record is built
    assert eng.replica.step_sink is None
    shares: list[EngineStepShares] = []
    bus.subscribe(EngineStepShares, shares.append)
    await asyncio.gather(run("r1", "acme", "enterprise", 300, 5), run("r2", "globex", "free", 120, 9))
    await eng.shutdown()
    assert len(shares) == 9  # one per step: r2's prefill (with r1's), then 8 decode steps
    assert all(s.duration_s > 0 for s in shares)
    assert all(b.wall_ts - b.duration_s >= a.wall_ts - 1e-9 for a, b in zip(shares, shares[1:], strict=False))
    assert shares[-1].wall_ts == pytest.approx(clock.wall())  # the last step ended at the clock's now
    per = {}
    for s in shares:
        for t in s.tenants:
            p = per.setdefault((t.tenant_id, t.tier), [0, 0, set()])
            p[0] += t.prefill_tokens
            p[1] += t.decode_tokens
            p[2] |= set(t.prefill_request_ids)
    assert per == {("acme", "enterprise"): [300, 4, {"r1"}], ("globex", "free"): [120, 8, {"r2"}]}
