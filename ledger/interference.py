"""Interference: when a tenant's request misses its tier's TTFT (or ITL) objective, whose engine
work filled the steps it waited through — issue 14, "who is hurting whom".

Inputs are two ledger tables: ``usage_events`` (read ``FINAL``: each attempt's arrival, TTFT,
mean ITL, finish) and ``engine_steps`` (migration 0007: per engine step and tenant, the scheduled
prefill and decode tokens, the KV tokens held, the ids of requests in prefill). The objectives are
the tiers' (:class:`~kvmeter.serving.tenancy.TierPolicy` ``ttft_slo_s`` / ``itl_slo_s``, passed as
:data:`~kvmeter.ledger.window_queries.TierSlo` triples by the caller, who holds the tenancy config).

Definitions (every number is a sum of ``engine_steps`` rows, so it can be recomputed by hand):

* a **missed request** of tenant T in ``[start, end)`` is a usage row of T whose ``finish_ts`` lies
  in the window (the ledger's period rule), that has a TTFT, and whose tier's objective is set and
  exceeded: ``ttft_s > ttft_slo_s`` (objective ``ttft``), or ``itl_mean_s > itl_slo_s``
  (objective ``itl``; the request has a mean ITL);
* its **engine** is the (``replica``, ``engine_idx``, ``model``) of the step rows between its
  arrival and finish naming its request id in ``prefill_request_ids`` (every request that produced
  a token was in prefill at least one step); a missed request with no such row (its steps not recorded) is counted in
  ``missed_requests`` but not in ``attributed_requests`` and adds no work;
* its **window** is the steps of its engine with ``ts`` in ``[arrival_ts, arrival_ts + ttft_s]``
  (``ttft``: from arrival to the first token) or ``[arrival_ts + ttft_s, finish_ts]`` (``itl``:
  between its first and last token), bounds included, on microseconds;
* for each tenant U with rows in the windows of T's missed requests: ``prefill_tokens`` = Σ over
  those requests r, over the steps s in r's window, of U's scheduled prefill tokens in s; likewise
  ``decode_tokens``; ``kv_token_seconds`` = Σ ``kv_tokens × duration_s`` (the KV U held while T
  waited, integrated over the steps' spans); ``steps`` = the number of those (r, s) rows of U. A
  step inside the windows of two missed requests counts once for each;
* U's **share** of each quantity = its sum ÷ the sum over every tenant of T's windows (T itself
  included: its own other requests, and the missed requests' own prefill chunks, are work in the
  same steps). ``None`` when the total is 0.

Anonymity is the caller's: :func:`anonymize` replaces every neighbour but the reader's own tenant
with ``tenant-1``, ``tenant-2``, ... in rank order (the read API and the dashboards apply it for a
tenant key; an admin sees names).

**Cluster mode** (``LedgerConfig.cluster``: ``usage_events`` and ``engine_steps`` are Distributed
tables, sharded by tenant and by replica, so a missed request and the steps it waited through
usually live on different shards): every ``IN`` and ``JOIN`` whose right side reads a ledger table
is written ``GLOBAL IN`` / ``GLOBAL JOIN`` (:func:`interference_sql`), so the initiator computes
the right side once, over every shard, and sends it to the shards as a temporary table. The one
that must be: the ``engines`` step's ``rid IN (SELECT request_id FROM victims)`` — its ``FROM`` is
the Distributed ``engine_steps``, so a plain ``IN`` would run ``victims`` on each shard over a
Distributed table, which ClickHouse refuses under its default ``distributed_product_mode = deny``
("Double-distributed IN/JOIN subqueries is denied") and which, allowed, would repeat the read per
shard. The others (the two JOINs and the ``attributed_requests`` ``IN``, whose left sides are
subqueries the initiator runs itself) are ``GLOBAL`` too, so that no level of the query depends on
where the planner places it; on a left side that is not Distributed, ``GLOBAL`` changes nothing.
The scalar subqueries (``min``/``max`` bounds) are computed once on the initiator and sent as
constants. Single node (the default) renders the query without ``GLOBAL``, as before.
What was run: the cluster rendering on chDB over local tables (where ``GLOBAL`` is accepted and
ignored), giving the same rows as the single-node query (``tests/ledger/test_interference.py``).
What was not: the query on a real multi-shard cluster (no ClickHouse server is installable on the
project machines; ``migrations/README.md``).

Cost: each window is cut into the whole seconds it touches and joined to its engine's step rows of
those seconds (equal model, replica, engine and second), then filtered to the window's bounds, so
a step row meets only the windows around it (each step counted once per window: it lies in one
second). 100,000 step rows (20,000 steps × 5 tenants) and 200 missed requests with 3 s windows:
0.19 s, against 6.0 s joining each window to all its engine's steps (bench/ledger/RESULTS.md,
"Interference").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterable, Protocol, Sequence

from clickhouse_connect.driver.client import Client

from .connection import ClientHolder
from .window_queries import _END, _START, TierSlo, WindowQueries, _tenant_filter

__all__ = ["InterferenceQueries", "OBJECTIVES", "anonymize", "interference_sql", "INTERFERENCE_COLUMNS", "Span"]

#: The objectives a request can miss, and the window each measures (module docstring).
OBJECTIVES = ("ttft", "itl")
#: Columns of one interference row.
INTERFERENCE_COLUMNS = (
    "tenant_id", "tier", "objective", "missed_requests", "attributed_requests", "rank", "neighbour",
    "is_self", "steps", "prefill_tokens", "decode_tokens", "kv_token_seconds", "prefill_share",
    "decode_share", "kv_share",
)

_WINDOW = {
    # objective: (miss condition, window start µs, window end µs)
    "ttft": ("ttft_s > ttft_slo",
             "toUnixTimestamp64Micro(arrival_ts)",
             "toUnixTimestamp64Micro(arrival_ts) + toInt64(round(ttft_s * 1000000))"),
    "itl": ("itl_mean_s IS NOT NULL AND itl_mean_s > itl_slo",
            "toUnixTimestamp64Micro(arrival_ts) + toInt64(round(ttft_s * 1000000))",
            "toUnixTimestamp64Micro(finish_ts)"),
}


class Span(Protocol):
    """What an interference read covers: ``[start, end)``, timezone-aware UTC datetimes (a
    :class:`~kvmeter.ledger.period.Period` or a dashboard :class:`~kvmeter.dashboards.window.Window`)."""

    @property
    def start(self) -> datetime: ...
    @property
    def end(self) -> datetime: ...


@dataclass(frozen=True, slots=True)
class _Buckets:
    start: datetime
    end: datetime
    step_s: int = 1


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def anonymize(rows: Iterable[dict[str, Any]], own_tenant: str) -> list[dict[str, Any]]:
    """The rows with every neighbour but ``own_tenant`` renamed ``tenant-<rank among the others>``.

    Numbering follows each row's ``rank`` within its (tenant, objective) group, so it is stable
    within one response and the same name never stands for two tenants in one group; work nobody
    attributed (``neighbour`` ``""``) stays ``""``.
    """
    out = []
    names: dict[tuple[str, str], dict[str, str]] = {}
    for r in sorted(rows, key=lambda r: (r["tenant_id"], r["objective"], r["rank"])):
        group = names.setdefault((r["tenant_id"], r["objective"]), {})
        row = dict(r)
        who = row["neighbour"]
        if who and who != own_tenant:
            row["neighbour"] = group.setdefault(who, f"tenant-{len(group) + 1}")
        out.append(row)
    return out


def interference_sql(objective: str, tenant_filter: bool, *, cluster: bool = False) -> tuple[str, str]:
    """The two queries of :meth:`InterferenceQueries.interference`: (per victim tenant, missed and
    attributed requests; per victim and neighbour tenant, the work in the windows), with the bound
    parameters ``start``, ``end``, ``slo_tiers``, ``slo_ttft``, ``slo_itl`` (and ``tenants`` when
    ``tenant_filter``).

    Args:
        objective: ``ttft`` or ``itl`` (:data:`OBJECTIVES`; a ``KeyError`` otherwise).
        cluster: render every ``IN`` / ``JOIN`` over a ledger table ``GLOBAL`` (module docstring,
            "Cluster mode"); ``False``: the single-node query.
    """
    miss, w_start, w_end = _WINDOW[objective]
    g = "GLOBAL " if cluster else ""
    ctes = f"""
            WITH victims AS (
                SELECT tenant_id, tier, request_id, model, w_start, w_end,
                    toUnixTimestamp64Micro(arrival_ts) AS arrival_us, toUnixTimestamp64Micro(finish_ts) AS finish_us
                FROM (
                    SELECT tenant_id, tier, request_id, model, arrival_ts, finish_ts, ttft_s, itl_mean_s,
                        transform(tier, {{slo_tiers:Array(String)}}, {{slo_ttft:Array(Float64)}}, inf) AS ttft_slo,
                        transform(tier, {{slo_tiers:Array(String)}}, {{slo_itl:Array(Float64)}}, inf) AS itl_slo,
                        {w_start} AS w_start, {w_end} AS w_end
                    FROM usage_events FINAL
                    WHERE finish_ts >= {_START} AND finish_ts < {_END}{_tenant_filter(() if tenant_filter else None)}
                        AND ttft_s IS NOT NULL)
                WHERE {miss}
            ),
            engines AS (
                SELECT rid AS request_id, model, any(replica) AS replica, any(engine_idx) AS engine_idx
                FROM engine_steps ARRAY JOIN prefill_request_ids AS rid
                WHERE ts >= fromUnixTimestamp64Micro((SELECT min(arrival_us) FROM victims) - 1, 'UTC')
                    AND ts <= fromUnixTimestamp64Micro((SELECT max(finish_us) FROM victims) + 1, 'UTC')
                    AND rid {g}IN (SELECT request_id FROM victims)
                GROUP BY rid, model
            ),
            windows AS (
                SELECT v.tenant_id AS tenant_id, v.request_id AS request_id, v.model AS model,
                    v.w_start AS w_start, v.w_end AS w_end, e.replica AS replica, e.engine_idx AS engine_idx
                FROM victims AS v {g}INNER JOIN engines AS e ON v.request_id = e.request_id AND v.model = e.model
            ),
            window_seconds AS (
                SELECT *, arrayJoin(range(toUInt64(intDiv(w_start, 1000000)), toUInt64(intDiv(w_end, 1000000)) + 1))
                    AS sec
                FROM windows
            )"""
    counts = ctes + f"""
            SELECT tenant_id, any(tier) AS tier, count() AS missed_requests,
                countIf(request_id {g}IN (SELECT request_id FROM windows)) AS attributed_requests
            FROM victims GROUP BY tenant_id ORDER BY tenant_id"""
    work = ctes + f"""
            SELECT w.tenant_id AS tenant_id, s.tenant_id AS neighbour, count() AS steps,
                sum(s.prefill_tokens) AS prefill_tokens, sum(s.decode_tokens) AS decode_tokens,
                sum(s.kv_tokens * s.duration_s) AS kv_token_seconds
            FROM window_seconds AS w {g}INNER JOIN (
                SELECT *, toUInt64(intDiv(toUnixTimestamp64Micro(ts), 1000000)) AS sec FROM engine_steps
                WHERE ts >= fromUnixTimestamp64Micro((SELECT min(w_start) FROM windows) - 1, 'UTC')
                    AND ts <= fromUnixTimestamp64Micro((SELECT max(w_end) FROM windows) + 1, 'UTC')
            ) AS s ON s.model = w.model AND s.replica = w.replica AND s.engine_idx = w.engine_idx AND s.sec = w.sec
            WHERE toUnixTimestamp64Micro(s.ts) >= w.w_start AND toUnixTimestamp64Micro(s.ts) <= w.w_end
            GROUP BY tenant_id, neighbour"""
    return counts, work


class InterferenceQueries(WindowQueries):
    """Who filled the engine steps a tenant's missed requests waited through
    (module docstring): :class:`~kvmeter.ledger.window_queries.WindowQueries`' client, parameters,
    row cleaning and errors, plus :meth:`interference`.

    Args:
        client: as :class:`~kvmeter.ledger.window_queries.WindowQueries`'.
        cluster: the ledger is in cluster mode (``LedgerConfig.cluster`` set): the queries read
            Distributed tables and are rendered with ``GLOBAL`` (module docstring); or a function
            answering that, asked on every read. Default ``False``: single node.
    """

    def __init__(self, client: ClientHolder | Callable[[], Client],
                 cluster: bool | Callable[[], bool] = False) -> None:
        super().__init__(client)
        self._cluster = cluster

    def _is_cluster(self) -> bool:
        return bool(self._cluster() if callable(self._cluster) else self._cluster)

    def interference(self, window: Span, tenants: Sequence[str] | None = None,
                     slos: Sequence[TierSlo] = (), objective: str = "ttft") -> list[dict[str, Any]]:
        """Per tenant with missed requests in ``[window.start, window.end)`` and
        per neighbour tenant whose work filled their windows.

        Args:
            tenants: the victim tenants (``None``: every tenant); neighbours are never filtered.
            slos: the tiers' objectives ``(tier, ttft_slo_s, itl_slo_s)`` (seconds, ``None`` = no
                such objective); a tier not listed misses nothing.
            objective: ``ttft`` or ``itl``.
        Returns:
            :data:`INTERFERENCE_COLUMNS` rows sorted by tenant, then ``rank`` (1 = the neighbour
            with the most scheduled tokens, prefill + decode, then KV token-seconds, then name):
            ``tenant_id``, ``tier`` (of one of its missed requests), ``objective``,
            ``missed_requests``, ``attributed_requests`` (≤ missed), ``neighbour`` (tenant id,
            ``""`` for unattributed work), ``is_self``, ``steps``, ``prefill_tokens``,
            ``decode_tokens``, ``kv_token_seconds``, and the three shares (0–1 or ``None``). A
            tenant with missed requests but no attributed one has one row with ``neighbour``
            ``None`` and zero work.
        Raises:
            ValueError: an unknown objective or an empty tenant id.
        """
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        names = [name for name, _, _ in slos]
        params = self._params(_Buckets(window.start, window.end), tenants, slo_tiers=names,
                              slo_ttft=[t if t is not None else math.inf for _, t, _ in slos],
                              slo_itl=[i if i is not None else math.inf for _, _, i in slos])
        counts_sql, work_sql = interference_sql(objective, tenants is not None, cluster=self._is_cluster())
        counts = self._query(counts_sql, params)
        if not counts:
            return []
        work = self._query(work_sql, params)
        by_victim: dict[str, list[dict[str, Any]]] = {}
        for r in work:
            by_victim.setdefault(r["tenant_id"], []).append(r)
        out: list[dict[str, Any]] = []
        for c in counts:
            head = {"tenant_id": c["tenant_id"], "tier": c["tier"], "objective": objective,
                    "missed_requests": int(c["missed_requests"]),
                    "attributed_requests": int(c["attributed_requests"])}
            rows = by_victim.get(c["tenant_id"], [])
            if not rows:
                out.append({**head, "rank": 1, "neighbour": None, "is_self": False, "steps": 0,
                            "prefill_tokens": 0, "decode_tokens": 0, "kv_token_seconds": 0.0,
                            "prefill_share": None, "decode_share": None, "kv_share": None})
                continue
            total_p = sum(int(r["prefill_tokens"]) for r in rows)
            total_d = sum(int(r["decode_tokens"]) for r in rows)
            total_kv = sum(float(r["kv_token_seconds"]) for r in rows)
            rows.sort(key=lambda r: (-(int(r["prefill_tokens"]) + int(r["decode_tokens"])),
                                     -float(r["kv_token_seconds"]), r["neighbour"]))
            for rank, r in enumerate(rows, start=1):
                p, d, kv = int(r["prefill_tokens"]), int(r["decode_tokens"]), float(r["kv_token_seconds"])
                out.append({**head, "rank": rank, "neighbour": r["neighbour"],
                            "is_self": r["neighbour"] == c["tenant_id"], "steps": int(r["steps"]),
                            "prefill_tokens": p, "decode_tokens": d, "kv_token_seconds": kv,
                            "prefill_share": _share(p, total_p), "decode_share": _share(d, total_d),
                            "kv_share": _share(kv, total_kv)})
        return out
