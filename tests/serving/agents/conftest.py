"""Fixtures for the agent-run tests: the same test body on the in-memory run store and on a real
redis-server (the session fixture ``redis_url``, tests/conftest.py), with a tenant directory, the quota gate
whose tool-call counters the store shares, and the services over them.

Records the services write go to an in-process list sink (what the ledger's ``record_agent``
receives); the HTTP tests (tests/serving/quota_http/test_agent_*_http.py) read them back from a real chDB
ledger instead.
"""

from __future__ import annotations

import textwrap
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import pytest
import pytest_asyncio

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.serving.agents import AgentRuns, AgentStore, ApprovalDesk, MemoryAgentStore, RedisAgentStore
from kvmeter.serving.quota import HierarchicalQuota, MemoryQuotaStore, RedisQuotaStore, redis_client
from kvmeter.serving.tenancy import TenantDirectory
from kvmeter.stats import AgentRunStopped, ApprovalEvent, ToolCallDecided
from tests.conftest import run_async_tests_on_session_loop

#: 2024-05-17 12:00:00 UTC
T0_WALL = 1_715_947_200.0

KEYS = {"agent": "sk-test-agent-0001", "other": "sk-test-other-0001", "ops": "sk-test-ops-00001",
        "admin": "sk-test-admin-0001", "rival": "sk-test-rival-0001", "second": "sk-test-second-001"}

#: acme's agent key: deploy_* is high risk (approved by ops), send_* side effects, search_* read-only,
#: shell_* blocked at the org; workspace "research" allows only some tools.
BASE = """
version: 1
default_tier: paid_interactive
tiers:
  paid_interactive:
    loop_stops: {{max_identical_tool_calls: 3, max_cycle_repeats: 3, max_repeated_prompts: 2}}
orgs:
  acme:
    tool_policy:
      block: ["shell_*"]
      risk: {{"deploy_*": high_risk, "send_*": side_effect, "search_*": read_only}}
      default_risk: side_effect
      approval_ttl_s: 600
      side_effect_window_s: 300
    approvers: [ops]
    run_budget: {{max_tool_calls: {max_tool_calls}}}
    workspaces:
      research:
        tool_policy:
          allow: ["search_*", "send_*", "deploy_*", "shell_ls", "lookup"]
        projects:
          bot:
            api_keys:
              agent: {{key: {agent}}}
              other: {{key: {other}}}
      ops:
        projects:
          ops:
            api_keys:
              ops: {{key: {ops}}}
  rival:
    approvers: [rival]
    workspaces:
      w:
        projects:
          p:
            api_keys:
              rival: {{key: {rival}}}
  platform:
    tier: enterprise
    workspaces:
      w:
        projects:
          p:
            api_keys:
              admin: {{key: {admin}, admin: true}}
"""


def config(max_tool_calls: int = 100) -> str:
    return textwrap.dedent(BASE).format(max_tool_calls=max_tool_calls, **KEYS)


@dataclass
class Kit:
    """One test's agent-run stack."""

    directory: TenantDirectory
    quota: HierarchicalQuota
    store: AgentStore
    agents: AgentRuns
    desk: ApprovalDesk
    clock: ManualClock
    bus: StatsBus
    records: list = field(default_factory=list)
    published: list = field(default_factory=list)

    def principal(self, name: str):
        return self.directory.authenticate(KEYS[name])

    async def record_agent(self, record) -> None:
        self.records.append(record)

    def records_of(self, cls) -> list:
        return [r for r in self.records if isinstance(r, cls)]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_wall=T0_WALL)


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest_asyncio.fixture
async def make_kit(store_kind: str, request: pytest.FixtureRequest, clock: ManualClock
                   ) -> AsyncIterator[Callable[..., Kit]]:
    """``make_kit(yaml_text=config())`` builds the stack on the parametrized store (Redis: a fresh
    key prefix per test, so earlier tests' runs are out of the way)."""
    opened: list = []

    def build(yaml_text: str | None = None) -> Kit:
        directory = TenantDirectory(yaml_text or config(), clock=clock)
        bus = StatsBus()
        if store_kind == "memory":
            counters = MemoryQuotaStore()
            store: AgentStore = MemoryAgentStore(counters)
        else:
            url = request.getfixturevalue("redis_url")
            prefix = f"t{uuid.uuid4().hex[:10]}"
            counters = RedisQuotaStore(redis_client(url, timeout_s=2.0), key_prefix=f"{prefix}q:")
            store = RedisAgentStore(redis_client(url, timeout_s=2.0), key_prefix=f"{prefix}a:")
            opened.extend([counters, store])
        quota = HierarchicalQuota(directory, counters, clock=clock)
        kit = Kit(directory, quota, store, None, None, clock, bus)  # type: ignore[arg-type]
        kit.agents = AgentRuns(directory, quota, store, recorder=kit, bus=bus, clock=clock)
        kit.desk = ApprovalDesk(directory, store, recorder=kit, bus=bus, clock=clock)
        for cls in (ToolCallDecided, ApprovalEvent, AgentRunStopped):
            bus.subscribe(cls, kit.published.append)
        return kit

    yield build
    for s in opened:
        await s.aclose()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run this folder's async tests on the session event loop, where the async fixtures live."""
    run_async_tests_on_session_loop(Path(__file__).parent, items)


@pytest.hookimpl(trylast=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark every test that talks to redis-server with ``redis`` (``-m "not redis"``)."""
    if Path(__file__).parent in item.path.parents:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("store_kind") == "redis" or "redis_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)
