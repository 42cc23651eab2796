"""Tool policy: which tools a key's agent runs may use, and how risky each one is.

Every node of the principal tree (org → workspace → project → API key) may set a ``tool_policy``
in the tenants config; an agent run gets its key's. The YAML (all fields optional)::

    tool_policy:
      allow: ["search_*", send_email, "deploy_*"]   # names or globs; absent = every tool not blocked
      block: ["shell_*", "*_prod"]                   # names or globs
      risk:                                          # name or glob → read_only | side_effect | high_risk
        "search_*": read_only
        send_email: side_effect
        "deploy_*": high_risk
      default_risk: side_effect     # org only: the class of a tool no level classifies
      approval_ttl_s: 3600          # an approval request (and an approval) is valid this long
      side_effect_window_s: 3600    # a side-effect call repeated within it (same run, tool and
                                    # arguments, no idempotency key) is the same call

The rules, in the order :meth:`ToolPolicy.evaluate` applies them:

1. **Blocked always beats allowed.** A tool matching a ``block`` pattern of *any* level of the
   chain is refused (``tool_blocked``), whatever an ``allow`` list says; a narrower level can add
   blocks but never lift one.
2. **The narrowest level wins** for ``allow``: the allow list of the narrowest level that sets one
   is the one in force (it replaces, not extends, its ancestors'); a tool it does not match is
   refused (``tool_not_allowed``). ``allow: []`` denies every tool by default. No level with an
   allow list: every tool not blocked is allowed.
3. **Risk class**: the narrowest level with a ``risk`` pattern matching the tool decides. Within a
   level an exact name beats a glob, and among matching globs the riskiest class wins
   (``high_risk`` > ``side_effect`` > ``read_only``: a doubt costs an approval, not an outage). A
   tool no level classifies gets the org's ``default_risk`` (built-in default ``side_effect``:
   recognised as a repeat, never silently retried twice, no approval needed).
4. ``approval_ttl_s`` and ``side_effect_window_s``: the narrowest level that sets them.

Patterns are shell globs (:mod:`fnmatch`: ``*``, ``?``, ``[seq]``, ``[!seq]``), case-sensitive,
matched against the whole tool name. They are compiled once when the config loads (one
:class:`ToolPolicy` per key, sharing each node's compiled patterns); evaluation costs a dictionary
lookup and at most a few regular-expression matches per level (globs are bucketed by their first
literal character, or their last when they start with a wildcard), and its answers are memoised per
tool name (``bench/agents/RESULTS.md``).

The policy **version** (:attr:`ToolPolicy.version`) is the SHA-256 of the effective policy's
canonical content (the patterns that block, the allow list in force, the risk maps narrowest level
first, the defaults — not the config paths they are written at); an
approval is bound to it, so a config change that touches the key's tool policy voids approvals
given under the old one. Approvers (``approvers:`` on a node) are not part of it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Mapping, Sequence, TypedDict, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvmeter.stats.agents import RISK_CLASSES

__all__ = [
    "RISK_CLASSES", "RiskClass", "TOOL_NAME_PATTERN", "TOOL_PATTERN_PATTERN", "DEFAULT_RISK",
    "DEFAULT_APPROVAL_TTL_S", "DEFAULT_SIDE_EFFECT_WINDOW_S", "ToolPolicyModel", "ToolVerdict",
    "ToolPolicy", "NodeToolRules", "NodePolicyData", "compile_node", "compile_tool_policy", "ALLOW_ALL",
    "valid_tool_name",
]

#: Risk classes, least risky first (defined with the stats that label them: kvmeter.stats.agents).
RiskClass = Literal["read_only", "side_effect", "high_risk"]

#: A tool name as kvmeter accepts it: OpenAI function names (``^[a-zA-Z0-9_-]{1,64}$``) plus the
#: ``.``, ``:`` and ``/`` MCP servers put in theirs, up to 128 characters.
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:/-]{1,128}$"
#: A tool pattern: a tool name's characters plus the glob characters ``* ? [ ] !``.
TOOL_PATTERN_PATTERN = r"^[A-Za-z0-9_.:/*?\[\]!-]{1,128}$"
_NAME_RE = re.compile(TOOL_NAME_PATTERN)
_PATTERN_RE = re.compile(TOOL_PATTERN_PATTERN)
_GLOB_CHARS = frozenset("*?[")

#: Class of a tool no level classifies, when the org sets no ``default_risk``.
DEFAULT_RISK: RiskClass = "side_effect"
#: Seconds an approval request, and the approval given to it, stays valid by default.
DEFAULT_APPROVAL_TTL_S = 3_600.0
#: Seconds within which a repeated side-effect call without an idempotency key is the same call.
DEFAULT_SIDE_EFFECT_WINDOW_S = 3_600.0

_MEMO_ENTRIES = 4_096


def valid_tool_name(name: object) -> bool:
    """True if ``name`` is a string matching :data:`TOOL_NAME_PATTERN`."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def _check_pattern(p: str) -> str:
    if not isinstance(p, str) or not _PATTERN_RE.match(p):
        raise ValueError(f"tool pattern {str(p)[:140]!r} must match {TOOL_PATTERN_PATTERN} "
                         "(a tool name, or a glob with * ? [seq] [!seq])")
    return p


class ToolPolicyModel(BaseModel):
    """``tool_policy`` of one node of the tenants config (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    allow: list[str] | None = None
    block: list[str] = Field(default_factory=list)
    risk: dict[str, RiskClass] = Field(default_factory=dict)
    default_risk: RiskClass | None = None
    approval_ttl_s: float | None = Field(default=None, gt=0, le=30 * 86_400)
    side_effect_window_s: float | None = Field(default=None, gt=0, le=7 * 86_400)

    @field_validator("allow", "block")
    @classmethod
    def _patterns(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            for p in v:
                _check_pattern(p)
        return v

    @field_validator("risk")
    @classmethod
    def _risk_keys(cls, v: dict[str, str]) -> dict[str, str]:
        for p in v:
            _check_pattern(p)
        return v


@dataclass(frozen=True, slots=True)
class ToolVerdict:
    """What a key's tool policy says about one tool.

    Attributes:
        tool: the tool name.
        allowed: False when a block pattern or the allow list refuses it.
        code: ``""`` (allowed), ``tool_blocked`` or ``tool_not_allowed``.
        rule: for a refusal, the rule that refused it, named by its config path and pattern
            (``orgs.acme.tool_policy.block 'shell_*'``, ``orgs.acme.workspaces.w.tool_policy.allow``).
        risk_class: ``read_only``, ``side_effect`` or ``high_risk``.
        risk_rule: where the class comes from (``orgs.acme.tool_policy.risk 'deploy_*'``,
            ``orgs.acme.tool_policy.default_risk`` or ``built-in default``).
    """

    tool: str
    allowed: bool
    code: str
    rule: str
    risk_class: str
    risk_rule: str

    @property
    def message(self) -> str:
        """One sentence for the client: which tool, refused by which rule."""
        if self.allowed:
            return f"tool {self.tool!r} is allowed ({self.risk_class})"
        if self.code == "tool_blocked":
            return f"tool {self.tool!r} is blocked by {self.rule}"
        return f"tool {self.tool!r} is not allowed: it matches no pattern of {self.rule}"


class _PatternSet:
    """Names and globs compiled for matching: exact names in a dict; globs as one regular
    expression per first literal character, those starting with a wildcard per *last* literal
    character, and one for globs with wildcards at both ends — so a name is tried only against the
    globs that could match it."""

    __slots__ = ("exact", "by_first", "by_last", "wild", "labels")

    def __init__(self, patterns: Iterable[str]) -> None:
        self.exact: dict[str, str] = {}
        first: dict[str, list[str]] = {}
        last: dict[str, list[str]] = {}
        wild: list[str] = []
        for p in dict.fromkeys(patterns):
            if not _GLOB_CHARS & set(p):
                self.exact[p] = p
            elif p[0] not in _GLOB_CHARS:
                first.setdefault(p[0], []).append(p)
            elif p[-1] not in _GLOB_CHARS and p[-1] != "]":
                last.setdefault(p[-1], []).append(p)
            else:
                wild.append(p)
        self.labels: list[str] = []
        self.by_first = {c: self._compile(ps) for c, ps in first.items()}
        self.by_last = {c: self._compile(ps) for c, ps in last.items()}
        self.wild = self._compile(wild) if wild else None

    def _compile(self, patterns: list[str]) -> re.Pattern[str]:
        parts = []
        for p in patterns:
            parts.append(f"(?P<g{len(self.labels)}>{fnmatch.translate(p)})")
            self.labels.append(p)
        return re.compile("|".join(parts))

    def match(self, name: str) -> str | None:
        """The first pattern matching ``name`` (an exact name before any glob), or None."""
        hit = self.exact.get(name)
        if hit is not None or not name:
            return hit
        m = None
        if self.by_first:
            rx = self.by_first.get(name[0])
            if rx is not None:
                m = rx.match(name)
        if m is None and self.by_last:
            rx = self.by_last.get(name[-1])
            if rx is not None:
                m = rx.match(name)
        if m is None and self.wild is not None:
            m = self.wild.match(name)
        if m is None or m.lastgroup is None:  # every alternative is a named group: a match has one
            return None
        return self.labels[int(m.lastgroup[1:])]

    def __bool__(self) -> bool:
        return bool(self.exact) or bool(self.by_first) or bool(self.by_last) or self.wild is not None


class NodePolicyData(TypedDict):
    """One node's ``tool_policy`` as plain data (:attr:`NodeToolRules.canonical`): what it sets,
    sorted, ``None`` where it sets nothing."""

    allow: list[str] | None
    block: list[str]
    risk: Mapping[str, str]
    default_risk: str | None
    approval_ttl_s: float | None
    side_effect_window_s: float | None


@dataclass(frozen=True, slots=True)
class NodeToolRules:
    """One node's ``tool_policy``, compiled (shared by every key below the node).

    Attributes:
        path: the node's config path (``orgs.acme.workspaces.research``).
        block: compiled block patterns.
        allow: compiled allow patterns, or None when the node sets no allow list.
        risk_exact: exact tool name → class.
        risk_globs: per class, riskiest first, the compiled globs of that class.
        default_risk, approval_ttl_s, side_effect_window_s: as set on the node, or None.
        canonical: the node's policy as plain data (hashed into the key's policy version).
    """

    path: str
    block: _PatternSet
    allow: _PatternSet | None
    risk_exact: Mapping[str, str]
    risk_globs: tuple[tuple[str, _PatternSet], ...]
    default_risk: str | None
    approval_ttl_s: float | None
    side_effect_window_s: float | None
    canonical: NodePolicyData

    def risk_of(self, tool: str) -> tuple[str, str] | None:
        """(class, pattern) of the node's rule classifying ``tool``, or None."""
        cls = self.risk_exact.get(tool)
        if cls is not None:
            return cls, tool
        for cls, globs in self.risk_globs:
            hit = globs.match(tool)
            if hit is not None:
                return cls, hit
        return None


def compile_node(path: str, model: ToolPolicyModel | None) -> NodeToolRules:
    """Compile one node's policy (``None``: the node sets none)."""
    m = model or ToolPolicyModel()
    exact = {p: c for p, c in m.risk.items() if not _GLOB_CHARS & set(p)}
    globs = tuple((cls, _PatternSet(p for p, c in m.risk.items() if c == cls and p not in exact))
                  for cls in reversed(RISK_CLASSES))
    canonical: NodePolicyData = {
        "allow": None if m.allow is None else sorted(set(m.allow)), "block": sorted(set(m.block)),
        "risk": dict(sorted(m.risk.items())), "default_risk": m.default_risk,
        "approval_ttl_s": m.approval_ttl_s, "side_effect_window_s": m.side_effect_window_s}
    return NodeToolRules(path=path, block=_PatternSet(m.block),
                         allow=None if m.allow is None else _PatternSet(m.allow), risk_exact=exact,
                         risk_globs=tuple(g for g in globs if g[1]), default_risk=m.default_risk,
                         approval_ttl_s=m.approval_ttl_s, side_effect_window_s=m.side_effect_window_s,
                         canonical=canonical)


@dataclass(frozen=True, slots=True, eq=False)
class ToolPolicy:
    """The effective tool policy of one API key (its chain org → workspace → project → key).

    Attributes:
        levels: the chain's compiled node rules, org first.
        default_risk: the class of an unclassified tool (the org's ``default_risk``).
        approval_ttl_s: seconds an approval request / approval is valid (> 0).
        side_effect_window_s: seconds a side-effect call without an idempotency key is remembered.
        approvers: API key ids that may approve this key's high-risk calls (the union of
            ``approvers`` along the chain; an admin key may always approve).
        version: hex SHA-256 of the effective policy (see the module docstring).
    """

    levels: tuple[NodeToolRules, ...]
    default_risk: str = DEFAULT_RISK
    approval_ttl_s: float = DEFAULT_APPROVAL_TTL_S
    side_effect_window_s: float = DEFAULT_SIDE_EFFECT_WINDOW_S
    approvers: frozenset[str] = frozenset()
    version: str = ""
    _allow: NodeToolRules | None = field(default=None, repr=False)
    _memo: dict[str, ToolVerdict] = field(default_factory=dict, repr=False)
    _blocking: tuple[NodeToolRules, ...] = field(default=(), repr=False)   # levels with blocks
    _classifying: tuple[NodeToolRules, ...] = field(default=(), repr=False)  # with risk rules, narrowest first

    def __post_init__(self) -> None:
        object.__setattr__(self, "_blocking", tuple(lvl for lvl in self.levels if lvl.block))
        object.__setattr__(self, "_classifying", tuple(lvl for lvl in reversed(self.levels)
                                                       if lvl.risk_exact or lvl.risk_globs))

    @property
    def can_withhold(self) -> bool:
        """True when some tool call could be refused or held under this policy: a level blocks
        tools, sets an allow list, or classifies a tool (or every unclassified one) ``high_risk``.
        False for a permissive policy, whose emitted tool calls the gateway passes through as the
        engine's serving layer streams them."""
        if self._blocking or (self._allow is not None and self._allow.allow is not None):
            return True
        if self.default_risk == "high_risk" or any(lvl.default_risk == "high_risk" for lvl in self.levels):
            return True
        for lvl in self.levels:
            if "high_risk" in lvl.risk_exact.values() or any(c == "high_risk" for c, _ in lvl.risk_globs):
                return True
        return False

    def evaluate(self, tool: str) -> ToolVerdict:
        """The verdict on ``tool`` (rules in the module docstring); memoised per name.

        Args:
            tool: a tool name (the caller checks it against :data:`TOOL_NAME_PATTERN`).
        """
        hit = self._memo.get(tool)
        if hit is not None:
            return hit
        verdict = self.evaluate_uncached(tool)
        memo = self._memo
        if len(memo) >= _MEMO_ENTRIES:
            memo.clear()
        memo[tool] = verdict
        return verdict

    def evaluate_uncached(self, tool: str) -> ToolVerdict:
        """:meth:`evaluate` without the memo (what the benchmark measures cold)."""
        risk, risk_rule = self._risk(tool)
        for lvl in self._blocking:
            hit = lvl.block.match(tool)
            if hit is not None:
                return ToolVerdict(tool, False, "tool_blocked", f"{lvl.path}.tool_policy.block {hit!r}",
                                   risk, risk_rule)
        allow = self._allow
        if allow is not None and allow.allow is not None and allow.allow.match(tool) is None:
            return ToolVerdict(tool, False, "tool_not_allowed", f"{allow.path}.tool_policy.allow", risk, risk_rule)
        return ToolVerdict(tool, True, "", "", risk, risk_rule)

    def _risk(self, tool: str) -> tuple[str, str]:
        for lvl in self._classifying:
            found = lvl.risk_of(tool)
            if found is not None:
                return found[0], f"{lvl.path}.tool_policy.risk {found[1]!r}"
        org = self.levels[0] if self.levels else None
        if org is not None and org.default_risk is not None:
            return org.default_risk, f"{org.path}.tool_policy.default_risk"
        return self.default_risk, "built-in default"

    def can_approve(self, api_key_id: str, admin: bool) -> bool:
        """True if a key may approve this policy's key's high-risk calls: an admin key, or a key
        listed in :attr:`approvers` (the caller refuses self-approval)."""
        return admin or api_key_id in self.approvers


_T = TypeVar("_T")


def _narrowest(levels: Sequence[NodeToolRules], value_of: Callable[[NodeToolRules], _T | None]) -> _T | None:
    """The value the narrowest level that sets one sets (None: no level does)."""
    for lvl in reversed(levels):
        value = value_of(lvl)
        if value is not None:
            return value
    return None


def compile_tool_policy(levels: Sequence[NodeToolRules], approvers: Iterable[str] = ()) -> ToolPolicy:
    """The effective policy of a key from its chain's compiled nodes (org first)."""
    levels = tuple(levels)
    allow = next((lvl for lvl in reversed(levels) if lvl.allow is not None), None)
    default_risk = levels[0].default_risk if levels and levels[0].default_risk else DEFAULT_RISK
    ttl = _narrowest(levels, lambda lvl: lvl.approval_ttl_s) or DEFAULT_APPROVAL_TTL_S
    window = _narrowest(levels, lambda lvl: lvl.side_effect_window_s) or DEFAULT_SIDE_EFFECT_WINDOW_S
    # what the policy decides, not where each rule is written: the union of blocks, the allow list
    # in force, the risk maps of the levels that set one (narrowest first), the defaults
    content = {"block": sorted({p for lvl in levels for p in lvl.canonical["block"]}),
               "allow": allow.canonical["allow"] if allow is not None else None,
               "risk": [lvl.canonical["risk"] for lvl in reversed(levels) if lvl.canonical["risk"]],
               "default_risk": default_risk, "approval_ttl_s": float(ttl),
               "side_effect_window_s": float(window)}
    version = hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return ToolPolicy(levels=levels, default_risk=default_risk, approval_ttl_s=float(ttl),
                      side_effect_window_s=float(window), approvers=frozenset(approvers),
                      version=version, _allow=allow)


#: The policy of a key whose chain sets none: every tool allowed, unknown tools ``side_effect``.
ALLOW_ALL = compile_tool_policy(())
