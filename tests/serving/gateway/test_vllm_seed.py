"""The seed range the gateway accepts is the one the real vLLM engine can run: both ends of a
signed 64-bit integer complete; one past either end is a 400 naming ``seed`` before the engine
is touched (it used to reach the engine and come back as a 503 "retry")."""

from __future__ import annotations

import pytest

from tests.serving.gateway.conftest import auth

pytestmark = [pytest.mark.engine]


async def test_int64_seeds_run_on_vllm_and_wider_ones_are_400(stack, client):
    body = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 1.0}
    for seed in (-(2**63), -1, 0, 2**63 - 1):
        resp = await client.post("/v1/chat/completions", headers=auth("acme"), json={**body, "seed": seed})
        assert resp.status_code == 200, (seed, resp.text)
    before = stack.usage_count("acme")
    for seed in (2**63, 2**64, 2**70, -(2**63) - 1):
        resp = await client.post("/v1/chat/completions", headers=auth("acme"), json={**body, "seed": seed})
        assert resp.status_code == 400, (seed, resp.text)
        assert resp.json()["error"]["param"] == "body.seed"  # vLLM's name for it
    assert stack.usage_count("acme") == before, "a refused seed was billed"
