"""KV budgets, engine gating, engine priority and multi-engine dispatch."""

from __future__ import annotations

import pytest

from kvmeter.serving.scheduler import SchedulerRejected
from kvmeter.serving.scheduler.gating import LEAD_SAMPLES, FirstTokenLead
from kvmeter.stats import EngineLoad

from .helpers import job, make_core


def test_kv_budget_blocks_a_tenant_while_others_proceed_and_unblocks_on_release():
    core, _ = make_core(capacity=100_000, tenant_kv_budget_tokens={"a": 1_000}, max_engine_waiting=100)
    for i in range(3):
        core.submit(job(f"a{i}", "a", prompt=400))
    core.submit(job("b0", "b", prompt=400))
    core.submit(job("b1", "b", prompt=400))
    grants = core.dispatch()
    by = [g.job.request_id for g in grants]
    assert by.count("a0") == 1 and "a1" in by and "a2" not in by  # 800 ≤ 1000 < 1200
    assert {"b0", "b1"} <= set(by)                                  # work-conserving for b
    assert core.tenant_active_kv("a") == 800
    core.charge_output(grants[0], 150)                               # a's KV grows with output
    assert core.tenant_active_kv("a") == 950
    core.release(grants[0])
    [g] = core.dispatch()
    assert g.job.request_id == "a2" and core.tenant_active_kv("a") == 800


def test_kv_budget_never_starves_a_single_request_larger_than_the_budget():
    core, _ = make_core(capacity=100_000, tenant_kv_budget_tokens={"a": 100})
    core.submit(job("big", "a", prompt=5_000))
    assert [g.job.request_id for g in core.dispatch()] == ["big"]


def test_default_budget_is_a_fraction_of_total_kv_capacity():
    core, _ = make_core(capacity=10_000, tenant_kv_budget_ratio=0.25, max_engine_waiting=100)
    for i in range(5):
        core.submit(job(f"a{i}", "a", prompt=1_000))
    assert len(core.dispatch()) == 2  # 2,000 ≤ 2,500 < 3,000
    assert core.snapshot().tenants[0].kv_budget_tokens == 2_500


def test_engine_kv_watermark_gates_dispatch():
    core, _ = make_core(capacity=10_000, kv_watermark_high=0.9)
    core.on_engine_load(EngineLoad(0.95, 10_000, 5, 0))
    core.submit(job("r", "a", prompt=10))
    assert core.dispatch() == []
    core.on_engine_load(EngineLoad(0.50, 10_000, 5, 0))
    assert len(core.dispatch()) == 1


def test_prompts_dispatched_since_the_last_report_count_against_the_watermark():
    core, _ = make_core(capacity=10_000, kv_watermark_high=0.9, max_engine_waiting=100,
                        tenant_kv_budget_ratio=None)
    for i in range(10):
        core.submit(job(f"r{i}", f"t{i}", prompt=2_000))
    assert len(core.dispatch()) == 4  # 4 × 2,000 = 8,000 ≤ 9,000 < 10,000


def test_head_of_line_request_that_does_not_fit_waits_and_is_not_skipped():
    core, _ = make_core(capacity=10_000, kv_watermark_high=0.9, tenant_kv_budget_ratio=None)
    core.submit(job("small", "a", prompt=100))
    [g] = core.dispatch()
    core.on_engine_load(EngineLoad(0.5, 10_000, 1, 0))
    core.submit(job("big", "b", prompt=5_000))   # b has the least counter but 5,000 > room
    core.submit(job("later", "c", prompt=1))
    assert core.dispatch() == []                  # no skipping: big would starve otherwise
    core.release(g)
    core.on_engine_load(EngineLoad(0.0, 10_000, 0, 0))
    assert [x.job.request_id for x in core.dispatch()] == ["big", "later"]


def test_prompt_larger_than_the_engine_can_ever_hold_is_refused_at_admission():
    core, _ = make_core(capacity=10_000, kv_watermark_high=0.9)
    with pytest.raises(SchedulerRejected) as err:
        core.submit(job("huge", "a", prompt=9_500))
    assert err.value.reason == "kv_capacity_exceeded" and err.value.status_code == 400


def test_running_and_waiting_counts_gate_dispatch():
    core, _ = make_core(max_engine_running=3, max_engine_waiting=2)
    for i in range(5):
        core.submit(job(f"r{i}", "a"))
    grants = core.dispatch()
    assert len(grants) == 2                       # two dispatched since the last report fill the queue
    core.on_engine_load(EngineLoad(0.0, 1_000_000, 1, 1))  # the engine took one into its batch
    grants += core.dispatch()
    assert len(grants) == 3                       # now the running cap (3 outstanding) binds
    core.on_engine_load(EngineLoad(0.0, 1_000_000, 3, 0))
    assert core.dispatch() == []
    core.release(grants[0])
    assert len(core.dispatch()) == 1


def test_without_engine_reports_requests_that_have_not_started_count_as_waiting():
    from kvmeter.clock import ManualClock
    from kvmeter.serving.scheduler import SchedulerConfig, SchedulerCore
    core = SchedulerCore(SchedulerConfig(max_engine_waiting=2), clock=ManualClock())
    for i in range(4):
        core.submit(job(f"r{i}", "a"))
    grants = core.dispatch()
    assert len(grants) == 2
    core.charge_output(grants[0], 1)              # its first token: it left the engine's queue
    assert len(core.dispatch()) == 1


def test_a_periodic_load_report_counts_the_engines_queue_from_unstarted_requests():
    """A remote engine reports its load once per scrape (per_step=False): the requests dispatched
    since that report are not all still queued in the engine (most started long ago), so the
    waiting gate counts kvmeter's own dispatched requests without a first token instead."""
    core, _ = make_core(max_engine_waiting=2, tenant_kv_budget_ratio=None)
    core.on_engine_load(EngineLoad(0.1, 1_000_000, 0, 0, per_step=False))
    for i in range(6):
        core.submit(job(f"r{i}", f"t{i}"))
    grants = core.dispatch()
    assert len(grants) == 2
    for g in grants:
        core.charge_output(g, 1)                  # first tokens: they left the engine's queue
    grants += core.dispatch()                     # no new report, yet the gate opens again
    assert len(grants) == 4
    # the same with per-step reports: the two dispatched since the report are counted as waiting
    step, _ = make_core(max_engine_waiting=2, tenant_kv_budget_ratio=None)
    step.on_engine_load(EngineLoad(0.1, 1_000_000, 0, 0))
    for i in range(6):
        step.submit(job(f"r{i}", f"t{i}"))
    first = step.dispatch()
    for g in first:
        step.charge_output(g, 1)
    assert len(first) == 2 and step.dispatch() == []


def test_a_watermark_without_a_capacity_still_closes_the_gate():
    """A scraped vLLM page without ``vllm:cache_config_info`` gives the watermark but no capacity."""
    core, _ = make_core(capacity=0, kv_watermark_high=0.9, max_engine_waiting=100)
    core.on_engine_load(EngineLoad(0.97, 0, 12, 3, per_step=False))
    core.submit(job("r", "a", prompt=10))
    assert core.dispatch() == []
    core.on_engine_load(EngineLoad(0.4, 0, 12, 3, per_step=False))
    assert [g.job.request_id for g in core.dispatch()] == ["r"]


def test_grant_carries_the_tier_engine_priority():
    core, _ = make_core(max_engine_waiting=10)
    core.submit(job("e", "x", tier="enterprise"))
    core.submit(job("f", "y", tier="free"))
    core.submit(job("u", "z", tier="no-such-tier"))  # unknown tiers use the default tier
    prio = {g.job.request_id: g.priority for g in core.dispatch()}
    assert prio == {"e": 0, "f": 3, "u": 1}


def test_multi_engine_dispatch_goes_to_the_engine_with_most_kv_room():
    core, _ = make_core(capacity=10_000, num_engines=2, max_engine_waiting=1)
    core.on_engine_load(EngineLoad(0.7, 10_000, 4, 0), 0)
    core.on_engine_load(EngineLoad(0.1, 10_000, 1, 0), 1)
    core.submit(job("r0", "a"))
    core.submit(job("r1", "b"))
    placed = {g.job.request_id: g.engine_idx for g in core.dispatch()}
    assert placed == {"r0": 1, "r1": 0}           # engine 1 first; its queue cap then sends r1 to 0
    with pytest.raises(ValueError):
        core.on_engine_load(EngineLoad(0.1, 10_000, 1, 0), 2)
    with pytest.raises(ValueError):
        core.on_engine_load(EngineLoad(1.5, 10_000, 1, 0), 0)


def test_prefill_budget_keeps_one_tenants_long_prompts_from_filling_every_step():
    core, _ = make_core(tenant_prefill_budget_tokens=1_000, tenant_kv_budget_ratio=None, max_engine_waiting=100)
    for i in range(3):
        core.submit(job(f"a{i}", "a", prompt=600))
    core.submit(job("b0", "b", prompt=600))
    first = core.dispatch()
    assert [g.job.request_id for g in first] == ["a0", "b0"]   # a1 would put 1,200 in prefill
    assert core.dispatch() == []
    core.charge_output(first[0], 1)                            # a0's prefill is done
    assert [g.job.request_id for g in core.dispatch()] == ["a1"]
    core.submit(job("huge", "c", prompt=50_000))               # alone in prefill: always allowed
    assert [g.job.request_id for g in core.dispatch()] == ["huge"]


def test_first_token_lead_fits_the_requests_own_size_and_never_extrapolates_one_size_upward():
    lead = FirstTokenLead()
    lead.observe(20, 0.2)                      # one size seen: proportional below it, flat above
    assert lead.lead_s(10) == pytest.approx(0.1)
    assert lead.lead_s(7_800) == pytest.approx(0.2)
    lead.observe(7_800, 26.0)                  # two sizes: a + c × tokens through both
    c = (26.0 - 0.2) / 7_780
    assert lead.per_token_s == pytest.approx(c)
    assert lead.intercept_s == pytest.approx(0.2 - 20 * c)
    assert lead.lead_s(20) == pytest.approx(0.2) and lead.lead_s(7_800) == pytest.approx(26.0)
    for _ in range(LEAD_SAMPLES):              # only the last LEAD_SAMPLES count
        lead.observe(100, 0.5)
    assert lead.samples == LEAD_SAMPLES and lead.lead_s(100) == pytest.approx(0.5)
    assert lead.lead_s(7_800) == pytest.approx(0.5)
