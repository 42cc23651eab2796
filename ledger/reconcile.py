"""Three-way reconciliation: engine counters vs gateway records vs ledger totals, per tenant.

Input: :meth:`LedgerQueries.reconcile_views` (the SQL joins the three views per request id).
Each difference is classified as *explained* or *unexplained*:

explained (expected by design, reported, not drift)
    ``aborted``         ledger events with outcome ``aborted`` and no engine record: billed from
                        the frontend's counts where the engine gave no account of the abort (an
                        engine without hooks; vLLM's own stats never report aborts, vLLM issue
                        55634, kvmeter's scheduler hook does: docs/ARCHITECTURE.md, "Facts
                        measured on the build machine"). An abort with an engine record is
                        matched like any request.
    ``frontend_only``   non-aborted events counted by the frontend (``token_source != engine_hooks``,
                        e.g. a remote engine without hooks).
    ``superseded``      engine work of an attempt whose logical request was billed under another
                        attempt (one billable record per logical request) — a retry after a
                        crash, or a re-run of an idempotent request whose replay was forgotten
                        (the in-memory idempotency store does not survive a restart).
    ``duplicate_rows``  stored rows not yet merged by the ReplacingMergeTree (billing reads FINAL).
    ``replayed``        idempotent replays served without engine work.
where the engine's tokens went (every attempt has its own usage row, migration 0006)
    ``delivered_engine_tokens``            engine work of the attempts that make a logical request's
                                           bill (its successful attempt; rows without an undelivered
                                           cause, as before)
    ``undelivered_billed_engine_tokens``   engine work that reached no client, billed by its tier's
                                           policy (default: the client abandoned it)
    ``undelivered_absorbed_engine_tokens`` engine work that reached no client, absorbed by the
                                           platform (a server failure, a shutdown, a deadline drop;
                                           any failed attempt of a request that succeeded)
    ``superseded_engine_tokens``           a second successful attempt of one logical request, plus
                                           ``superseded_tokens`` (engine work with no row of its own)
    ``engine_tokens_explained_ratio``      the four over ``engine_tokens`` (1.0 with no engine tokens):
                                           1.0 when every engine token is accounted for
unexplained (drift)
    ``mismatched``      matched requests whose ledger tokens differ from the engine's.
    ``ledger_only``     events that claim engine counts (``engine_hooks``) but have no engine record.
    ``engine_unbilled`` engine work with no billable record and no later attempt billed.
    ``duplicate_billed`` one request id billed under more than one event id.
    ``missing_finishes`` admitted attempts with neither an engine record nor a usage event
                        (lost, or still running at the end of the period); their reserved
                        tokens are shown as ``missing_finish_reserved_tokens`` (an upper bound).

``unexplained_drift_tokens`` = |matched token differences| + ledger-only tokens + engine-unbilled
tokens + duplicate-billed tokens; ``unexplained_drift_ratio`` divides it by all work seen
(ledger tokens + engine-unbilled tokens, at least 1). Reservation drift (what admission
reserved vs what the requests used) is reported for quota tuning; it is not billing drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import polars as pl

__all__ = ["ReconcileReport", "reconcile", "view_drift", "RECONCILE_COLUMNS", "UNATTRIBUTED"]

UNATTRIBUTED = "(unattributed)"

RECONCILE_COLUMNS = (
    "tenant_id", "status",
    # the three views
    "engine_requests", "engine_tokens", "gateway_attempts", "gateway_admitted", "rejected_attempts",
    "replayed_attempts", "ledger_requests", "ledger_tokens",
    # explained
    "matched_requests", "aborted_requests", "aborted_tokens", "frontend_only_requests", "frontend_only_tokens",
    "superseded_requests", "superseded_tokens", "duplicate_rows",
    # where the engine's tokens went
    "delivered_engine_tokens", "undelivered_billed_engine_tokens", "undelivered_absorbed_engine_tokens",
    "superseded_engine_tokens", "explained_engine_tokens", "engine_tokens_explained_ratio",
    # unexplained
    "mismatched_requests", "matched_token_drift", "ledger_only_requests", "ledger_only_tokens",
    "engine_unbilled_requests", "engine_unbilled_tokens", "duplicate_billed_requests", "duplicate_billed_tokens",
    "missing_finishes", "missing_finish_reserved_tokens",
    "unexplained_requests", "unexplained_drift_tokens", "unexplained_drift_ratio",
    # quota quality
    "reserved_tokens", "actual_tokens", "reservation_drift_tokens", "reservation_drift_ratio",
)


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    """The outcome of :func:`reconcile`.

    Attributes:
        frame: one row per tenant, :data:`RECONCILE_COLUMNS`.
        threshold_ratio: the unexplained-drift ratio above which a tenant fails.
        failed_tenants: tenants whose ``status`` is ``drift``.
    """

    frame: pl.DataFrame
    threshold_ratio: float
    failed_tenants: tuple[str, ...]

    @property
    def failed(self) -> bool:
        """True when any tenant's unexplained drift passes the threshold."""
        return bool(self.failed_tenants)


def reconcile(views: Iterable[dict[str, Any]], *, threshold_ratio: float = 0.0,
              max_missing_finishes: int | None = None) -> ReconcileReport:
    """Classify the three views' differences per tenant (see the module docstring).

    Args:
        views: rows of :meth:`LedgerQueries.reconcile_views`.
        threshold_ratio: a tenant is ``drift`` when its ``unexplained_drift_ratio`` exceeds this
            (0.0 = any unexplained token fails). Must be ≥ 0.
        max_missing_finishes: also fail a tenant with more missing finishes than this
            (``None``: missing finishes are reported but do not fail).
    Raises:
        ValueError: on a negative threshold.
    """
    if threshold_ratio < 0:
        raise ValueError(f"threshold_ratio must be >= 0, got {threshold_ratio}")
    rows = list(views)
    base = pl.DataFrame(rows) if rows else pl.DataFrame({"tenant_id": []}, schema={"tenant_id": pl.String})
    needed = ("engine_requests", "engine_input_tokens", "engine_output_tokens", "attempts", "gateway_admitted",
              "rejected_attempts", "replayed_attempts", "ledger_requests", "ledger_input_tokens",
              "ledger_output_tokens", "matched_requests", "aborted_requests", "aborted_tokens",
              "frontend_only_requests", "frontend_only_tokens", "superseded_requests", "superseded_tokens",
              "stored_rows", "mismatched_requests", "matched_token_drift", "ledger_only_requests", "ledger_only_tokens",
              "engine_unbilled_requests", "engine_unbilled_tokens", "duplicate_billed_requests",
              "duplicate_billed_tokens", "missing_finishes", "missing_finish_reserved_tokens", "reserved_tokens",
              "actual_tokens", "delivered_engine_tokens", "undelivered_billed_engine_tokens",
              "undelivered_absorbed_engine_tokens", "superseded_engine_tokens")
    base = base.with_columns([pl.col(c).cast(pl.Int64).fill_null(0) if c in base.columns
                              else pl.lit(0, pl.Int64).alias(c) for c in needed])
    df = base.with_columns(
        pl.when(pl.col("tenant_id") == "").then(pl.lit(UNATTRIBUTED)).otherwise(pl.col("tenant_id")).alias("tenant_id"),
        (pl.col("engine_input_tokens") + pl.col("engine_output_tokens")).alias("engine_tokens"),
        pl.col("attempts").alias("gateway_attempts"),
        (pl.col("ledger_input_tokens") + pl.col("ledger_output_tokens")).alias("ledger_tokens"),
        (pl.col("stored_rows") - pl.col("ledger_requests")).clip(lower_bound=0).alias("duplicate_rows"),
        (pl.col("mismatched_requests") + pl.col("ledger_only_requests") + pl.col("engine_unbilled_requests")
         + pl.col("duplicate_billed_requests") + pl.col("missing_finishes")).alias("unexplained_requests"),
        (pl.col("matched_token_drift") + pl.col("ledger_only_tokens") + pl.col("engine_unbilled_tokens")
         + pl.col("duplicate_billed_tokens")).alias("unexplained_drift_tokens"),
        (pl.col("reserved_tokens") - pl.col("actual_tokens")).alias("reservation_drift_tokens"),
        (pl.col("delivered_engine_tokens") + pl.col("undelivered_billed_engine_tokens")
         + pl.col("undelivered_absorbed_engine_tokens") + pl.col("superseded_engine_tokens")
         + pl.col("superseded_tokens")).alias("explained_engine_tokens"),
    )
    denominator = pl.max_horizontal(pl.col("ledger_tokens") + pl.col("engine_unbilled_tokens"), pl.lit(1))
    df = df.with_columns(
        (pl.col("unexplained_drift_tokens") / denominator).alias("unexplained_drift_ratio"),
        pl.when(pl.col("reserved_tokens") > 0)
          .then(pl.col("reservation_drift_tokens") / pl.col("reserved_tokens")).otherwise(None)
          .alias("reservation_drift_ratio"),
        pl.when(pl.col("engine_tokens") > 0)
          .then(pl.col("explained_engine_tokens") / pl.col("engine_tokens")).otherwise(1.0)
          .alias("engine_tokens_explained_ratio"),
    )
    fail = pl.col("unexplained_drift_ratio") > threshold_ratio
    if max_missing_finishes is not None:
        fail = fail | (pl.col("missing_finishes") > max_missing_finishes)
    df = df.with_columns(pl.when(fail).then(pl.lit("drift")).otherwise(pl.lit("ok")).alias("status"))
    df = df.select(RECONCILE_COLUMNS).sort("tenant_id")
    failed = tuple(df.filter(pl.col("status") == "drift")["tenant_id"].to_list())
    return ReconcileReport(frame=df, threshold_ratio=threshold_ratio, failed_tenants=failed)


def view_drift(report: ReconcileReport) -> dict[str, tuple[int, int]]:
    """Unexplained drift of each view against the ledger, summed over the report's tenants.

    Returns:
        ``{"engine": (tokens, seen), "gateway": (requests, admitted)}``:

        * engine — ``unexplained_drift_tokens`` (matched token differences + ledger-only +
          engine-unbilled + duplicate-billed tokens) and the work seen (ledger tokens +
          engine-unbilled tokens): the numerator and denominator of ``unexplained_drift_ratio``;
        * gateway — admitted attempts with neither an engine record nor a usage event
          (``missing_finishes``) plus requests billed under more than one event id
          (``duplicate_billed_requests``), and the admitted attempts (``gateway_admitted``).

        Divide by ``max(denominator, 1)`` for the ratio (0 when nothing was seen).
    """
    f = report.frame
    if f.height == 0:
        return {"engine": (0, 0), "gateway": (0, 0)}
    totals = f.select(
        pl.col("unexplained_drift_tokens").sum().alias("engine"),
        (pl.col("ledger_tokens") + pl.col("engine_unbilled_tokens")).sum().alias("seen"),
        (pl.col("missing_finishes") + pl.col("duplicate_billed_requests")).sum().alias("gateway"),
        pl.col("gateway_admitted").sum().alias("admitted"),
    ).row(0, named=True)
    return {"engine": (int(totals["engine"]), int(totals["seen"])),
            "gateway": (int(totals["gateway"]), int(totals["admitted"]))}
