"""One "gateway replica" as its own OS process, for the shared-Redis race test.

Run: python quota_mp_worker.py --config F --url redis://... --prefix P --key SECRET --wall W
Prints ``ready`` once connected, waits for a ``go`` token pushed by the test, fires ``--attempts``
concurrent reservations of ``--prompt`` input tokens, then prints one JSON line with its counts.
The clock is a ManualClock frozen at ``--wall`` in every process, so the tokens-per-minute budget
cannot refill during the test: the fleet-wide admitted total must equal the limit exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import redis.asyncio as aioredis

from kvmeter.clock import ManualClock
from kvmeter.serving.quota import HierarchicalQuota, QuotaRejected, RedisQuotaStore, UsageEstimate
from kvmeter.serving.tenancy import TenantDirectory
from kvmeter.tokens import TokenCounts


async def main(args: argparse.Namespace) -> None:
    directory = TenantDirectory(path=args.config)
    store = RedisQuotaStore.from_url(args.url, key_prefix=args.prefix, timeout_s=5.0)
    gate = HierarchicalQuota(directory, store, clock=ManualClock(start_wall=args.wall))
    principal = directory.authenticate(args.key)
    waiter = aioredis.Redis.from_url(args.url)  # no socket timeout: it blocks on BLPOP
    await store.client.ping()
    print("ready", flush=True)
    await waiter.blpop([args.prefix + "go"], timeout=60)

    async def one() -> tuple[int, str]:
        try:
            await gate.reserve(principal, UsageEstimate(principal.attribution(model="m"),
                                                        TokenCounts(input_tokens=args.prompt)))
            return 1, ""
        except QuotaRejected as e:
            return 0, f"{e.status_code}:{e.reason}:{e.level}/{e.dimension}"

    results = await asyncio.gather(*(one() for _ in range(args.attempts)))
    print(json.dumps({"admitted": sum(a for a, _ in results),
                      "rejections": sorted({r for a, r in results if not a})}), flush=True)
    await waiter.aclose()
    await store.aclose()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for name in ("--config", "--url", "--prefix", "--key"):
        p.add_argument(name, required=True)
    p.add_argument("--wall", type=float, required=True)
    p.add_argument("--attempts", type=int, default=100)
    p.add_argument("--prompt", type=int, default=100)
    asyncio.run(main(p.parse_args()))
