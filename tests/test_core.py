"""Core pieces: traces, serve config precedence, model resolution errors, the usage event."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmeter.events import UsageEvent, event_id_for
from kvmeter.model import ModelError, resolve_model
from kvmeter.serving.config import ServeConfigError, load_serve_config
from kvmeter.traces import TraceError, load_trace


def test_azure_trace_with_seven_fractional_digits():
    rows = load_trace("azure-code", limit=5)
    assert rows[0].arrival_s == 0.0 and all(r.arrival_s >= 0 for r in rows)
    assert rows == sorted(rows, key=lambda r: r.arrival_s)
    full = load_trace("azure-conv")
    assert len(full) == 19_366
    assert 3500 < full[-1].arrival_s < 3600          # ~59 minutes
    assert max(r.input_tokens for r in full) == 14_050


def test_mooncake_trace_keeps_block_hashes():
    rows = load_trace("mooncake", limit=100)
    assert all(r.hash_ids for r in rows)
    assert rows[0].hash_ids[0] == rows[1].hash_ids[0] == 0   # shared first block


def test_bad_traces_are_clear_errors(tmp_path: Path):
    with pytest.raises(TraceError, match="not found"):
        load_trace("no-such-trace")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(TraceError, match="bad.jsonl:1"):
        load_trace(bad)


def test_serve_config_precedence_flag_file_env_default(tmp_path: Path):
    f = tmp_path / "k.yaml"
    f.write_text("server: {port: 9001}\nquota_store: redis://file:6379/0\n")
    env = {"KVMETER_QUOTA_STORE": "redis://env:6379/0", "KVMETER_LEDGER_DSN": "chdb:///env"}
    cfg = load_serve_config(f, {("server", "port"): 9002}, env=env)
    assert cfg.server.port == 9002                       # flag beats file
    assert cfg.quota_store == "redis://file:6379/0"      # file beats env
    assert cfg.ledger_dsn == "chdb:///env"               # env beats default
    assert cfg.engine.kind == "vllm"                     # default


def test_serve_config_errors_name_the_field(tmp_path: Path):
    f = tmp_path / "k.yaml"
    f.write_text("engine: {max_num_seqs: 0}\n")
    with pytest.raises(ServeConfigError, match="engine.max_num_seqs"):
        load_serve_config(f, env={})
    f.write_text("engine: {wat: 1}\n")
    with pytest.raises(ServeConfigError, match="engine.wat"):
        load_serve_config(f, env={})
    with pytest.raises(ServeConfigError, match="cannot read"):
        load_serve_config(tmp_path / "missing.yaml", env={})


def test_reconciliation_period_from_file_env_and_default(tmp_path: Path):
    default = load_serve_config(None, env={}).reconciliation
    assert (default.interval_s, default.first_run_delay_s, default.lookback_s) == (3600, 60, 86400)  # hourly
    env = {"KVMETER_RECONCILE_INTERVAL_S": "900", "KVMETER_RECONCILE_FIRST_RUN_DELAY_S": "5"}
    from_env = load_serve_config(None, env=env).reconciliation
    assert (from_env.interval_s, from_env.first_run_delay_s) == (900, 5)
    f = tmp_path / "k.yaml"
    f.write_text("reconciliation: {interval_s: 1800, lookback_s: 3600}\n")
    both = load_serve_config(f, env=env).reconciliation
    assert (both.interval_s, both.first_run_delay_s, both.lookback_s) == (1800, 5, 3600)  # file beats env
    f.write_text("reconciliation: {interval_s: 0}\n")
    with pytest.raises(ServeConfigError, match="reconciliation.interval_s"):
        load_serve_config(f, env={})
    with pytest.raises(ServeConfigError, match="reconciliation.first_run_delay_s"):
        load_serve_config(None, env={"KVMETER_RECONCILE_FIRST_RUN_DELAY_S": "soon"})


def test_model_resolution_errors(tmp_path: Path):
    with pytest.raises(ModelError, match="neither"):
        resolve_model(str(tmp_path / "nothing-here"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "hf")) == (tmp_path / "hf", "hf")


def test_usage_event_invariants():
    base = dict(event_id=event_id_for("t", "r"), tenant_id="t", request_id="r", tier="free", model="m",
                endpoint="e", outcome="ok", finish_reason="stop", arrival_ts=1.0, finish_ts=2.0,
                prompt_tokens=10, completion_tokens=5)
    event = UsageEvent(**base, cached_prompt_tokens=10, reasoning_tokens=5)
    assert event.total_tokens == 15                       # cached and reasoning are parts, not additions
    assert UsageEvent.from_dict(event.to_dict()) == event
    with pytest.raises(ValueError, match="part of prompt_tokens"):
        UsageEvent(**base, cached_prompt_tokens=11)
    with pytest.raises(ValueError, match="outcome"):
        UsageEvent(**{**base, "outcome": "maybe"})
    with pytest.raises(ValueError, match="prompt_tokens"):
        UsageEvent(**{**base, "prompt_tokens": -1})
    assert event_id_for("t1", "k") != event_id_for("t2", "k")  # dedup is scoped by tenant
