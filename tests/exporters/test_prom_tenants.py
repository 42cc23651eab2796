"""Bounded tenant labels: top-K by active (token) work plus ``other``, with decay and hysteresis;
a counter series, once exported, never disappears and every total stays monotonic — all on a
manual clock."""

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


def exporter_tokens(registry, tenant):
    return sum(s.value for fam in registry.collect() for s in fam.samples
               if s.name == "kvmeter_tokens_total" and s.labels["tenant"] == tenant)


def counter_samples(registry) -> dict[tuple, float]:
    """Every sample of every counter family: (name, labels) → value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in registry.collect()
            if fam.type == "counter" for s in fam.samples if s.name.endswith("_total")}


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
    # the first three arrivals held the free slots until the refresh, then the heaviest won; the
    # demoted t0, t1, t2 keep their first-round series (frozen), their second round is in other
    assert labels == {"t9", "t8", "t7", "t0", "t1", "t2", OTHER}
    assert exporter_tokens(registry, "t0") == 1000
    total = sum(s.value for fam in registry.collect() for s in fam.samples
                if s.name == "kvmeter_tokens_total")
    assert total == 2 * sum(work.values())  # every token is under some label


def test_demotion_freezes_series_and_later_counts_move_to_other(bus, registry, clock):
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
    bus.publish(done("early", 10))  # demoted: counted under other
    assert exporter.tenants.demotions == 1
    assert exporter.tenants.labeled() == {"late"}
    assert tenant_values(registry) == {"early", "late", OTHER}  # early's series stays, frozen
    assert registry.get_sample_value("kvmeter_requests_total",
                                     {"tier": "free", "tenant": "early", "outcome": "ok"}) == 1
    assert registry.get_sample_value("kvmeter_requests_total",
                                     {"tier": "free", "tenant": OTHER, "outcome": "ok"}) == 2


def test_an_aborted_tenants_counter_survives_a_refresh_with_free_slots(bus, registry, clock):
    """Issue 15 item 7: kvmeter_requests_total{outcome="aborted"} read 2 and was gone 20 s later at
    the top-K refresh, with free label slots (the aborted requests carried no tokens: score 0)."""
    install_prometheus(bus, registry, clock=clock, config=PrometheusConfig(top_k_tenants=20))
    aborted = {"tier": "free", "tenant": "quitter", "outcome": "aborted"}
    for _ in range(2):
        bus.publish(RequestCompletion(attribution=Attribution("quitter", tier="free", model="m"), outcome="aborted",
                                      tokens=TokenCounts(), e2e_s=0.2))
    assert registry.get_sample_value("kvmeter_requests_total", aborted) == 2
    clock.advance(20)  # past the 15 s refresh
    bus.publish(done("busy", 500))  # any labelled update runs the refresh first
    assert registry.get_sample_value("kvmeter_requests_total", aborted) == 2


def test_a_refused_only_tenants_rejections_survive_every_refresh(bus, registry, clock):
    """A tenant locked out by its cap (every request refused: score 0) keeps every
    kvmeter_admission_rejected_requests_total series across refreshes, and it keeps counting."""
    from kvmeter.stats import AdmissionDecision

    install_prometheus(bus, registry, clock=clock, config=PrometheusConfig(top_k_tenants=5))
    refused = lambda reason: AdmissionDecision(attribution=Attribution("capped", tier="free"), admitted=False,  # noqa: E731
                                               reason=reason, level="org", dimension="spend_per_day",
                                               status_code=402)
    for minute in range(1, 6):
        bus.publish(refused("spend_exhausted"))
        bus.publish(refused("request_too_large"))
        clock.advance(60)
        bus.publish(done("busy", 1000))
        rejected = {s.labels["reason"]: s.value for fam in registry.collect() for s in fam.samples
                    if s.name == "kvmeter_admission_rejected_requests_total" and s.labels["tenant"] == "capped"}
        assert rejected == {"spend_exhausted": minute, "request_too_large": minute}


def test_every_counter_stays_monotonic_through_demotions(bus, registry, clock):
    """Random tenants, K = 3, frequent refreshes with demotions: between any two scrapes no counter
    series disappears or goes down, and the sum over tenants of each counter only grows."""
    rng = random.Random(11)
    exporter = install_prometheus(bus, registry, clock=clock,
                                  config=PrometheusConfig(top_k_tenants=3, tenant_refresh_s=5,
                                                          tenant_half_life_s=20))
    before = counter_samples(registry)
    for step in range(40):
        for _ in range(20):
            tenant = f"t{rng.randrange(12)}"
            outcome = rng.choice(["ok", "ok", "aborted", "error"])
            bus.publish(RequestCompletion(
                attribution=Attribution(tenant, tier="free", model="m"), outcome=outcome,
                tokens=TokenCounts(input_tokens=rng.randrange(0, 3000), output_tokens=rng.randrange(0, 50)),
                e2e_s=1.0))
        clock.advance(rng.choice([1, 3, 7]))
        after = counter_samples(registry)
        for key, value in before.items():
            assert key in after, f"{key} vanished at step {step}"
            assert after[key] >= value, f"{key} went down at step {step}"
        before = after
    assert exporter.tenants.demotions > 0  # the run did demote tenants
    assert sum(v for (name, _), v in before.items() if name == "kvmeter_requests_total") == 40 * 20


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
    # demoted tenants' counter series stay (frozen): the bound is the tenants ever labelled
    assert len(tenant_values(registry)) <= 10 * k + 1
    assert len(tenant_values(registry, "kvmeter_tokens_total")) <= 10 * k + 1


def test_labels_handed_out_are_capped_per_process(clock):
    labels = TenantLabels(1, clock=clock, refresh_s=1, max_labels_per_process=2)
    for i, tenant in enumerate(["a", "b", "c"]):
        labels.observe(tenant, 1000 * 10 ** i)  # each far above the last: it takes the slot
        labels.label(tenant)
        clock.advance(2)
        labels.refresh()
    assert labels.labeled() == {"b"}  # c never gets a label: a and b's series stay for good
    assert labels.label("c") == OTHER


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
