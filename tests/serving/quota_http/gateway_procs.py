"""``kvmeter serve --engine instant`` as real processes (for the multi-replica test and benches).

Each process gets its own chDB ledger directory and spool (chDB on disk is single-process) and the
same principals file, price list and quota store URL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["GatewayProcess", "start_gateways", "stop_gateways"]

KVMETER = Path(sys.executable).with_name("kvmeter")


@dataclass
class GatewayProcess:
    """One running ``kvmeter serve``."""

    proc: subprocess.Popen
    port: int
    root: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ledger_dsn(self) -> str:
        return f"chdb://{self.root}/chdb"

    @property
    def spool_dir(self) -> Path:
        return self.root / "spool"


def start_gateways(n: int, root: Path, ports: list[int], *, tenants: Path, prices: Path,
                   quota_store: str, extra_env: dict[str, str] | None = None,
                   start_timeout_s: float = 180.0) -> list[GatewayProcess]:
    """Start ``n`` gateways and wait until each answers ``/healthz`` 200.

    Raises:
        RuntimeError: a process exited or did not become healthy in ``start_timeout_s``
            (its log is in the message).
    """
    env = {**os.environ, "KVMETER_QUOTA_REPLICAS": str(n), "TOKENIZERS_PARALLELISM": "false",
           **(extra_env or {})}
    procs: list[GatewayProcess] = []
    for i in range(n):
        home = root / f"gw{i}"
        home.mkdir(parents=True, exist_ok=True)
        log = open(home / "serve.log", "wb")
        cmd = [str(KVMETER), "--log-level", "WARNING", "serve", "--engine", "instant",
               "--port", str(ports[i]), "--tenants", str(tenants), "--prices", str(prices),
               "--quota-store", quota_store, "--ledger-dsn", f"chdb://{home}/chdb",
               "--spool-dir", str(home / "spool")]
        procs.append(GatewayProcess(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                     cwd=home), ports[i], home))
    deadline = time.monotonic() + start_timeout_s
    for gp in procs:  # process start-up, not timing logic
        while True:
            if gp.proc.poll() is not None:
                stop_gateways(procs)
                raise RuntimeError(f"gateway on {gp.port} exited: {(gp.root / 'serve.log').read_text()[-3000:]}")
            try:
                if httpx.get(gp.url + "/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                stop_gateways(procs)
                raise RuntimeError(f"gateway on {gp.port} not healthy in {start_timeout_s} s")
            time.sleep(0.2)
    return procs


def stop_gateways(procs: list[GatewayProcess], timeout_s: float = 60.0) -> None:
    """SIGTERM each (uvicorn shuts down gracefully: the ledger drains and closes), then wait."""
    for gp in procs:
        if gp.proc.poll() is None:
            gp.proc.send_signal(signal.SIGTERM)
    for gp in procs:
        try:
            gp.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            gp.proc.kill()
            gp.proc.wait()
