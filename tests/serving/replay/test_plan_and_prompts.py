"""The trace → replay scaling rule and exact-length prompt synthesis."""

from __future__ import annotations

import pytest

from kvmeter.serving.replay.cli import parse_tenant
from kvmeter.serving.replay.plan import ReplayTenant, ScalingRule, build_plan
from kvmeter.traces import TraceRequest, load_trace

TENANTS = [ReplayTenant("a", "k-a", 3.0), ReplayTenant("b", "k-b", 1.0), ReplayTenant("n", "k-n", 1.0, noisy=True)]


def test_scaling_rule_by_hand():
    rule = ScalingRule(time_compression=2.0, token_scale=0.125, max_input_tokens=2048,
                       max_output_tokens=1024, noisy_input_tokens=4096, min_input_tokens=31)
    trace = [TraceRequest(10.0, 374, 44), TraceRequest(20.0, 100, 3), TraceRequest(30.0, 90_000, 20_000)]
    plan = build_plan(trace, [ReplayTenant("a", "k")], rule)
    assert [p.arrival_s for p in plan] == [5.0, 10.0, 15.0]
    assert [p.input_tokens for p in plan] == [47, 31, 2048]     # round(374/8)=47; floor 31; cap 2048
    assert [p.output_tokens for p in plan] == [6, 1, 1024]       # round(5.5)=6 (half-even), floor 1, cap
    assert plan[0].trace_input_tokens == 374


def test_plan_is_deterministic_and_follows_shares_and_noisy_prompts():
    trace = load_trace("azure-conv", limit=2000)
    rule = ScalingRule()
    a = build_plan(trace, TENANTS, rule, seed=3)
    b = build_plan(trace, TENANTS, rule, seed=3)
    assert [(p.tenant.name, p.input_tokens) for p in a] == [(p.tenant.name, p.input_tokens) for p in b]
    share = sum(p.tenant.name == "a" for p in a) / len(a)
    assert 0.55 < share < 0.65                     # 3 / (3 + 1 + 1)
    assert all(p.input_tokens == 4096 for p in a if p.tenant.noisy)
    assert all(p.input_tokens <= 2048 for p in a if not p.tenant.noisy)
    assert repr(TENANTS[0]).find("k-a") == -1      # keys never printed


def test_bad_rules_and_tenants_are_refused():
    with pytest.raises(ValueError, match="token_scale"):
        ScalingRule(token_scale=0)
    with pytest.raises(ValueError, match="at least one tenant"):
        build_plan([TraceRequest(0, 1, 1)], [], ScalingRule())
    with pytest.raises(ValueError, match="NAME=KEY"):
        parse_tenant("justaname")
    assert parse_tenant("u=sk-x:0.5:noisy") == ReplayTenant("u", "sk-x", 0.5, True)


def test_prompts_have_the_exact_templated_length(model_dir):
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.replay.prompts import PromptSynthesizer

    tok = HFTokenizer(model_dir)
    synth = PromptSynthesizer(tok, seed=1)
    for n in (synth.overhead + 1, 64, 500, 4096):
        messages = synth.messages(n, seed=n)
        assert len(tok.encode_chat(messages)) == n
    assert synth.messages(200, seed=1) != synth.messages(200, seed=2)  # no accidental shared prefixes
    with pytest.raises(ValueError, match="template"):
        synth.messages(synth.overhead, seed=0)
