"""Alert rules: valid for Prometheus, unit-tested with ``promtool test rules``, each alert shown to
fire in a test, every metric they read declared in the exporter's names table."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvmeter.exporters.prometheus import METRICS, rule_files
from kvmeter.exporters.prometheus.rules import generate_slo

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH (Debian: apt-get install -y prometheus)")
TESTS = sorted((Path(__file__).parent / "promtool").glob("*.test.yml"))
RULE_FILES = rule_files()


def test_every_rule_file_is_shipped_and_tested():
    names = {p.name for p in RULE_FILES}
    assert names == {"engine.yml", "requests.yml", "tenants.yml", "gpu.yml", "ledger.yml", "slo.yml"}
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
    assert alerts - fired == set()


def test_every_alert_has_severity_and_summary():
    for name, rule in _alerts():
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
                assert head + alt + tail in declared, f"{name}: {rule.get('alert')} reads undeclared {head + alt + tail}"
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


def test_burn_rates_follow_the_sre_workbook():
    # Table 5-8: 2 % of a 30-day budget in 1 h (14.4x), 5 % in 6 h (6x), 10 % in 1 d (3x), 10 % in 3 d (1x)
    burns = {(long, short): burn for _, long, short, burn, _ in generate_slo.BURN_ALERTS}
    assert burns == {("1h", "5m"): 14.4, ("6h", "30m"): 6.0, ("1d", "2h"): 3.0, ("3d", "6h"): 1.0}
    for (long, _), burn in burns.items():
        hours = {"1h": 1, "6h": 6, "1d": 24, "3d": 72}[long]
        budget_spent = burn * hours / (30 * 24)
        assert budget_spent == pytest.approx({"1h": 0.02, "6h": 0.05, "1d": 0.10, "3d": 0.10}[long])
