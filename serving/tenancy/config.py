"""The principals configuration file: schema, loading and validation.

A YAML file (see ``kvmeter/serving/quota/examples/principals.yaml``) describes the hierarchy
org → workspace → project → API key, the tiers and the platform-wide (``global``) limits::

    version: 1
    default_tier: free
    global: {limits: {requests_per_minute: 100000}}
    tiers:                       # override built-in tiers field by field, or add new ones
      free: {weight: 0.5, ttft_slo_s: 8.0, limits: {api_key: {requests_per_minute: 10}}}
    orgs:
      acme:                      # ids: letters, digits, '.', '_', '-' (1-128 chars)
        tier: enterprise
        billing_timezone: America/New_York   # IANA zone of its invoices and spend days (default UTC)
        limits: {spend_per_month: "5000.00"}
        run_budget: {max_model_calls: 100}
        workspaces:
          research:
            projects:
              chatbot:
                api_keys:
                  chatbot-prod:
                    key_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
                  chatbot-dev:
                    key: sk-dev-only-plain-secret   # dev convenience: hashed at load, never logged

Any node (org, workspace, project, key) may also set a ``tool_policy`` (allowed / blocked tools and
risk classes of agent tool calls, :mod:`kvmeter.serving.tenancy.toolpolicy`) and ``approvers``
(ids of keys of the same org that may approve the high-risk tool calls of runs below the node);
a tier may set ``loop_stops`` (:class:`~kvmeter.serving.tenancy.limits.LoopStops`) and
``undelivered_billing`` (who pays for engine work that reached no client, per cause:
``{client_abandoned: billed, server_failure: absorbed, shutdown: absorbed, deadline: absorbed}``
by default; a cause not given keeps the tier's value).

Validation is pydantic's, with ``extra="forbid"`` everywhere; every problem is reported as a
dotted field path (``orgs.acme.workspaces.research.limits.requests_per_minute: ...``) in one
:class:`ConfigError`, and the input value is never echoed (it could be a plain key).

Numbers: YAML floats are read as :class:`~decimal.Decimal` from their source text, so
``spend_per_day: 10.10`` is exactly ten-ten; quoting money (``"10.10"``) works too.
"""

from __future__ import annotations

import hashlib
import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from kvmeter.billing_calendar import check_zone
from kvmeter.events import UNDELIVERED_CAUSES
from kvmeter.serving.tenancy.limits import NODE_LEVELS
from kvmeter.serving.tenancy.tiers import DEFAULT_TIERS, TIER_FIELDS, tier_field_problem
from kvmeter.serving.tenancy.toolpolicy import ToolPolicyModel

__all__ = [
    "ConfigError",
    "LimitsModel",
    "RunBudgetModel",
    "LoopStopsModel",
    "UndeliveredBillingModel",
    "TierModel",
    "ApiKeyModel",
    "ProjectModel",
    "WorkspaceModel",
    "OrgModel",
    "GlobalModel",
    "TenancyConfig",
    "parse_config",
    "load_config",
    "ID_PATTERN",
    "MAX_MONEY",
    "DEMO_TENANTS_FILE",
]

#: The tenants the demo and a bare ``kvmeter serve`` use (demo keys; replace them in production).
DEMO_TENANTS_FILE = Path(__file__).resolve().parents[1] / "defaults" / "demo-tenants.yaml"

#: Ids of orgs, workspaces, projects, keys and tiers (they become parts of store keys and labels).
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_ID_RE = re.compile(ID_PATTERN)
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

#: Largest money limit the quota store can hold exactly (int64 nano-units, 9 decimal places).
MAX_MONEY = Decimal("9000000000")


class ConfigError(ValueError):
    """An invalid principals configuration.

    Attributes:
        problems: ``(field path, message)`` pairs, e.g.
            ``("orgs.acme.limits.requests_per_minute", "Input should be greater than or equal to 0")``.
        source: the file (or ``"<string>"``) the config came from.
    The message lists every problem and never contains input values (a value could be a key).
    """

    def __init__(self, problems: list[tuple[str, str]], source: str = "<string>") -> None:
        self.problems = list(problems)
        self.source = source
        lines = "; ".join(f"{path or '<root>'}: {msg}" for path, msg in self.problems)
        super().__init__(f"invalid tenancy config {source}: {lines}")


_STRICT = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

_Count = Field(default=None, ge=0)
_Money = Field(default=None, ge=0, le=MAX_MONEY, decimal_places=9)


class LimitsModel(BaseModel):
    """Limits of one node (see :class:`kvmeter.serving.tenancy.limits.Limits`); all optional.

    A field set to ``null`` explicitly removes the tier's default for that field at this node.
    """

    model_config = _STRICT

    requests_per_minute: int | None = _Count
    input_tokens_per_minute: int | None = _Count
    output_tokens_per_minute: int | None = _Count
    concurrent_requests: int | None = _Count
    max_context_tokens: int | None = Field(default=None, ge=1)
    active_kv_tokens: int | None = _Count
    spend_per_day: Decimal | None = _Money
    spend_per_month: Decimal | None = _Money


class RunBudgetModel(BaseModel):
    """Agent-run budget (see :class:`kvmeter.serving.tenancy.limits.RunBudget`); all optional."""

    model_config = _STRICT

    max_model_calls: int | None = _Count
    max_tool_calls: int | None = _Count
    max_runtime_s: float | None = Field(default=None, gt=0)
    max_cost: Decimal | None = _Money
    max_retries: int | None = _Count
    max_parallel_branches: int | None = Field(default=None, ge=1)


class LoopStopsModel(BaseModel):
    """A tier's agent-run loop stops (see :class:`kvmeter.serving.tenancy.limits.LoopStops`); all
    optional, an explicit ``null`` turns a stop off."""

    model_config = _STRICT

    max_identical_tool_calls: int | None = Field(default=None, ge=1)
    max_cycle_repeats: int | None = Field(default=None, ge=1)
    max_cycle_length: int = Field(default=4, ge=2, le=16)
    max_repeated_prompts: int | None = Field(default=None, ge=1)


_Billing = Literal["billed", "absorbed"]


class UndeliveredBillingModel(BaseModel):
    """A tier's billing of undelivered engine work per cause (see
    :attr:`~kvmeter.serving.tenancy.tiers.TierPolicy.undelivered_billing`): ``billed`` or
    ``absorbed``; a cause not given keeps the tier's value, an unknown cause is refused."""

    model_config = _STRICT

    client_abandoned: _Billing | None = None
    server_failure: _Billing | None = None
    shutdown: _Billing | None = None
    deadline: _Billing | None = None

    def given(self) -> dict[str, str]:
        """The causes this config sets, cause → ``billed`` / ``absorbed``."""
        return {c: getattr(self, c) for c in UNDELIVERED_CAUSES if getattr(self, c) is not None}


assert tuple(UndeliveredBillingModel.model_fields) == UNDELIVERED_CAUSES


def _check_levels(value: Mapping[str, Any]) -> Mapping[str, Any]:
    for level in value:
        if level not in NODE_LEVELS:
            raise ValueError(f"unknown level {level!r}; expected one of {', '.join(NODE_LEVELS)}")
    return value


class TierModel(BaseModel):
    """A tier's settings: every field of :class:`~kvmeter.serving.tenancy.tiers.TierPolicy`.

    For a built-in tier each field given overrides the built-in value (``limits`` and
    ``run_budget`` field by field); a new tier starts from the :class:`TierPolicy` defaults. An
    explicit ``null`` is allowed only where the policy allows ``None`` (an SLO, ``max_queue_wait_s``,
    a pause/shed level: "none"). The value rules are :func:`~kvmeter.serving.tenancy.tiers.
    tier_field_problem`'s, reported under the field's path (``tiers.free.weight: ...``).
    """

    model_config = _STRICT

    weight: float | None = None
    priority: int | None = None
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None
    deadline_slo_factor: float | None = None
    max_queue_wait_s: float | None = None
    pause_at: int | None = None
    shed_new_at: int | None = None
    shed_queued_at: int | None = None
    limits: dict[str, LimitsModel] = Field(default_factory=dict)
    run_budget: RunBudgetModel | None = None
    loop_stops: LoopStopsModel | None = None
    undelivered_billing: UndeliveredBillingModel | None = None

    @field_validator(*TIER_FIELDS, mode="before")
    @classmethod
    def _no_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML's true/false are not 1/0 here
            raise ValueError("must be a number, not a boolean")
        return v

    @field_validator(*TIER_FIELDS)
    @classmethod
    def _rule(cls, v: Any, info: ValidationInfo) -> Any:
        problem = tier_field_problem(str(info.field_name), v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("limits")
    @classmethod
    def _levels(cls, v: dict[str, LimitsModel]) -> dict[str, LimitsModel]:
        return dict(_check_levels(v))

    def fields_set(self) -> dict[str, Any]:
        """The policy fields this config sets explicitly (``limits``/``run_budget`` excluded)."""
        return {name: getattr(self, name) for name in TIER_FIELDS if name in self.model_fields_set}


class _Node(BaseModel):
    model_config = _STRICT

    tier: str | None = None
    limits: LimitsModel | None = None
    run_budget: RunBudgetModel | None = None
    agent_run_limits: LimitsModel | None = None
    tool_policy: ToolPolicyModel | None = None
    approvers: list[str] = Field(default_factory=list)
    description: str = ""


class ApiKeyModel(_Node):
    """An API key: exactly one of ``key_sha256`` (hex SHA-256 of the secret, the normal form) or
    ``key`` (the plain secret — a development convenience, hashed at load). ``admin`` keys may
    read every tenant's usage."""

    key_sha256: str | None = None
    key: SecretStr | None = None
    admin: bool = False

    @field_validator("key_sha256")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = v.strip().lower()
        if not _SHA256_RE.match(v):
            raise ValueError("must be 64 hexadecimal characters (the SHA-256 of the key)")
        return v

    @field_validator("key")
    @classmethod
    def _plain(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 8:
            raise ValueError("a plain key must be at least 8 characters")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> "ApiKeyModel":
        if (self.key_sha256 is None) == (self.key is None):
            raise ValueError("give exactly one of key_sha256 or key")
        return self

    def digest(self) -> str:
        """Hex SHA-256 of the key (hashing the plain form on the fly)."""
        if self.key_sha256 is not None:
            return self.key_sha256
        assert self.key is not None
        return hashlib.sha256(self.key.get_secret_value().encode("utf-8")).hexdigest()


class ProjectModel(_Node):
    """A project and its API keys (id → key)."""

    api_keys: dict[str, ApiKeyModel] = Field(default_factory=dict)


class WorkspaceModel(_Node):
    """A workspace and its projects (id → project)."""

    projects: dict[str, ProjectModel] = Field(default_factory=dict)


class OrgModel(_Node):
    """An organisation (the billed tenant) and its workspaces (id → workspace).

    ``billing_timezone``: the IANA zone of the tenant's billing calendar (default ``UTC``): its
    invoice periods, ``spend_per_day`` / ``spend_per_month`` windows and read-API periods are
    local days and months there (:mod:`kvmeter.billing_calendar`)."""

    billing_timezone: str = "UTC"
    workspaces: dict[str, WorkspaceModel] = Field(default_factory=dict)

    @field_validator("billing_timezone")
    @classmethod
    def _zone(cls, v: str) -> str:
        problem = check_zone(v)
        if problem is not None:
            raise ValueError(problem)
        return v


class GlobalModel(BaseModel):
    """Platform-wide limits (shared by every tenant)."""

    model_config = _STRICT

    limits: LimitsModel | None = None


class TenancyConfig(BaseModel):
    """The whole file."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True,
                              populate_by_name=True)

    version: int = Field(default=1, ge=1, le=1)
    default_tier: str = "free"
    global_: GlobalModel = Field(default_factory=GlobalModel, alias="global")
    tiers: dict[str, TierModel] = Field(default_factory=dict)
    orgs: dict[str, OrgModel] = Field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# YAML with exact decimals and no silent duplicate keys


class _Loader(yaml.SafeLoader):
    pass


def _decimal_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node).replace("_", "")
    try:
        return Decimal(text)
    except ArithmeticError:
        return loader.construct_yaml_float(node)  # .inf / .nan keep YAML's meaning


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError([(str(key), f"duplicate key at line {key_node.start_mark.line + 1}")])
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:float", _decimal_float)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _path(loc: tuple[Any, ...]) -> str:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


def _semantic_problems(cfg: TenancyConfig) -> list[tuple[str, str]]:
    """Cross-field checks pydantic cannot express per field."""
    problems: list[tuple[str, str]] = []
    tiers = set(DEFAULT_TIERS) | set(cfg.tiers)
    for name in cfg.tiers:
        if not _ID_RE.match(name):
            problems.append((f"tiers.{name}", f"tier name must match {ID_PATTERN}"))
    if cfg.default_tier not in tiers:
        problems.append(("default_tier", f"unknown tier {cfg.default_tier!r}; known: {', '.join(sorted(tiers))}"))

    digests: dict[str, str] = {}
    key_ids: dict[str, str] = {}
    key_orgs: dict[str, str] = {kid: oid for oid, org in cfg.orgs.items() for ws in org.workspaces.values()
                                for proj in ws.projects.values() for kid in proj.api_keys}

    def node(path: str, ident: str, n: _Node, tenant_id: str = "") -> None:
        if not _ID_RE.match(ident):
            problems.append((path, f"id must match {ID_PATTERN}"))
        if n.tier is not None and n.tier not in tiers:
            problems.append((f"{path}.tier", f"unknown tier {n.tier!r}; known: {', '.join(sorted(tiers))}"))
        if tenant_id and n.tool_policy is not None and n.tool_policy.default_risk is not None:
            problems.append((f"{path}.tool_policy.default_risk",
                             "default_risk is the org's: set it on the org's tool_policy"))
        for i, approver in enumerate(n.approvers):
            owner = key_orgs.get(approver)
            if owner is None:
                problems.append((f"{path}.approvers[{i}]", f"no API key {approver!r} is configured"))
            elif owner != (tenant_id or ident):
                problems.append((f"{path}.approvers[{i}]",
                                 f"API key {approver!r} belongs to another org; approvers must be its own"))

    for oid, org in cfg.orgs.items():
        op = f"orgs.{oid}"
        node(op, oid, org)
        for wid, ws in org.workspaces.items():
            wp = f"{op}.workspaces.{wid}"
            node(wp, wid, ws, oid)
            for pid, proj in ws.projects.items():
                pp = f"{wp}.projects.{pid}"
                node(pp, pid, proj, oid)
                for kid, key in proj.api_keys.items():
                    kp = f"{pp}.api_keys.{kid}"
                    node(kp, kid, key, oid)
                    if kid in key_ids:
                        problems.append((kp, f"API key id {kid!r} is already used at {key_ids[kid]}"))
                    else:
                        key_ids[kid] = kp
                    digest = key.digest()
                    if digest in digests:
                        problems.append((kp, f"same key as {digests[digest]}"))
                    else:
                        digests[digest] = kp
    return problems


def parse_config(data: str | bytes | Mapping[str, Any], source: str = "<string>") -> TenancyConfig:
    """Validate a config given as YAML text or an already-parsed mapping.

    Returns:
        The validated :class:`TenancyConfig`.
    Raises:
        ConfigError: naming every bad field path (YAML syntax errors name the line).
    """
    if isinstance(data, (str, bytes)):
        try:
            raw = yaml.load(data, Loader=_Loader)  # noqa: S506 — _Loader is a SafeLoader
        except ConfigError as e:
            raise ConfigError(e.problems, source) from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
            raise ConfigError([("", f"YAML syntax error at {where}: {getattr(e, 'problem', e)}")],
                              source) from None
    else:
        raw = data
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError([("", f"top level must be a mapping, got {type(raw).__name__}")], source)
    try:
        cfg = TenancyConfig.model_validate(raw)
    except ValidationError as e:
        problems = [(_path(err["loc"]), err["msg"])
                    for err in e.errors(include_input=False, include_url=False, include_context=False)]
        raise ConfigError(problems, source) from None
    problems = _semantic_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_config(path: str | Path) -> TenancyConfig:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: unreadable file or invalid content (the message names the file and fields).
    """
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as e:
        raise ConfigError([("", f"cannot read file: {e.strerror}")], str(p)) from None
    return parse_config(text, source=str(p))
