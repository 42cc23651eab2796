"""The engine pool's router (kvmeter.serving.scheduler.router): the three policies, the prefix
index on an injected clock, and the core dispatching through it (failover, down replicas)."""

from __future__ import annotations

import pytest

from kvmeter.attribution import Attribution
from kvmeter.clock import ManualClock
from kvmeter.serving.scheduler import Job, SchedulerConfig, SchedulerCore, SchedulerRejected
from kvmeter.serving.scheduler.gating import EngineGate
from kvmeter.serving.scheduler.router import PrefixIndex, Router, prefix_block_hashes
from kvmeter.stats import EngineLoad, RoutingDecision

CAP = 100_000
SYSTEM = list(range(1000, 1064))  # a 64-token shared system prompt: 4 blocks of 16


def prompt(tail: int, n_tail: int = 20) -> list[int]:
    return SYSTEM + [tail + i for i in range(n_tail)]


def gates(*watermarks: float, config: SchedulerConfig | None = None) -> list[EngineGate]:
    config = config or SchedulerConfig()
    out = []
    for i, w in enumerate(watermarks):
        g = EngineGate(i, config)
        g.load = EngineLoad(w, CAP, 0, 0, per_step=False)
        g.reported = True
        out.append(g)
    return out


def test_block_hashes_are_chained_full_blocks():
    a = prefix_block_hashes(prompt(5000), 16)
    b = prefix_block_hashes(prompt(9000), 16)
    assert len(a) == 5 and len(b) == 5  # 84 tokens: 5 full blocks, the 4 leftover tokens not hashed
    assert a[:4] == b[:4] and a[4] != b[4]  # same system prompt, different question
    # a block's hash names the prefix up to it: the same block after another prefix differs
    assert prefix_block_hashes(SYSTEM[16:32], 16)[0] != a[1]
    assert prefix_block_hashes(list(range(15)), 16) == ()
    assert len(prefix_block_hashes(list(range(16 * 100)), 16, max_blocks=8)) == 8
    with pytest.raises(ValueError):
        prefix_block_hashes([1], 0)


def test_the_index_matches_leading_blocks_forgets_after_its_ttl_and_evicts_lru():
    clock = ManualClock()
    index = PrefixIndex(capacity_blocks=6, ttl_s=60.0, clock=clock)
    a = prefix_block_hashes(prompt(5000), 16)
    index.record(a, 1)
    assert index.match(a) == {1: 5}
    assert index.match(prefix_block_hashes(prompt(9000), 16)) == {1: 4}  # the shared head only
    clock.advance(30.0)
    index.record(a[:2], 0)
    assert index.match(a) == {1: 5, 0: 2}
    clock.advance(30.0)  # replica 1's entries are 60 s old: gone; replica 0's are 30 s old
    assert index.match(a) == {0: 2}
    index.record([1, 2], 2)  # 5 + 2 blocks > 6: the least recently used block (a[2]) goes
    assert len(index) == 6 and index.match(a) == {0: 2}
    index.forget(0)
    assert index.match(a) == {}


def test_round_robin_cycles_over_the_open_replicas():
    g = gates(0.9, 0.1, 0.5)
    router = Router("round_robin")
    cfg = SchedulerConfig()
    chosen = []
    for _ in range(4):
        route = router.choose(g, (), cfg)
        router.commit(route, ())
        chosen.append(route.engine.idx)
    assert chosen == [0, 1, 2, 0]
    route = router.choose([g[0], g[2]], (), cfg)  # 1 closed: after 0 comes 2
    assert route.engine.idx == 2 and route.outcome == "no_prefix"


def test_least_kv_takes_the_most_free_kv():
    route = Router("least_kv").choose(gates(0.6, 0.2, 0.4), prefix_block_hashes(prompt(1)), SchedulerConfig())
    assert route.engine.idx == 1 and route.outcome == "prefix_miss"


def test_prefix_aware_follows_the_prefix_until_the_replica_is_much_fuller():
    clock = ManualClock()
    cfg = SchedulerConfig()
    decisions: list[RoutingDecision] = []
    router = Router("prefix_aware", clock=clock, model="m", replica_names=["http://a", "http://b"],
                    on_decision=decisions.append)
    g = gates(0.3, 0.1)
    first = prefix_block_hashes(prompt(5000))
    route = router.choose(g, first, cfg)
    assert route.engine.idx == 1 and route.outcome == "prefix_miss"  # nothing known: the emptier
    router.commit(route, first)
    # the same system prompt, another question: 4 of 5 blocks held by 1, which stays chosen even
    # when it is fuller than 0 (a hit of 0.8 outweighs 0.5 more KV) ...
    g[1].load = EngineLoad(0.8, CAP, 0, 0, per_step=False)
    second = prefix_block_hashes(prompt(9000))
    route = router.choose(g, second, cfg)
    assert (route.engine.idx, route.outcome, route.matched_blocks) == (1, "prefix_hit", 4)
    router.commit(route, second)
    # ... but not with a queue half its bound as well: the request goes where there is room (a miss)
    g[1].unstarted = cfg.max_engine_waiting // 2
    third = prefix_block_hashes(prompt(7000))
    route = router.choose(g, third, cfg)
    assert (route.engine.idx, route.outcome) == (0, "prefix_miss")
    assert [(d.outcome, d.replica, d.policy, d.model) for d in decisions] == [
        ("prefix_miss", "http://b", "prefix_aware", "m"), ("prefix_hit", "http://b", "prefix_aware", "m")]
    # past the index's ttl the affinity is gone
    g[1].unstarted = 0
    clock.advance(router.index.ttl_s)
    assert router.choose(g, second, cfg).outcome == "prefix_miss"


def test_a_replica_whose_room_cannot_take_the_prompt_is_passed_over():
    cfg = SchedulerConfig()
    router = Router("prefix_aware")
    g = gates(0.0, 0.0)
    blocks = prefix_block_hashes(prompt(1))
    router.commit(router.choose([g[0]], blocks, cfg), blocks)
    g[0].unstarted_tokens = int(cfg.kv_watermark_high * CAP) - 10  # 10 tokens of room left
    other = prefix_block_hashes(list(range(5000, 5084)))  # nothing of it cached on 0
    assert router.choose(g, other, cfg, need_tokens=84).engine.idx == 1


def test_the_blocks_a_replica_holds_do_not_count_against_its_room():
    # the system prompt's 4 blocks (64 tokens) are cached on replica 0, which has 30 tokens of room
    # left: the request's 84-token prompt needs 20 new ones there, so it still goes to the holder
    # (counted whole, 84 > 30, it went to the fuller replica 1 and missed the cache)
    cfg = SchedulerConfig()
    router = Router("prefix_aware")
    g = gates(0.0, 0.5)
    first = prefix_block_hashes(prompt(1))
    router.commit(router.choose([g[0]], first, cfg), first)
    g[0].unstarted_tokens = int(cfg.kv_watermark_high * CAP) - 30
    second = prefix_block_hashes(prompt(500))
    route = router.choose(g, second, cfg, need_tokens=84)
    assert (route.engine.idx, route.outcome, route.matched_blocks) == (0, "prefix_hit", 4)
    # a replica holding nothing of it still needs the whole prompt's room
    assert router.choose(g, prefix_block_hashes(list(range(5000, 5084))), cfg, need_tokens=84).engine.idx == 1
    with pytest.raises(ValueError):
        Router(block_tokens=0)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round_robin"):
        Router("random")


def _job(rid: str, tokens: list[int]) -> Job:
    return Job(request_id=rid, attribution=Attribution("t1", tier="paid_interactive"), input_tokens=len(tokens),
               max_tokens=8, arrival_s=0.0, prefix_blocks=prefix_block_hashes(tokens))


def test_the_core_routes_through_the_router_and_fails_over_off_a_down_replica():
    clock = ManualClock()
    decisions: list[RoutingDecision] = []
    router = Router("prefix_aware", clock=clock, model="m", on_decision=decisions.append)
    core = SchedulerCore(SchedulerConfig(), clock=clock, num_engines=3, router=router)
    for i in range(3):
        core.on_engine_load(EngineLoad(0.1 * (i + 1), CAP, 0, 0, per_step=False), i)
    core.submit(_job("a", prompt(5000)))
    (a,) = core.dispatch()
    assert a.engine_idx == 0  # the emptiest, nothing known yet
    core.submit(_job("b", prompt(9000)))
    (b,) = core.dispatch()
    assert b.engine_idx == 0 and decisions[-1].outcome == "prefix_hit"
    # replica 0 refuses connections: b moves (its accounting with it), and 0 takes no more
    core.set_engine_available(0, False)
    assert core.reroute(b) == 1 and b.engine_idx == 1 and decisions[-1].outcome == "failover"
    gates_ = core.engine_gates
    assert (gates_[0].outstanding, gates_[1].outstanding) == (1, 1)
    assert (gates_[0].unstarted_tokens, gates_[1].unstarted_tokens) == (84, 84)
    core.submit(_job("c", prompt(5000)))
    (c,) = core.dispatch()
    # 0 takes nothing new; b's failover recorded the shared head on 1, so c follows it there
    assert c.engine_idx == 1 and decisions[-1].outcome == "prefix_hit"
    for g in (a, b, c):
        core.release(g)
    assert (gates_[0].outstanding, gates_[1].outstanding, gates_[0].unstarted_tokens) == (0, 0, 0)
    core.set_engine_available(1, False)
    core.set_engine_available(2, False)
    with pytest.raises(SchedulerRejected) as none_left:  # no replica available: refused, not queued
        core.submit(_job("d", prompt(1)))
    assert none_left.value.status_code == 503 and none_left.value.reason == "no_replica_available"
    core.set_engine_available(2, True)
    core.submit(_job("d", prompt(1)))
    (d,) = core.dispatch()
    assert d.engine_idx == 2
    assert core.reroute(d) is None  # nowhere else to go


def _queued_job(rid: str, tier: str, deadline_s: float | None = None) -> Job:
    return Job(request_id=rid, attribution=Attribution(f"t-{rid}", tier=tier), input_tokens=10, max_tokens=8,
               arrival_s=0.0, deadline_s=deadline_s)


def test_a_pool_with_every_replica_down_refuses_at_once_and_ends_the_queued_waits():
    """Regression: with every replica down, requests queued without a deadline (batch) waited
    forever and the others until their deadline (a misleading 429 ``deadline``)."""
    clock = ManualClock()
    core = SchedulerCore(SchedulerConfig(max_engine_running=1), clock=clock, num_engines=2, model="m")
    running = []
    for i in range(2):
        core.submit(_queued_job(f"run{i}", "enterprise"))
        running += core.dispatch()
    assert len(running) == 2  # both replicas full: the next ones queue
    for rid, tier, deadline in [("b", "batch", None), ("e", "enterprise", 3.0), ("f", "free", 10.0)]:
        core.submit(_queued_job(rid, tier, deadline))
    assert core.queued_total == 3
    core.set_engine_available(0, False, down=True)
    assert core.queued_total == 3 and core.take_dropped() == []  # replica 1 is still up: they wait
    core.set_engine_available(1, False, down=True)
    dropped = core.take_dropped()
    assert sorted(job.request_id for job, _ in dropped) == ["b", "e", "f"] and core.queued_total == 0
    for _, err in dropped:
        assert (err.status_code, err.reason) == (503, "no_replica_available")
        assert "model 'm'" in err.message and "all 2 of its replicas are down" in err.message
    with pytest.raises(SchedulerRejected, match="all 2 of its replicas are down") as refused:
        core.submit(_queued_job("late", "batch"))
    assert refused.value.status_code == 503 and core.rejected_total["no_replica_available"] == 1
    assert core.dropped_total["no_replica_available"] == 3
    for g in running:  # what ran goes on and ends as usual
        core.release(g)
    assert core.running_total == 0
    # drained by an operator: the same refusal, saying so
    core.set_engine_available(1, False, down=False)
    with pytest.raises(SchedulerRejected, match=r"replicas are down \(1\) or drained by an operator \(1\)"):
        core.submit(_queued_job("x", "free"))
    core.set_engine_available(0, False, down=False)
    with pytest.raises(SchedulerRejected, match="all 2 of its replicas are drained by an operator"):
        core.submit(_queued_job("y", "free"))
    # a replica back: served again
    core.set_engine_available(0, True)
    core.submit(_queued_job("z", "batch"))
    (z,) = core.dispatch()
    assert z.engine_idx == 0 and core.take_dropped() == []
