"""Four ``kvmeter serve`` processes sharing one Redis enforce one global tokens-per-minute limit.

Real processes (``kvmeter serve --engine instant --quota-store redis://...``), each with its own
chDB ledger and spool, against a real redis-server; clients drive all four at once. The global
input-tokens-per-minute limit is GCRA with a burst of the whole limit, refilling limit / 60 per
second, so over a run of ``T`` seconds the fleet may admit at most ``limit + limit × T / 60``
tokens — four independent limits would admit four times the burst.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from kvmeter.ledger import Ledger, LedgerConfig
from tests.conftest import free_port
from tests.serving.quota_http.conftest import PRICES_YAML, completion, tenants
from tests.serving.quota_http.gateway_procs import start_gateways, stop_gateways

pytestmark = [pytest.mark.slow, pytest.mark.redis]

LIMIT = 3000          # input tokens per minute, platform-wide
PROMPT = 100          # tokens per request (exact: token-id prompts)
CFG = tenants("""
acme:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            k1: {key: sk-test-fleet-0001}
            k2: {key: sk-test-fleet-0002}
""", extra_top=f"global: {{limits: {{input_tokens_per_minute: {LIMIT}}}}}")
KEYS = ["sk-test-fleet-0001", "sk-test-fleet-0002"]


def _billed_tokens(gw_root: Path) -> int:
    """Prompt tokens billed in one stopped gateway's own ledger."""
    ledger = Ledger.open(LedgerConfig(dsn=f"chdb://{gw_root}/chdb", spool_dir=gw_root / "spool"))
    try:
        assert ledger.flush(30.0)
        result = ledger.query_client().query("SELECT sum(input_tokens) FROM usage_events FINAL")
        return int(result.result_rows[0][0] or 0)
    finally:
        ledger.close()


async def test_four_gateways_share_one_global_token_limit(tmp_path, redis_url):
    (tmp_path / "tenants.yaml").write_text(CFG)
    (tmp_path / "prices.yaml").write_text(PRICES_YAML)
    procs = await asyncio.to_thread(
        start_gateways, 4, tmp_path, [free_port() for _ in range(4)], tenants=tmp_path / "tenants.yaml",
        prices=tmp_path / "prices.yaml", quota_store=redis_url.rsplit("/", 1)[0] + "/7")
    try:
        admitted = rejected = 0
        started = time.monotonic()

        async def drive(gw_url: str, key: str) -> None:
            nonlocal admitted, rejected
            async with httpx.AsyncClient(base_url=gw_url, timeout=30) as client:
                for _ in range(25):
                    resp = await client.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                                             json=completion(PROMPT, 1))
                    if resp.status_code == 200:
                        admitted += resp.json()["usage"]["prompt_tokens"]
                    else:
                        assert resp.status_code == 429, resp.text
                        assert resp.json()["error"]["level"] == "global"
                        assert resp.json()["error"]["dimension"] == "input_tokens_per_minute"
                        rejected += 1

        # 4 gateways × 2 keys × 2 clients × 25 requests × 100 tokens = 40,000 tokens asked
        await asyncio.gather(*(drive(gp.url, key) for gp in procs for key in KEYS for _ in range(2)))
        elapsed = time.monotonic() - started
    finally:
        await asyncio.to_thread(stop_gateways, procs)

    ceiling = LIMIT + LIMIT * elapsed / 60 + PROMPT
    print(f"admitted {admitted} tokens of {LIMIT}/min in {elapsed:.2f} s (ceiling {ceiling:.0f}); "
          f"{rejected} requests refused")
    assert LIMIT <= admitted <= ceiling, (admitted, ceiling, elapsed)
    assert admitted < 2 * LIMIT, "the four replicas did not share one limit"
    assert rejected >= 400 - ceiling / PROMPT
    billed = [await asyncio.to_thread(_billed_tokens, gp.root) for gp in procs]
    assert sum(billed) == admitted  # every admitted token billed once, in its own replica's ledger
    assert sum(1 for b in billed if b > 0) >= 2  # the limit was shared, not served by one replica
