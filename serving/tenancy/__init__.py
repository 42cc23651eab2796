"""Principals and authentication: who is calling, on whose bill, under which tier and limits.

Public surface (re-exported here; the modules are internals):

* :class:`Principal`, :class:`Authenticator`, :class:`AuthError`, :func:`hash_api_key`,
  :func:`constant_time_lookup`, :data:`TIERS` — the shapes every other part relies on
  (:mod:`.principal`).
* :class:`TenantDirectory` — the loaded YAML config (org → workspace → project → API key, tiers,
  global limits): ``authenticate()``, ``tier_policy()``, ``entry()``, atomic ``reload()`` and a
  file watcher (:mod:`.directory`).
* :class:`TierPolicy`, :data:`DEFAULT_TIERS` — weight, TTFT/ITL SLOs, engine priority and default
  limits per tier (:mod:`.tiers`).
* :class:`Limits`, :class:`RunBudget`, :class:`LoopStops` and the level/dimension names (:mod:`.limits`).
* :class:`ToolPolicy`, :class:`ToolVerdict`, :data:`RISK_CLASSES` — a key's compiled tool policy
  (allowed / blocked tools, risk classes, approvers) (:mod:`.toolpolicy`).
* :func:`load_config`, :func:`parse_config`, :class:`ConfigError`, :data:`DEMO_TENANTS_FILE` (the demo
  tenants a bare ``kvmeter serve`` uses) (:mod:`.config`).
"""

from kvmeter.serving.tenancy.config import DEMO_TENANTS_FILE, ConfigError, TenancyConfig, load_config, parse_config
from kvmeter.serving.tenancy.directory import (
    DirectorySnapshot,
    KeyEntry,
    NodeLimits,
    TenantDirectory,
)
from kvmeter.serving.tenancy.limits import (
    DIMENSIONS,
    LEVELS,
    RUN_DIMENSIONS,
    Limits,
    LoopStops,
    RunBudget,
)
from kvmeter.serving.tenancy.principal import (
    TIERS,
    AuthError,
    Authenticator,
    Principal,
    constant_time_lookup,
    hash_api_key,
)
from kvmeter.serving.tenancy.tiers import DEFAULT_TIERS, TierPolicy
from kvmeter.serving.tenancy.toolpolicy import RISK_CLASSES, ToolPolicy, ToolVerdict, valid_tool_name

__all__ = [
    "Principal",
    "Authenticator",
    "AuthError",
    "TIERS",
    "hash_api_key",
    "constant_time_lookup",
    "TenantDirectory",
    "DirectorySnapshot",
    "KeyEntry",
    "NodeLimits",
    "TierPolicy",
    "DEFAULT_TIERS",
    "Limits",
    "RunBudget",
    "LoopStops",
    "ToolPolicy",
    "ToolVerdict",
    "RISK_CLASSES",
    "valid_tool_name",
    "LEVELS",
    "DIMENSIONS",
    "RUN_DIMENSIONS",
    "TenancyConfig",
    "ConfigError",
    "load_config",
    "parse_config",
    "DEMO_TENANTS_FILE",
]
