"""Principals config: validation naming the field path, keys, tiers, inheritance, authentication."""

from __future__ import annotations

import hashlib
import logging
from decimal import Decimal

import pytest

from kvmeter.clock import ManualClock
from kvmeter.serving.quota import EXAMPLE_CONFIG, HierarchicalQuota
from kvmeter.serving.tenancy import (
    DEFAULT_TIERS,
    AuthError,
    ConfigError,
    Limits,
    Principal,
    RunBudget,
    TenantDirectory,
    constant_time_lookup,
    hash_api_key,
    load_config,
    parse_config,
)
from quota_testlib import tree

SECRET = "sk-test-super-secret-value"


def problems(text: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    return info.value.problems


def one_key(key_fields: str, *, org_fields: str = "", top: str = "") -> str:
    return f"""
{top}
orgs:
  acme:
    {org_fields}
    workspaces:
      ws:
        projects:
          proj:
            api_keys:
              k1: {{{key_fields}}}
"""


@pytest.mark.parametrize("text,path,words", [
    (one_key(f"key: {SECRET}, limits: {{requests_per_minute: -1}}"),
     "orgs.acme.workspaces.ws.projects.proj.api_keys.k1.limits.requests_per_minute", "greater than or equal to 0"),
    (one_key(f"key: {SECRET}, limits: {{spend_per_day: '1.0000000001'}}"),
     "orgs.acme.workspaces.ws.projects.proj.api_keys.k1.limits.spend_per_day", "decimal places"),
    (one_key(f"key: {SECRET}, limits: {{requests_per_mnute: 5}}"),
     "orgs.acme.workspaces.ws.projects.proj.api_keys.k1.limits.requests_per_mnute", "not permitted"),
    (one_key("key_sha256: abc"),
     "orgs.acme.workspaces.ws.projects.proj.api_keys.k1.key_sha256", "64 hexadecimal"),
    (one_key(""), "orgs.acme.workspaces.ws.projects.proj.api_keys.k1", "exactly one of key_sha256 or key"),
    (one_key(f"key: {SECRET}, tier: gold"), "orgs.acme.workspaces.ws.projects.proj.api_keys.k1.tier", "unknown tier"),
    (one_key(f"key: {SECRET}", org_fields="run_budget: {max_parallel_branches: 0}"),
     "orgs.acme.run_budget.max_parallel_branches", "greater than or equal to 1"),
    (one_key(f"key: {SECRET}", top="tiers: {free: {limits: {galaxy: {requests_per_minute: 1}}}}"),
     "tiers.free.limits", "unknown level 'galaxy'"),
    (one_key(f"key: {SECRET}", top="default_tier: platinum"), "default_tier", "unknown tier"),
    (one_key(f"key: {SECRET}", top="version: 2"), "version", "less than or equal to 1"),
    ("orgs: {'bad:id': {}}", "orgs.bad:id", "id must match"),
])
def test_validation_error_names_the_field_path(text, path, words):
    found = problems(text)
    assert any(p == path and words in msg for p, msg in found), found


def test_every_problem_is_reported_at_once_and_the_secret_never_appears():
    text = one_key(f"key: {SECRET}, limits: {{requests_per_minute: -1, concurrent_requests: x}}",
                   org_fields="tier: nope")
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    paths = {p for p, _ in info.value.problems}
    assert {"orgs.acme.workspaces.ws.projects.proj.api_keys.k1.limits.requests_per_minute",
            "orgs.acme.workspaces.ws.projects.proj.api_keys.k1.limits.concurrent_requests"} <= paths
    assert SECRET not in str(info.value)
    # a too-short plain key fails validation without echoing it
    with pytest.raises(ConfigError) as info:
        parse_config(one_key("key: shortie"))
    assert "shortie" not in str(info.value)
    assert "at least 8 characters" in str(info.value)


def test_duplicate_yaml_keys_and_duplicate_secrets_are_errors():
    dup = """
orgs:
  acme: {}
  acme: {}
"""
    assert "duplicate key at line 4" in problems(dup)[0][1]
    same_secret = one_key(f"key: {SECRET}").replace(
        f"k1: {{key: {SECRET}}}", f"k1: {{key: {SECRET}}}\n              k2: {{key_sha256: {hash_api_key(SECRET)}}}")
    found = problems(same_secret)
    assert found == [("orgs.acme.workspaces.ws.projects.proj.api_keys.k2",
                      "same key as orgs.acme.workspaces.ws.projects.proj.api_keys.k1")]


def test_api_key_ids_are_unique_across_the_tree():
    text = tree().replace("o1: {key: sk-test-other-one", "k1: {key: sk-test-other-one")
    found = problems(text)
    assert found[0][0] == "orgs.other.workspaces.ws.projects.proj.api_keys.k1"
    assert "already used at orgs.acme" in found[0][1]


def test_yaml_syntax_error_names_the_line():
    found = problems("orgs:\n  acme: {workspaces: [\n")
    assert found[0][0] == "" and "YAML syntax error at line" in found[0][1]


def test_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_money_is_exact_decimal():
    cfg = parse_config(one_key(f"key: {SECRET}", org_fields="limits: {spend_per_day: 10.10, spend_per_month: '0.3'}"))
    lim = cfg.orgs["acme"].limits
    assert lim.spend_per_day == Decimal("10.10") and lim.spend_per_month == Decimal("0.3")


def test_plain_key_is_hashed_at_load_and_never_in_repr(caplog):
    caplog.set_level(logging.DEBUG)
    cfg = parse_config(one_key(f"key: {SECRET}"))
    key = cfg.orgs["acme"].workspaces["ws"].projects["proj"].api_keys["k1"]
    assert SECRET not in repr(cfg) and SECRET not in str(key)
    directory = TenantDirectory(cfg)
    assert SECRET not in repr(directory.snapshot)
    assert directory.authenticate(SECRET).api_key_id == "k1"
    assert SECRET not in caplog.text


def test_authenticate_resolves_the_principal_path_and_refuses_unknown_keys():
    d = TenantDirectory(tree())
    assert d.authenticate("sk-test-key-two") == Principal(
        tenant_id="acme", tier="enterprise", workspace_id="ws", project_id="proj",
        api_key_id="k2", admin=False)
    for bad, code in ((None, "missing_api_key"), ("", "missing_api_key"), ("sk-test-key-on", "invalid_api_key"),
                      ("x" * 10_000, "invalid_api_key"), (b"sk-test-key-one", "invalid_api_key")):
        with pytest.raises(AuthError) as info:
            d.authenticate(bad)  # type: ignore[arg-type]
        assert info.value.code == code
        assert "sk-test" not in info.value.message


def test_admin_keys_may_read_every_tenant():
    d = TenantDirectory(one_key(f"key_sha256: {hash_api_key(SECRET)}, admin: true"))
    admin = d.authenticate(SECRET)
    assert admin.admin and d.can_read_usage(admin, "someone-else")
    user = TenantDirectory(tree()).authenticate("sk-test-key-one")
    assert d.can_read_usage(user, "acme") and not d.can_read_usage(user, "other")


def test_constant_time_lookup_still_matches_the_digest_map():
    p = Principal("t", "free", "w", "p", "k")
    assert constant_time_lookup({hash_api_key(SECRET): p}, SECRET) is p
    assert constant_time_lookup({hash_api_key(SECRET): p}, SECRET + "x") is None


def test_tier_defaults_apply_per_level_and_nodes_override_them_field_by_field():
    text = """
default_tier: free
tiers:
  free: {weight: 0.75, ttft_slo_s: 3.0, limits: {api_key: {requests_per_minute: 7}}}
  research: {weight: 2, priority: 5, limits: {org: {concurrent_requests: 9}}}
orgs:
  hobby:
    workspaces:
      w:
        projects:
          p:
            api_keys:
              a: {key: sk-test-aaaaaaaa}
              b: {key: sk-test-bbbbbbbb, limits: {requests_per_minute: 3, concurrent_requests: null}}
  lab:
    tier: research
    limits: {requests_per_minute: 50}
    workspaces:
      w:
        projects:
          p:
            tier: batch
            api_keys:
              c: {key: sk-test-cccccccc}
"""
    d = TenantDirectory(text)
    free = d.tier_policy("free")
    assert (free.weight, free.ttft_slo_s, free.itl_slo_s, free.priority) == (0.75, 3.0, 0.25, 3)
    a, b = d.entry("a"), d.entry("b")
    assert [n.level for n in a.chain] == ["global", "org", "workspace", "project", "api_key"]
    assert a.chain[4].limits.requests_per_minute == 7
    assert a.chain[4].limits.concurrent_requests == DEFAULT_TIERS["free"].limits_for("api_key").concurrent_requests
    assert a.chain[1].limits == DEFAULT_TIERS["free"].limits_for("org")
    assert b.chain[4].limits.requests_per_minute == 3 and b.chain[4].limits.concurrent_requests is None
    c = d.entry("c")
    assert c.principal.tier == "batch"  # a project's tier applies to its keys
    assert c.chain[1].limits == Limits(requests_per_minute=50, concurrent_requests=9)
    research = d.tier_policy("research")
    assert (research.weight, research.priority, research.ttft_slo_s) == (2.0, 5, None)
    with pytest.raises(KeyError, match="unknown tier 'gold'"):
        d.tier_policy("gold")


def test_run_budget_and_run_limits_take_the_tightest_value_of_the_chain():
    text = tree(run_budget="{max_model_calls: 10, max_cost: '2.00'}", agent_run_limits="{requests_per_minute: 30}")
    text = text.replace("k1: {key: sk-test-key-one, limits: {}}",
                        "k1: {key: sk-test-key-one, run_budget: {max_model_calls: 50, max_tool_calls: 4},"
                        " agent_run_limits: {requests_per_minute: 10}}")
    d = TenantDirectory(text)
    tier_budget = DEFAULT_TIERS["enterprise"].run_budget
    assert d.entry("k1").run_budget == RunBudget(
        max_model_calls=10, max_tool_calls=4, max_runtime_s=tier_budget.max_runtime_s, max_cost=Decimal("2.00"),
        max_retries=tier_budget.max_retries, max_parallel_branches=tier_budget.max_parallel_branches)
    assert d.entry("k1").run_limits.requests_per_minute == 10
    assert d.entry("k2").run_limits.requests_per_minute == 30  # the org's cap


def test_the_shipped_example_config_loads_and_authenticates():
    d = TenantDirectory(path=EXAMPLE_CONFIG)
    assert d.authenticate("sk-demo-acme-chat-prod").tier == "enterprise"
    assert d.authenticate("sk-demo-acme-batch").tier == "batch"
    assert d.authenticate("sk-demo-hobby").tier == "free"
    assert d.authenticate("sk-demo-admin").admin
    assert d.snapshot.has_spend_limits


def test_spend_limits_without_a_price_fail_at_construction():
    clock = ManualClock()
    directory = TenantDirectory(tree(org_limits="{spend_per_month: '10'}"))
    with pytest.raises(ValueError, match="no price function"):
        HierarchicalQuota(directory, clock=clock)
    HierarchicalQuota(TenantDirectory(tree()), clock=clock)  # no spend limits: no price needed


def test_hash_api_key_is_sha256_hex():
    assert hash_api_key(SECRET) == hashlib.sha256(SECRET.encode()).hexdigest()
