"""``kvmeter serve``'s runtime wires the collectors with no extra flag: the NVML poller (GPU signals
on a GPU machine, one "no GPU" line and nothing else without one) and the signal recorder (history
into the ledger's ``signals`` table). Real ServeRuntime, instant engine over the real tokenizer,
real embedded ledger (chDB in tmp_path), ManualClock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvmeter.clock import ManualClock
from kvmeter.collectors.gpu import CaptureNvml
from kvmeter.serving.config import load_serve_config
from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
from kvmeter.serving.engines.instant import InstantEngine
from kvmeter.serving.runtime import ServeRuntime
from kvmeter.stats import EngineStepShares, GpuCollectorStatus, TenantStepShare

MIB = 1024 * 1024
T0 = 1_790_000_000.0
MODEL = "SmolLM2-135M-Instruct"
H200 = "linux-x86_64__nvidia-h200__590.48.01.txt"


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> HFTokenizer:
    return HFTokenizer(model_dir)


async def runtime_for(tmp_path: Path, tokenizer: HFTokenizer, **kwargs) -> ServeRuntime:
    config = load_serve_config(None, {
        ("engine", "kind"): "instant", ("ledger_dsn",): f"chdb://{tmp_path}/chdb",
        ("spool_dir",): str(tmp_path / "spool"),
        ("engine_steps_retention_days",): 0}, env={})  # T0 is in the past: keep its engine_steps rows
    engine = InstantEngine(tokenizer, MODEL)
    await engine.start()  # a given engine is not started by the runtime
    return ServeRuntime(config, engine=engine, registry=CollectorRegistry(), clock=ManualClock(start_wall=T0),
                        **kwargs)


async def test_gpu_machine_gets_gpu_signals_and_their_history(tmp_path, tokenizer, data_dir):
    nvml = CaptureNvml.from_file(data_dir / "gpu" / "nvidia_smi" / H200)
    runtime = await runtime_for(tmp_path, tokenizer, nvml=nvml)
    polled = threading.Event()
    runtime.bus.subscribe(GpuCollectorStatus, lambda s: s.state == "ok" and polled.set())
    await runtime.start()
    try:
        assert runtime.gpu.running
        assert await asyncio.to_thread(polled.wait, 30), "the GPU poller published nothing"
        registry = runtime.registry
        assert registry.get_sample_value("kvmeter_gpu_nvml_available") == 1
        assert registry.get_sample_value("kvmeter_gpu_memory_used_bytes", {"gpu": "0"}) == 32362 * MIB
        assert runtime.signal_recorder.tick(force=True) > 0
        ledger = runtime.recorder.ledger
        assert ledger.flush(30.0)
        rows = ledger.query_client().query(
            "SELECT name, labels['gpu'], value FROM signals WHERE name LIKE 'kvmeter_gpu_%'").result_rows
        assert ("kvmeter_gpu_memory_used_bytes", "0", 32362 * MIB) in rows
    finally:
        await runtime.stop()
        await runtime.engine.shutdown()
    assert not runtime.gpu.running and runtime.gpu.collector.status.state == "closed"


async def test_this_machine_gpu_or_not_serve_starts(tmp_path, tokenizer, caplog):
    """The real pynvml: a machine without a GPU logs one "no GPU" line and serves on."""
    runtime = await runtime_for(tmp_path, tokenizer)
    with caplog.at_level(logging.INFO, logger="kvmeter"):
        await runtime.start()
    try:
        assert runtime.ready
        state = runtime.gpu.collector.status.state
        available = runtime.registry.get_sample_value("kvmeter_gpu_nvml_available")
        if state == "ok":  # a GPU machine
            assert runtime.gpu.running and available == 1
        else:
            assert not runtime.gpu.running and available == 0
            lines = [r.getMessage() for r in caplog.records if "GPU" in r.getMessage()]
            assert len(lines) == 1 and lines[0].startswith("no GPU: no_gpu"), lines
    finally:
        await runtime.stop()
        await runtime.engine.shutdown()


async def test_engine_step_shares_reach_the_ledgers_engine_steps(tmp_path, tokenizer, monkeypatch):
    """The per-step, per-tenant rows the vLLM engine publishes go into ``engine_steps`` with the
    served model and this process's replica name, and the read API serves the interference read."""
    monkeypatch.setenv("KVMETER_REPLICA", "replica-a")
    runtime = await runtime_for(tmp_path, tokenizer)
    await runtime.start()
    try:
        runtime.bus.publish(EngineStepShares(wall_ts=T0, engine_idx=1, duration_s=0.25, tenants=(
            TenantStepShare("acme", "paid_interactive", 64, 2, 300, 3, ("r-1",)),)))
        ledger = runtime.recorder.ledger
        assert ledger.flush(30.0)
        assert ledger.query_client().query(
            "SELECT replica, engine_idx, model, tenant_id, prefill_tokens, decode_tokens, kv_tokens, "
            "prefill_request_ids FROM engine_steps").result_rows == [
            ("replica-a", 1, MODEL, "acme", 64, 2, 300, ["r-1"])]
        assert any(getattr(r, "path", "") == "/v1/usage/interference" for r in runtime.app().routes)
    finally:
        await runtime.stop()
        await runtime.engine.shutdown()
