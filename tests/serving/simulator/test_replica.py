"""Simulator replica invariants: KV accounting, preemption, chunked prefill, prefix caching, and
exactness of decode segments."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmeter.serving.simulator import PrefixCache, RooflineCostModel, SimReplica, SimRequest, get_model
from kvmeter.serving.simulator.hardware import AcceleratorSpec
from kvmeter.serving.simulator.replica import FINISHED


def _tiny(kv_blocks: int, **kw) -> SimReplica:
    """SmolLM2 on a CPU-like profile whose KV space holds ``kv_blocks`` blocks of 16 tokens."""
    acc = AcceleratorSpec("tiny", "test profile", memory_bytes=2 ** 34, memory_bandwidth_bytes_per_s=20e9,
                          peak_flops={"bf16": 1e12}, kv_cache_bytes=kv_blocks * 16 * 23_040,
                          max_num_batched_tokens=kw.pop("budget", 512), max_num_seqs=kw.pop("seqs", 16))
    return SimReplica(RooflineCostModel(get_model("smollm2-135m"), acc), **kw)


def _check(rep: SimReplica) -> None:
    p = rep.private_tokens()
    assert (p >= 0).all(), "private KV tokens went negative"
    cache = rep.cache
    assert cache.used_shared_blocks >= 0 and cache.evictable_blocks >= 0
    assert rep.private_blocks() + cache.used_shared_blocks + cache.evictable_blocks <= cache.total_blocks
    assert 0.0 <= rep.load().kv_watermark_ratio <= 1.0
    assert rep.n_running == len(rep.running_requests()) <= rep.max_seqs


def _drain(rep: SimReplica, horizon_step: bool = False, check: bool = True) -> float:
    now = 0.0
    while rep.has_work():
        end = rep.plan(now, horizon=now if horizon_step else float("inf"))
        assert end is not None and end > now
        if check:
            _check(rep)
        rep.complete()
        if check:
            _check(rep)
        now = end
    return now


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 150), st.integers(0, 3)), min_size=1,
                max_size=25), st.integers(40, 120))
def test_kv_accounting_never_negative_nor_over_capacity_and_every_request_finishes_exactly(reqs, blocks):
    rep = _tiny(blocks)
    made = []
    for i, (p, o, prio) in enumerate(reqs):
        if p + o > blocks * 16:
            continue
        r = SimRequest(f"r{i}", p, o, priority=prio)
        rep.add(r, 0.0)
        made.append(r)
    _drain(rep)
    for r in made:
        assert r.state == FINISHED and r.out == r.target
        assert r.first_token_s is not None and r.finish_s >= r.first_token_s
    assert rep.used_blocks() == 0 and rep.n_running == 0


def test_kv_pressure_preempts_by_recompute_lowest_priority_first_and_still_finishes():
    rep = _tiny(48, budget=2048)                       # 768 tokens of KV
    hi = [SimRequest(f"hi{i}", 100, 200, priority=0) for i in range(2)]
    lo = [SimRequest(f"lo{i}", 100, 200, priority=5) for i in range(2)]
    for r in hi + lo:
        rep.add(r, 0.0)
    _drain(rep)
    assert rep.preemptions_total > 0
    assert sum(r.preemptions for r in lo) >= 1 and sum(r.preemptions for r in hi) == 0
    assert all(r.out == 200 for r in hi + lo)
    assert any(r.gap_itls for r in lo)                 # the recompute gap shows up as one long ITL
    assert rep.input_tokens_computed > 4 * 100        # recompute re-prefills prompt + output


def test_chunked_prefill_spreads_a_long_prompt_over_steps_within_the_token_budget():
    rep = _tiny(2000, budget=1024)
    long = SimRequest("long", 3000, 5)
    rep.add(long, 0.0)
    steps = 0
    now = 0.0
    while long.first_token_s is None:
        now = rep.plan(now)
        rep.complete()
        steps += 1
    assert steps == 3                                  # 1024 + 1024 + 952
    short = SimRequest("short", 100, 5)
    rep.add(short, now)
    chunk_sizes = []
    while rep.has_work():
        now = rep.plan(now)
        chunk_sizes.append(sum(c for _, c in rep.planned_chunks()))
        rep.complete()
    assert max(chunk_sizes) <= 1024


def test_long_prefill_threshold_caps_a_request_per_step():
    rep = _tiny(2000, budget=1024, long_prefill_token_threshold=256)
    a, b = SimRequest("a", 2000, 2), SimRequest("b", 200, 2)
    rep.add(a, 0.0)
    rep.add(b, 0.0)
    rep.plan(0.0)
    assert sorted(c for _, c in rep.planned_chunks()) == [200, 256]
    rep.complete()


def test_prefix_cache_hits_on_repeated_hashes_and_skips_that_prefill():
    rep = _tiny(2000, budget=4096, group_tokens=512)
    first = SimRequest("first", 2100, 3, hash_ids=[11, 12, 13, 14, 15])
    rep.add(first, 0.0)
    now = _drain(rep)
    computed_before = rep.input_tokens_computed
    second = SimRequest("second", 2100, 3, hash_ids=[11, 12, 13, 99, 98])  # shares 3 groups
    rep.add(second, now)
    _drain(rep)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 3 * 512
    assert rep.input_tokens_computed - computed_before == 2100 - 3 * 512
    assert rep.cache.hits_tokens == 3 * 512 and rep.cache.queries_tokens == 4200


def test_prefix_cache_evicts_least_recently_released_groups():
    cache = PrefixCache(total_blocks=100, block_size=16, group_tokens=512)   # 32 blocks per group
    assert cache.register(1) and cache.register(2) and not cache.register(1)
    cache.release(1)
    cache.release(2)
    assert cache.evictable_blocks == 64 and cache.used_shared_blocks == 0
    assert cache.cached_prefix([1, 2, 3]) == 2
    assert cache.make_room(private_blocks=30, new_blocks=30)    # 6 free → evict group 1 (LRU)
    assert cache.cached_prefix([1]) == 0 and cache.cached_prefix([2]) == 1
    cache.acquire(2)
    assert cache.used_shared_blocks == 32 and cache.evictable_blocks == 0
    assert not cache.make_room(private_blocks=60, new_blocks=20)
    with pytest.raises(ValueError):
        PrefixCache(10, 16, 100)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000))
def test_decode_segments_give_the_same_timeline_as_single_steps(seed):
    rnd = random.Random(seed)
    spec = [(rnd.randint(1, 400), rnd.randint(1, 120), rnd.randint(0, 2)) for _ in range(12)]

    def run(single: bool) -> dict[str, tuple[float, float]]:
        rep = _tiny(200, budget=512)
        reqs = [SimRequest(f"r{i}", p, o, priority=pr) for i, (p, o, pr) in enumerate(spec)]
        for r in reqs:
            rep.add(r, 0.0)
        _drain(rep, horizon_step=single, check=False)
        return {r.request_id: (r.first_token_s, r.finish_s) for r in reqs}

    fast, slow = run(False), run(True)
    for rid in fast:
        assert fast[rid] == pytest.approx(slow[rid], rel=1e-9, abs=1e-9)


def test_requests_that_can_never_fit_are_refused_and_bad_lengths_raise():
    rep = _tiny(10)
    with pytest.raises(ValueError, match="KV tokens"):
        rep.add(SimRequest("big", 150, 50), 0.0)
    with pytest.raises(ValueError):
        SimRequest("zero", 0, 5)
    with pytest.raises(ValueError):
        _tiny(10, scheduling="random")
