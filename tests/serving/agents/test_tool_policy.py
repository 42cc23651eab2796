"""The tool policy in the tenants config: inheritance down org → workspace → project → key,
blocked beats allowed, the narrowest level wins, risk classes, validation naming the field,
reload, the policy version; and the tiers' loop stops."""

from __future__ import annotations

import textwrap

import pytest

from kvmeter.serving.tenancy import ConfigError, LoopStops, TenantDirectory
from kvmeter.serving.tenancy.toolpolicy import ALLOW_ALL

TREE = """
version: 1
orgs:
  acme:
    tool_policy:
      block: ["rm_*", "*_prod"]
      risk: {{"deploy_*": high_risk, "db_*": side_effect, "get_*": read_only}}
      default_risk: read_only
{org_extra}
    workspaces:
      w:
        tool_policy: {ws}
        projects:
          p:
            tool_policy: {proj}
            api_keys:
              k: {{key: sk-test-key-00001, tool_policy: {key}}}
              plain: {{key: sk-test-key-00002}}
"""


def policy(ws="{}", proj="{}", key="{}", org_extra="", which="k"):
    d = TenantDirectory(textwrap.dedent(TREE).format(ws=ws, proj=proj, key=key, org_extra=org_extra))
    return d.snapshot.keys[which].tool_policy


def test_blocked_anywhere_up_the_chain_beats_any_allow_list():
    p = policy(ws='{allow: ["*"]}', key='{allow: ["rm_rf", "deploy_prod"]}')
    assert p.evaluate("rm_rf").code == "tool_blocked"
    assert p.evaluate("rm_rf").rule == "orgs.acme.tool_policy.block 'rm_*'"
    assert p.evaluate("deploy_prod").rule == "orgs.acme.tool_policy.block '*_prod'"
    # a narrower level adds blocks, never lifts them
    p = policy(proj='{block: ["get_secret"]}')
    assert p.evaluate("get_secret").rule == "orgs.acme.workspaces.w.projects.p.tool_policy.block 'get_secret'"
    assert p.evaluate("get_user").allowed


def test_the_narrowest_allow_list_wins():
    p = policy(ws='{allow: ["get_*"]}', proj='{allow: ["db_*"]}')
    assert p.evaluate("db_read").allowed and not p.evaluate("get_user").allowed
    assert p.evaluate("get_user").rule == "orgs.acme.workspaces.w.projects.p.tool_policy.allow"
    assert p.evaluate("get_user").code == "tool_not_allowed"
    assert not policy(ws="{allow: []}").evaluate("get_user").allowed  # deny by default
    assert policy().evaluate("anything").allowed  # no allow list anywhere: all but blocked


def test_risk_classes_narrowest_level_then_exact_then_riskiest_glob():
    p = policy(proj='{risk: {"deploy_docs": read_only}}')
    assert p.evaluate("deploy_docs").risk_class == "read_only"  # the project overrides the org
    assert p.evaluate("deploy_api").risk_class == "high_risk"
    assert p.evaluate("deploy_api").risk_rule == "orgs.acme.tool_policy.risk 'deploy_*'"
    # two globs of one level match: the riskier class wins; an exact name beats both
    p = policy(key='{risk: {"db_*": read_only, "*_drop": high_risk, "db_list_drop": side_effect}}')
    assert p.evaluate("db_table_drop").risk_class == "high_risk"
    assert p.evaluate("db_list_drop").risk_class == "side_effect"
    assert p.evaluate("db_read").risk_class == "read_only"
    # an unclassified tool gets the org's default class; without one, side_effect
    assert (p.evaluate("other").risk_class, p.evaluate("other").risk_rule) == (
        "read_only", "orgs.acme.tool_policy.default_risk")
    plain = TenantDirectory("version: 1\norgs: {o: {workspaces: {w: {projects: {p: {api_keys: "
                            "{k: {key: sk-test-key-00003}}}}}}}}").snapshot.keys["k"].tool_policy
    assert plain.evaluate("x").risk_class == "side_effect" and plain.version == ALLOW_ALL.version


def test_globs_match_the_whole_name_and_are_case_sensitive():
    p = policy(key='{block: ["ab?", "[xy]z", "q[!0-9]"]}')
    assert [p.evaluate(t).allowed for t in ("abc", "abcd", "xz", "yz", "zz", "qa", "q1", "ABC")] == [
        False, True, False, False, True, False, True, True]


def test_approval_ttl_and_window_narrowest_level_wins():
    p = policy(org_extra="      approval_ttl_s: 100", proj="{approval_ttl_s: 50, side_effect_window_s: 7}")
    assert (p.approval_ttl_s, p.side_effect_window_s) == (50.0, 7.0)
    assert (policy().approval_ttl_s, policy().side_effect_window_s) == (3600.0, 3600.0)


def test_the_policy_version_follows_the_effective_policy_only():
    a, b = policy(), policy(which="plain")
    assert a.version == b.version  # the same effective policy (the key sets none)
    assert policy(key='{block: ["x"]}').version != a.version
    assert policy(key='{block: ["x", "x"]}').version == policy(key='{block: ["x"]}').version
    assert len(a.version) == 64
    # where a block sits does not change what it blocks
    moved = policy(ws='{block: ["x"]}').version
    assert moved == policy(key='{block: ["x"]}').version


@pytest.mark.parametrize("where, yaml_value, path", [
    ("ws", '{block: ["bad name"]}', "orgs.acme.workspaces.w.tool_policy.block"),
    ("proj", '{risk: {"x": dangerous}}', "orgs.acme.workspaces.w.projects.p.tool_policy.risk.x"),
    ("key", '{allow: "get_*"}', "orgs.acme.workspaces.w.projects.p.api_keys.k.tool_policy.allow"),
    ("proj", "{approval_ttl_s: 0}", "orgs.acme.workspaces.w.projects.p.tool_policy.approval_ttl_s"),
    ("ws", "{blok: []}", "orgs.acme.workspaces.w.tool_policy.blok"),
    ("ws", "{default_risk: high_risk}", "orgs.acme.workspaces.w.tool_policy.default_risk"),
])
def test_validation_names_the_bad_field(where, yaml_value, path):
    with pytest.raises(ConfigError) as exc:
        policy(**{where: yaml_value})
    assert any(p.startswith(path) for p, _ in exc.value.problems), exc.value.problems
    assert path in str(exc.value)


def test_approvers_must_be_keys_of_the_same_org():
    base = textwrap.dedent("""
        version: 1
        orgs:
          a:
            approvers: [{who}]
            workspaces: {{w: {{projects: {{p: {{api_keys: {{ka: {{key: sk-test-key-000a1}}}}}}}}}}}}
          b:
            workspaces: {{w: {{projects: {{p: {{api_keys: {{kb: {{key: sk-test-key-000b1}}}}}}}}}}}}
    """)
    assert TenantDirectory(base.format(who="ka")).snapshot.keys["ka"].tool_policy.approvers == {"ka"}
    for who, why in (("kb", "another org"), ("nobody", "no API key")):
        with pytest.raises(ConfigError) as exc:
            TenantDirectory(base.format(who=who))
        assert exc.value.problems[0][0] == "orgs.a.approvers[0]" and why in exc.value.problems[0][1]


def test_a_reload_swaps_the_compiled_policy_and_a_bad_one_keeps_the_old(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(textwrap.dedent(TREE).format(ws="{}", proj="{}", key="{}", org_extra=""))
    d = TenantDirectory.from_file(path)
    assert d.snapshot.keys["k"].tool_policy.evaluate("get_x").allowed
    path.write_text(textwrap.dedent(TREE).format(ws='{block: ["get_x"]}', proj="{}", key="{}", org_extra=""))
    d.reload()
    assert d.snapshot.keys["k"].tool_policy.evaluate("get_x").code == "tool_blocked"
    path.write_text(textwrap.dedent(TREE).format(ws='{block: ["no space"]}', proj="{}", key="{}", org_extra=""))
    with pytest.raises(ConfigError):
        d.reload()
    assert d.snapshot.keys["k"].tool_policy.evaluate("get_x").code == "tool_blocked"


def test_loop_stops_are_a_tier_policy_set_field_by_field():
    d = TenantDirectory(textwrap.dedent("""
        version: 1
        tiers:
          free: {loop_stops: {max_identical_tool_calls: 2, max_repeated_prompts: null}}
        orgs: {}
    """))
    free = d.snapshot.tiers["free"].loop_stops
    assert free == LoopStops(max_identical_tool_calls=2, max_cycle_repeats=4, max_repeated_prompts=None)
    assert d.snapshot.tiers["enterprise"].loop_stops == LoopStops()
    with pytest.raises(ConfigError) as exc:
        TenantDirectory("version: 1\ntiers: {free: {loop_stops: {max_cycle_length: 1}}}\norgs: {}")
    assert exc.value.problems[0][0] == "tiers.free.loop_stops.max_cycle_length"
    with pytest.raises(ValueError):
        LoopStops(max_identical_tool_calls=0)


PLAIN = """
version: 1
orgs:
  acme:
    tool_policy: {org}
    workspaces:
      w:
        projects:
          p:
            api_keys:
              k: {{key: sk-test-key-00001, tool_policy: {key}}}
"""


@pytest.mark.parametrize("org, key, withholds", [
    ("{}", "{}", False),                                    # no policy: every call passes through
    ('{risk: {"get_*": read_only}}', "{}", False),          # classes that never hold a call
    ('{default_risk: side_effect}', "{}", False),
    ('{block: ["rm_*"]}', "{}", True),
    ("{}", '{allow: ["get_*"]}', True),                     # an allow list refuses the rest
    ('{risk: {"deploy_*": high_risk}}', "{}", True),
    ("{}", '{risk: {"deploy": high_risk}}', True),
    ('{default_risk: high_risk}', "{}", True),              # every unclassified call is held
])
def test_a_policy_says_whether_it_could_withhold_an_emitted_call(org, key, withholds):
    d = TenantDirectory(textwrap.dedent(PLAIN).format(org=org, key=key))
    assert d.snapshot.keys["k"].tool_policy.can_withhold is withholds
    assert ALLOW_ALL.can_withhold is False
