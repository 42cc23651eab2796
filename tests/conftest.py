"""Shared fixtures: the real vLLM CPU engine (one per test session) and the prepared model."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

# vLLM's CPU build sizes its KV cache from this (GiB); 1 GiB ≈ 46k tokens for SmolLM2-135M.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_uvicorn(server) -> asyncio.Task:
    """Run ``server`` (a ``uvicorn.Server``) in a task on this loop and wait until it listens
    (up to 30 s; waiting for a server to come up, not timing logic). Stop it with
    ``server.should_exit = True`` and ``await`` the task."""
    task = asyncio.create_task(server.serve())
    for _ in range(600):
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    assert server.started, "uvicorn did not start"
    return task


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct directory (dequantized once, cached)."""
    from kvmeter.model import resolve_model

    path, _ = resolve_model(None)
    return path


@pytest.fixture(scope="session")
async def vllm_engine(model_dir):
    """One real vLLM CPU engine for the whole session, with its stats on a session bus."""
    from kvmeter.bus import StatsBus
    from kvmeter.model import DEFAULT_MODEL_NAME
    from kvmeter.serving.engines.vllm_engine import VllmEngine, VllmEngineConfig

    bus = StatsBus()
    engine = VllmEngine(VllmEngineConfig(model_dir=str(model_dir), served_name=DEFAULT_MODEL_NAME,
                                         max_model_len=4096, max_num_seqs=64), bus=bus)
    await engine.start()
    engine.test_bus = bus  # tests subscribe here
    yield engine
    await engine.shutdown()
