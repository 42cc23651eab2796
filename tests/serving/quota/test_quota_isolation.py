"""Isolation: a noisy API key exhausts its own limits; its sibling and another org keep being admitted."""

from __future__ import annotations

import pytest

from kvmeter.serving.quota import QuotaRejected
from quota_testlib import estimate, tree, used

NOISY, SIBLING, OTHER_ORG = "sk-test-key-one", "sk-test-key-two", "sk-test-other-one"


async def test_noisy_key_bursting_requests_and_tokens(make_gate, clock):
    gate = make_gate(tree(
        key_limits="{requests_per_minute: 5, output_tokens_per_minute: 2000, concurrent_requests: 3}",
        project_limits="{requests_per_minute: 100}", org_limits="{requests_per_minute: 200}"))
    d = gate.directory
    noisy, sibling, other = d.authenticate(NOISY), d.authenticate(SIBLING), d.authenticate(OTHER_ORG)
    noisy_ok, noisy_refusals, good = 0, set(), 0
    for i in range(60):
        try:
            r = await gate.reserve(noisy, estimate("m", 500, 300, principal=noisy))
            noisy_ok += 1
            await gate.reconcile(r, used(500, 0, 300))
        except QuotaRejected as e:
            noisy_refusals.add((e.status_code, e.level, e.dimension))
        if i % 12 == 11:  # the neighbours keep working the whole time (within their own 5/min)
            for pr in (sibling, other):
                r = await gate.reserve(pr, estimate("m", 50, 50, principal=pr))
                await gate.reconcile(r, used(50, 0, 20))
                good += 1
        clock.advance(0.05)
    assert noisy_ok == 5
    assert noisy_refusals == {(429, "api_key", "requests_per_minute")}
    assert good == 10


async def test_noisy_key_holding_kv_with_long_sessions(make_gate):
    """Long prompts held open (never reconciled) fill the key's KV budget, not its neighbours'."""
    gate = make_gate(tree(key_limits="{active_kv_tokens: 10000}", project_limits="{active_kv_tokens: 100000}"))
    d = gate.directory
    noisy = d.authenticate(NOISY)
    held = [await gate.reserve(noisy, estimate("m", 4000, 1000, principal=noisy)) for _ in range(2)]
    for _ in range(5):
        with pytest.raises(QuotaRejected) as info:
            await gate.reserve(noisy, estimate("m", 4000, 1000, principal=noisy))
        assert (info.value.reason, info.value.level) == ("kv_budget_exceeded", "api_key")
    for secret in (SIBLING, OTHER_ORG):
        pr = d.authenticate(secret)
        for _ in range(3):
            r = await gate.reserve(pr, estimate("m", 2000, 1000, principal=pr))
            await gate.reconcile(r, used(2000, 0, 1000))
    assert len(held) == 2


async def test_a_noisy_project_cannot_starve_a_project_with_its_own_budget(make_gate):
    """Project-level spend caps: the noisy project's keys are refused, proj2's key is not."""
    gate = make_gate(tree(project_limits="{spend_per_day: '0.001'}"))
    d = gate.directory
    for secret in (NOISY, SIBLING):  # both keys of proj drain proj's budget together
        pr = d.authenticate(secret)
        for _ in range(3):
            try:
                await gate.reserve(pr, estimate("m", 1000, 100, principal=pr))  # 0.00065 each
            except QuotaRejected as e:
                assert (e.status_code, e.level, e.dimension) == (402, "project", "spend_per_day")
    k3 = d.authenticate("sk-test-key-three")  # proj2 has no project cap
    for _ in range(3):
        await gate.reserve(k3, estimate("m", 1000, 100, principal=k3))
