"""Retention of the ledger's per-step table: the TTL on ``engine_steps`` (migration 0008).

``engine_steps`` holds one row per engine step and tenant (migration 0007), so it grows with every
step; usage, attempts and every table that bills or reconciles are kept forever. Its limit is
:attr:`~kvmeter.ledger.config.LedgerConfig.engine_steps_retention_days` (default
:data:`DEFAULT_ENGINE_STEPS_RETENTION_DAYS`, 0 = keep forever): a row goes in a TTL merge once its
``ts`` is that many days old (``TTL toDateTime(ts) + INTERVAL N DAY``; ClickHouse deletes expired
rows when it merges parts — in the background, or at ``OPTIMIZE TABLE ... FINAL``). Migration 0008
sets the default; :func:`apply_engine_steps_retention` (run by :meth:`Ledger.open
<kvmeter.ledger.ledger.Ledger.open>` after the migrations) makes the table's TTL the configured one
(``MODIFY TTL`` or ``REMOVE TTL``, only when it differs), as a metadata change
(``materialize_ttl_after_modify = 0``: no rewrite of the table while the ledger opens): rows
already stored go at their parts' next merge — the background TTL merges (ClickHouse's
``merge_with_ttl_timeout``, 4 h by default) or an ``OPTIMIZE TABLE engine_steps FINAL``. Measured
on chDB (``tests/ledger/test_engine_steps_retention.py``): rows 10 days old stay after the limit
is set to 7 days and go at ``OPTIMIZE ... FINAL``, rows 1 day old stay; with a 7-day TTL a row
already expired is dropped at insert. The TTL compares ``ts`` with ClickHouse's own clock, so step
rows dated further back than the limit never stay — a spool drained after a longer outage, a
bench or test writing steps at fixed past dates: those set ``engine_steps_retention_days=0``.
In cluster mode the TTL is on ``engine_steps_local`` ``ON CLUSTER`` (rendered and unit-tested;
not run on a cluster).
"""

from __future__ import annotations

import logging
import re

from clickhouse_connect.driver.client import Client

from .errors import MigrationError

__all__ = ["DEFAULT_ENGINE_STEPS_RETENTION_DAYS", "engine_steps_ttl_days", "retention_statement",
           "apply_engine_steps_retention"]

log = logging.getLogger(__name__)

#: Days of ``engine_steps`` rows kept when nothing else is configured (migration 0008's TTL).
DEFAULT_ENGINE_STEPS_RETENTION_DAYS = 7

# ClickHouse writes the TTL back normalized: ``TTL toDateTime(ts) + toIntervalDay(7)``
_TTL = re.compile(r"\bTTL toDateTime\(ts\) \+ toIntervalDay\((\d+)\)")
_ANY_TTL = re.compile(r"\)\s*ENGINE[\s\S]*\bTTL\b")


def _table(cluster: str | None) -> str:
    return "engine_steps_local" if cluster else "engine_steps"


def engine_steps_ttl_days(client: Client, cluster: str | None = None) -> int | None:
    """The retention in days the table's TTL sets: ``0`` without a TTL, ``None`` for a TTL of
    another form (set by hand).

    Raises:
        MigrationError: the table does not exist (migration 0007 not applied).
    """
    rows = client.query("SELECT create_table_query FROM system.tables WHERE database = currentDatabase() "
                        "AND name = {t:String}", parameters={"t": _table(cluster)}).result_rows
    if not rows:
        raise MigrationError(f"{_table(cluster)} does not exist: migrate the ledger first")
    ddl = str(rows[0][0])
    m = _TTL.search(ddl)
    if m:
        return int(m.group(1))
    return None if _ANY_TTL.search(ddl) else 0


def retention_statement(days: int, cluster: str | None = None) -> str:
    """The ``ALTER TABLE`` giving ``engine_steps`` a retention of ``days`` (> 0), or removing its TTL (0).

    Raises:
        ValueError: ``days`` is not an int ≥ 0.
    """
    if not isinstance(days, int) or isinstance(days, bool) or days < 0:
        raise ValueError(f"retention days must be an int >= 0, got {days!r}")
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    what = f"MODIFY TTL toDateTime(ts) + INTERVAL {days} DAY" if days else "REMOVE TTL"
    return f"ALTER TABLE {_table(cluster)}{on_cluster} {what}"


def apply_engine_steps_retention(client: Client, days: int, cluster: str | None = None) -> bool:
    """Make ``engine_steps``' TTL a retention of ``days`` (0: no TTL), altering the table only when
    its TTL differs.

    Args:
        client: a client on the migrated ledger database.
        days: days of rows kept (int ≥ 0; 0 = forever).
        cluster: the cluster name in cluster mode (the TTL is on ``engine_steps_local``).
    Returns:
        Whether the table was altered.
    Raises:
        ValueError: a bad ``days``.
        MigrationError: the table is missing or ClickHouse refused the ``ALTER``.
    """
    statement = retention_statement(days, cluster)
    if engine_steps_ttl_days(client, cluster) == days:
        return False
    try:
        client.command(statement, settings={"materialize_ttl_after_modify": 0})
    except Exception as exc:  # noqa: BLE001 — translated at the boundary
        raise MigrationError(f"cannot set the engine_steps retention ({statement}): {exc}") from exc
    log.info("ledger: engine_steps retention set to %s", f"{days} days" if days else "forever")
    return True
