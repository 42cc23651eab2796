"""Real redis-server processes on loopback, for the tests and the benchmarks alike.

:class:`RedisServer` starts the Debian ``redis-server`` binary on 127.0.0.1 (a free port unless
given, no persistence, its files in ``workdir``); :class:`RedisClusterServers` starts several with
``--cluster-enabled yes`` and joins them with ``redis-cli --cluster create``. The quota tests
(``tests/serving/quota/quota_testlib.py`` re-exports these), the session fixtures ``redis_server``
and ``redis_url`` (``tests/conftest.py``) and ``bench/quota`` use them; a benchmark must not
import from ``tests/``, so this lives here (tests already import ``bench.parity``).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis
from kvmeter.net import free_port

__all__ = ["REDIS_BIN", "REDIS_CLI", "NO_REDIS", "free_port", "RedisServer", "RedisClusterServers"]

#: The ``redis-server`` / ``redis-cli`` binaries on PATH, or None.
REDIS_BIN = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
#: Why a test that needs redis-server is skipped.
NO_REDIS = "redis-server not on PATH (Debian: apt-get install -y redis-server)"


class RedisServer:
    """A real redis-server process on 127.0.0.1 that a test may stop and start again.

    Args:
        workdir: its working folder (created; ``redis.log`` goes there).
        port: the TCP port (default: a free one, kept across restarts).
        extra_args: more ``redis-server`` arguments.
    ``start()`` waits until it answers PING (at most 15 s; RuntimeError otherwise); ``stop()``
    terminates it (idempotent).
    """

    def __init__(self, workdir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_BIN is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 15
        while True:  # wait for the server to accept connections (process start, not timing logic)
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
        client.close()

    def version(self) -> str:
        """The running server's ``redis_version`` (``INFO server``)."""
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2.0)
        try:
            return str(client.info("server")["redis_version"])
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


class RedisClusterServers:
    """A real Redis Cluster on 127.0.0.1: ``masters`` redis-server processes started with
    ``--cluster-enabled yes`` (each in its own folder under ``workdir``), joined with
    ``redis-cli --cluster create ... --cluster-replicas 0`` (the 16,384 slots split between them)."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes = [RedisServer(workdir / f"node{i}", extra_args=(
            "--cluster-enabled", "yes", "--cluster-port", str(free_port()),
            "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"))
            for i in range(masters)]

    @property
    def url(self) -> str:
        """``redis+cluster://`` of the first node (the client discovers the others)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        assert REDIS_CLI is not None
        for node in self.nodes:
            node.start()
        subprocess.run([REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        deadline = time.monotonic() + 30
        for node in self.nodes:  # wait until every node sees every slot served (process start)
            client = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=1.0)
            while client.cluster("info").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis cluster on {node.port} did not reach cluster_state:ok")
                time.sleep(0.05)
            client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
