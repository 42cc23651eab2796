"""Move quota keys written before the hash-tag layout to their tagged names (one Redis).

Until 3 Dec 2026 quota keys had no hash tag (``kvq:o:acme:rpm``, ``kvq:k:acme/ws/proj/k1:conc``,
``kvq:g::rpm``, ``kvq:r:acme/RUN:mc``); now the org sits in braces (``kvq:o:{acme}:rpm``, see
:mod:`.plan`). New gateways never read the old names, so without this step every counter would
start empty after the upgrade — spend budgets of the day and month included. Upgrade so:

1. stop every gateway (old and new gateways would count in different keys; no rolling upgrade);
2. ``python -m kvmeter.serving.quota.key_migration redis://host:port/db [--prefix kvq:] [--dry-run]``
   renames each old key to its new name with ``RENAMENX`` (value and TTL kept; a key whose new
   name already exists is left as it is and reported as a conflict) and deletes the old
   concurrency / active-KV / parallel-branch holds (``conc``, ``kv``, ``pb``): with every gateway
   stopped nothing holds them any more — what is left there is what killed gateways leaked, which
   the old layout could not expire;
3. start the new gateways.

It runs on one Redis. To move to a Redis Cluster, migrate on the single Redis first, then import
the keys (``redis-cli --cluster import``); the tagged names put each org in one slot.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from kvmeter.serving.quota.plan import LEVEL_CODES, tagged_node_id

__all__ = ["tagged_key", "migrate_keys", "MigrationReport", "HOLD_CODES"]

#: Dimension codes of holds (released at reconciliation): dropped, not renamed.
HOLD_CODES = frozenset({"conc", "kv", "pb"})

_CODES = frozenset(LEVEL_CODES.values())


def tagged_key(old: str, prefix: str = "kvq:") -> str | None:
    """The hash-tagged name of an old-layout quota key, or None if ``old`` is not one (another
    store's key, or already tagged).

    ``kvq:o:acme:rpm`` → ``kvq:o:{acme}:rpm``; ``kvq:g::sd:2026-12-03`` →
    ``kvq:g:{_global}:sd:2026-12-03``; ``kvq:r:acme/run:1:mc`` → ``kvq:r:{acme}/run:1:mc``.
    """
    if not old.startswith(prefix):
        return None
    rest = old[len(prefix):]
    level, sep, tail = rest.partition(":")
    if not sep or level not in _CODES or tail.startswith("{"):
        return None
    if level == "r":  # {org}/{run id}:{code}; the run id may hold ':'
        org, slash, run = tail.partition("/")
        return f"{prefix}r:{tagged_node_id(org)}/{run}" if slash and org else None
    node, sep, dim = tail.partition(":")
    if not sep or not dim:
        return None
    return f"{prefix}{level}:{tagged_node_id(node)}:{dim}"


def _is_hold(key: str) -> bool:
    return key.rsplit(":", 1)[-1] in HOLD_CODES


@dataclass
class MigrationReport:
    """What :func:`migrate_keys` did (or would do, with ``dry_run``).

    Attributes:
        renamed: old → new names moved.
        dropped: old hold keys deleted.
        conflicts: old keys left because their new name exists already.
    """

    renamed: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)


async def migrate_keys(client: aioredis.Redis, prefix: str = "kvq:", *, dry_run: bool = False) -> MigrationReport:
    """Rename every old-layout quota key under ``prefix`` (see the module docstring).

    Args:
        client: the Redis the gateways used (one Redis, not a cluster).
        prefix: the quota stores' ``key_prefix``.
        dry_run: report only.
    Raises:
        redis.exceptions.RedisError: from the client.
    """
    report = MigrationReport()
    async for raw in client.scan_iter(match=f"{prefix}?:*", count=1000):
        old = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
        new = tagged_key(old, prefix)
        if new is None:
            continue
        if _is_hold(old):
            report.dropped.append(old)
            if not dry_run:
                await client.delete(raw)
            continue
        if dry_run:
            report.renamed.append((old, new))
        elif await client.renamenx(raw, new.encode("utf-8", "surrogateescape")):
            report.renamed.append((old, new))
        else:
            report.conflicts.append(old)
    return report


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m kvmeter.serving.quota.key_migration URL [--prefix P] [--dry-run]``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="redis://host:port/db of the quota store")
    ap.add_argument("--prefix", default="kvq:")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)

    async def run() -> MigrationReport:
        client = aioredis.Redis.from_url(args.url)
        try:
            return await migrate_keys(client, args.prefix, dry_run=args.dry_run)
        finally:
            await client.aclose()

    report = asyncio.run(run())
    verb = "would rename" if args.dry_run else "renamed"
    print(f"{verb} {len(report.renamed)} keys, dropped {len(report.dropped)} old holds, "
          f"{len(report.conflicts)} conflicts (left as they are)")
    for old in report.conflicts:
        print(f"conflict: {old}")
    return 1 if report.conflicts else 0


if __name__ == "__main__":
    raise SystemExit(main())
