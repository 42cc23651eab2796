"""The agent-run source: tool-call decisions, approval events and run stops become the declared
metrics with bounded labels (a value outside its fixed set is ``other``; tenants top-K)."""

from __future__ import annotations

from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus
from kvmeter.attribution import Attribution
from kvmeter.stats import AgentRunStopped, ApprovalEvent, ToolCallDecided


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_agent_metrics(bus, registry, clock):
    install_prometheus(bus, registry, clock=clock, config=PrometheusConfig(top_k_tenants=1, tenant_refresh_s=10))
    who = Attribution("acme", tier="free", api_key_id="k", agent_run_id="r1")
    for decision in ("allowed", "allowed", "blocked", "made_up"):
        bus.publish(ToolCallDecided(who, "search", "read_only", "reported", decision))
    bus.publish(ToolCallDecided(who, "x", "weird", "emitted", "blocked"))
    assert value(registry, "kvmeter_agent_tool_calls_total", source="reported", risk_class="read_only",
                 decision="allowed") == 2
    assert value(registry, "kvmeter_agent_tool_calls_total", source="reported", risk_class="read_only",
                 decision="other") == 1
    assert value(registry, "kvmeter_agent_tool_calls_total", source="emitted", risk_class="other",
                 decision="blocked") == 1
    assert value(registry, "kvmeter_agent_approval_events_total", event="approved") == 0  # present from the start
    bus.publish(ApprovalEvent(Attribution("acme", tier="free"), "a1", "requested"))
    bus.publish(ApprovalEvent(Attribution("acme", tier="free"), "a1", "approved", wait_s=42.0))
    assert value(registry, "kvmeter_agent_approval_events_total", event="requested") == 1
    assert value(registry, "kvmeter_agent_approval_wait_seconds_count", event="approved") == 1
    assert value(registry, "kvmeter_agent_approval_wait_seconds_bucket", event="approved", le="60.0") == 1
    assert value(registry, "kvmeter_agent_approval_wait_seconds_bucket", event="approved", le="30.0") == 0
    bus.publish(AgentRunStopped(Attribution("acme", tier="free", agent_run_id="r1"), "tool_cycle"))
    bus.publish(AgentRunStopped(Attribution("acme", tier="free", agent_run_id="r2"), "tool_cycle"))
    bus.publish(AgentRunStopped(Attribution("globex", tier="free", agent_run_id="r3"), "repeated_prompt"))
    stops = {tuple(sorted(s.labels.items())): s.value for fam in registry.collect() for s in fam.samples
             if s.name == "kvmeter_agent_stopped_runs_total"}
    assert sum(stops.values()) == 3
    assert {dict(k)["tenant"] for k in stops} <= {"acme", "globex", "other"}  # at most top-1 + other


def test_model_calls_per_agent_run(bus, registry, clock, monkeypatch):
    """Every completed model call with a run id counts a call, the first one of a run a run; the
    memory of runs is bounded (a forgotten run counts again: calls per run errs low)."""
    from kvmeter.exporters.prometheus import agents
    from kvmeter.stats import RequestCompletion
    from kvmeter.tokens import TokenCounts

    monkeypatch.setattr(agents, "RUNS_REMEMBERED", 2)
    install_prometheus(bus, registry, clock=clock, config=PrometheusConfig(top_k_tenants=5))

    def call(tenant: str, run: str) -> None:
        bus.publish(RequestCompletion(attribution=Attribution(tenant, tier="free", agent_run_id=run), outcome="ok",
                                      tokens=TokenCounts(input_tokens=10, output_tokens=1)))

    for run in ("r1", "r1", "r1", "r2", "", ""):  # two calls outside any run
        call("acme", run)
    call("globex", "r1")                          # another tenant's run of the same id is another run
    assert value(registry, "kvmeter_agent_run_model_calls_total", tier="free", tenant="acme") == 4
    assert value(registry, "kvmeter_agent_runs_seen_total", tier="free", tenant="acme") == 2
    assert value(registry, "kvmeter_agent_runs_seen_total", tier="free", tenant="globex") == 1
    call("acme", "r2")                            # remembered (most recent two: acme r2, globex r1)
    assert value(registry, "kvmeter_agent_runs_seen_total", tier="free", tenant="acme") == 2
    call("acme", "r1")                            # forgotten: counted again
    assert value(registry, "kvmeter_agent_runs_seen_total", tier="free", tenant="acme") == 3
