"""Bounded tenant labels: top-K by active (token) work plus ``other``, with decay, hysteresis and
pruning of demoted tenants' series — all on a manual clock."""

from __future__ import annotations

import random

import pytest

from kvmeter.attribution import Attribution
from kvmeter.exporters.prometheus import OTHER, PrometheusConfig, TenantLabels, install_prometheus
from kvmeter.stats import RequestCompletion
from kvmeter.tokens import TokenCounts


def done(tenant: str, tokens: int, tier: str = "free") -> RequestCompletion:
    return RequestCompletion(
        attribution=Attribution(tenant, tier=tier, model="m"),
        tokens=TokenCounts(input_tokens=tokens, output_tokens=0),
        outcome="ok",
        e2e_s=1.0,
    )


def tenant_values(registry, metric="kvmeter_requests_total"):
    return {s.labels["tenant"] for fam in registry.collect() for s in fam.samples
            if s.name == metric}


def test_top_k_by_work_plus_other(bus, registry, clock):
    install_prometheus(bus, registry, clock=clock,
                       config=PrometheusConfig(top_k_tenants=3, tenant_refresh_s=10))
    work = {f"t{i}": (i + 1) * 1000 for i in range(10)}  # t9 heaviest
    for tenant, tokens in work.items():
        bus.publish(done(tenant, tokens))
    clock.advance(11)  # next label() call refreshes the ranking
    for tenant, tokens in work.items():
        bus.publish(done(tenant, tokens))
    labels = tenant_values(registry, "kvmeter_tokens_total")
    # the first three arrivals held the free slots until the refresh, then the heaviest won
    assert labels >= {"t9", "t8", "t7", OTHER}
    assert {"t0", "t1", "t2"}.isdisjoint(labels)  # demoted at the refresh: their series are gone
    total = sum(s.value for fam in registry.collect() for s in fam.samples
                if s.name == "kvmeter_tokens_total")
    # every token is under some label, except the pruned first-round series of t0, t1, t2
    assert total == 2 * sum(work.values()) - (1000 + 2000 + 3000)


def test_demotion_prunes_series_and_counts_move_to_other(bus, registry, clock):
    exporter = install_prometheus(bus, registry, clock=clock,
                                  config=PrometheusConfig(top_k_tenants=1, tenant_refresh_s=5,
                                                          tenant_half_life_s=60))
    bus.publish(done("early", 5000))
    assert tenant_values(registry) == {"early"}
    bus.publish(done("late", 100))
    assert tenant_values(registry) == {"early", OTHER}
    clock.advance(600)  # ten half-lives: early's score decays to ~5 tokens
    bus.publish(done("late", 100_000))  # refresh happens before this is labelled
    bus.publish(done("late", 100_000))
    assert tenant_values(registry) == {"late", OTHER}
    assert exporter.tenants.demotions == 1
    assert registry.get_sample_value("kvmeter_requests_total",
                                     {"tier": "free", "tenant": "early", "outcome": "ok"}) is None


def test_hysteresis_keeps_incumbents_near_the_edge(clock):
    labels = TenantLabels(2, clock=clock, refresh_s=1, hysteresis=0.2)
    for tenant, work in (("a", 1000), ("b", 1000)):
        labels.observe(tenant, work)
        assert labels.label(tenant) == tenant
    labels.observe("c", 1100)  # 10 % above b: within the 20 % margin
    clock.advance(2)
    assert labels.label("c") == OTHER and labels.labeled() == {"a", "b"}
    labels.observe("c", 400)  # now 50 % above b
    clock.advance(2)
    assert labels.label("c") == "c"
    assert "c" in labels.labeled() and len(labels.labeled()) == 2


def test_decay_makes_recent_work_outrank_old_work(clock):
    labels = TenantLabels(1, clock=clock, half_life_s=300, refresh_s=0)
    labels.observe("old", 10_000)
    assert labels.label("old") == "old"
    clock.advance(3600)  # 12 half-lives: 10000 → ~2.4 tokens
    labels.observe("new", 100)
    assert labels.label("new") == "new" and labels.label("old") == OTHER


def test_active_tokens_count_as_work(clock):
    labels = TenantLabels(1, clock=clock, refresh_s=0)
    labels.observe("chatty", 500)
    labels.set_active("longctx", 120_000)  # e.g. active KV tokens (round-2 scheduler)
    assert labels.label("longctx") == "longctx" and labels.label("chatty") == OTHER
    labels.set_active("longctx", 0)
    clock.advance(1)
    assert labels.label("chatty") == "chatty"


def test_zero_k_puts_everyone_in_other(bus, registry, clock):
    install_prometheus(bus, registry, clock=clock, config=PrometheusConfig(top_k_tenants=0))
    for i in range(20):
        bus.publish(done(f"t{i}", 100))
    assert tenant_values(registry) == {OTHER}


def test_cardinality_stays_bounded_with_1000_tenants(bus, registry, clock):
    rng = random.Random(7)
    k = 20
    install_prometheus(bus, registry, clock=clock,
                       config=PrometheusConfig(top_k_tenants=k, tenant_refresh_s=15))
    for step in range(5000):
        tenant = f"t{int(rng.paretovariate(1.2)) % 1000}"  # heavy-tailed, like real tenant mixes
        bus.publish(done(tenant, rng.randint(10, 5000), tier=rng.choice(["free", "batch"])))
        if step % 100 == 0:
            clock.advance(5)
    assert len(tenant_values(registry)) <= k + 1
    assert len(tenant_values(registry, "kvmeter_tokens_total")) <= k + 1


def test_multiprocess_mode_caps_labels_handed_out(clock):
    labels = TenantLabels(2, clock=clock, refresh_s=1, multiprocess=True, max_labels_per_process=3)
    for i, tenant in enumerate(["a", "b", "c", "d"]):
        labels.observe(tenant, 1000 * (i + 1))
        labels.label(tenant)
        clock.advance(2)
        labels.refresh()
    # a, b, c got labels at some point; d never does: series cannot be removed in this mode
    assert labels.label("d") == OTHER


def test_bad_settings_fail_at_construction(clock):
    with pytest.raises(ValueError):
        TenantLabels(-1, clock=clock)
    with pytest.raises(ValueError):
        TenantLabels(3, clock=clock, half_life_s=0)


def test_a_tenant_only_ever_refused_gets_its_own_label_while_slots_are_free(bus, registry, clock):
    """A tenant with no work yet (every request refused) still shows by name when K is not full."""
    from kvmeter.stats import AdmissionDecision

    install_prometheus(bus, registry, clock=clock, config=PrometheusConfig(top_k_tenants=20))
    for _ in range(3):
        bus.publish(
            AdmissionDecision(
                attribution=Attribution("hobbyist", tier="free"),
                admitted=False,
                reason="concurrency_limited",
                status_code=429,
            )
        )
    bus.publish(AdmissionDecision(attribution=Attribution('initech', tier='batch'), admitted=True))
    rejected = {s.labels["tenant"]: s.value for fam in registry.collect() for s in fam.samples
                if s.name == "kvmeter_admission_rejected_requests_total"}
    admitted = {s.labels["tenant"] for fam in registry.collect() for s in fam.samples
                if s.name == "kvmeter_admission_admitted_requests_total"}
    assert rejected == {"hobbyist": 3}
    assert admitted == {"initech"}
