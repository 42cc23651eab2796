"""Helpers shared by the quota tests (a price function, configs, estimates, a TCP relay).

The real redis-server processes (:class:`RedisServer`, :class:`RedisClusterServers`) live in
``bench/redis_servers.py``, which the benchmarks import too; they are re-exported here for the
quota tests. Named uniquely (not ``conftest``/``helpers``) so it cannot clash with other test
folders' modules.
"""

from __future__ import annotations

import dataclasses
from decimal import Decimal

from bench.redis_servers import (NO_REDIS, REDIS_BIN, REDIS_CLI, RedisClusterServers,  # noqa: F401 (re-exported)
                                 RedisServer, free_port)
from kvmeter.attribution import Attribution
from kvmeter.ledger.prices import parse_price_list
from kvmeter.serving.quota import UsageEstimate
from kvmeter.serving.tenancy import Principal
from kvmeter.tokens import TokenCounts

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
