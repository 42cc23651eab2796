"""RequestMeter on a hand-driven clock: TTFT, ITL, KV token-seconds and the usage event."""

from __future__ import annotations

import pytest

from kvmeter.attribution import Attribution
from kvmeter.clock import ManualClock
from kvmeter.events import event_id_for
from kvmeter.serving.engines.base import EngineOutput
from kvmeter.serving.gateway.metering import RequestIdentity, RequestMeter
from kvmeter.serving.tenancy import TierPolicy
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import TokenCounts

ACME = Attribution("acme", tier="enterprise", model="m", endpoint="chat.completions")
IDENT = RequestIdentity(request_id="kvm-1", attribution=ACME, stream=True)


def _out(total: int, new: int, *, prompt: int = 100, cached: int = 0, finished: bool = False,
         stats: EngineRequestStats | None = None) -> EngineOutput:
    return EngineOutput(new_token_ids=[1] * new, new_text="x" * new, num_output_tokens=total,
                        num_input_tokens=prompt, num_cached_input_tokens=cached, finished=finished,
                        finish_reason="length" if finished else None, stats=stats)


def test_ttft_itl_and_kv_token_seconds_by_hand():
    clock = ManualClock()
    meter = RequestMeter(IDENT, clock, reserved=TokenCounts(input_tokens=100, output_tokens=4))
    clock.advance(0.5)
    meter.dispatched()                       # queued 0.5 s
    clock.advance(1.0)
    meter.on_output(_out(1, 1))              # first token at 1.5 s; prompt (100) held 1.0 s
    clock.advance(0.2)
    meter.on_output(_out(3, 2))              # 2 tokens after 0.2 s → two ITLs of 0.1 s; held 101 × 0.2
    clock.advance(0.3)
    stats = EngineRequestStats(
        "kvm-1",
        "length",
        TokenCounts(input_tokens=100, cached_input_tokens=40, output_tokens=4),
        queued_s=0.05,
        prefill_s=0.9,
        decode_s=0.5,
    )
    meter.on_output(_out(4, 1, finished=True, stats=stats))  # held 103 × 0.3, then KV freed
    clock.advance(5.0)                       # time after the engine finished does not hold KV
    event, done = meter.finish("ok", status_code=200, policy=TierPolicy("t", ttft_slo_s=2.0, itl_slo_s=0.2))
    assert event.ttft_s == pytest.approx(1.5)
    assert done.itls_s == pytest.approx([0.1, 0.1, 0.3])
    assert event.itl_mean_s == pytest.approx(0.5 / 3)
    assert event.kv_token_seconds == pytest.approx(100 * 1.0 + 101 * 0.2 + 103 * 0.3)
    assert event.queue_s == pytest.approx(0.5 + 0.05)
    # engine-true counts from the engine's own stats, cached ⊆ input
    assert event.tokens == stats.tokens == TokenCounts(100, 40, 4, 0) and done.tokens is event.tokens
    assert event.attribution is done.attribution is ACME  # carried by reference, never copied
    assert event.token_source == "engine_hooks"
    assert event.e2e_s == pytest.approx(7.0)
    assert done.slo_met is True
    assert event.event_id == event_id_for("acme", "kvm-1")


def test_abort_bills_what_the_frontend_saw_and_misses_its_slo():
    clock = ManualClock()
    meter = RequestMeter(IDENT, clock, reserved=TokenCounts(input_tokens=50, output_tokens=500))
    meter.dispatched()
    clock.advance(0.1)
    meter.on_output(_out(7, 7, prompt=50, cached=16))
    clock.advance(0.1)
    event, done = meter.finish("aborted", status_code=200, policy=TierPolicy("t", ttft_slo_s=2.0),
                               finish_reason="abort")
    assert event.tokens == TokenCounts(input_tokens=50, cached_input_tokens=16, output_tokens=7)
    assert event.token_source == "frontend" and event.outcome == "aborted"
    assert event.reserved == TokenCounts(input_tokens=50, output_tokens=500)
    assert event.kv_token_seconds == pytest.approx(50 * 0.1 + 57 * 0.1)  # held until the abort
    assert done.slo_met is False


def test_abort_before_any_output_without_an_engine_account_bills_nothing():
    clock = ManualClock()
    meter = RequestMeter(IDENT, clock, reserved=TokenCounts(input_tokens=4000, output_tokens=10))
    meter.dispatched()
    clock.advance(3.0)
    event, _ = meter.finish("aborted", status_code=499, finish_reason="abort")
    assert (event.tokens, event.kv_token_seconds) == (TokenCounts(), 0.0)
    assert event.ttft_s is None


def _abort_account(prompt: int, generated: int, cached: int = 0) -> EngineRequestStats:
    """What the vLLM scheduler hook reports for a request it freed early."""
    return EngineRequestStats("kvm-1", "abort", TokenCounts(input_tokens=prompt, output_tokens=generated,
                                                            cached_input_tokens=cached),
                              computed_tokens=prompt + generated,
                              preempted_tokens=0, phase_times_measured=False)


def test_abort_before_any_output_bills_the_engines_account_of_its_prefill():
    clock = ManualClock()
    meter = RequestMeter(IDENT, clock, reserved=TokenCounts(input_tokens=1500, output_tokens=10))
    clock.advance(0.25)
    meter.dispatched()
    clock.advance(0.5)  # the client leaves mid-prefill; the engine ran two 256-token chunks
    meter.engine_account(_abort_account(512, 0))
    event, done = meter.finish("aborted", status_code=200, finish_reason="abort")
    assert event.tokens == TokenCounts(input_tokens=512)
    assert event.token_source == "engine_hooks" and event.outcome == "aborted"
    assert event.reserved.input_tokens == 1500
    assert event.prefill_s is None and event.decode_s is None  # the account measured no phases
    assert event.queue_s == pytest.approx(0.25) and event.ttft_s is None
    assert done.tokens == TokenCounts(input_tokens=512)


def test_abort_mid_stream_bills_what_the_engine_generated_not_what_arrived():
    clock = ManualClock()
    meter = RequestMeter(IDENT, clock, reserved=TokenCounts(input_tokens=50, output_tokens=500))
    meter.dispatched()
    meter.on_output(_out(7, 7, prompt=50, cached=16))
    meter.engine_account(_abort_account(50, 9, cached=16))  # two tokens were in flight
    event, _ = meter.finish("aborted", status_code=200, finish_reason="abort")
    assert event.tokens == TokenCounts(input_tokens=50, cached_input_tokens=16, output_tokens=9)
    assert event.token_source == "engine_hooks"


def test_an_account_after_the_final_delta_changes_nothing():
    clock = ManualClock()
    meter = RequestMeter(IDENT, clock, reserved=TokenCounts(input_tokens=100, output_tokens=4))
    meter.dispatched()
    final = EngineRequestStats("kvm-1", "length", TokenCounts(input_tokens=100, output_tokens=4), prefill_s=0.2)
    meter.on_output(_out(4, 4, finished=True, stats=final))
    meter.engine_account(_abort_account(100, 6))
    meter.engine_account(None)
    event, _ = meter.finish("ok", status_code=200)
    assert (event.tokens, event.prefill_s) == (TokenCounts(input_tokens=100, output_tokens=4), 0.2)


def test_idempotency_key_decides_the_event_id_and_slow_ttft_misses_the_slo():
    clock = ManualClock()
    ident = RequestIdentity(request_id="kvm-2", attribution=Attribution("acme", tier="t", model="m", endpoint="e"),
                            stream=False, idempotency_key="order-17", attempt=2)
    meter = RequestMeter(ident, clock, reserved=TokenCounts(input_tokens=10, output_tokens=1))
    meter.dispatched()
    clock.advance(3.0)
    meter.on_output(_out(1, 1, prompt=10, finished=True))
    event, done = meter.finish("ok", status_code=200, policy=TierPolicy("t", ttft_slo_s=2.0))
    assert event.event_id == event_id_for("acme", "order-17") and event.attempt == 2
    assert done.slo_met is False
