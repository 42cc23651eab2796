"""docker-compose.yml and the config files it mounts: parsed and checked (no Docker engine here)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvmeter.serving.config import load_serve_config
from kvmeter.serving.tenancy import TenantDirectory

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _bind_mounts():
    for name, service in COMPOSE["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                yield name, source


def test_every_production_service_is_declared():
    assert {"gateway", "dashboard", "clickhouse", "redis", "prometheus", "otel-collector"} <= set(COMPOSE["services"])
    gpu = COMPOSE["services"]["gateway"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


@pytest.mark.parametrize("service,source", list(_bind_mounts()))
def test_every_mounted_file_exists(service, source):
    assert (ROOT / source).exists(), f"{service} mounts {source}, which is not in the repository"


def test_build_context_and_dockerfile_exist():
    build = COMPOSE["services"]["gateway"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()


def test_mounted_kvmeter_configs_are_valid():
    from kvmeter.serving.engines.vllm_args import parse_vllm_argv, serving_argv

    config = load_serve_config(ROOT / "deploy/kvmeter/kvmeter.yaml", env={})
    assert config.engine.kind == "vllm" and config.server.host == "0.0.0.0"
    # the serving flags are ones vLLM's own `vllm serve` parser accepts
    args = parse_vllm_argv(["--model", config.engine.model, *serving_argv(config.openai.flags())])
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.max_logprobs) == ("llama3_json", True, 20)
    directory = TenantDirectory.from_file(ROOT / "deploy/kvmeter/tenants.yaml")
    assert directory.snapshot.keys, "the production tenants template defines no keys"


@pytest.mark.prometheus
def test_prometheus_config_is_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    # promtool resolves rule_files against the container path; check the config with the rules
    # directory mapped the way compose mounts it.
    text = (ROOT / "deploy/prometheus/prometheus.yml").read_text().replace(
        "/etc/prometheus/rules", str(ROOT / "exporters/prometheus/rules"))
    tmp = ROOT / "var" / "prometheus-check.yml"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(text)
    result = subprocess.run([promtool, "check", "config", str(tmp)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
