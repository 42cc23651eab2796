"""Alert rules: valid for Prometheus, unit-tested with ``promtool test rules``, each alert shown to
fire in a test, every metric they read declared in the exporter's names table.

The reconciliation alerts are tested on series a real run produced: ``kvmeter serve``'s runtime
(instant engine, embedded chDB ledger, injected clock) serves requests, its periodic
reconciliation runs, its ``/metrics`` page is scraped, and the scraped series become the input of
a promtool test written to a temporary file."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvmeter.clock import ManualClock
from kvmeter.exporters.prometheus import METRICS, rule_files
from kvmeter.exporters.prometheus.rules import generate_slo, noisy
from kvmeter.stats import ReconciliationStats
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import TokenCounts

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH (Debian: apt-get install -y prometheus)")
TESTS = sorted((Path(__file__).parent / "promtool").glob("*.test.yml"))
RULE_FILES = rule_files()
#: Alerts whose promtool tests are generated from a real run's series (test_reconciliation_alerts_*,
#: test_selfcheck.py).
FIRED_BY_REAL_RUN = {"KvmeterReconciliationDrift", "KvmeterReconciliationStale",
                     "KvmeterTtftBelowPhysicalFloor"}  # tests/exporters/test_selfcheck.py


def test_every_rule_file_is_shipped_and_tested():
    names = {p.name for p in RULE_FILES}
    assert names == {"engine.yml", "requests.yml", "tenants.yml", "gpu.yml", "ledger.yml", "slo.yml", "agents.yml",
                     "selfcheck.yml", "noisy.yml"}
    tested = {Path(f).name for t in TESTS for f in yaml.safe_load(t.read_text())["rule_files"]}
    assert tested == names


@needs_promtool
@pytest.mark.prometheus
@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path):
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
@pytest.mark.prometheus
@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests(path):
    result = subprocess.run([PROMTOOL, "test", "rules", path.name], cwd=path.parent,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def _alerts():
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                yield path.name, rule


def test_every_alert_fires_in_some_unit_test():
    fired = set()
    for t in TESTS:
        for case in yaml.safe_load(t.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])
    alerts = {rule["alert"] for _, rule in _alerts() if "alert" in rule}
    assert alerts - fired == FIRED_BY_REAL_RUN
    assert FIRED_BY_REAL_RUN <= alerts


def test_every_alert_has_severity_and_summary():
    for _, rule in _alerts():
        if "alert" in rule:
            assert rule["labels"]["severity"] in {"page", "critical", "warning", "ticket", "info"}, rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


_NAME_REGEX = re.compile(r'__name__\s*=~\s*"([^"]+)"')


def test_rules_read_only_declared_metrics():
    declared = {m.name: m for m in METRICS}
    for name, rule in _alerts():
        # {__name__=~"kvmeter_a_(x|y)_total"}: every alternative must be declared
        for pattern in _NAME_REGEX.findall(rule["expr"]):
            head, alternatives, tail = re.fullmatch(r"([a-z0-9_]*)\(([a-z0-9_|]+)\)([a-z0-9_]*)", pattern).groups()
            for alt in alternatives.split("|"):
                assert head + alt + tail in declared, (
                    f"{name}: {rule.get('alert')} reads undeclared {head + alt + tail}")
        expr = _NAME_REGEX.sub("", rule["expr"])
        for metric in set(re.findall(r"\bkvmeter_[a-z0-9_]+", expr)):
            base = metric
            for suffix in ("_bucket", "_count", "_sum"):
                if base.endswith(suffix) and base.removesuffix(suffix) in declared:
                    base = base.removesuffix(suffix)
            assert base in declared, f"{name}: {rule.get('alert') or rule.get('record')} reads undeclared {metric}"
            sig = declared[base]
            used = set(re.findall(rf"{metric}\{{([^}}]*)\}}", expr))
            for selector in used:
                for label in re.findall(r"(\w+)\s*[!=]~?", selector):
                    assert label in sig.labels or label == "le", f"{metric} has no label {label}"


def test_generated_slo_rules_are_up_to_date():
    path = Path(generate_slo.__file__).with_name("slo.yml")
    assert path.read_text() == generate_slo.render(), "run python -m kvmeter.exporters.prometheus.rules.generate_slo"


def test_generated_noisy_neighbour_rules_are_up_to_date():
    path = Path(noisy.__file__).with_name("noisy.yml")
    assert path.read_text() == noisy.render(), "run python -m kvmeter.exporters.prometheus.rules.noisy"
    assert noisy.main(["--check", "--out", str(path)]) == 0


def test_noisy_neighbour_thresholds_are_stated_in_the_rules_and_configurable(tmp_path):
    text = noisy.render()
    t = noisy.THRESHOLDS
    assert f"< {t.cache_hit_ratio_below:g}" in text and f">= {t.cache_min_input_tokens_per_s:g}" in text
    assert f"> {t.retries_per_request_above:g}" in text and f">= {t.retries_min_per_s:g}" in text
    out = tmp_path / "noisy.yml"
    assert noisy.main(["--cache-hit-ratio-below", "0.1", "--window", "30m", "--for", "5m", "--out", str(out)]) == 0
    custom = yaml.safe_load(out.read_text())["groups"][0]["rules"]
    alert = next(r for r in custom if r.get("alert") == "KvmeterTenantPromptCacheHitLow")
    assert alert["for"] == "5m" and "ratio_rate30m{tenant!=\"other\"} < 0.1" in alert["expr"]
    assert noisy.main(["--check", "--out", str(out)]) == 1  # not the defaults any more
    with pytest.raises(ValueError, match="cache_hit_ratio_below"):
        noisy.NoisyThresholds(cache_hit_ratio_below=1.5)
    with pytest.raises(ValueError, match="window"):
        noisy.NoisyThresholds(window="15 minutes")


def test_the_dashboards_predicates_are_the_rules_conditions():
    t = noisy.THRESHOLDS  # < 0.25 hit ratio while >= 500 input tokens/s; > 0.5 retries while >= 0.1/s
    assert t.cache_hit_low(input_tokens=600_000, cached_input_tokens=30_000, seconds=900)    # 0.05, 667/s
    assert not t.cache_hit_low(input_tokens=600_000, cached_input_tokens=150_000, seconds=900)  # 0.25: not below
    assert not t.cache_hit_low(input_tokens=400_000, cached_input_tokens=0, seconds=900)     # 444/s: quiet
    assert not t.cache_hit_low(input_tokens=0, cached_input_tokens=0, seconds=900)
    assert t.retrying(retries=180, keyed_requests=100, seconds=900)                          # 1.8, 0.2/s
    assert not t.retrying(retries=50, keyed_requests=100, seconds=900)                       # 0.5: not above
    assert not t.retrying(retries=80, keyed_requests=10, seconds=900)                        # 0.089/s: sparse
    assert not t.retrying(retries=5, keyed_requests=0, seconds=900)


def test_the_new_shapes_predicates_are_the_rules_conditions():
    t = noisy.THRESHOLDS  # shares > 0.5 of >= 1000 prefill / >= 100 decode tokens/s; queue > 0.5 of >= 10
    assert t.prefill_pressure_score(750_000, 1_000_000, 900) == pytest.approx(0.5)       # 0.75 of 1,111/s
    assert t.prefill_pressure_score(500_000, 1_000_000, 900) is None                      # 0.5: not above
    assert t.prefill_pressure_score(800_000, 800_000, 900) is None                        # 889/s: not busy
    assert t.decode_pressure_score(90_000, 100_000, 900) == pytest.approx(0.8)            # 0.9 of 111/s
    assert t.decode_pressure_score(90_000, 0, 900) is None
    assert t.kv_pressure_score(6_000, 10_000, 0.8) == pytest.approx(0.2)                  # 0.6 while 80% full
    assert t.kv_pressure_score(6_000, 10_000, 0.7) is None                                # 70%: not above
    assert t.queue_pressure_score(30, 40) == pytest.approx(0.5)
    assert t.queue_pressure_score(6, 6) is None                                           # 6 waiting: too few
    assert t.thrash_score(300_000, 600_000, 900) == pytest.approx(2 / 3)                  # 0.5 at 667/s
    assert t.thrash_score(300_000, 400_000, 900) is None                                  # 444/s: quiet
    assert t.agent_loop_score(900, 0, 900) == pytest.approx(17.0)                         # 900 calls, an old run
    assert t.agent_loop_score(900, 90, 900) is None                                       # 10 per run
    assert t.agent_loop_score(90, 0, 900) is None                                         # 0.1 calls/s: sparse
    assert t.slow_client_score(9, 900) == pytest.approx(1.0)                              # 0.01/s, twice 0.005
    assert t.cache_hit_low_score(600_000, 0, 900) == 1.0 and t.retries_score(180, 100, 900) == pytest.approx(2.6)


def test_every_shape_has_one_detector_and_kv_pressure_is_the_tenants_rule():
    assert noisy.SHAPES == tuple(d.shape for d in noisy.DETECTORS) and len(set(noisy.SHAPES)) == len(noisy.SHAPES)
    alerts = {rule["alert"]: name for name, rule in _alerts() if "alert" in rule}
    for d in noisy.DETECTORS:
        assert alerts[d.alert] == d.rule_file, d
    kv = next(d for d in noisy.DETECTORS if d.shape == "kv_pressure")
    rendered = yaml.safe_load(noisy.render())["groups"][0]["rules"]
    assert kv.rule_file == "tenants.yml"  # one definition, not two:
    assert not any("kvmeter_tenant_active_kv_tokens" in r["expr"] or r.get("alert") == kv.alert for r in rendered)
    assert noisy.tenants_kv_expr().split() == noisy.kv_share_expr().split()
    # a KV threshold that tenants.yml does not state is refused, not silently left out
    assert noisy.main(["--check", "--kv-share-above", "0.6"]) == 1


def test_burn_rates_follow_the_sre_workbook():
    # Table 5-8: 2 % of a 30-day budget in 1 h (14.4x), 5 % in 6 h (6x), 10 % in 1 d (3x), 10 % in 3 d (1x)
    burns = {(long, short): burn for _, long, short, burn, _ in generate_slo.BURN_ALERTS}
    assert burns == {("1h", "5m"): 14.4, ("6h", "30m"): 6.0, ("1d", "2h"): 3.0, ("3d", "6h"): 1.0}
    for (long, _), burn in burns.items():
        hours = {"1h": 1, "6h": 6, "1d": 24, "3d": 72}[long]
        budget_spent = burn * hours / (30 * 24)
        assert budget_spent == pytest.approx({"1h": 0.02, "6h": 0.05, "1d": 0.10, "3d": 0.10}[long])


# ---------------------------------------------------------------- reconciliation: a real run

LEDGER_RULES = next(p for p in RULE_FILES if p.name == "ledger.yml")
T0 = 1_790_000_000.0  # the injected clock's wall time at start (2026-09)
ACME_KEY = "sk-demo-acme-0001"  # a demo tenant's public key
GHOST_TOKENS = (300, 50)  # input, output of the engine work nobody billed


async def _real_run(tmp_path: Path, *, ghost: bool) -> tuple[str, float, ReconciliationStats, int]:
    """``kvmeter serve``'s runtime on a fresh ledger: three requests, an engine record without a
    request (``ghost``), the periodic reconciliation (its own loop, due by the manual clock),
    then ``/metrics`` 15 minutes later. Returns the exposition text, the wall time of the scrape,
    the run's stats and the billed tokens."""
    from kvmeter.serving.config import load_serve_config
    from kvmeter.serving.runtime import ServeRuntime

    config = load_serve_config(None, {("engine", "kind"): "instant", ("ledger_dsn",): f"chdb://{tmp_path}/chdb",
                                      ("spool_dir",): str(tmp_path / "spool")},
                               env={"KVMETER_RECONCILE_FIRST_RUN_DELAY_S": "120",
                                    "KVMETER_RECONCILE_INTERVAL_S": "1800"})
    clock = ManualClock(start_wall=T0)
    runtime = ServeRuntime(config, registry=CollectorRegistry(), clock=clock)
    app = runtime.app()
    await runtime.start()
    try:
        loop = asyncio.get_running_loop()
        ran = asyncio.Event()
        runs: list[ReconciliationStats] = []
        runtime.bus.subscribe(ReconciliationStats, lambda s: (runs.append(s), loop.call_soon_threadsafe(ran.set)))
        billed = 0
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as client:
            for i in range(3):
                r = await client.post("/v1/chat/completions", headers={"authorization": f"Bearer {ACME_KEY}"},
                                      json={"model": runtime.engine.model_name, "max_tokens": 5 + i,
                                            "messages": [{"role": "user", "content": f"question {i}"}]})
                assert r.status_code == 200, r.text
                billed += r.json()["usage"]["total_tokens"]
            if ghost:
                runtime.bus.publish(EngineRequestStats(
                    "ghost-1", "stop", TokenCounts(input_tokens=GHOST_TOKENS[0], output_tokens=GHOST_TOKENS[1]),
                    wall_ts=clock.wall()))
            assert await asyncio.to_thread(runtime.recorder.ledger.flush, 30.0)
            assert runtime.reconciler.interval_s == 1800  # serve's config reaches its reconciler
            clock.advance(119)
            assert runs == [] and not runtime.reconciler.due()  # the first run waits 120 s
            # past the first run's delay and the window's settle time (10 min): the loop runs it
            clock.advance(1 + 600)
            await asyncio.wait_for(ran.wait(), 60)  # bounds a hang; when it is due is the clock's call
            clock.advance(900)
            r = await client.get("/metrics")
            assert r.status_code == 200
            return r.text, clock.wall(), runs[0], billed
    finally:
        await runtime.stop()


def _promtool_input(exposition: str, scraped_at: float, samples: int) -> list[dict[str, str]]:
    """Every scraped series the ledger rules read, constant for ``samples`` minutes. promtool's
    clock starts at 0, so a ``*_timestamp_seconds`` value is shifted by the scrape's wall time:
    promtool time 0 is the moment of the scrape."""
    read = set(re.findall(r"\bkvmeter_[a-z0-9_]+", LEDGER_RULES.read_text()))
    series = []
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name not in read:
                continue
            value = sample.value - scraped_at if sample.name.endswith("_timestamp_seconds") else sample.value
            labels = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(sample.labels.items()))
            series.append({"series": f"{sample.name}{{{labels}}}", "values": f"{value!r}x{samples}"})
    return series


def _annotations(alert: str, **labels: str) -> dict[str, str]:
    """The rule's annotations with ``{{ $labels.x }}`` filled in (the value-dependent summaries
    are given by the caller)."""
    rule = next(r for g in yaml.safe_load(LEDGER_RULES.read_text())["groups"] for r in g["rules"]
                if r.get("alert") == alert)
    out = {}
    for key, text in rule["annotations"].items():
        for name, value in labels.items():
            text = text.replace(f"{{{{ $labels.{name} }}}}", value)
        out[key] = text
    return out


def _promtool(tmp_path: Path, series: list[dict[str, str]], checks: list[dict]) -> None:
    test = {"rule_files": [str(LEDGER_RULES)], "evaluation_interval": "1m",
            "tests": [{"name": "a real run's series", "interval": "1m", "input_series": series,
                       "alert_rule_test": checks}]}
    path = tmp_path / "reconciliation.test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = subprocess.run([PROMTOOL, "test", "rules", path.name], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def _stale_checks() -> list[dict]:
    """The last run was 15 minutes before promtool's time 0: fresh for 1 h 45 m, then stale; the
    rule waits 10 minutes (``for``) before it fires."""
    stale = {"severity": "warning"}
    return [
        {"eval_time": "1h", "alertname": "KvmeterReconciliationStale", "exp_alerts": []},
        {"eval_time": "1h50m", "alertname": "KvmeterReconciliationStale", "exp_alerts": []},  # pending
        {"eval_time": "3h", "alertname": "KvmeterReconciliationStale", "exp_alerts": [
            {"exp_labels": stale, "exp_annotations": {
                **_annotations("KvmeterReconciliationStale"),
                "summary": "No reconciliation finished for 3h 15m 0s"}}]},
    ]


@needs_promtool
@pytest.mark.prometheus
async def test_reconciliation_alerts_fire_on_a_real_runs_drift_and_age(tmp_path, model_dir):
    exposition, scraped_at, stats, billed = await _real_run(tmp_path, ghost=True)
    ghost = sum(GHOST_TOKENS)
    assert stats.ok and stats.drift_units == {"engine": ghost, "gateway": 0}
    assert stats.drift_ratio["engine"] == pytest.approx(ghost / (billed + ghost))
    series = _promtool_input(exposition, scraped_at, samples=240)
    names = {s["series"].split("{")[0] for s in series}
    assert {"kvmeter_reconciliation_drift_ratio", "kvmeter_reconciliation_last_run_timestamp_seconds"} <= names
    drift = {"exp_labels": {"severity": "critical", "view": "engine"}, "exp_annotations": {
        **_annotations("KvmeterReconciliationDrift", view="engine"),
        # humanizePercentage: 4 significant digits
        "summary": f"engine totals differ from the ledger by {stats.drift_ratio['engine'] * 100:.4g}%"}}
    _promtool(tmp_path, series, [{"eval_time": "5m", "alertname": "KvmeterReconciliationDrift", "exp_alerts": [drift]},
                                 *_stale_checks()])


@needs_promtool
@pytest.mark.prometheus
async def test_reconciliation_alerts_stay_quiet_on_a_clean_real_run(tmp_path, model_dir):
    exposition, scraped_at, stats, billed = await _real_run(tmp_path, ghost=False)
    assert stats.ok and stats.drift_ratio == {"engine": 0.0, "gateway": 0.0} and billed > 0
    series = _promtool_input(exposition, scraped_at, samples=240)
    assert {s["series"] for s in series} >= {'kvmeter_reconciliation_drift_ratio{view="engine"}',
                                             'kvmeter_reconciliation_drift_ratio{view="gateway"}'}
    _promtool(tmp_path, series, [{"eval_time": "5m", "alertname": "KvmeterReconciliationDrift", "exp_alerts": []},
                                 {"eval_time": "3h", "alertname": "KvmeterReconciliationDrift", "exp_alerts": []},
                                 *_stale_checks()])
