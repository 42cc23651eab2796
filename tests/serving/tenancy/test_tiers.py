"""The one tier policy: its rules (deadline, goodput, validation), its defaults, and a tenants config
that can set every field of it with errors naming the field."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

import pytest

from kvmeter.serving.scheduler import SchedulerConfig
from kvmeter.serving.tenancy import (DEFAULT_TIERS, ConfigError, Limits, RunBudget, TenantDirectory,
                                     TierPolicy, parse_config)
from kvmeter.serving.tenancy.tiers import (PRESSURE_ELEVATED, PRESSURE_OVERLOAD, TIER_FIELDS,
                                           tier_field_problem)


def test_tier_fields_are_every_policy_field_but_name_limits_run_budget_loop_stops_and_billing():
    names = {f.name for f in dataclasses.fields(TierPolicy)}
    assert set(TIER_FIELDS) == names - {"name", "limits", "run_budget", "loop_stops", "undelivered_billing"}


def test_the_deadline_rule_is_max_queue_wait_else_factor_times_ttft_else_none():
    assert TierPolicy("a", ttft_slo_s=2.0).deadline_s(10.0) == 16.0           # default factor 3
    assert TierPolicy("a", ttft_slo_s=2.0, deadline_slo_factor=1.5).deadline_s(10.0) == 13.0
    assert TierPolicy("a", ttft_slo_s=2.0, max_queue_wait_s=60.0).deadline_s(10.0) == 70.0
    assert TierPolicy("a", max_queue_wait_s=60.0).deadline_s(10.0) == 70.0
    assert TierPolicy("a", itl_slo_s=0.1).deadline_s(10.0) is None


def test_meets_slo_checks_each_promise_that_is_set():
    p = TierPolicy("a", ttft_slo_s=1.0, itl_slo_s=0.1)
    assert p.meets_slo(1.0, 0.1) and p.meets_slo(0.5, None)
    assert not p.meets_slo(1.01, 0.05) and not p.meets_slo(0.5, 0.11)
    assert TierPolicy("b", itl_slo_s=0.1).meets_slo(1e6, 0.1)
    assert not TierPolicy("b").has_slo and TierPolicy("b", ttft_slo_s=1.0).has_slo


@pytest.mark.parametrize("name,value", [
    ("weight", 0), ("weight", -1.0), ("weight", float("inf")), ("weight", None), ("weight", True),
    ("priority", -1), ("priority", 1.5), ("priority", None),
    ("ttft_slo_s", 0.0), ("itl_slo_s", -0.1), ("max_queue_wait_s", float("nan")),
    ("deadline_slo_factor", 0.5), ("deadline_slo_factor", None),
    ("pause_at", 0), ("pause_at", 3), ("shed_new_at", True), ("shed_queued_at", 1.0),
])
def test_a_bad_field_is_refused_by_the_policy_naming_the_field(name, value):
    assert tier_field_problem(name, value) is not None
    with pytest.raises(ValueError, match=name):
        TierPolicy("x", **{name: value})


def test_the_built_in_tiers_are_valid_and_the_scheduler_runs_with_them():
    assert list(DEFAULT_TIERS) == ["enterprise", "paid_interactive", "batch", "free"]
    assert all(tier_field_problem(f, getattr(p, f)) is None for p in DEFAULT_TIERS.values() for f in TIER_FIELDS)
    # one table: the scheduler's default tiers are the tenancy's objects themselves
    assert all(SchedulerConfig().tiers[name] is policy for name, policy in DEFAULT_TIERS.items())
    weights = [p.weight for p in DEFAULT_TIERS.values()]
    priorities = [p.priority for p in DEFAULT_TIERS.values()]
    assert weights == [8.0, 4.0, 1.0, 1.0] and priorities == [0, 1, 2, 3]
    assert [p.protected for p in DEFAULT_TIERS.values()] == [True, True, False, False]


EVERY_FIELD = """
default_tier: research
tiers:
  free:
    weight: 0.5
    priority: 7
    ttft_slo_s: 8
    itl_slo_s: 0.5
    deadline_slo_factor: 2
    max_queue_wait_s: null
    pause_at: 1
    shed_new_at: 2
    shed_queued_at: null
    limits: {org: {requests_per_minute: 11}}
    run_budget: {max_tool_calls: 3}
  research:
    weight: 2.5
    priority: 4
    ttft_slo_s: null
    itl_slo_s: 0.2
    deadline_slo_factor: 1.5
    max_queue_wait_s: 120
    pause_at: 2
    shed_new_at: null
    shed_queued_at: 2
    limits: {api_key: {concurrent_requests: 3, spend_per_day: "1.50"}}
    run_budget: {max_model_calls: 9}
"""


def test_a_tenants_config_sets_every_field_of_a_built_in_and_of_a_new_tier():
    tiers = TenantDirectory(EVERY_FIELD).snapshot.tiers
    free, research = tiers["free"], tiers["research"]
    assert {f: getattr(free, f) for f in TIER_FIELDS} == {
        "weight": 0.5, "priority": 7, "ttft_slo_s": 8.0, "itl_slo_s": 0.5, "deadline_slo_factor": 2.0,
        "max_queue_wait_s": None, "pause_at": PRESSURE_ELEVATED, "shed_new_at": PRESSURE_OVERLOAD,
        "shed_queued_at": None}
    assert {f: getattr(research, f) for f in TIER_FIELDS} == {
        "weight": 2.5, "priority": 4, "ttft_slo_s": None, "itl_slo_s": 0.2, "deadline_slo_factor": 1.5,
        "max_queue_wait_s": 120.0, "pause_at": PRESSURE_OVERLOAD, "shed_new_at": None,
        "shed_queued_at": PRESSURE_OVERLOAD}
    # limits and run budget: the built-in's, overridden field by field; a new tier has only its own
    assert free.limits_for("org") == dataclasses.replace(DEFAULT_TIERS["free"].limits_for("org"),
                                                        requests_per_minute=11)
    assert free.limits_for("api_key") == DEFAULT_TIERS["free"].limits_for("api_key")
    assert free.run_budget == dataclasses.replace(DEFAULT_TIERS["free"].run_budget, max_tool_calls=3)
    assert research.limits_for("api_key") == Limits(concurrent_requests=3, spend_per_day=Decimal("1.50"))
    assert research.limits_for("org") == Limits() and research.run_budget == RunBudget(max_model_calls=9)
    # the tiers the file does not touch stay the built-in objects
    assert tiers["enterprise"] is DEFAULT_TIERS["enterprise"]
    assert free.deadline_s(0.0) == 16.0 and research.deadline_s(0.0) == 120.0


@pytest.mark.parametrize("field,value,words", [
    ("weight", "0", "weight must be a positive"),
    ("weight", "null", "weight must be a positive"),
    ("priority", "-2", "priority must be an integer ≥ 0"),
    ("ttft_slo_s", "0", "ttft_slo_s must be a positive"),
    ("itl_slo_s", "-1", "itl_slo_s must be a positive"),
    ("deadline_slo_factor", "0.5", "deadline_slo_factor must be a finite number ≥ 1"),
    ("max_queue_wait_s", ".inf", "max_queue_wait_s must be a positive finite"),
    ("pause_at", "3", "pause_at must be 1 (elevated), 2 (overload) or null"),
    ("shed_new_at", "true", "not a boolean"),
    ("shed_queued_at", "overload", "valid integer"),
    ("deadline_factor", "2", "not permitted"),
])
def test_a_bad_tier_field_in_the_config_is_an_error_naming_it(field, value, words):
    with pytest.raises(ConfigError) as info:
        parse_config(f"tiers: {{free: {{{field}: {value}}}}}")
    assert any(path == f"tiers.free.{field}" and words in msg for path, msg in info.value.problems), \
        info.value.problems
