"""``kvmeter simulate``'s argument handling: bad values are one-line errors, never tracebacks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvmeter.cli import build_parser
from kvmeter.serving.simulator import cli


def _parse(*argv: str):
    return build_parser(["simulate"]).parse_args(["simulate", *argv])


@pytest.mark.parametrize("flag,value", [("--limit", "0"), ("--limit", "-5"), ("--limit", "ten"),
                                        ("--max-num-seqs", "0"), ("--max-num-batched-tokens", "-1"),
                                        ("--top-tenants", "-1")])
def test_counts_out_of_range_are_argparse_errors(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parse(flag, value)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: argument {flag}:" in err and "Traceback" not in err


def test_an_empty_trace_slice_is_a_clear_error(capsys, tmp_path: Path) -> None:
    # once a polars traceback (a datetime minus the null of an empty frame) with --limit 0, and an
    # empty report written without complaint for a window past the trace's end
    args = _parse("--trace", "azure-conv", "--start-s", "100000000", "--no-progress", "--tenants", "single",
                  "--out", str(tmp_path / "sim"))
    assert cli.run(args) == 2
    assert not list(tmp_path.iterdir())
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvmeter simulate: the trace slice is empty") and "--start-s" in err and "\n" not in err


def test_tier_map_takes_inline_json_or_a_json_file(tmp_path: Path) -> None:
    assert _parse("--tier-map", '{"sg-1": "enterprise"}').tier_map == {"sg-1": "enterprise"}
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps({"sg-2": "free"}))
    assert _parse("--tier-map", str(path)).tier_map == {"sg-2": "free"}


@pytest.mark.parametrize("value,why", [
    ("notjson", "neither a JSON object"),
    ("{bad", "not valid JSON"),
    ('{"sg-1": 3}', "JSON object of tenant id"),
    ("/etc/hostname-nope", "neither a JSON object"),
])
def test_tier_map_that_is_neither_is_a_clear_error(value: str, why: str, capsys) -> None:
    with pytest.raises(SystemExit):
        _parse("--tier-map", value)
    err = capsys.readouterr().err
    assert "error: argument --tier-map:" in err and why in err


def test_tier_map_file_that_is_not_json_names_the_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "tiers.txt"
    path.write_text("sg-1 = enterprise\n")
    with pytest.raises(SystemExit):
        _parse("--tier-map", str(path))
    err = capsys.readouterr().err
    assert str(path) in err and "not valid JSON" in err


def test_help_says_tier_map_is_json_or_a_file(capsys) -> None:
    with pytest.raises(SystemExit):
        _parse("--help")
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--tier-map JSON|FILE" in help_text and "inline JSON" in help_text and "path of a JSON file" in help_text


def test_the_fcfs_baseline_is_plain_fcfs_and_an_addition_is_named() -> None:
    # (once the simulator's FCFS ran with kvmeter's 50 % per-tenant KV budget and 32k prefill budget)
    cfg, label = cli.scheduler_config(_parse("--policy", "fcfs"))
    assert label == "fcfs"
    assert cfg.tenant_kv_budget_ratio is None and cfg.tenant_prefill_budget_tokens is None
    assert not cfg.overload_control and not cfg.adaptive_engine_limit and cfg.max_queued_total >= 10 ** 9
    cfg, label = cli.scheduler_config(_parse("--policy", "rpm", "--rpm-limit", "30", "--kv-budget-ratio", "0.5"))
    assert label == "rpm+kv-budget" and cfg.tenant_kv_budget_ratio == 0.5 and cfg.rpm_limit == 30
    cfg, label = cli.scheduler_config(_parse("--policy", "fcfs", "--overload-control"))
    assert label == "fcfs+overload-control" and cfg.overload_control and cfg.max_queued_total == 100_000
    assert cfg.tenant_kv_budget_ratio is None
    cfg, label = cli.scheduler_config(_parse())               # kvmeter's own: every mechanism on
    assert label == "vtc" and cfg.overload_control and cfg.tenant_kv_budget_ratio == 0.5
    assert cfg.tenant_prefill_budget_tokens == 32_768 and cfg.adaptive_engine_limit


def test_the_report_goes_to_var_sim_by_default_which_git_ignores(tmp_path: Path, monkeypatch, capsys) -> None:
    # once kvmeter-sim-*.json / .csv in the current directory: the repository root, not ignored
    monkeypatch.chdir(tmp_path)
    args = _parse("--trace", "azure-conv", "--limit", "20", "--no-progress", "--tenants", "single",
                  "--policy", "fcfs")
    assert cli.run(args) == 0, capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["var"]
    written = sorted(p.name for p in (tmp_path / "var" / "sim").iterdir())
    assert written == ["kvmeter-sim-azure-conv-fcfs.csv", "kvmeter-sim-azure-conv-fcfs.json"], written
    assert json.loads((tmp_path / "var" / "sim" / written[1]).read_text())["meta"]["policy"] == "fcfs"
    repo = Path(__file__).resolve().parents[3]
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout: .gitignore cannot be asked")
    ignored = subprocess.run(["git", "check-ignore", "-q", f"var/sim/{written[0]}"], cwd=repo)
    assert ignored.returncode == 0, "var/sim/ is not git-ignored"
