"""Interference on simulated engine steps: a simulated 70B/H200 replica's per-step records written
through the ledger's step records into a real chDB ledger, read back by the unchanged
interference query, against a hand computation of the same steps."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import pytest
from ledgerkit import T0, make_event

from kvmeter.bus import StatsBus
from kvmeter.serving.simulator import SimConfig, Simulation
from kvmeter.serving.tenancy.tiers import DEFAULT_TIERS
from kvmeter.stats import EngineStepShares
from kvmeter.traces import TraceRequest

MODEL = "llama-3.1-70b"
SLOS = [(t.name, t.ttft_slo_s, t.itl_slo_s) for t in DEFAULT_TIERS.values()]


@dataclass(frozen=True)
class _Window:
    start: datetime
    end: datetime


async def test_a_simulated_long_prefill_is_who_the_victim_waited_for(open_ledger):
    # hog's 20,000-token prompt at 0 s takes three chunked-prefill steps (8,192 + 8,192 + 3,616
    # tokens under the 8,192-token budget); vic (enterprise: TTFT objective 1 s) arrives at 0.01 s
    # and is admitted into the third step with the budget left over, so its first token comes
    # at that step's end, > 1 s after its arrival
    reqs = [TraceRequest(0.0, 20_000, 1, tenant_id="hog", tier="batch"),
            TraceRequest(0.01, 100, 5, tenant_id="vic", tier="enterprise")]
    bus = StatsBus()
    steps: list[EngineStepShares] = []
    bus.subscribe(EngineStepShares, steps.append)
    res = Simulation(reqs, sim=SimConfig(model=MODEL, gpu="h200", tp=4), policy="fcfs", bus=bus,
                     start_wall=T0 + 100).run()
    hog, vic = sorted(res.records, key=lambda r: r.tenant_id)
    ttft = vic.first_token_s - vic.arrival_s
    assert ttft > 1.0
    assert [[(t.tenant_id, t.prefill_tokens) for t in s.tenants] for s in steps[:3]] == [
        [("hog", 8192)], [("hog", 8192)], [("hog", 3616), ("vic", 100)]]  # vic waits (no KV, no row) in step 2
    assert steps[2].wall_ts == pytest.approx(T0 + 100 + vic.first_token_s)

    ledger = open_ledger()
    for s in steps:
        ledger.record_step_shares(s, model=MODEL, replica="sim")
    for r in res.records:
        await ledger.record(make_event(
            100, r.tenant_id, key=r.request_id, request_id=r.request_id, tier=r.tier, model=MODEL,
            arrival_ts=T0 + 100 + r.arrival_s, finish_ts=T0 + 100 + r.finish_s,
            ttft_s=r.first_token_s - r.arrival_s, input_tokens=r.input_tokens, output_tokens=r.generated,
            itl_mean_s=(r.finish_s - r.first_token_s) / (r.generated - 1) if r.generated > 1 else None))
    assert ledger.flush()
    window = _Window(datetime.fromtimestamp(T0, timezone.utc), datetime.fromtimestamp(T0 + 3600, timezone.utc))
    rows = ledger.interference.interference(window, slos=SLOS)
    # by hand: vic's window is [arrival, first token] = the three steps; in them hog scheduled
    # 20,000 prefill tokens and held 8,192, 16,384 and 20,000 KV tokens; vic 100 tokens in the third
    d = [s.duration_s for s in steps[:3]]
    assert {(r["tenant_id"], r["missed_requests"], r["attributed_requests"]) for r in rows} == {("vic", 1, 1)}
    by = {r["neighbour"]: r for r in rows}
    assert (by["hog"]["rank"], by["hog"]["steps"], by["hog"]["prefill_tokens"], by["hog"]["decode_tokens"]) == (
        1, 3, 20_000, 0)
    assert by["hog"]["kv_token_seconds"] == pytest.approx(8192 * d[0] + 16_384 * d[1] + 20_000 * d[2])
    assert (by["vic"]["steps"], by["vic"]["prefill_tokens"]) == (1, 100)
    assert by["vic"]["kv_token_seconds"] == pytest.approx(100 * d[2])
    assert by["hog"]["prefill_share"] == pytest.approx(20_000 / 20_100)
    assert by["hog"]["decode_share"] is None  # nobody decoded while vic waited
    assert hog.generated == 1
