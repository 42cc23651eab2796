"""Who pays for engine work that reached no client: a per-tier policy over one list of causes."""

from __future__ import annotations

import pytest

from kvmeter.attribution import Attribution
from kvmeter.clock import ManualClock
from kvmeter.events import DEFAULT_UNDELIVERED_BILLING, UNDELIVERED_CAUSES
from kvmeter.serving.gateway.metering import RequestIdentity, RequestMeter
from kvmeter.serving.tenancy import DEFAULT_TIERS, ConfigError, TenantDirectory, TierPolicy, parse_config


def test_the_default_bills_abandoned_work_and_absorbs_the_servers_losses() -> None:
    assert dict(DEFAULT_UNDELIVERED_BILLING) == {"client_abandoned": "billed", "server_failure": "absorbed",
                                                 "shutdown": "absorbed", "deadline": "absorbed"}
    assert tuple(DEFAULT_UNDELIVERED_BILLING) == UNDELIVERED_CAUSES
    for policy in DEFAULT_TIERS.values():
        assert dict(policy.undelivered_billing) == dict(DEFAULT_UNDELIVERED_BILLING)
    # a policy given some causes keeps the default for the others
    generous = TierPolicy("generous", undelivered_billing={"client_abandoned": "absorbed"})
    assert [generous.undelivered(c) for c in UNDELIVERED_CAUSES] == ["absorbed"] * 4
    with pytest.raises(KeyError):
        generous.undelivered("gremlins")


@pytest.mark.parametrize("billing,words", [
    ({"gremlins": "billed"}, "undelivered_billing.gremlins: unknown cause"),
    ({"shutdown": "free"}, "undelivered_billing.shutdown must be 'billed' or 'absorbed'"),
])
def test_a_tier_policy_refuses_an_unknown_cause_or_billing_naming_it(billing, words) -> None:
    with pytest.raises(ValueError, match=words):
        TierPolicy("t", undelivered_billing=billing)


def test_the_tenants_config_sets_it_per_tier_cause_by_cause() -> None:
    tiers = TenantDirectory("""
tiers:
  free: {undelivered_billing: {client_abandoned: absorbed}}
  enterprise: {undelivered_billing: {server_failure: billed, deadline: billed}}
""").snapshot.tiers
    assert dict(tiers["free"].undelivered_billing) == {**DEFAULT_UNDELIVERED_BILLING, "client_abandoned": "absorbed"}
    assert dict(tiers["enterprise"].undelivered_billing) == {
        **DEFAULT_UNDELIVERED_BILLING, "server_failure": "billed", "deadline": "billed"}
    assert tiers["batch"] is DEFAULT_TIERS["batch"]


@pytest.mark.parametrize("value,path,words", [
    ("{gremlins: billed}", "tiers.free.undelivered_billing.gremlins", "Extra inputs are not permitted"),
    ("{shutdown: free}", "tiers.free.undelivered_billing.shutdown", "'billed' or 'absorbed'"),
    ("billed", "tiers.free.undelivered_billing", "valid dictionary"),
])
def test_a_bad_undelivered_billing_in_the_config_is_an_error_naming_the_field(value, path, words) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(f"tiers: {{free: {{undelivered_billing: {value}}}}}")
    assert any(p == path and words in msg for p, msg in info.value.problems), info.value.problems


@pytest.mark.parametrize("outcome,cause,billing", [
    ("aborted", "client_abandoned", "absorbed"),   # this tier absorbs what its clients abandon
    ("aborted", "shutdown", "billed"),             # ... and bills what a shutdown cut
    ("error", "server_failure", "absorbed"),       # the default for a cause it does not set
])
def test_the_meter_records_the_cause_and_the_tiers_billing(outcome, cause, billing) -> None:
    policy = TierPolicy("t", undelivered_billing={"client_abandoned": "absorbed", "shutdown": "billed"})
    meter = RequestMeter(RequestIdentity("req-1", Attribution("acme", tier="t"), stream=True), ManualClock())
    event, _ = meter.finish(outcome, status_code=499, policy=policy, cause=cause)
    assert (event.outcome, event.undelivered_cause, event.undelivered_billing) == (outcome, cause, billing)
    ok, _ = RequestMeter(RequestIdentity("req-2", Attribution("acme"), stream=False), ManualClock()).finish(
        "ok", status_code=200, policy=policy)
    assert (ok.undelivered_cause, ok.undelivered_billing) == ("", "")
