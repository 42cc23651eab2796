"""The engine_steps retention on a real chDB ledger: migration 0008's default TTL, the configured
limit applied at open (``MODIFY TTL`` / ``REMOVE TTL``), and old rows going in a TTL merge
(``OPTIMIZE ... FINAL``) while recent ones stay. ClickHouse's TTL compares with its own ``now()``,
so the step rows here are dated from the real wall clock (days old), not the test clock."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvmeter.ledger import LedgerConfig
from kvmeter.ledger.errors import ConfigError
from kvmeter.ledger.retention import (DEFAULT_ENGINE_STEPS_RETENTION_DAYS, apply_engine_steps_retention,
                                      engine_steps_ttl_days, retention_statement)
from kvmeter.ledger.schema import load_migrations, migrate
from kvmeter.stats import EngineStepShares, TenantStepShare

DAY = 86400.0
AGES_DAYS = (10, 1, 0.001)  # one row each: older than the 7-day limit, and two inside it


def _ddl(ledger) -> str:
    return ledger.query_client().query("SHOW CREATE TABLE engine_steps").result_rows[0][0]


def _write_steps(ledger) -> None:
    now = time.time()
    for age in AGES_DAYS:
        ledger.record_step_shares(EngineStepShares(wall_ts=now - age * DAY, engine_idx=0, duration_s=0.5,
                                                   tenants=(TenantStepShare("acme", "free", 8, 0, 8, 1, ()),)),
                                  model="m", replica="r1")
    assert ledger.flush()


def _ages(ledger) -> list[int]:
    rows = ledger.query_client().query(
        "SELECT dateDiff('day', ts, now64(6)) FROM engine_steps ORDER BY ts").result_rows
    return [int(r[0]) for r in rows]


def test_the_default_keeps_seven_days_and_an_expired_row_is_not_kept(open_ledger, config, tmp_path):
    default = LedgerConfig(dsn=f"chdb://{tmp_path}").engine_steps_retention_days
    assert default == DEFAULT_ENGINE_STEPS_RETENTION_DAYS == 7
    ledger = open_ledger(dataclasses.replace(config, engine_steps_retention_days=DEFAULT_ENGINE_STEPS_RETENTION_DAYS))
    assert "TTL toDateTime(ts) + toIntervalDay(7)" in _ddl(ledger)
    assert engine_steps_ttl_days(ledger.query_client()) == 7
    _write_steps(ledger)
    ledger.query_client().command("OPTIMIZE TABLE engine_steps FINAL")
    assert _ages(ledger) == [1, 0]  # the 10-day-old row is gone (already at insert), the others stay


def test_a_limit_set_later_removes_old_rows_at_the_ttl_merge_and_keeps_recent_ones(open_ledger, config):
    forever = dataclasses.replace(config, engine_steps_retention_days=0)
    ledger = open_ledger(forever)
    assert "TTL" not in _ddl(ledger) and engine_steps_ttl_days(ledger.query_client()) == 0
    _write_steps(ledger)
    client = ledger.query_client()
    client.command("OPTIMIZE TABLE engine_steps FINAL")
    assert _ages(ledger) == [10, 1, 0]  # kept forever
    ledger.close()

    ledger = open_ledger(dataclasses.replace(config, engine_steps_retention_days=7))
    assert "TTL toDateTime(ts) + toIntervalDay(7)" in _ddl(ledger)
    assert _ages(ledger) == [10, 1, 0]  # a metadata change at open: nothing rewritten yet
    ledger.query_client().command("OPTIMIZE TABLE engine_steps FINAL")
    assert _ages(ledger) == [1, 0]  # the TTL merge took the 10-day-old row only
    ledger.close()

    ledger = open_ledger(dataclasses.replace(config, engine_steps_retention_days=30))
    assert "TTL toDateTime(ts) + toIntervalDay(30)" in _ddl(ledger)
    assert apply_engine_steps_retention(ledger.query_client(), 30) is False  # already so: no ALTER
    assert apply_engine_steps_retention(ledger.query_client(), 0) is True
    assert "TTL" not in _ddl(ledger)


def test_migration_0008_renders_the_ttl_on_the_local_table_in_cluster_mode():
    (single,) = [m for m in load_migrations() if m.version == 8]
    (cluster,) = [m for m in load_migrations("main") if m.version == 8]
    assert single.statements == ("ALTER TABLE engine_steps  MODIFY TTL toDateTime(ts) + INTERVAL 7 DAY",)
    assert cluster.statements == (
        "ALTER TABLE engine_steps_local ON CLUSTER main MODIFY TTL toDateTime(ts) + INTERVAL 7 DAY",)
    assert retention_statement(3, "main") == (
        "ALTER TABLE engine_steps_local ON CLUSTER main MODIFY TTL toDateTime(ts) + INTERVAL 3 DAY")
    assert retention_statement(0) == "ALTER TABLE engine_steps REMOVE TTL"
    with pytest.raises(ValueError):
        retention_statement(-1)


def test_a_ledger_at_0007_gets_the_ttl_from_the_upgrade(open_ledger, config):
    ledger = open_ledger(dataclasses.replace(config, engine_steps_retention_days=7))
    client = ledger.query_client()
    client.command("ALTER TABLE engine_steps REMOVE TTL")
    client.command("ALTER TABLE schema_migrations DELETE WHERE version = 8 SETTINGS mutations_sync = 1")
    assert engine_steps_ttl_days(client) == 0
    assert migrate(client) == [8]
    assert engine_steps_ttl_days(client) == 7


@pytest.mark.parametrize("days", [-1, 1.5, True])
def test_a_bad_retention_is_refused(tmp_path, days):
    with pytest.raises(ConfigError, match="engine_steps_retention_days"):
        LedgerConfig(dsn=f"chdb://{tmp_path}", engine_steps_retention_days=days)


def test_the_retention_comes_from_the_environment(tmp_path):
    env = {"KVMETER_LEDGER_ENGINE_STEPS_RETENTION_DAYS": "0"}
    assert LedgerConfig.from_env(env, dsn=f"chdb://{tmp_path}").engine_steps_retention_days == 0
    with pytest.raises(ConfigError, match="whole number"):
        LedgerConfig.from_env({"KVMETER_LEDGER_ENGINE_STEPS_RETENTION_DAYS": "a week"}, dsn=f"chdb://{tmp_path}")


def test_the_serve_config_sets_the_ledgers_retention(monkeypatch, tmp_path):
    from kvmeter.serving.config import load_serve_config
    from kvmeter.serving.runtime import ledger_config_of

    monkeypatch.delenv("KVMETER_LEDGER_ENGINE_STEPS_RETENTION_DAYS", raising=False)
    dsn = {("ledger_dsn",): f"chdb://{tmp_path}"}
    assert ledger_config_of(load_serve_config(None, dsn, env={})).engine_steps_retention_days == 7
    config = load_serve_config(None, {**dsn, ("engine_steps_retention_days",): 3}, env={})
    assert ledger_config_of(config).engine_steps_retention_days == 3
    monkeypatch.setenv("KVMETER_LEDGER_ENGINE_STEPS_RETENTION_DAYS", "0")  # the ledger's own variable
    assert ledger_config_of(load_serve_config(None, dsn, env={})).engine_steps_retention_days == 0
