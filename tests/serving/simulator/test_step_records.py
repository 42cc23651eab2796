"""The simulator's per-step records (EngineStepShares on a StatsBus) and what they feed: the real
Prometheus exporter and the noisy-neighbour evaluator, run on a simulated 70B/H200 deployment."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmeter.bus import StatsBus
from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus
from kvmeter.exporters.prometheus.rules.noisy_eval import rank
from kvmeter.serving.simulator import SimConfig, Simulation
from kvmeter.serving.simulator.costmodel import RooflineCostModel
from kvmeter.serving.simulator.hardware import AcceleratorSpec
from kvmeter.serving.simulator.models import get_model
from kvmeter.serving.simulator.replica import SimReplica, SimRequest
from kvmeter.serving.simulator.runner import build_cost_model
from kvmeter.stats import EngineStepShares, EngineStepStats, RequestCompletion, SchedulerStats
from kvmeter.traces import TraceRequest

H200 = SimConfig(model="llama-3.1-70b", gpu="h200", tp=4)


def _collect(bus: StatsBus, kind: type) -> list:
    got: list = []
    bus.subscribe(kind, got.append)
    return got


def _mixed(n: int = 300, seed: int = 1) -> list[TraceRequest]:
    """Three tenants; c's prompts share hash prefixes (prefix-cache hits), a and b's do not."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tenant = rng.choice("abc")
        hashes = tuple(1000 * (i % 7) + b for b in range(3)) if tenant == "c" else ()
        out.append(TraceRequest(i * 0.15, 3 * 512 + 50 if hashes else rng.randint(100, 3000), rng.randint(1, 300),
                                hash_ids=hashes, tenant_id=tenant, tier="paid_interactive"))
    return out


def test_one_request_alone_step_by_step():
    """A 1,000-token prompt with 4 output tokens, alone: one prefill step (its first token), then
    a decode segment of 3 steps — 3 records, each holding one KV position more."""
    rep = SimReplica(build_cost_model(H200))
    got: list[EngineStepShares] = []
    rep.step_sink = got.append
    rep.wall_offset_s = 1_000.0
    rep.add(SimRequest("r1", 1000, 4, tenant_id="t", tier="free"), 0.0)
    ends = []
    while rep.has_work():
        rep.plan(rep.now)
        ends.append(rep.complete().end_s)
    assert [[(s.tenant_id, s.tier, s.prefill_tokens, s.decode_tokens, s.kv_tokens, s.requests, s.prefill_request_ids)
              for s in g.tenants] for g in got] == [
        [("t", "free", 1000, 0, 1000, 1, ("r1",))],
        [("t", "free", 0, 1, 1001, 1, ())],
        [("t", "free", 0, 1, 1002, 1, ())],
        [("t", "free", 0, 1, 1003, 1, ())]]
    assert len(ends) == 2, "the three decode steps are one segment"
    assert got[0].wall_ts == pytest.approx(1_000.0 + ends[0]) and got[-1].wall_ts == pytest.approx(1_000.0 + ends[1])
    assert sum(g.duration_s for g in got) == pytest.approx(ends[1])
    assert all(b.wall_ts - b.duration_s == pytest.approx(a.wall_ts) for a, b in zip(got, got[1:], strict=False))


def test_preemption_recompute_is_prefill_and_the_records_keep_the_replicas_totals():
    """768 tokens of KV for four 100 + 200-token requests: the low-priority ones are preempted and
    recompute prompt + output from 0 — prefill by vLLM's rule (the chunk starts inside the
    prompt). The records still sum to exactly the tokens the replica computed."""
    acc = AcceleratorSpec("tiny", "test profile", memory_bytes=2 ** 34, memory_bandwidth_bytes_per_s=20e9,
                          peak_flops={"bf16": 1e12}, kv_cache_bytes=48 * 16 * 23_040,
                          max_num_batched_tokens=2048, max_num_seqs=16)
    got: list[EngineStepShares] = []
    rep = SimReplica(RooflineCostModel(get_model("smollm2-135m"), acc), step_sink=got.append)
    reqs = [SimRequest(f"{t}{i}", 100, 200, priority=p, tenant_id=t) for t, p in (("hi", 0), ("lo", 5))
            for i in range(2)]
    for r in reqs:
        rep.add(r, 0.0)
    prefill = decode = 0
    while rep.has_work():
        rep.plan(rep.now)
        out = rep.complete()
        prefill += out.prefill_tokens
        decode += out.decode_tokens
    assert rep.preemptions_total > 0
    assert sum(t.prefill_tokens for g in got for t in g.tenants) == prefill > 4 * 100
    assert sum(t.decode_tokens for g in got for t in g.tenants) == decode
    by = {who: sum(t.prefill_tokens for g in got for t in g.tenants if t.tenant_id == who) for who in ("hi", "lo")}
    assert by["hi"] == 2 * 100 and by["lo"] > 2 * 100  # only the preempted tenant recomputed
    assert len(got) == rep.steps_total


def test_step_records_sum_to_each_tenants_prefill_and_decode_tokens():
    """As on the real engine: Σ prefill = Σ (input − cached), Σ decode = Σ (output − 1) per tenant
    (no preemption here), and the records' token sums and spans are the replica's own."""
    bus = StatsBus()
    steps, stats = _collect(bus, EngineStepShares), _collect(bus, EngineStepStats)
    res = Simulation(_mixed(), sim=H200, bus=bus).run()
    ok = [r for r in res.records if r.outcome == "ok"]
    assert res.preemptions == 0 and len(ok) > 200 and sum(r.cached_tokens for r in ok) > 0
    for tenant in "abc":
        mine = [r for r in ok if r.tenant_id == tenant]
        shares = [t for s in steps for t in s.tenants if t.tenant_id == tenant]
        assert sum(t.prefill_tokens for t in shares) == sum(r.input_tokens - r.cached_tokens for r in mine)
        assert sum(t.decode_tokens for t in shares) == sum(r.output_tokens - 1 for r in mine)
        assert {rid for t in shares for rid in t.prefill_request_ids} == {r.request_id for r in mine}
    assert len(steps) == sum(res.seg_k[0])  # one record per engine step
    busy = sum(t * k for t, k in zip(res.seg_t[0], res.seg_k[0], strict=True))
    assert sum(s.duration_s for s in steps) == pytest.approx(busy)
    assert sum(s.scheduled_tokens for s in steps) == sum(s.scheduled_tokens for s in stats)
    assert bus.errors_total == 0


def test_the_bus_does_not_change_the_simulation():
    plain = Simulation(_mixed(), sim=H200).run()
    bus = StatsBus()
    done = _collect(bus, RequestCompletion)
    observed = Simulation(_mixed(), sim=H200, bus=bus).run()
    assert [(r.request_id, r.first_token_s, r.finish_s) for r in plain.records] == [
        (r.request_id, r.first_token_s, r.finish_s) for r in observed.records]
    ok = {r.request_id: r for r in observed.records if r.outcome == "ok"}
    assert len(done) == len(ok)
    assert sorted(c.ttft_s for c in done) == pytest.approx(sorted(r.first_token_s - r.arrival_s for r in ok.values()))


def _noisy_run(noisy: bool) -> list[tuple[float, str]]:
    """Three normal tenants for 120 s on a simulated 70B/H200 (TP 4); with ``noisy``, tenant
    ``hog`` sends 24,000-token prompts from 60 s on. /metrics rendered every 5 simulated s."""
    rng = random.Random(3)
    reqs = [TraceRequest(rng.uniform(0, 120), rng.randint(600, 2000), rng.randint(50, 250), hash_ids=(j,),
                         tenant_id=t, tier="paid_interactive")
            for j, t in enumerate(("acme", "globex", "initech")) for _ in range(120)]
    if noisy:
        reqs += [TraceRequest(60 + 3 * k, 24_000, 1, tenant_id="hog", tier="paid_interactive") for k in range(20)]
    bus = StatsBus()
    sim = Simulation(reqs, sim=H200, bus=bus, policy="fcfs")
    registry = CollectorRegistry()
    install_prometheus(bus, registry, config=PrometheusConfig(top_k_tenants=20, model="llama-3.1-70b"),
                       clock=sim.clock)
    snaps: list[tuple[float, str]] = []

    def sample(_: SchedulerStats) -> None:
        now = sim.clock.monotonic()
        if not snaps or now >= snaps[-1][0] + 5.0:
            snaps.append((now, generate_latest(registry).decode()))

    bus.subscribe(SchedulerStats, sample)
    sim.run()
    assert bus.errors_total == 0
    return snaps


def _at(snaps: list[tuple[float, str]], t: float) -> tuple[float, str]:
    return max((s for s in snaps if s[0] <= t), key=lambda s: s[0])


def test_the_detector_ranks_the_simulated_noisy_tenant_first_and_the_clean_run_names_nobody():
    clean = _noisy_run(noisy=False)
    for t_end in (60.0, 90.0, 120.0):
        (t0, before), (t1, after) = _at(clean, t_end - 30), _at(clean, t_end)
        assert all(not v for v in rank(before, after, t1 - t0).values()), t_end
    noisy = _noisy_run(noisy=True)
    (t0, before), (t1, after) = _at(noisy, 90.0), _at(noisy, 120.0)
    ranked = rank(before, after, t1 - t0)
    assert ranked["prefill_pressure"] and ranked["prefill_pressure"][0][0] == "hog"
    # and nobody else: hog's prompts also never hit the prefix cache (true: no hash blocks)
    assert {n for v in ranked.values() for n, _ in v} == {"hog"}
    assert {shape for shape, v in ranked.items() if v} == {"prefill_pressure", "prompt_cache_hit_low"}
