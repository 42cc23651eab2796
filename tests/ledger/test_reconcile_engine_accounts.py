"""Reconciliation of aborted requests the engine accounted for (the vLLM scheduler hook): the
engine record of an abort matches its bill like a finished request's, and a bill that ignored the
engine's work (an abort billed 0 after the engine prefilled) is drift, not an explained abort."""

from __future__ import annotations

from ledgerkit import PERIOD, make_attempt, make_event

from kvmeter.bus import StatsBus
from kvmeter.ledger.reconcile import reconcile
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import TokenCounts

RESERVED = TokenCounts(input_tokens=1500, output_tokens=64)


def _abort_account(event, prompt: int, generated: int) -> EngineRequestStats:  # noqa: ANN001
    """The scheduler hook's account, stamped with the request's attribution (as the engine does)."""
    return EngineRequestStats(request_id=event.request_id, finish_reason="abort",
                              tokens=TokenCounts(input_tokens=prompt, output_tokens=generated),
                              computed_tokens=prompt + generated, preempted_tokens=0, phase_times_measured=False,
                              wall_ts=event.finish_ts + 0.01, attribution=event.attribution)


def test_engine_accounted_aborts_match_and_a_bill_that_ignores_them_is_drift(open_ledger) -> None:
    bus = StatsBus()
    ledger = open_ledger(bus=bus)
    for i in range(3):  # left mid-prefill (2 chunks of 256) or mid-decode: billed the engine's count
        prompt, out = (512, 0) if i < 2 else (25, 6)
        e = make_event(i, "accounted", outcome="aborted", finish_reason="abort", input_tokens=prompt,
                       output_tokens=out, reserved=RESERVED, token_source="engine_hooks")
        ledger.record_attempt_sync(make_attempt(e))
        bus.publish(_abort_account(e, prompt, out))
        ledger.record_sync(e)
    unbilled = make_event(0, "ignored", outcome="aborted", finish_reason="abort", input_tokens=0,
                          output_tokens=0, reserved=RESERVED, token_source="frontend")
    ledger.record_attempt_sync(make_attempt(unbilled))
    bus.publish(_abort_account(unbilled, 512, 0))  # the engine prefilled 512 tokens of it
    ledger.record_sync(unbilled)
    assert ledger.flush()

    rows = {r["tenant_id"]: r for r in reconcile(ledger.queries.reconcile_views(PERIOD)).frame.to_dicts()}
    accounted = rows["accounted"]
    assert accounted["status"] == "ok" and accounted["unexplained_drift_tokens"] == 0
    assert (accounted["matched_requests"], accounted["aborted_requests"]) == (3, 0)
    assert accounted["engine_tokens"] == accounted["ledger_tokens"] == 2 * 512 + 31
    ignored = rows["ignored"]
    assert ignored["status"] == "drift"
    assert (ignored["mismatched_requests"], ignored["matched_token_drift"]) == (1, 512)

    detailed = {r["tenant_id"]: r for r in ledger.queries.reconcile_views(PERIOD, detailed=True)}
    fast = {r["tenant_id"]: r for r in ledger.queries.reconcile_views(PERIOD)}
    for tenant in fast:
        assert {k: v for k, v in fast[tenant].items() if k != "checked"} == \
            {k: v for k, v in detailed[tenant].items() if k != "checked"}, tenant
