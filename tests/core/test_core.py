"""Core pieces: traces, serve config precedence, model resolution errors, the usage event."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmeter.attribution import Attribution
from kvmeter.events import UsageEvent, event_id_for
from kvmeter.model import ModelError, resolve_model
from kvmeter.serving.config import ServeConfigError, load_serve_config
from kvmeter.serving.tenancy import Principal
from kvmeter.tokens import TokenCounts
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


def test_token_counts_invariants_are_checked_in_one_place():
    tokens = TokenCounts(input_tokens=10, cached_input_tokens=10, output_tokens=5, reasoning_tokens=5)
    assert tokens.total_tokens == 15                      # cached and reasoning are parts, not additions
    assert tokens.parts() == (0, 10, 0, 5) and sum(tokens.parts()) == tokens.total_tokens
    assert TokenCounts.from_row({"input_tokens": 7, "output_tokens": 3}) == TokenCounts(7, 0, 3, 0)
    assert TokenCounts().empty and not TokenCounts(output_tokens=1).empty
    with pytest.raises(ValueError, match="part of input_tokens"):
        TokenCounts(input_tokens=10, cached_input_tokens=11)
    with pytest.raises(ValueError, match="part of output_tokens"):
        TokenCounts(output_tokens=1, reasoning_tokens=2)
    for bad in (-1, True, 1.0, "3"):
        with pytest.raises(ValueError, match="input_tokens"):
            TokenCounts(input_tokens=bad)  # type: ignore[arg-type]


def test_attribution_is_built_once_from_the_principal():
    principal = Principal(tenant_id="acme", tier="enterprise", workspace_id="ws", project_id="p",
                          api_key_id="k1", admin=True)
    a = principal.attribution(model="m", endpoint="chat.completions", agent_run_id="run-1")
    assert a == Attribution(tenant_id="acme", workspace_id="ws", project_id="p", api_key_id="k1",
                            tier="enterprise", agent_run_id="run-1", model="m", endpoint="chat.completions")
    with pytest.raises(TypeError, match="tier"):
        Attribution("acme", tier=None)  # type: ignore[arg-type]


def test_usage_event_invariants():
    attribution = Attribution("t", tier="free", model="m", endpoint="e")
    base = dict(event_id=event_id_for("t", "r"), request_id="r", attribution=attribution, outcome="ok",
                finish_reason="stop", arrival_ts=1.0, finish_ts=2.0)
    event = UsageEvent(**base, tokens=TokenCounts(10, 10, 5, 5), reserved=TokenCounts(10, 0, 64, 0))
    assert event.tenant_id == "t" and event.attribution is attribution   # carried by reference
    assert UsageEvent.from_dict(event.to_dict()) == event
    with pytest.raises(ValueError, match="outcome"):
        UsageEvent(**{**base, "outcome": "maybe"}, tokens=TokenCounts())
    with pytest.raises(ValueError, match="tenant_id"):
        UsageEvent(**{**base, "attribution": Attribution("")}, tokens=TokenCounts())
    with pytest.raises(TypeError, match="tokens"):
        UsageEvent(**base, tokens=(10, 0, 5, 0))  # type: ignore[arg-type]
    assert event_id_for("t1", "k") != event_id_for("t2", "k")  # dedup is scoped by tenant
