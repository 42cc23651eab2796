"""VTC properties of the scheduler core on a ManualClock (Sheng et al., OSDI 2024)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmeter.serving.scheduler import SchedulerConfig, SchedulerCore, SchedulerRejected, jain_index
from kvmeter.serving.tenancy import TierPolicy

from .helpers import StepEngine, job, make_core


def test_least_counter_dispatches_first_and_input_is_charged_at_dispatch():
    core, _ = make_core(max_engine_waiting=100)
    for i in range(3):
        core.submit(job(f"a{i}", "a", prompt=100))
        core.submit(job(f"b{i}", "b", prompt=30))
    order = [g.job.tenant_id for g in core.dispatch()]
    # b is cheaper per request, so VTC serves b more often: a(0→100) b(0→30) b(60) b(90) a(200) a
    assert order == ["a", "b", "b", "b", "a", "a"]
    assert core.tenant_counter("a") == 300.0
    assert core.tenant_counter("b") == 90.0


def test_output_tokens_are_charged_with_the_output_weight():
    core, _ = make_core(input_weight=1.0, output_weight=2.0)
    core.submit(job("r", "a", prompt=50))
    [g] = core.dispatch()
    core.charge_output(g, 5)
    assert core.tenant_counter("a") == 50 + 2 * 5
    core2, _ = make_core(input_weight=3.0, output_weight=5.0, tenant_weights={"a": 2.0})
    core2.submit(job("r", "a", prompt=50))
    [g2] = core2.dispatch()
    core2.charge_output(g2, 4)
    assert core2.tenant_counter("a") == (3 * 50 + 5 * 4) / 2.0
    assert core2.tenant_service("a") == 3 * 50 + 5 * 4


def test_negative_or_fractional_charge_is_a_clear_error():
    core, _ = make_core()
    core.submit(job("r", "a"))
    [g] = core.dispatch()
    with pytest.raises(ValueError, match="token count"):
        core.charge_output(g, -1)
    with pytest.raises(ValueError):
        core.charge_output(g, 1.5)


def test_reactivated_tenant_is_lifted_to_the_backlogged_minimum():
    core, _ = make_core(max_engine_waiting=1000)
    for i in range(20):
        core.submit(job(f"a{i}", "a", prompt=100))
    core.dispatch(max_grants=10)          # a: counter 1000, still backlogged
    assert core.tenant_counter("a") == 1000
    core.submit(job("b0", "b", prompt=10))  # b was idle: no banked credit
    assert core.tenant_counter("b") == 1000
    # b goes first once (tie broken by order), then they alternate by counter, never b ten times
    order = [g.job.tenant_id for g in core.dispatch(max_grants=4)]
    assert order.count("b") == 1


def test_lift_never_lowers_a_counter_and_uses_virtual_time_when_nobody_is_backlogged():
    core, _ = make_core(max_engine_waiting=1000)
    core.submit(job("a0", "a", prompt=500))
    core.dispatch()                          # a served 500 and left the backlog
    core.submit(job("b0", "b", prompt=10))   # nobody backlogged: lifted to the last leaver's 500
    assert core.tenant_counter("b") == 500
    core.dispatch()
    assert core.tenant_counter("b") == 510
    core.submit(job("c0", "c", prompt=1))
    core.submit(job("c1", "c", prompt=1))
    core.submit(job("b1", "b", prompt=1))    # b (510) joins c (510 after lift): b keeps its 510
    assert core.tenant_counter("b") == 510


def _run_backlogged(core, clock, tenants, steps, prompt=64, out=16, capacity=200_000, refill=24):
    eng = StepEngine(core, clock, capacity=capacity)
    n = 0
    for _ in range(steps):
        for t in tenants:
            while core.tenant_queue_depth(t) < refill:
                core.submit(job(f"{t}-{n}", t, prompt=prompt, max_tokens=out, tier=tenants[t]))
                n += 1
        eng.step()
    return eng


def test_weights_one_two_three_four_share_service_in_proportion():
    weights = {"w1": 1.0, "w2": 2.0, "w3": 3.0, "w4": 4.0}
    core, clock = make_core(tenant_weights=weights, max_engine_running=16, max_engine_waiting=16,
                            overload_control=False)
    _run_backlogged(core, clock, {t: "paid_interactive" for t in weights}, steps=3000)
    services = {t: core.tenant_service(t) for t in weights}
    total = sum(services.values())
    for t, w in weights.items():
        assert services[t] / total == pytest.approx(w / 10.0, rel=0.02)


def test_tier_weights_apply_before_tenant_weights():
    tiers = {"gold": TierPolicy("gold", weight=3.0), "bronze": TierPolicy("bronze", weight=1.0)}
    core, clock = make_core(tiers=tiers, default_tier="gold", max_engine_running=16,
                            max_engine_waiting=16, overload_control=False)
    layout = {"g1": "gold", "g2": "gold", "g3": "gold", "b1": "bronze"}
    _run_backlogged(core, clock, layout, steps=3000)
    gold = sum(core.tenant_service(t) for t in ("g1", "g2", "g3"))
    bronze = core.tenant_service("b1")
    assert gold / (gold + bronze) == pytest.approx(0.75, rel=0.02)
    assert jain_index([core.tenant_service(t) for t in ("g1", "g2", "g3")]) > 0.999


@settings(max_examples=40, deadline=None)
@given(prompts_f=st.lists(st.integers(1, 400), min_size=1, max_size=6),
       prompts_g=st.lists(st.integers(1, 400), min_size=1, max_size=6),
       out_f=st.integers(1, 60), out_g=st.integers(1, 60), slots=st.integers(1, 8))
def test_service_difference_of_two_backlogged_tenants_stays_within_the_vtc_bound(
        prompts_f, prompts_g, out_f, out_g, slots):
    """|W_f − W_g| ≤ 2·U, U = max(w_p·L_input, w_q·M) (Sheng et al., §4), at every step."""
    capacity = 2_000  # M: the most tokens the running batch holds
    core, clock = make_core(capacity=capacity, max_engine_running=slots, max_engine_waiting=slots,
                            tenant_kv_budget_ratio=None, overload_control=False)
    eng = StepEngine(core, clock, capacity=capacity)
    cfg = core.config
    bound = 2 * max(cfg.input_weight * max(prompts_f + prompts_g), cfg.output_weight * capacity)
    n = 0
    for _ in range(300):
        for t, prompts, out in (("f", prompts_f, out_f), ("g", prompts_g, out_g)):
            while core.tenant_queue_depth(t) < 12:  # deeper than the slots: always backlogged
                core.submit(job(f"{t}{n}", t, prompt=prompts[n % len(prompts)], max_tokens=out))
                n += 1
        eng.step()
        assert core.tenant_queue_depth("f") and core.tenant_queue_depth("g")
        assert abs(core.tenant_service("f") - core.tenant_service("g")) <= bound


def test_work_conserving_a_lone_tenant_fills_every_free_slot():
    core, clock = make_core(max_engine_running=4, max_engine_waiting=4)
    for i in range(10):
        core.submit(job(f"a{i}", "a", max_tokens=3))
    eng = StepEngine(core, clock)
    assert len(eng.dispatch()) == 4
    for _ in range(3):
        eng.step()
    assert len(eng.finished) == 4 and len(eng.running) == 4  # refilled at once
    while core.queued_total or eng.running:
        eng.step()
    assert len(eng.finished) == 10


def test_fcfs_policy_serves_in_global_arrival_order():
    core, _ = make_core("fcfs", max_engine_waiting=100)
    seq = [("a", 100), ("b", 1), ("a", 100), ("c", 5), ("b", 1)]
    for i, (t, p) in enumerate(seq):
        core.submit(job(f"r{i}", t, prompt=p))
    assert [g.job.request_id for g in core.dispatch()] == [f"r{i}" for i in range(5)]


def test_rpm_policy_refuses_past_the_limit_even_with_free_capacity_then_recovers():
    core, clock = make_core("rpm", rpm_limit=3)
    for i in range(3):
        core.submit(job(f"r{i}", "a"))
    with pytest.raises(SchedulerRejected) as err:
        core.submit(job("r3", "a"))
    assert err.value.reason == "rate_limited" and err.value.status_code == 429
    assert 59.0 <= err.value.retry_after_s <= 60.0
    core.submit(job("other", "b"))  # the limit is per tenant
    clock.advance(60.5)
    core.submit(job("r4", "a", arrival=clock.monotonic()))
    assert core.rejected_total["rate_limited"] == 1


def test_unknown_policy_and_bad_config_fail_at_construction():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        SchedulerCore(policy="lottery")
    with pytest.raises(ValueError, match="kv_watermark_high"):
        SchedulerConfig(kv_watermark_high=1.5)
    with pytest.raises(ValueError, match="default_tier"):
        SchedulerConfig(default_tier="platinum")
    with pytest.raises(ValueError, match="weight"):
        TierPolicy("x", weight=0)


def test_malformed_jobs_are_refused_with_400_not_raised_as_crashes():
    core, _ = make_core()
    for bad in (job("r", ""), job("r", "a", prompt=-1), job("r", "a", max_tokens=-5)):
        with pytest.raises(SchedulerRejected) as err:
            core.submit(bad)
        assert err.value.status_code == 400 and err.value.reason == "invalid"
    core.submit(job("dup", "a"))
    with pytest.raises(SchedulerRejected, match="already scheduled"):
        core.submit(job("dup", "a"))
