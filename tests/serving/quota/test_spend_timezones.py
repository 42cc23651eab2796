"""Spend windows follow the tenant's billing time zone (org ``billing_timezone``), DST edges
included; every body runs on the memory store and on real Redis."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from quota_testlib import P_IN, P_OUT, estimate, tree
from kvmeter.clock import ManualClock
from kvmeter.serving.quota import HierarchicalQuota, QuotaRejected
from kvmeter.tokens import TokenCounts
from kvmeter.serving.quota.plan import period_end_s
from kvmeter.serving.tenancy import ConfigError, TenantDirectory, parse_config

K1, O1 = "sk-test-key-one", "sk-test-other-one"
ONE = P_IN * 100 + P_OUT * 100      # the price of estimate() (100 in, 100 out)




def at(iso: str) -> float:
    return datetime.fromisoformat(iso).astimezone(timezone.utc).timestamp()


def zoned(zone: str, org_limits: str) -> str:
    return tree(org_limits).replace("    tier: enterprise\n    limits:",
                                    f"    tier: enterprise\n    billing_timezone: {zone}\n    limits:", 1)


def gate_at(make_gate, clock: ManualClock, when: str, config: str) -> HierarchicalQuota:
    clock.advance(at(when) - clock.wall())
    return make_gate(config)


async def spend_keys(gate: HierarchicalQuota, code: str, *periods: str) -> list[int]:
    return await gate.store.get_values([f"{gate.store.key_prefix}o:{{acme}}:{code}:{p}" for p in periods])


async def test_new_york_spend_day_starts_at_local_midnight_and_is_23_hours_on_spring_forward(make_gate, clock):
    gate = gate_at(make_gate, clock, "2026-03-08T04:59:00+00:00",   # 23:59 EST on 2026-03-07
                   zoned("America/New_York", f"{{spend_per_day: '{ONE}'}}"))
    principal = gate.directory.authenticate(K1)
    r = await gate.reserve(principal, estimate(principal=principal))
    await gate.reconcile(r, TokenCounts(input_tokens=100, cached_input_tokens=0, output_tokens=100))
    with pytest.raises(QuotaRejected) as info:
        await gate.reserve(principal, estimate(principal=principal))
    assert info.value.retry_after_s == pytest.approx(60)                 # to 00:00 EST, not to UTC midnight
    clock.advance(60)                                                   # 2026-03-08T00:00 EST: a new local day
    r = await gate.reserve(principal, estimate(principal=principal))
    with pytest.raises(QuotaRejected) as info:
        await gate.reserve(principal, estimate(principal=principal))
    assert info.value.retry_after_s == pytest.approx(23 * 3600)         # the clocks spring forward: 23 h
    await gate.reconcile(r, TokenCounts(input_tokens=100, cached_input_tokens=0, output_tokens=100))
    assert await spend_keys(gate, "sd", "2026-03-07", "2026-03-08") == [ONE * 10**9, ONE * 10**9]


async def test_new_york_fall_back_day_is_25_hours(make_gate, clock):
    gate = gate_at(make_gate, clock, "2026-11-01T04:00:00+00:00",   # 00:00 EDT on 2026-11-01
                   zoned("America/New_York", f"{{spend_per_day: '{ONE}'}}"))
    principal = gate.directory.authenticate(K1)
    await gate.reserve(principal, estimate(principal=principal))
    with pytest.raises(QuotaRejected) as info:
        await gate.reserve(principal, estimate(principal=principal))
    assert info.value.retry_after_s == pytest.approx(25 * 3600)
    clock.advance(25 * 3600 - 1)                                        # 23:59:59 EST: still 2026-11-01
    with pytest.raises(QuotaRejected):
        await gate.reserve(principal, estimate(principal=principal))
    clock.advance(1)
    await gate.reserve(principal, estimate(principal=principal))                                # 2026-11-02 local


async def test_kathmandu_day_turns_at_18_15_utc_and_month_follows_the_zone(make_gate, clock):
    gate = gate_at(make_gate, clock, "2026-04-30T18:14:00+00:00",   # 23:59 on 2026-04-30 (+05:45)
                   zoned("Asia/Kathmandu", f"{{spend_per_day: '{ONE}', spend_per_month: '{ONE * 10}'}}"))
    principal = gate.directory.authenticate(K1)
    await gate.reserve(principal, estimate(principal=principal))
    clock.advance(60)                                                   # 00:00 on 2026-05-01 local
    await gate.reserve(principal, estimate(principal=principal))
    assert await spend_keys(gate, "sd", "2026-04-30", "2026-05-01") == [ONE * 10**9] * 2
    assert await spend_keys(gate, "sm", "2026-04", "2026-05") == [ONE * 10**9] * 2


async def test_global_spend_stays_utc_and_other_tenants_keep_utc(make_gate, clock):
    gate = gate_at(make_gate, clock, "2026-03-08T04:59:00+00:00",
                   zoned("Europe/Berlin", f"{{spend_per_day: '{ONE * 5}'}}").replace(
                       "global: {limits: {}}", f"global: {{limits: {{spend_per_day: '{ONE * 5}'}}}}"))
    k1 = gate.directory.authenticate(K1)
    await gate.reserve(k1, estimate(principal=k1))
    o1 = gate.directory.authenticate(O1)
    await gate.reserve(o1, estimate(principal=o1))
    prefix = gate.store.key_prefix
    day = "sd:2026-03-08"
    assert await gate.store.get_values([f"{prefix}g:{{_global}}:{day}", f"{prefix}o:{{acme}}:{day}"]) == \
        [2 * ONE * 10**9, ONE * 10**9]                                  # 05:59 in Berlin is 2026-03-08 too


async def test_a_reload_moves_the_spend_window_to_the_new_zone(make_gate, clock):
    gate = gate_at(make_gate, clock, "2026-06-15T02:00:00+00:00",   # 22:00 EDT on 2026-06-14
                   tree(f"{{spend_per_day: '{ONE}'}}"))
    principal = gate.directory.authenticate(K1)
    await gate.reserve(principal, estimate(principal=principal))
    with pytest.raises(QuotaRejected):                                  # UTC day 2026-06-15 is spent
        await gate.reserve(principal, estimate(principal=principal))
    gate.directory.reload(zoned("America/New_York", f"{{spend_per_day: '{ONE}'}}"))
    await gate.reserve(principal, estimate(principal=principal))        # local day 2026-06-14: fresh
    assert await spend_keys(gate, "sd", "2026-06-14", "2026-06-15") == [ONE * 10**9] * 2


def test_period_end_bills_exactly_the_local_hours():
    assert period_end_s(at("2026-03-29T00:00:00+01:00"), "day", "Europe/Berlin") == 23 * 3600
    assert period_end_s(at("2026-10-25T00:00:00+02:00"), "day", "Europe/Berlin") == 25 * 3600
    assert period_end_s(at("2026-11-01T00:00:00-04:00"), "month", "America/New_York") == (30 * 24 + 1) * 3600
    assert period_end_s(at("2026-11-01T00:00:00+00:00"), "day") == 24 * 3600


@pytest.mark.parametrize("zone", ["Mars/Olympus_Mons", "EST5EDT ", "", "../etc/passwd"])
def test_a_bad_zone_is_refused_naming_the_field(zone):
    with pytest.raises(ConfigError) as info:
        parse_config(zoned(repr(zone) if zone.strip() != zone or not zone else zone, "{}"))
    assert [p for p, _ in info.value.problems] == ["orgs.acme.billing_timezone"]
    assert "IANA" in str(info.value)


def test_the_directory_reports_each_tenants_zone_and_utc_for_others():
    d = TenantDirectory(zoned("Asia/Kathmandu", "{}"))
    assert (d.billing_timezone("acme"), d.billing_timezone("other"), d.billing_timezone("ghost")) == \
        ("Asia/Kathmandu", "UTC", "UTC")
