"""The tenant directory: the loaded principals config, authentication, lookups and live reload.

:class:`TenantDirectory` turns a validated :class:`~kvmeter.serving.tenancy.config.TenancyConfig`
into an immutable :class:`DirectorySnapshot` — every API key's :class:`Principal`, its chain of
effective limits (global → org → workspace → project → key), its agent-run limits and budget, and
the tier policies — and swaps that snapshot atomically on :meth:`TenantDirectory.reload`. Readers
take ``directory.snapshot`` once per request and use only that object, so a reload in the middle
of a request never mixes two configs; reservations carry their own store keys, so in-flight
reservations stay valid across a reload (see the quota package).

Effective limits of a node: its tier's defaults for the node's level, overridden field by field by
the node's own ``limits`` (a field set to ``null`` removes the default). A node's tier is its own
``tier`` or else its parent's (the org's falls back to ``default_tier``).

Agent-run limits and run budgets: for each field, the tightest value any node of the key's chain
sets explicitly; if no node sets it, the key's tier default. So an org can cap every run below it
and no project or key can raise that cap.

Authentication: the presented key is hashed with SHA-256 and looked up by digest, then the digest
is re-compared with ``hmac.compare_digest``. A lookup keyed by the digest can at most leak, through
timing, bits of *digests* — which do not help an attacker find a key (SHA-256 preimage resistance) —
and keeps authentication O(1) in the number of keys. :func:`constant_time_lookup` (a full scan) is
kept for callers that prefer it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from kvmeter.billing_calendar import UTC
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.serving.tenancy.config import ConfigError, TenancyConfig, TierModel, parse_config
from kvmeter.serving.tenancy.limits import NO_LIMITS, Limits, LoopStops, RunBudget
from kvmeter.serving.tenancy.principal import AuthError, Principal
from kvmeter.serving.tenancy.tiers import DEFAULT_TIERS, TierPolicy
from kvmeter.serving.tenancy.toolpolicy import ALLOW_ALL, NodeToolRules, ToolPolicy, compile_node, compile_tool_policy
from kvmeter.stats.tenancy import ConfigReloaded

__all__ = ["TenantDirectory", "DirectorySnapshot", "KeyEntry", "NodeLimits", "MAX_PRESENTED_KEY_CHARS"]

log = logging.getLogger(__name__)

#: Presented keys longer than this are refused without hashing (bounds the work per request).
MAX_PRESENTED_KEY_CHARS = 512


@dataclass(frozen=True, slots=True)
class NodeLimits:
    """One level of a key's chain.

    Attributes:
        level: ``global``, ``org``, ``workspace``, ``project`` or ``api_key``.
        node_id: the node's path from the root, ``/``-joined (``acme/research/chatbot``); ``""``
            for ``global``. Store keys and usage reads use it.
        limits: the node's effective :class:`Limits`.
    """

    level: str
    node_id: str
    limits: Limits


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """Everything admission needs about one API key.

    Attributes:
        principal: the resolved identity.
        chain: effective limits from ``global`` down to the ``api_key`` node (5 entries).
        run_limits: the 7-dimension limits applied to each agent run of this key.
        run_budget: the budget of each agent run of this key.
        tool_policy: the tools its agent runs may use and their risk classes
            (:class:`~kvmeter.serving.tenancy.toolpolicy.ToolPolicy`, compiled at load).
        billing_timezone: its org's billing time zone (IANA name; the org, workspace, project
            and key spend windows are local days and months there; ``global`` stays UTC).
    """

    principal: Principal
    chain: tuple[NodeLimits, ...]
    run_limits: Limits
    run_budget: RunBudget
    tool_policy: ToolPolicy = ALLOW_ALL
    billing_timezone: str = UTC


@dataclass(frozen=True, slots=True)
class DirectorySnapshot:
    """An immutable, compiled config. Obtain it from :attr:`TenantDirectory.snapshot`.

    Attributes:
        version: increases by one on every successful (re)load, starting at 1.
        config: the validated config it was built from.
        tiers: tier name → :class:`TierPolicy` (built-ins merged with the file's overrides).
        default_tier: the tier of orgs that name none.
        keys: API key id → :class:`KeyEntry`.
        has_spend_limits: True if any node, tier or run budget limits money (admission then needs
            a price function).
        source_sha256: hex SHA-256 of the file bytes it came from (``""`` when not from a file).
        billing_timezones: tenant (org) id → its billing time zone (IANA name), every org of
            the config; a tenant not in it is billed in UTC (:meth:`billing_timezone`).
    """

    version: int
    config: TenancyConfig
    tiers: Mapping[str, TierPolicy]
    default_tier: str
    keys: Mapping[str, KeyEntry]
    has_spend_limits: bool
    source_sha256: str = ""
    billing_timezones: Mapping[str, str] = field(default_factory=dict)
    _by_digest: Mapping[str, tuple[str, str]] = field(default_factory=dict, repr=False)

    def billing_timezone(self, tenant_id: str) -> str:
        """The billing time zone of ``tenant_id`` (``UTC`` for a tenant the config does not name)."""
        return self.billing_timezones.get(tenant_id, UTC)

    def entry_for_digest(self, digest: str) -> KeyEntry | None:
        """The key whose SHA-256 hex digest is ``digest``, or None (timing-safe re-compare)."""
        hit = self._by_digest.get(digest)
        if hit is None:
            return None
        known, key_id = hit
        return self.keys[key_id] if hmac.compare_digest(known, digest) else None


# ---------------------------------------------------------------------------------------------
# compilation


def _overlay(base: Any, model: Any | None, cls: type) -> Any:
    """``base`` with the fields ``model`` sets explicitly (including explicit nulls)."""
    if model is None:
        return base
    values = {f.name: getattr(base, f.name) for f in fields(cls)}
    for name in model.model_fields_set:
        values[name] = getattr(model, name)
    return cls(**values)


def _tightest_explicit(default: Any, models: list[Any], cls: type) -> Any:
    """Per field: min of the values nodes set explicitly (an explicit null alone → unlimited);
    the tier default where no node sets the field."""
    values = {}
    for f in fields(cls):
        explicit = [getattr(m, f.name) for m in models if m is not None and f.name in m.model_fields_set]
        if not explicit:
            values[f.name] = getattr(default, f.name)
        else:
            present = [v for v in explicit if v is not None]
            values[f.name] = min(present) if present else None
    return cls(**values)


def _compile_tiers(overrides: Mapping[str, TierModel]) -> dict[str, TierPolicy]:
    """The built-in tiers with the file's overrides (each field it sets replaces the built-in
    one; limits per level and the run budget field by field), plus the tiers it adds."""
    tiers = dict(DEFAULT_TIERS)
    for name, m in overrides.items():
        base = tiers.get(name, TierPolicy(name=name))
        levels = dict(base.limits)
        for level, lm in m.limits.items():
            levels[level] = _overlay(base.limits_for(level), lm, Limits)
        billing = {**base.undelivered_billing, **(m.undelivered_billing.given() if m.undelivered_billing else {})}
        tiers[name] = replace(base, **m.fields_set(), limits=MappingProxyType(levels),
                              run_budget=_overlay(base.run_budget, m.run_budget, RunBudget),
                              loop_stops=_overlay(base.loop_stops, m.loop_stops, LoopStops),
                              undelivered_billing=MappingProxyType(billing))
    return tiers


def _limits_has_spend(lim: Limits) -> bool:
    return lim.spend_per_day is not None or lim.spend_per_month is not None


def compile_snapshot(cfg: TenancyConfig, version: int, source_sha256: str = "") -> DirectorySnapshot:
    """Build the immutable snapshot of ``cfg`` (see the module docstring for the rules)."""
    tiers = _compile_tiers(cfg.tiers)
    global_limits = _overlay(NO_LIMITS, cfg.global_.limits, Limits)
    keys: dict[str, KeyEntry] = {}
    by_digest: dict[str, tuple[str, str]] = {}
    spend = _limits_has_spend(global_limits)
    rules: dict[str, NodeToolRules] = {}  # each node's tool policy compiled once, shared below it

    def node_rules(path: str, n: Any) -> NodeToolRules:
        hit = rules.get(path)
        if hit is None:
            hit = rules[path] = compile_node(path, n.tool_policy)
        return hit

    for oid, org in cfg.orgs.items():
        org_tier = org.tier or cfg.default_tier
        org_lim = _overlay(tiers[org_tier].limits_for("org"), org.limits, Limits)
        for wid, ws in org.workspaces.items():
            ws_tier = ws.tier or org_tier
            ws_lim = _overlay(tiers[ws_tier].limits_for("workspace"), ws.limits, Limits)
            for pid, proj in ws.projects.items():
                p_tier = proj.tier or ws_tier
                p_lim = _overlay(tiers[p_tier].limits_for("project"), proj.limits, Limits)
                for kid, key in proj.api_keys.items():
                    k_tier = key.tier or p_tier
                    k_lim = _overlay(tiers[k_tier].limits_for("api_key"), key.limits, Limits)
                    tier = tiers[k_tier]
                    nodes = (org, ws, proj, key)
                    run_limits = _tightest_explicit(tier.limits_for("agent_run"),
                                                    [n.agent_run_limits for n in nodes], Limits)
                    run_budget = _tightest_explicit(tier.run_budget, [n.run_budget for n in nodes],
                                                    RunBudget)
                    principal = Principal(tenant_id=oid, tier=k_tier, workspace_id=wid,
                                          project_id=pid, api_key_id=kid, admin=key.admin)
                    chain = (
                        NodeLimits("global", "", global_limits),
                        NodeLimits("org", oid, org_lim),
                        NodeLimits("workspace", f"{oid}/{wid}", ws_lim),
                        NodeLimits("project", f"{oid}/{wid}/{pid}", p_lim),
                        NodeLimits("api_key", f"{oid}/{wid}/{pid}/{kid}", k_lim),
                    )
                    paths = (f"orgs.{oid}", f"orgs.{oid}.workspaces.{wid}",
                             f"orgs.{oid}.workspaces.{wid}.projects.{pid}",
                             f"orgs.{oid}.workspaces.{wid}.projects.{pid}.api_keys.{kid}")
                    policy = compile_tool_policy([node_rules(p, n) for p, n in zip(paths, nodes, strict=True)],
                                                 approvers=[a for n in nodes for a in n.approvers])
                    keys[kid] = KeyEntry(principal, chain, run_limits, run_budget, policy, org.billing_timezone)
                    digest = key.digest()
                    by_digest[digest] = (digest, kid)
                    spend = spend or any(_limits_has_spend(n.limits) for n in chain) \
                        or _limits_has_spend(run_limits) or run_budget.max_cost is not None
    return DirectorySnapshot(
        version=version, config=cfg, tiers=MappingProxyType(tiers), default_tier=cfg.default_tier,
        keys=MappingProxyType(keys), has_spend_limits=spend, source_sha256=source_sha256,
        billing_timezones=MappingProxyType({oid: org.billing_timezone for oid, org in cfg.orgs.items()}),
        _by_digest=MappingProxyType(by_digest))


# ---------------------------------------------------------------------------------------------


class TenantDirectory:
    """Loaded principals config with authentication and atomic reload; an ``Authenticator``.

    Args:
        config: a validated config (or a mapping / YAML text, validated here), or ``None`` when
            ``path`` is given.
        path: YAML file to load now and on :meth:`reload` / :meth:`poll_file`.
        bus: where :class:`~kvmeter.stats.ConfigReloaded` stats go (optional).
        clock: for the stats' timestamps.
    Raises:
        ConfigError: the initial config is invalid (construction fails loudly).
        ValueError: neither or both of ``config`` and ``path`` given.
    """

    def __init__(self, config: TenancyConfig | Mapping[str, Any] | str | None = None, *,
                 path: str | Path | None = None, bus: StatsBus | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        if (config is None) == (path is None):
            raise ValueError("TenantDirectory needs exactly one of config= or path=")
        self._path = Path(path) if path is not None else None
        self._bus = bus
        self._clock = clock
        self._file_state: tuple[int, int] | None = None
        self._watch_task: asyncio.Task | None = None
        if config is None:  # path= (exactly one of the two, checked above)
            cfg, sha, state = self._read_file()
            self._snapshot = compile_snapshot(cfg, 1, sha)
            self._file_state = state
        else:
            cfg = config if isinstance(config, TenancyConfig) else parse_config(config)
            self._snapshot = compile_snapshot(cfg, 1)

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "TenantDirectory":
        """Load from a YAML file (same as ``TenantDirectory(path=path)``)."""
        return cls(path=path, **kwargs)

    # -- reads -------------------------------------------------------------------------------

    @property
    def snapshot(self) -> DirectorySnapshot:
        """The live snapshot (immutable; take it once per request)."""
        return self._snapshot

    @property
    def path(self) -> Path | None:
        """The config file, if loaded from one."""
        return self._path

    def authenticate(self, presented_key: str | None) -> Principal:
        """Resolve a presented API key (the bare secret, without ``Bearer``).

        Returns:
            The key's :class:`Principal`.
        Raises:
            AuthError: ``missing_api_key`` if empty/None, ``invalid_api_key`` if unknown, not a
                string or longer than :data:`MAX_PRESENTED_KEY_CHARS`. The message never
                contains the key.
        """
        if presented_key is None or presented_key == "":
            raise AuthError("missing API key", code="missing_api_key")
        if not isinstance(presented_key, str) or len(presented_key) > MAX_PRESENTED_KEY_CHARS:
            raise AuthError("invalid API key")
        digest = hashlib.sha256(presented_key.encode("utf-8", "surrogatepass")).hexdigest()
        entry = self._snapshot.entry_for_digest(digest)
        if entry is None:
            raise AuthError("invalid API key")
        return entry.principal

    def entry(self, api_key_id: str) -> KeyEntry | None:
        """The live :class:`KeyEntry` of a key id, or None if the key is not configured."""
        return self._snapshot.keys.get(api_key_id)

    def tier_policy(self, tier: str) -> TierPolicy:
        """The :class:`TierPolicy` named ``tier``.

        Raises:
            KeyError: unknown tier (message lists the known ones).
        """
        try:
            return self._snapshot.tiers[tier]
        except KeyError:
            raise KeyError(f"unknown tier {tier!r}; known: {', '.join(sorted(self._snapshot.tiers))}") from None

    def billing_timezone(self, tenant_id: str) -> str:
        """The billing time zone (IANA name) of ``tenant_id`` in the current snapshot (``UTC`` for
        a tenant the config does not name); follows reloads."""
        return self._snapshot.billing_timezone(tenant_id)

    def can_read_usage(self, principal: Principal, tenant_id: str) -> bool:
        """True if ``principal`` may read ``tenant_id``'s usage (its own tenant, or any if admin)."""
        return principal.admin or principal.tenant_id == tenant_id

    # -- reload ------------------------------------------------------------------------------

    def _read_file(self) -> tuple[TenancyConfig, str, tuple[int, int]]:
        assert self._path is not None
        try:
            st = self._path.stat()
            data = self._path.read_bytes()
        except OSError as e:
            raise ConfigError([("", f"cannot read file: {e.strerror}")], str(self._path)) from None
        cfg = parse_config(data, source=str(self._path))
        return cfg, hashlib.sha256(data).hexdigest(), (st.st_mtime_ns, st.st_size)

    def reload(self, config: TenancyConfig | Mapping[str, Any] | str | None = None) -> DirectorySnapshot:
        """Swap in a new config atomically; the old snapshot stays live if the new one is invalid.

        Args:
            config: the new config; ``None`` re-reads the file given at construction.
        Returns:
            The new live snapshot (its ``version`` is the old one + 1).
        Raises:
            ConfigError: invalid config (nothing changed).
            ValueError: ``config`` is None and the directory has no file.
        """
        old = self._snapshot
        try:
            if config is None:
                if self._path is None:
                    raise ValueError("reload() without a config needs a directory loaded from a file")
                cfg, sha, state = self._read_file()
                new = compile_snapshot(cfg, old.version + 1, sha)
                self._file_state = state
            else:
                cfg = config if isinstance(config, TenancyConfig) else parse_config(config)
                new = compile_snapshot(cfg, old.version + 1)
        except ConfigError as e:
            log.error("tenancy config reload rejected, keeping version %d: %s", old.version, e)
            self._publish(ConfigReloaded(ok=False, version=old.version, error=str(e),
                                         keys=len(old.keys), wall_ts=self._clock.wall()))
            raise
        self._snapshot = new  # one reference assignment: atomic for every reader
        log.info("tenancy config version %d live (%d API keys)", new.version, len(new.keys))
        self._publish(ConfigReloaded(ok=True, version=new.version, keys=len(new.keys),
                                     wall_ts=self._clock.wall()))
        return new

    def poll_file(self) -> bool:
        """Reload if the file changed (mtime, size or content hash). Never raises.

        Returns:
            True if a new config went live; False if unchanged, or if the changed file was
            invalid or unreadable (logged, published as :class:`~kvmeter.stats.ConfigReloaded` ``ok=False``;
            the old config stays live).
        """
        if self._path is None:
            return False
        try:
            st = self._path.stat()
        except OSError as e:
            log.error("tenancy config %s unreadable: %s", self._path, e.strerror)
            return False
        if (st.st_mtime_ns, st.st_size) == self._file_state:
            return False
        try:
            data = self._path.read_bytes()
        except OSError as e:
            log.error("tenancy config %s unreadable: %s", self._path, e.strerror)
            return False
        if hashlib.sha256(data).hexdigest() == self._snapshot.source_sha256:
            self._file_state = (st.st_mtime_ns, st.st_size)
            return False
        try:
            self.reload()
        except ConfigError:
            self._file_state = (st.st_mtime_ns, st.st_size)  # do not retry the same bad file
            return False
        return True

    async def watch(self, interval_s: float = 2.0) -> None:
        """Poll the file every ``interval_s`` seconds (> 0) until cancelled (see :meth:`poll_file`)."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        while True:
            await asyncio.sleep(interval_s)
            self.poll_file()

    def start_watching(self, interval_s: float = 2.0) -> asyncio.Task:
        """Run :meth:`watch` as a task on the running loop; returns it (cancel it to stop)."""
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(self.watch(interval_s))
        return self._watch_task

    def _publish(self, obj: object) -> None:
        if self._bus is not None:
            self._bus.publish(obj)
