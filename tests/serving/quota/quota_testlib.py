"""Helpers shared by the quota tests (a real redis-server process, a price function, configs).

Named uniquely (not ``conftest``/``helpers``) so it cannot clash with other test folders' modules.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import time
from decimal import Decimal
from pathlib import Path

import redis

from kvmeter.attribution import Attribution
from kvmeter.ledger.prices import parse_price_list
from kvmeter.serving.quota import UsageEstimate
from kvmeter.serving.tenancy import Principal
from kvmeter.tokens import TokenCounts

REDIS_BIN = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NO_REDIS = "redis-server not on PATH (Debian: apt-get install -y redis-server)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server process on 127.0.0.1 that a test may stop and start again."""

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


#: Prices per token (exact decimals): input 0.50 / 1M, cached input 0.25 / 1M, output 1.50 / 1M.
P_IN, P_CACHED, P_OUT = Decimal("0.0000005"), Decimal("0.00000025"), Decimal("0.0000015")

#: The quota tests' price list (model ``m``, alias ``smollm2``; reasoning at the output price).
PRICES = parse_price_list({"version": "quota-tests", "currency": "USD", "models": {
    "m": {"input": "0.50", "cached_input": "0.25", "output": "1.50", "aliases": ["smollm2"]}}}, "quota_testlib")

#: The ledger's price function over :data:`PRICES`, as ``kvmeter serve`` hands it to the quota.
price = PRICES.cost

#: The attribution of the estimates below when a test names no principal (acme's key k1).
ACME_K1 = Attribution("acme", workspace_id="ws", project_id="proj", api_key_id="k1", tier="enterprise",
                      model="m", endpoint="chat.completions")


def estimate(model: str = "m", input_tokens: int = 100, max_output_tokens: int = 100, *, agent_run_id: str = "",
             request_id: str = "", attempt: int = 1, principal: Principal | None = None) -> UsageEstimate:
    """An admission estimate as the gateway builds it: ``principal``'s attribution (default acme's
    k1) for ``model`` and ``agent_run_id``, ``input_tokens`` and ``max_output_tokens`` as output."""
    attribution = (principal.attribution(model=model, endpoint="chat.completions", agent_run_id=agent_run_id)
                   if principal is not None else
                   dataclasses.replace(ACME_K1, model=model, agent_run_id=agent_run_id))
    return UsageEstimate(attribution, TokenCounts(input_tokens=input_tokens, output_tokens=max_output_tokens),
                         request_id=request_id, attempt=attempt)


def used(input_tokens: int = 0, cached_input_tokens: int = 0, output_tokens: int = 0) -> TokenCounts:
    """Engine-true usage to reconcile a reservation to (``used()``: nothing ran)."""
    return TokenCounts(
        input_tokens=input_tokens, cached_input_tokens=cached_input_tokens, output_tokens=output_tokens
    )


def tree(org_limits: str = "{}", key_limits: str = "{}", *, extra: str = "", tier: str = "enterprise",
         run_budget: str = "{}", project_limits: str = "{}", ws_limits: str = "{}", global_limits: str = "{}",
         agent_run_limits: str = "{}") -> str:
    """A YAML config: org ``acme`` (keys k1, k2 in ws/proj; k3 in ws/proj2), org ``other`` (key o1)."""
    return f"""
version: 1
global: {{limits: {global_limits}}}
orgs:
  acme:
    tier: {tier}
    limits: {org_limits}
    run_budget: {run_budget}
    agent_run_limits: {agent_run_limits}
    workspaces:
      ws:
        limits: {ws_limits}
        projects:
          proj:
            limits: {project_limits}
            api_keys:
              k1: {{key: sk-test-key-one, limits: {key_limits}}}
              k2: {{key: sk-test-key-two, limits: {key_limits}}}
          proj2:
            api_keys:
              k3: {{key: sk-test-key-three, limits: {key_limits}}}
  other:
    tier: {tier}
    workspaces:
      ws:
        projects:
          proj:
            api_keys:
              o1: {{key: sk-test-other-one, limits: {key_limits}}}
{extra}
"""


class TcpProxy:
    """A real loopback TCP relay in front of a server; ``stop()`` cuts the network path (open
    connections are closed, new ones refused) while the server keeps its data."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._server = None
        self._writers: set = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        import asyncio

        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, reader, writer) -> None:
        import asyncio

        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pump(src, dst) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            self._writers.clear()
            await self._server.wait_closed()
            self._server = None
