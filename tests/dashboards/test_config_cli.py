"""Settings precedence, the ``kvmeter dashboard`` command, and the signal-name contract with the
exporters' sampler."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone

import pytest

from kvmeter.attribution import Attribution
from kvmeter.cli import build_parser
from kvmeter.dashboards import cli
from kvmeter.dashboards.config import DashboardConfig
from kvmeter.dashboards.errors import ConfigError
from kvmeter.tokens import TokenCounts
from tests.conftest import ledger_held_by_another_process


def test_explicit_beats_environment_beats_default():
    env = {"KVMETER_LEDGER_DSN": "http://u:secret@ch:8123/kv", "KVMETER_DASHBOARD_REFRESH_S": "60"}
    cfg = DashboardConfig.from_env(env)
    assert cfg.mode == "dsn" and cfg.refresh_s == 60.0 and cfg.target == "http://u@ch:8123/kv"  # no password
    assert DashboardConfig.from_env(env, refresh_s=10).refresh_s == 10
    server = DashboardConfig.from_env(env, server_url="http://127.0.0.1:8000")
    assert server.mode == "server" and server.target == "http://127.0.0.1:8000"  # the env DSN is unused
    assert DashboardConfig.from_env({}).ledger_dsn.startswith("chdb://")
    pinned = DashboardConfig.from_env({"KVMETER_DASHBOARD_UNTIL": "2026-11-27T02:30:00Z"})
    assert pinned.until == datetime(2026, 11, 27, 2, 30, tzinfo=timezone.utc)


def test_the_key_never_shows():
    cfg = DashboardConfig.from_env({"KVMETER_DASHBOARD_API_KEY": "sk-very-secret"})
    assert cfg.api_key == "sk-very-secret" and "sk-very-secret" not in repr(cfg)


@pytest.mark.parametrize("bad", [
    {"server_url": "http://a:1", "ledger_dsn": "chdb:///x"},
    {"server_url": "ftp://a"},
    {"ledger_dsn": "mysql://a"},
    {"refresh_s": 2},
    {"cache_ttl_s": 0},
    {"default_range": "last century"},
])
def test_invalid_settings_fail_at_construction(bad):
    with pytest.raises(ConfigError):
        DashboardConfig.from_env({}, **bad)


class _Execd(Exception):
    """Raised by the stand-in for ``os.execvpe``: the point where this process would become Streamlit."""


def _streamlit_calls(monkeypatch) -> list:
    """Replace ``os.execvpe`` in the command (the one stand-in: a real exec would replace pytest;
    test_dashboard_process.py runs the real one) and record (argv, env) of each exec."""
    calls: list = []

    def execvpe(file, argv, env):  # noqa: ANN001
        assert file == argv[0]
        calls.append((list(argv), dict(env)))
        raise _Execd

    monkeypatch.setattr(cli.os, "execvpe", execvpe)
    return calls


def _run(args) -> int | str:  # noqa: ANN001
    """``cli.run(args)``: its exit status, or ``"exec"`` when it handed the process to Streamlit."""
    try:
        return cli.run(args)
    except _Execd:
        return "exec"


def test_the_command_runs_streamlit_on_the_app_with_settings_in_the_environment(monkeypatch):
    calls = _streamlit_calls(monkeypatch)
    monkeypatch.setenv("KVMETER_LEDGER_DSN", "chdb:///should/not/leak")
    args = build_parser(["dashboard"]).parse_args(
        ["dashboard", "--server", "http://127.0.0.1:8000", "--refresh", "15", "--port", "8600"])
    assert _run(args) == "exec"
    argv, env = calls[0]
    assert argv[1:4] == ["-m", "streamlit", "run"] and argv[4] == str(cli.APP) and cli.APP.is_file()
    assert argv[argv.index("--server.port") + 1] == "8600" and "--server.headless" in argv
    assert env["KVMETER_DASHBOARD_SERVER"] == "http://127.0.0.1:8000" and env["KVMETER_DASHBOARD_REFRESH_S"] == "15.0"
    assert "KVMETER_LEDGER_DSN" not in env  # server mode reads through serve only


def test_the_command_refuses_both_modes(monkeypatch, capsys):
    calls = _streamlit_calls(monkeypatch)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--server", "http://a:1", "--ledger-dsn", "chdb:///x"])
    args = parser.parse_args(["--refresh", "1"])
    assert _run(args) == 2 and "refresh_s" in capsys.readouterr().err and not calls


def test_a_streamlit_that_cannot_be_executed_is_one_line_and_exit_127(monkeypatch, capsys, tmp_path):
    """The real ``os.execvpe`` on an interpreter path that does not exist (it cannot succeed)."""
    missing = tmp_path / "no-python"
    monkeypatch.setattr(cli.sys, "executable", str(missing))
    args = build_parser(["dashboard"]).parse_args(["dashboard", "--server", "http://127.0.0.1:8000"])
    assert cli.run(args) == 127
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"kvmeter dashboard: cannot start Streamlit ({missing}): No such file or directory", err


def test_api_key_flag_signs_in_at_start_through_the_environment_and_is_never_printed(monkeypatch, capsys):
    calls = _streamlit_calls(monkeypatch)
    monkeypatch.delenv("KVMETER_DASHBOARD_API_KEY", raising=False)
    args = build_parser(["dashboard"]).parse_args(
        ["dashboard", "--server", "http://127.0.0.1:8000", "--api-key", "sk-flag-secret"])
    assert _run(args) == "exec"
    argv, env = calls[-1]
    assert env["KVMETER_DASHBOARD_API_KEY"] == "sk-flag-secret"  # Streamlit's environment, not its argv
    assert not any("sk-flag-secret" in a for a in argv)
    out = capsys.readouterr()
    assert "sk-flag-secret" not in out.out + out.err and "server mode" in out.err
    # without the flag: the variable, as before
    monkeypatch.setenv("KVMETER_DASHBOARD_API_KEY", "sk-env-secret")
    assert _run(build_parser(["dashboard"]).parse_args(["dashboard", "--server", "http://127.0.0.1:8000"])) == "exec"
    assert calls[-1][1]["KVMETER_DASHBOARD_API_KEY"] == "sk-env-secret"
    # the flag wins over the variable
    assert _run(build_parser(["dashboard"]).parse_args(
        ["dashboard", "--server", "http://127.0.0.1:8000", "--api-key", "sk-flag-secret"])) == "exec"
    assert calls[-1][1]["KVMETER_DASHBOARD_API_KEY"] == "sk-flag-secret"
    out = capsys.readouterr()
    assert "secret" not in out.out + out.err


def test_a_chdb_path_without_a_ledger_is_refused_not_created(monkeypatch, capsys, tmp_path):
    calls = _streamlit_calls(monkeypatch)
    for path, why in ((tmp_path / "nonexistent2" / "x", "no such directory"), (tmp_path, "not a kvmeter ledger")):
        args = build_parser(["dashboard"]).parse_args(["dashboard", "--ledger-dsn", f"chdb://{path}"])
        assert _run(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("kvmeter dashboard: ") and why in err and "\n" not in err, err
    assert not calls and not (tmp_path / "nonexistent2").exists()
    # the default DSN (no flag, no variable) is checked too
    monkeypatch.delenv("KVMETER_LEDGER_DSN", raising=False)
    monkeypatch.chdir(tmp_path)
    assert _run(build_parser(["dashboard"]).parse_args(["dashboard"])) == 2 and not calls
    assert not (tmp_path / "var").exists()
    # a migrated chDB path (what `kvmeter serve` leaves) starts
    (tmp_path / "ledger" / "metadata" / "kvmeter").mkdir(parents=True)
    (tmp_path / "ledger" / "metadata" / "kvmeter" / "schema_migrations.sql").write_text("ATTACH TABLE ...")
    args = build_parser(["dashboard"]).parse_args(["dashboard", "--ledger-dsn", f"chdb://{tmp_path / 'ledger'}"])
    assert _run(args) == "exec" and len(calls) == 1


def test_a_chdb_path_another_process_holds_is_refused_before_streamlit_starts(monkeypatch, capsys, tmp_path):
    calls = _streamlit_calls(monkeypatch)
    path = tmp_path / "ledger"
    args = build_parser(["dashboard"]).parse_args(["dashboard", "--ledger-dsn", f"chdb://{path}"])
    with ledger_held_by_another_process(path, tmp_path / "spool"):
        assert _run(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"kvmeter dashboard: the embedded ledger at {path} is held by another process"), err
        assert "--server" in err and "\n" not in err, err
        assert not calls
    assert _run(args) == "exec" and len(calls) == 1  # released: the dashboard may open it


@pytest.mark.parametrize("flag", ["--tenants", "--prices"])
def test_a_missing_tenants_or_prices_file_is_refused_before_streamlit_starts(flag, monkeypatch, capsys, tmp_path):
    calls = _streamlit_calls(monkeypatch)
    args = build_parser(["dashboard"]).parse_args(
        ["dashboard", "--server", "http://127.0.0.1:8000", flag, str(tmp_path / "nope.yaml")])
    assert _run(args) == 2 and not calls
    err = capsys.readouterr().err.strip()
    assert err == f"kvmeter dashboard: {flag} {tmp_path / 'nope.yaml'}: no such file"


def test_every_signal_the_pages_read_is_one_the_sampler_writes():
    """Drive the exporters' real SignalSampler with one of each stats object it subscribes to
    (GPU readings from the real H200 and H100-MIG captures) and check the names it writes."""
    from dashkit import H200_CAPTURE

    from kvmeter.bus import StatsBus
    from kvmeter.clock import ManualClock
    from kvmeter.collectors.gpu import CaptureNvml, NvmlCollector
    from kvmeter.dashboards import signals
    from kvmeter.exporters.signals import SignalSampler, SignalSamplerConfig
    from kvmeter.stats import (
        EngineStepShares,
        EngineStepStats,
        ReplicaHealth,
        RequestCompletion,
        RoutingDecision,
        SchedulerStats,
        TenantSchedulerStats,
        TenantStepShare,
    )

    bus, clock = StatsBus(), ManualClock(start_wall=1_795_000_000.0)
    sampler = SignalSampler(bus, clock=clock, model="m", config=SignalSamplerConfig(interval_s=1.0))
    written: set[str] = set()
    for capture in (H200_CAPTURE.with_name("linux-x86_64__nvidia-h100-mig__590.48.01.txt"), H200_CAPTURE):
        collector = NvmlCollector(CaptureNvml.from_file(capture), bus=bus, clock=clock)
        collector.start()
        collector.collect()
        clock.advance(1.0)
        written |= {row.name for row in sampler.sample()}  # both captures are GPU 0: one at a time
    bus.publish(EngineStepStats(wall_ts=clock.wall(), kv_watermark_ratio=0.4, kv_blocks_total=100, num_running=3,
                                num_waiting=1, output_tokens=50, num_preempted=1))
    bus.publish(EngineStepShares(wall_ts=clock.wall(), duration_s=0.1,
                                 tenants=(TenantStepShare("acme", "enterprise", 64, 2, 300, 1),)))
    bus.publish(SchedulerStats(wall_ts=clock.wall(), policy="vtc", pressure_level=0, queued_total=1, running_total=3,
                               service_rate_per_s=10.0, jain_index=0.9, max_service_gap=5.0, service_gap=2.0,
                               tenants=[TenantSchedulerStats("acme", "enterprise", 1.0, 1, 10, 0.5, 0.2, 0.1, 3, 300,
                                                             0, 1.0, 10, 20, 1.0, 3, 2)]))
    bus.publish(
        RequestCompletion(
            attribution=Attribution("acme", tier="enterprise", model="m"),
            tokens=TokenCounts(input_tokens=10, output_tokens=5),
            outcome="ok",
            slo_met=True,
            reprefill_input_tokens=4,
        )
    )
    bus.publish(ReplicaHealth(model="m", replica="http://gpu-a:8000", index=0, healthy=True))
    bus.publish(RoutingDecision(model="m", policy="prefix_aware", outcome="prefix_hit", replica="http://gpu-a:8000"))
    clock.advance(1.0)
    written |= {row.name for row in sampler.sample()}
    sampler.close()
    read = set(signals.ALL)
    # GPM fields (SM/tensor/DRAM activity) are absent from nvidia-smi captures: missing stays missing
    gpm = {signals.GPU["sm_active"], signals.GPU["tensor_active"], signals.GPU["dram_bandwidth"],
           signals.MIG["sm_active"]}
    assert read - gpm <= written, sorted(read - gpm - written)


def test_no_pages_folder_beside_the_app():
    """Streamlit's legacy multipage mode (``PagesManager.uses_pages_directory``) takes a ``pages/``
    folder beside the main script as the app's pages, and serves a deep link (``/replicas``) as
    that file alone — no ``st.navigation``, no sidebar sign-in — until a session has run app.py.
    The page scripts live in ``page_scripts/``; a leftover ``pages/`` (even one holding only an
    old ``__pycache__``) brings the bug back. The browser check: test_replicas_page's Chromium test."""
    assert not (cli.APP.parent / "pages").exists(), "remove dashboards/pages/ (page scripts: page_scripts/)"
    scripts = {p.stem for p in (cli.APP.parent / "page_scripts").glob("*.py")} - {"__init__"}
    assert {"overview", "replicas", "quota"} <= scripts and len(scripts) == 11
