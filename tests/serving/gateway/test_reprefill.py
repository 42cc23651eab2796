"""The prompt-cache thrash tracker (serving/gateway/reprefill.py) on an injected clock, the gateway
meter settling it at the end, and the per-tenant counter it feeds."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus
from kvmeter.serving.engines.base import EngineOutput
from kvmeter.serving.gateway.metering import RequestIdentity, RequestMeter
from kvmeter.serving.gateway.reprefill import PrefixReuse, block_hashes
from kvmeter.tokens import TokenCounts

B = 16
PROMPT = list(range(1000, 1000 + 10 * B + 5))  # 165 tokens: 10 full blocks, all hittable


def run(tracker: PrefixReuse, prompt: list[int], cached: int, *, taken: int | None = None) -> int:
    """One request: dispatched now, ending at once with ``cached`` tokens served from the cache."""
    probe = tracker.probe([prompt])
    return probe.settle(TokenCounts(input_tokens=len(prompt) if taken is None else taken,
                                    cached_input_tokens=cached, output_tokens=1))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_chained_hashes_name_the_whole_prefix():
    a = block_hashes(PROMPT, B)
    assert len(a) == 10 and len(set(a)) == 10
    other_first = [7] + PROMPT[1:]  # differs in block 0 only: every later block's hash differs too
    assert not set(a) & set(block_hashes(other_first, B))
    other_last = PROMPT[:-10] + [7] * 10  # differs in block 9 (and the tail): blocks 0-8 shared
    assert block_hashes(other_last, B)[:9] == a[:9] and block_hashes(other_last, B)[9] != a[9]


def test_a_repeat_within_the_window_with_no_cache_hit_counts_its_blocks(clock):
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    assert run(tracker, PROMPT, cached=0) == 0  # first sight: nothing was computed before
    clock.advance(30)
    assert run(tracker, PROMPT, cached=0) == 10 * B  # prefilled again: thrash
    clock.advance(30)
    assert run(tracker, PROMPT, cached=4 * B) == 6 * B  # the cache kept 4 blocks of 10


def test_a_repeat_served_from_the_cache_counts_zero(clock):
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    run(tracker, PROMPT, cached=0)
    clock.advance(5)
    assert run(tracker, PROMPT, cached=10 * B) == 0


def test_a_repeat_after_the_window_counts_zero(clock):
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    run(tracker, PROMPT, cached=0)
    clock.advance(60.5)
    assert run(tracker, PROMPT, cached=0) == 0
    clock.advance(60)  # ...but that run was seen again: its repeat within the window counts
    assert run(tracker, PROMPT, cached=0) == 10 * B


def test_a_shared_prefix_counts_only_its_shared_blocks(clock):
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    run(tracker, PROMPT, cached=0)
    longer = PROMPT[:6 * B] + list(range(50_000, 50_000 + 8 * B))  # shares 6 blocks
    assert run(tracker, longer, cached=0) == 6 * B
    # now all of it was computed: 14 blocks, 13 hittable (the last token is always computed)
    assert run(tracker, longer, cached=13 * B) == 0
    assert run(tracker, longer, cached=6 * B) == 7 * B


def test_the_last_token_is_never_a_hit(clock):
    """vLLM computes a prompt's last token itself: a block-aligned prompt repeated in full can hit
    all its blocks but the last, so that block is not thrash."""
    aligned = PROMPT[:4 * B]
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    run(tracker, aligned, cached=0)
    assert run(tracker, aligned, cached=3 * B) == 0
    assert run(tracker, aligned, cached=0) == 3 * B


def test_concurrent_requests_do_not_count_against_each_other(clock):
    """Blocks become seen when a request ends; warmth is decided at dispatch."""
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    a, b = tracker.probe([PROMPT]), tracker.probe([PROMPT])
    full = TokenCounts(input_tokens=len(PROMPT), output_tokens=1)
    assert a.settle(full) == 0 and b.settle(full) == 0
    assert b.settle(full) == 0 and len(tracker) == 10  # idempotent: recorded once


def test_only_the_input_the_engine_took_in_is_recorded_and_counted(clock):
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    assert run(tracker, PROMPT, cached=0, taken=0) == 0  # never reached the engine's prefill
    assert len(tracker) == 0
    assert run(tracker, PROMPT, cached=0, taken=3 * B + 2) == 0  # a prefill cut after 50 tokens
    assert len(tracker) == 3
    assert run(tracker, PROMPT, cached=0, taken=2 * B) == 2 * B  # warm 3, of which it ran 2
    assert run(tracker, PROMPT, cached=0) == 3 * B


def test_several_prompts_sum_against_the_request_cached_count(clock):
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    other = list(range(70_000, 70_000 + 5 * B + 1))
    probe = tracker.probe([PROMPT, other])
    total = len(PROMPT) + len(other)
    assert probe.settle(TokenCounts(input_tokens=total, output_tokens=2)) == 0
    again = tracker.probe([PROMPT, other])
    assert again.warm_blocks == (10, 5)
    assert again.settle(TokenCounts(input_tokens=total, cached_input_tokens=10 * B, output_tokens=2)) == 5 * B


def test_the_lru_bound_holds_and_forgets_the_least_recently_seen(clock):
    tracker = PrefixReuse(B, window_s=600, max_blocks=12, clock=clock)
    first, second = PROMPT, list(range(90_000, 90_000 + 10 * B + 1))
    run(tracker, first, cached=0)
    clock.advance(1)
    run(tracker, second, cached=0)  # 20 blocks seen, 12 kept: second's 10 and first's 2 leading ones
    assert len(tracker) == 12
    assert tracker.probe([second]).warm_blocks == (10,)
    # the deepest blocks go first, so what is left of a prompt is still its leading prefix
    assert tracker.probe([first]).warm_blocks == (2,)
    for _ in range(50):
        clock.advance(1)
        start = int(clock.monotonic()) * 1000
        run(tracker, list(range(start, start + 3 * B + 1)), cached=0)
        assert len(tracker) <= 12


def test_settings_are_checked_at_construction(clock):
    for kwargs in ({"block_size_tokens": 0}, {"block_size_tokens": B, "window_s": 0},
                   {"block_size_tokens": B, "max_blocks": 0}):
        with pytest.raises(ValueError, match=next(iter(k for k in kwargs if kwargs[k] == 0))):
            PrefixReuse(clock=clock, **kwargs)


def _request(tracker: PrefixReuse, clock: ManualClock, tenant: str, cached: int) -> RequestMeter:
    ident = RequestIdentity(request_id=f"r-{clock.monotonic()}", stream=False,
                            attribution=Attribution(tenant, tier="paid_interactive", model="smollm2"))
    meter = RequestMeter(ident, clock, reserved=TokenCounts(input_tokens=len(PROMPT), output_tokens=4))
    meter.dispatched()
    meter.prefix_probe = tracker.probe([PROMPT])
    clock.advance(0.5)
    meter.on_output(EngineOutput(new_token_ids=(1, 2), new_text="ab", num_output_tokens=2,
                                 num_input_tokens=len(PROMPT), num_cached_input_tokens=cached,
                                 finished=True, finish_reason="stop"))
    return meter


def test_the_meter_settles_at_the_end_and_the_tenant_counter_takes_it(clock):
    """The gateway's meter puts the re-prefill on the completion; the exporter counts it under the
    tenant that re-prefilled (bounded label) and the model."""
    bus, registry = StatsBus(), CollectorRegistry()
    install_prometheus(bus, registry, config=PrometheusConfig(top_k_tenants=1, model="smollm2"), clock=clock)
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    for tenant, cached, expected in (("acme", 0, 0), ("globex", 0, 10 * B), ("acme", 10 * B, 0),
                                     ("initech", 4 * B, 6 * B)):
        _, completion = _request(tracker, clock, tenant, cached).finish("ok", status_code=200)
        assert completion.reprefill_input_tokens == expected
        bus.publish(completion)
    get = registry.get_sample_value
    # a re-prefill of 0 adds nothing
    assert get("kvmeter_prompt_reprefill_tokens_total", {"tenant": "acme", "model": "smollm2"}) is None
    # K = 1: acme holds the one label (it came first); the others' thrash goes to "other"
    assert get("kvmeter_prompt_reprefill_tokens_total", {"tenant": "other", "model": "smollm2"}) == 16 * B
    assert get("kvmeter_tokens_total", {"tier": "paid_interactive", "tenant": "other", "type": "input",
                                        "outcome": "ok"}) == 2 * len(PROMPT)


def test_a_meter_without_a_probe_reports_zero(clock):
    tracker = PrefixReuse(B, window_s=60, clock=clock)
    meter = _request(tracker, clock, "acme", 0)
    meter.prefix_probe = None
    assert meter.finish("ok", status_code=200)[1].reprefill_input_tokens == 0
