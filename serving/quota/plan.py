"""Compile a key's chain of limits into the list of counters one reservation touches.

A :class:`QuotaPlan` is built once per API key per config version and cached. It holds one
:class:`PlanItem` per (level, limited dimension) — e.g. 5 levels × 7 counted dimensions = 35 items —
plus the agent-run items (used when the call carries a run id). Per request only two small lists
change: the concrete store keys (spend keys carry the local day / month of the key's billing time
zone — its org's ``billing_timezone``, UTC for the ``global`` level; run keys carry the run id) and
the amounts. A spend day is the zone's local day (:mod:`kvmeter.billing_calendar`): 23 or 25 hours
on a DST change.

Store key layout (``prefix`` is the store's namespace, ``kvq:`` by default; ``{org}`` is the
org id in braces, a Redis Cluster hash tag)::

    {prefix}{level code}:{{org}}[/{rest of the node path}]:{dimension code}[:{period}]
    kvq:o:{acme}:rpm   kvq:k:{acme}/research/chatbot/key-1:otpm   kvq:o:{acme}:sd:2024-05-17
    kvq:r:{acme}/RUN-ID:mc                                       (agent run RUN-ID of org acme)
    kvq:g:{_global}:rpm                                          (the global level)

Redis Cluster hashes only the part between the first ``{`` and the next ``}``, so every key of one
org (its workspaces, projects, keys and agent runs) lands in one slot and the org's part of a
reservation is one Lua script on one node. The global level has its own tag, ``_global`` (no org
id can start with ``_``), so a config with global limits touches two slots (see
:mod:`.redis_store`). Ids cannot contain ``:``, ``{`` or ``}`` (config validation), the prefix
may not contain braces (:func:`build_plan` refuses one), and a run id comes last, so keys never
collide and the first brace pair is always the org's.

Before this layout (kvmeter ≤ 3 Dec 2026) keys had no braces (``kvq:o:acme:rpm``); see
:mod:`.key_migration` for moving existing keys.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from datetime import date

from kvmeter.billing_calendar import UTC, day_bounds, local_date, month_bounds

from kvmeter.serving.quota.money import to_units
from kvmeter.serving.tenancy.directory import KeyEntry
from kvmeter.serving.tenancy.limits import Limits

__all__ = [
    "PlanItem",
    "QuotaPlan",
    "build_plan",
    "RATE",
    "COUNTER",
    "DEADLINE",
    "SRC_REQUEST",
    "SRC_INPUT",
    "SRC_OUTPUT",
    "SRC_KV",
    "SRC_COST",
    "SRC_ZERO",
    "SRC_RETRY",
    "SETTLE_ADJUST",
    "SETTLE_RELEASE",
    "SETTLE_KEEP",
    "LEVEL_CODES",
    "RUN_TTL_S",
    "GLOBAL_TAG",
    "tagged_node_id",
]

#: Item kinds: GCRA rate, bounded counter (gauge or period budget), first-seen deadline.
RATE, COUNTER, DEADLINE = "r", "c", "d"

#: Amount sources: index into the per-request amount vector built by the gate.
SRC_REQUEST, SRC_INPUT, SRC_OUTPUT, SRC_KV, SRC_COST, SRC_ZERO, SRC_RETRY = range(7)

#: What reconciliation does with an item: move it to the actual amount, give all of it back, or
#: keep what was reserved (attempt counters).
SETTLE_ADJUST, SETTLE_RELEASE, SETTLE_KEEP = "adjust", "release", "keep"

LEVEL_CODES = {"global": "g", "org": "o", "workspace": "w", "project": "p", "api_key": "k",
               "agent_run": "r"}

#: Seconds an agent run's counters live after the run's first call (at least max_runtime_s + 1 h).
RUN_TTL_S = 7 * 86_400

_DAY_TTL_S = 2 * 86_400          # a day's spend key outlives the day (late reconciles land)
_MONTH_TTL_S = 62 * 86_400

# dimension → (key code, kind, amount source, settle rule, period)
_DIMS: dict[str, tuple[str, str, int, str, str]] = {
    "requests_per_minute": ("rpm", RATE, SRC_REQUEST, SETTLE_ADJUST, ""),
    "input_tokens_per_minute": ("itpm", RATE, SRC_INPUT, SETTLE_ADJUST, ""),
    "output_tokens_per_minute": ("otpm", RATE, SRC_OUTPUT, SETTLE_ADJUST, ""),
    "concurrent_requests": ("conc", COUNTER, SRC_REQUEST, SETTLE_RELEASE, ""),
    "active_kv_tokens": ("kv", COUNTER, SRC_KV, SETTLE_RELEASE, ""),
    "spend_per_day": ("sd", COUNTER, SRC_COST, SETTLE_ADJUST, "day"),
    "spend_per_month": ("sm", COUNTER, SRC_COST, SETTLE_ADJUST, "month"),
}


_DESC = struct.Struct("<cBcddd")

#: Counter limits at or above 2**53 cannot be compared exactly as Lua doubles; the Redis script
#: compares those as decimal strings against a headroom computed exactly in Python.
EXACT_DOUBLE_LIMIT = 2 ** 53


@dataclass(frozen=True, slots=True)
class PlanItem:
    """One counter of a reservation.

    Attributes:
        kind: :data:`RATE`, :data:`COUNTER` or :data:`DEADLINE`.
        level, dimension: what a rejection names (``api_key``, ``output_tokens_per_minute``).
        source: which request amount it counts (``SRC_*``).
        settle: reconciliation rule (``SETTLE_*``).
        limit: units per period (rate), maximum value (counter; money in nano-units), 0 (deadline).
        period_s: rate window (60 s) or, for a deadline, the maximum age in seconds.
        interval_s: GCRA emission interval ``period_s / limit`` (rate only).
        ttl_s: key lifetime in seconds (0 = none): for counters and deadlines counted from the
            key's creation, for rate keys from each write.
        period: ``day`` / ``month`` for spend keys (the key carries the local period), else ``""``.
        timezone: the IANA zone of a spend key's day / month (``UTC`` for ``global``).
        money: the limit is money (nano-units); the rejection is a spend rejection.
        desc: the item as the Redis scripts read it (derived; see redis_store).
        big: counter limit ≥ 2**53 (derived).
    """

    kind: str
    level: str
    dimension: str
    source: int
    settle: str
    limit: int
    period_s: float = 0.0
    interval_s: float = 0.0
    ttl_s: int = 0
    period: str = ""
    money: bool = False
    timezone: str = UTC
    desc: bytes = field(init=False, default=b"", compare=False, repr=False)
    big: bool = field(init=False, default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # The Redis scripts read each item as struct '<c1Bc1ddd' (27 bytes): kind, source, settle
        # rule (a/r/k), then three doubles — rate: interval s, tolerance s, key TTL ms;
        # counter: limit (exact below 2**53), TTL s from creation, big flag; deadline: max age s,
        # TTL s, 0.
        if self.kind == RATE:
            x, y, z = self.interval_s, float(self.period_s), float(self.ttl_s * 1000)
        elif self.kind == COUNTER:
            big = self.limit >= EXACT_DOUBLE_LIMIT
            object.__setattr__(self, "big", big)
            x, y, z = float(min(self.limit, EXACT_DOUBLE_LIMIT)), float(self.ttl_s), float(big)
        else:
            x, y, z = float(self.period_s), float(self.ttl_s), 0.0
        desc = _DESC.pack(self.kind.encode(), self.source, self.settle[0].encode(), x, y, z)
        object.__setattr__(self, "desc", desc)

    def settle_delta(self, reserved: "tuple[int, ...] | list[int]", actual: "tuple[int, ...] | list[int]") -> int:
        """Signed units reconciliation moves this item by (see ``SETTLE_*``)."""
        if self.settle == SETTLE_ADJUST:
            return actual[self.source] - reserved[self.source]
        if self.settle == SETTLE_RELEASE:
            return -reserved[self.source]
        return 0


def _rate_item(level: str, dimension: str, source: int, limit: int, period_s: float = 60.0,
               ttl_s: int = 0) -> PlanItem:
    # limit 0: only zero amounts pass the gate's size check; any positive interval keeps 0·T = 0.
    interval = period_s / limit if limit > 0 else period_s
    return PlanItem(RATE, level, dimension, source, SETTLE_ADJUST, limit, period_s=period_s,
                    interval_s=interval, ttl_s=ttl_s)


def _counter_item(level: str, dimension: str, source: int, settle: str, limit: int, ttl_s: int = 0,
                  period: str = "", money: bool = False, timezone: str = UTC) -> PlanItem:
    return PlanItem(COUNTER, level, dimension, source, settle, limit, ttl_s=ttl_s, period=period,
                    money=money, timezone=timezone)


def _items_for(level: str, limits: Limits, ttl_s: int = 0, timezone: str = UTC) -> list[tuple[str, PlanItem]]:
    """(key code, item) for each limited counted dimension of a node (``ttl_s``: for run keys)."""
    out: list[tuple[str, PlanItem]] = []
    for dim, (code, kind, source, settle, period) in _DIMS.items():
        value = getattr(limits, dim)
        if value is None:
            continue
        if kind == RATE:
            out.append((code, _rate_item(level, dim, source, int(value), ttl_s=ttl_s)))
        elif period:
            out.append((code, _counter_item(level, dim, source, settle, to_units(value),
                                            _DAY_TTL_S if period == "day" else _MONTH_TTL_S,
                                            period, money=True, timezone=timezone)))
        else:
            out.append((code, _counter_item(level, dim, source, settle, int(value), ttl_s)))
    return out


@dataclass(slots=True)
class QuotaPlan:
    """The compiled counters of one API key (see module docstring).

    Attributes:
        entry: the directory entry it was built from.
        items: node items (global → api_key).
        run_items: agent-run items (7 dimensions of ``run_limits`` + the run budget).
        max_context_tokens: tightest ``max_context_tokens`` over the chain and run limits, or None.
        max_context_level: the level that sets it (outermost on ties).
        run_max_context_tokens: ``max_context_tokens`` of the run limits alone (None if unset).
        min_limit: per amount source, the smallest limit of any item counting it (for the cheap
            "can never fit" check), ``None`` if nothing counts it.
    """

    entry: KeyEntry
    items: tuple[PlanItem, ...]
    run_items: tuple[PlanItem, ...]
    max_context_tokens: int | None
    max_context_level: str
    run_max_context_tokens: int | None
    min_limit: tuple[int | None, ...]
    run_min_limit: tuple[int | None, ...]
    _key_parts: tuple[tuple[str, str, str], ...] = ()   # (key without period, period, zone) per item
    _run_codes: tuple[bytes, ...] = ()
    _run_prefix: str = ""
    _cache_window: tuple[float, float] = (0.0, 0.0)     # [from, until) epoch s the cached keys hold for
    _cache_keys: list[bytes] = field(default_factory=list)

    def keys(self, wall_s: float) -> list[bytes]:
        """Concrete store keys (UTF-8) of :attr:`items` at wall-clock ``wall_s``: a spend key
        carries the local day (``YYYY-MM-DD``) or month (``YYYY-MM``) of its item's zone."""
        lo, hi = self._cache_window
        if not lo <= wall_s < hi:
            keys: list[bytes] = []
            lo, hi = float("-inf"), float("inf")
            for base, period, tz in self._key_parts:
                if not period:
                    keys.append(base.encode())
                    continue
                d = local_date(wall_s, tz)
                start, end = day_bounds(d, tz)
                lo, hi = max(lo, start.timestamp()), min(hi, end.timestamp())
                label = d.isoformat() if period == "day" else d.isoformat()[:7]
                keys.append(f"{base}:{label}".encode())
            self._cache_keys, self._cache_window = keys, (lo, hi)
        return self._cache_keys

    def run_keys(self, run_id: str) -> list[bytes]:
        """Concrete store keys (UTF-8) of :attr:`run_items` for ``run_id``."""
        head = (self._run_prefix + run_id + ":").encode("utf-8", "surrogatepass")
        return [head + code for code in self._run_codes]

    def tool_calls_key(self, run_id: str) -> bytes:
        """The store key (UTF-8) counting ``run_id``'s reported tool calls."""
        return (self._run_prefix + run_id + ":tc").encode("utf-8", "surrogatepass")


#: Hash tag of the global level's keys (an org id cannot start with ``_``).
GLOBAL_TAG = "_global"


def tagged_node_id(node_id: str) -> str:
    """A node path with its org in braces, the org's Redis hash tag: ``acme/ws`` → ``{acme}/ws``;
    the global node (``""``) → ``{_global}``."""
    org, sep, rest = node_id.partition("/")
    return "{" + (org or GLOBAL_TAG) + "}" + sep + rest


def period_end_s(wall_s: float, period: str, timezone: str = UTC) -> float:
    """Seconds from ``wall_s`` to the end of its local ``day`` or ``month`` in ``timezone`` (> 0)."""
    d: date = local_date(wall_s, timezone)
    end = day_bounds(d, timezone)[1] if period == "day" else month_bounds(d.year, d.month, timezone)[1]
    return end.timestamp() - wall_s


def _min_limits(items: tuple[PlanItem, ...]) -> tuple[int | None, ...]:
    mins: list[int | None] = [None] * 7
    for it in items:
        if it.kind == DEADLINE:
            continue
        cur = mins[it.source]
        mins[it.source] = it.limit if cur is None else min(cur, it.limit)
    return tuple(mins)


def build_plan(entry: KeyEntry, prefix: str) -> QuotaPlan:
    """Compile ``entry``'s chain into a :class:`QuotaPlan` whose keys start with ``prefix``."""
    items: list[PlanItem] = []
    key_parts: list[tuple[str, str, str]] = []
    ctx: int | None = None
    ctx_level = ""
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"a quota key prefix cannot contain braces (Redis hash tags), got {prefix!r}")
    for node in entry.chain:
        base = f"{prefix}{LEVEL_CODES[node.level]}:{tagged_node_id(node.node_id)}:"
        tz = UTC if node.level == "global" else entry.billing_timezone
        for code, item in _items_for(node.level, node.limits, timezone=tz):
            items.append(item)
            key_parts.append((base + code, item.period, item.timezone))
        c = node.limits.max_context_tokens
        if c is not None and (ctx is None or c < ctx):
            ctx, ctx_level = c, node.level

    b = entry.run_budget
    run_ttl = max(RUN_TTL_S, int(b.max_runtime_s or 0) + 3_600)
    run_items: list[PlanItem] = []
    run_codes: list[str] = []
    for code, item in _items_for("agent_run", entry.run_limits, run_ttl):
        if item.period:  # per-run "spend per day/month" has no meaning beyond max_cost: skip
            continue
        run_items.append(item)
        run_codes.append(code)
    lvl = "agent_run"
    if b.max_model_calls is not None:
        run_items.append(_counter_item(lvl, "model_calls", SRC_REQUEST, SETTLE_KEEP, b.max_model_calls, run_ttl))
        run_codes.append("mc")
    if b.max_tool_calls is not None:
        run_items.append(_counter_item(lvl, "tool_calls", SRC_ZERO, SETTLE_KEEP, b.max_tool_calls, run_ttl))
        run_codes.append("tc")
    if b.max_retries is not None:
        run_items.append(_counter_item(lvl, "retries", SRC_RETRY, SETTLE_KEEP, b.max_retries, run_ttl))
        run_codes.append("rt")
    if b.max_parallel_branches is not None:
        run_items.append(_counter_item(lvl, "parallel_branches", SRC_REQUEST, SETTLE_RELEASE,
                                       b.max_parallel_branches, run_ttl))
        run_codes.append("pb")
    if b.max_cost is not None:
        run_items.append(_counter_item(lvl, "cost", SRC_COST, SETTLE_ADJUST, to_units(b.max_cost),
                                       run_ttl, money=True))
        run_codes.append("cost")
    if b.max_runtime_s is not None:
        run_items.append(PlanItem(DEADLINE, lvl, "runtime_seconds", SRC_ZERO, SETTLE_KEEP, 0,
                                  period_s=float(b.max_runtime_s), ttl_s=run_ttl))
        run_codes.append("start")

    run_ctx = entry.run_limits.max_context_tokens
    items_t, run_t = tuple(items), tuple(run_items)
    return QuotaPlan(
        entry=entry, items=items_t, run_items=run_t, max_context_tokens=ctx,
        max_context_level=ctx_level, run_max_context_tokens=run_ctx,
        min_limit=_min_limits(items_t), run_min_limit=_min_limits(run_t),
        _key_parts=tuple(key_parts), _run_codes=tuple(c.encode() for c in run_codes),
        _run_prefix=f"{prefix}r:{tagged_node_id(entry.principal.tenant_id)}/",
    )
