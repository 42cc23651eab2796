"""Pure transforms from read rows to the frames the charts draw (polars; no Streamlit, no I/O).

Units are in the column names: ``_per_s`` rates, ``_tokens``, ``_s`` seconds, ``_ratio`` 0–1,
``_share`` 0–1 of a total. Formulas and their sources are stated where they are defined.
"""

from __future__ import annotations

import io
import math
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping, Sequence

import polars as pl

from .viewer import TierInfo
from .window import Window

__all__ = [
    "INPUT_WEIGHT", "OUTPUT_WEIGHT", "frame", "fill_buckets", "bucket_seconds", "traffic_rates",
    "service", "jain_index", "jain_by_bucket", "tenant_ranking", "goodput_by_tier", "slo_table",
    "reservation_drift", "long", "to_csv_bytes", "to_parquet_bytes", "tier_weights", "top_n",
    "per_bucket_rate", "OTHER",
]

#: Label of the tenants folded together outside a top-N.
OTHER = "(other)"

#: Service charged per input / output token: VTC's cost function w_p = 1, w_q = 2 (Sheng et al.,
#: "Fairness in Serving Large Language Models", OSDI 2024, §3) — the scheduler's defaults
#: (:class:`kvmeter.serving.scheduler.SchedulerConfig`).
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0

_TS = pl.Datetime("us", "UTC")


def frame(rows: Sequence[Mapping[str, Any]], schema: Mapping[str, Any]) -> pl.DataFrame:
    """Rows as a frame with (at least) ``schema``'s columns and dtypes, also when empty.

    Extra columns in the rows are kept with inferred types; ``ts``-like columns become UTC
    datetimes.
    """
    if not rows:
        return pl.DataFrame(schema=dict(schema))
    names = list(dict.fromkeys(k for r in rows[:1] for k in r))  # every row of a read has the same keys
    columns = {k: [r.get(k) for r in rows] for k in names}
    df = pl.DataFrame(columns, schema_overrides={k: v for k, v in schema.items() if k in names
                                                 and not isinstance(v, pl.Datetime)}, strict=False)
    casts = []
    for name, dtype in schema.items():
        if name not in df.columns:
            casts.append(pl.lit(None, dtype).alias(name))
        elif isinstance(dtype, pl.Datetime):
            col = pl.col(name)
            read = df.schema[name]
            if read == pl.String:
                col = col.str.to_datetime(time_zone="UTC")
            elif isinstance(read, pl.Datetime) and read.time_zone is None:
                col = col.dt.replace_time_zone("UTC")
            casts.append(col.cast(dtype).alias(name))
        else:
            casts.append(pl.col(name).cast(dtype, strict=False).alias(name))
    return df.with_columns(casts)


def fill_buckets(df: pl.DataFrame, window: Window, by: Sequence[str] = (),
                 zero: Sequence[str] = ()) -> pl.DataFrame:
    """Every bucket of ``window`` (× every combination of ``by`` values seen), with ``zero``
    columns set to 0 where a bucket had no row — so a quiet minute draws as 0, not as a line
    interpolated across the gap. Other columns stay null there."""
    grid = pl.DataFrame({"ts": window.bucket_starts()}, schema={"ts": _TS})
    if by:
        keys = df.select(list(by)).unique() if df.height else pl.DataFrame(schema={k: df.schema[k] for k in by})
        grid = grid.join(keys, how="cross")
    out = grid.join(df, on=["ts", *by], how="left")
    return out.with_columns([pl.col(c).fill_null(0) for c in zero if c in out.columns]).sort(["ts", *by])


def bucket_seconds(window: Window, now: datetime | None = None) -> pl.Expr:
    """Seconds of each bucket that lie inside the window and before ``now``: the divisor of
    every per-second rate, so the window's first, partial bucket and the newest, still-filling
    one are not under-reported. Null for a bucket with less than one such second (no rate is
    drawn there rather than a count divided by a sliver of time)."""
    end = min(window.end, now.astimezone(timezone.utc)) if now is not None else window.end
    start_col = pl.col("ts")
    stop = pl.min_horizontal(start_col + timedelta(seconds=window.step_s), pl.lit(end, _TS))
    begin = pl.max_horizontal(start_col, pl.lit(window.start, _TS))
    seconds = (stop - begin).dt.total_microseconds() / 1e6
    return pl.when(seconds >= 1.0).then(seconds).otherwise(None)


def traffic_rates(traffic: pl.DataFrame, window: Window, now: datetime | None = None) -> pl.DataFrame:
    """Per-bucket rates from :meth:`~kvmeter.ledger.window_queries.WindowQueries.traffic` rows
    (filled to every bucket).

    Adds: ``requests_per_s``, ``input_tokens_per_s``, ``output_tokens_per_s``,
    ``tokens_per_request`` (mean input + output tokens per request, ``None`` without requests),
    ``active_kv_tokens`` (mean KV tokens held = ∫KV dt ÷ bucket seconds), ``queue_depth``
    (mean requests waiting = Σ queue wait ÷ bucket seconds, Little's law L = λW).
    """
    counts = ["requests", "ok_requests", "aborted_requests", "error_requests", "input_tokens",
              "cached_input_tokens", "output_tokens", "kv_token_seconds", "queue_seconds"]
    df = fill_buckets(traffic, window, zero=counts)
    secs = bucket_seconds(window, now)
    return df.with_columns(
        (pl.col("requests") / secs).alias("requests_per_s"),
        (pl.col("input_tokens") / secs).alias("input_tokens_per_s"),
        (pl.col("output_tokens") / secs).alias("output_tokens_per_s"),
        pl.when(pl.col("requests") > 0)
          .then((pl.col("input_tokens") + pl.col("output_tokens")) / pl.col("requests"))
          .otherwise(None).alias("tokens_per_request"),
        (pl.col("kv_token_seconds") / secs).alias("active_kv_tokens"),
        (pl.col("queue_seconds") / secs).alias("queue_depth"),
    )


def top_n(df: pl.DataFrame, key: str, value: str, n: int, *, sum_cols: Sequence[str] = (),
          by: Sequence[str] = ("ts",)) -> pl.DataFrame:
    """Keep the ``n`` ``key`` values with the largest total ``value``; fold the rest into one
    :data:`OTHER` row per ``by`` group (summing ``value`` and ``sum_cols``). For charts of many
    tenants: the legend stays readable and totals stay exact."""
    if df.height == 0 or df.select(pl.col(key).n_unique()).item() <= n:
        return df
    keep = (df.group_by(key).agg(pl.col(value).sum()).sort([value, key], descending=[True, False])
            .head(n).get_column(key))
    cols = [value, *sum_cols]
    folded = df.with_columns(pl.when(pl.col(key).is_in(keep.implode())).then(pl.col(key))
                             .otherwise(pl.lit(OTHER)).alias(key))
    return folded.group_by([*by, key]).agg([pl.col(c).sum() for c in cols]).sort([*by, key])


def per_bucket_rate(df: pl.DataFrame, column: str, window: Window, now: datetime | None = None, *,
                    alias: str) -> pl.DataFrame:
    """Add ``alias`` = ``column`` ÷ the bucket's seconds (see :func:`bucket_seconds`)."""
    return df.with_columns((pl.col(column) / bucket_seconds(window, now)).alias(alias))


def tier_weights(tiers: Iterable[TierInfo]) -> dict[str, float]:
    """Tier name → fairness weight."""
    return {t.name: t.weight for t in tiers}


def service(df: pl.DataFrame, tiers: Iterable[TierInfo]) -> pl.DataFrame:
    """Add ``service_tokens`` = w_p × input + w_q × output tokens (VTC's weighted token work,
    :data:`INPUT_WEIGHT`, :data:`OUTPUT_WEIGHT`) and ``normalised_service`` = service ÷ the
    tier's weight (1.0 for an unknown tier) — equal normalised service is the fair outcome."""
    weights = tier_weights(tiers)
    weight = pl.col("tier").replace_strict(weights, default=1.0, return_dtype=pl.Float64)
    return df.with_columns(
        (INPUT_WEIGHT * pl.col("input_tokens") + OUTPUT_WEIGHT * pl.col("output_tokens"))
        .cast(pl.Float64).alias("service_tokens"),
    ).with_columns((pl.col("service_tokens") / weight).alias("normalised_service"))


def jain_index(values: Iterable[float]) -> float | None:
    """Jain's fairness index J = (Σx)² / (n · Σx²) of non-negative allocations.

    (R. Jain, D. Chiu, W. Hawe, "A Quantitative Measure of Fairness and Discrimination for
    Resource Allocation in Shared Computer Systems", DEC-TR-301, 1984.) J is 1 when every x is
    equal and 1/n when one party gets everything.

    Returns:
        J in [1/n, 1]; 1.0 for a single party or when every x is 0; ``None`` for no parties.
    Raises:
        ValueError: on a negative or non-finite value.
    """
    xs = [float(v) for v in values]
    if any(not math.isfinite(x) or x < 0 for x in xs):
        raise ValueError("Jain's index needs finite allocations >= 0")
    if not xs:
        return None
    square_sum = sum(x * x for x in xs)
    if square_sum == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * square_sum)


def jain_by_bucket(by_tenant: pl.DataFrame, tiers: Iterable[TierInfo], *,
                   backlogged_only: bool = True) -> pl.DataFrame:
    """Jain's index of weight-normalised service per bucket from
    :meth:`~kvmeter.ledger.window_queries.WindowQueries.traffic_by_tenant` rows.

    Fairness is only at stake among tenants that wanted more than they got, so by default only
    *backlogged* tenants of a bucket count (a request waited ≥ ``BACKLOG_QUEUE_S`` in the queue),
    as the scheduler's own index counts backlogged tenants only.

    Returns:
        ``ts``, ``tenants`` (how many counted), ``jain_index`` (``None`` with no tenant).
    """
    df = service(by_tenant, tiers)
    if backlogged_only and "backlogged" in df.columns:
        df = df.filter(pl.col("backlogged") > 0)
    if df.height == 0:
        return pl.DataFrame(schema={"ts": _TS, "tenants": pl.UInt32, "jain_index": pl.Float64})
    out = df.group_by("ts").agg(
        pl.len().alias("tenants"),
        pl.col("normalised_service").sum().alias("_s"),
        (pl.col("normalised_service") ** 2).sum().alias("_s2"),
    ).with_columns(
        pl.when(pl.col("_s2") > 0).then(pl.col("_s") ** 2 / (pl.col("tenants") * pl.col("_s2")))
          .otherwise(1.0).alias("jain_index"),
    )
    return out.select("ts", "tenants", "jain_index").sort("ts")


def tenant_ranking(totals: pl.DataFrame, tiers: Iterable[TierInfo], window: Window) -> pl.DataFrame:
    """The noisy-neighbour table from :meth:`~kvmeter.ledger.window_queries.WindowQueries.tenant_totals`
    rows: who carries the load by tokens and KV held, beside who sends the most requests.

    Returns:
        The totals plus ``total_tokens``, ``service_tokens``, ``normalised_service``,
        ``service_share`` (of all service in the window, 0–1), ``token_share``, ``kv_share``,
        ``request_share``, ``mean_active_kv_tokens`` (∫KV dt ÷ window seconds),
        ``rank_by_requests``, ``rank_by_tokens``, ``rank_by_kv`` (1 = largest), sorted by KV held.
    """
    if totals.height == 0:
        return totals
    df = service(totals, tiers).with_columns(
        (pl.col("input_tokens") + pl.col("output_tokens")).alias("total_tokens"))

    def share(col: str) -> pl.Expr:
        total = pl.col(col).sum()
        return pl.when(total > 0).then(pl.col(col) / total).otherwise(0.0)

    return df.with_columns(
        share("service_tokens").alias("service_share"),
        share("total_tokens").alias("token_share"),
        share("kv_token_seconds").alias("kv_share"),
        share("requests").alias("request_share"),
        (pl.col("kv_token_seconds") / window.span_s).alias("mean_active_kv_tokens"),
        pl.col("requests").rank("min", descending=True).cast(pl.Int64).alias("rank_by_requests"),
        pl.col("total_tokens").rank("min", descending=True).cast(pl.Int64).alias("rank_by_tokens"),
        pl.col("kv_token_seconds").rank("min", descending=True).cast(pl.Int64).alias("rank_by_kv"),
    ).sort(["kv_token_seconds", "tenant_id"], descending=[True, False])


def goodput_by_tier(goodput: pl.DataFrame) -> pl.DataFrame:
    """Window totals per tier from :meth:`~kvmeter.ledger.window_queries.WindowQueries.goodput` rows.

    Returns:
        ``tier``, ``requests``, ``good_requests``, ``slo_missed_requests``,
        ``throughput_tokens`` (input + output of every request that ended), ``goodput_tokens``
        (of good requests), ``goodput_ratio`` (goodput ÷ throughput tokens; ``None`` without
        traffic), ``wasted_tokens`` (aborted + failed requests' tokens).
    """
    if goodput.height == 0:
        return pl.DataFrame(schema={"tier": pl.String, "requests": pl.Int64, "good_requests": pl.Int64,
                                    "slo_missed_requests": pl.Int64, "throughput_tokens": pl.Int64,
                                    "goodput_tokens": pl.Int64, "goodput_ratio": pl.Float64,
                                    "wasted_tokens": pl.Int64})
    out = goodput.group_by("tier").agg(
        pl.col("requests").sum(), pl.col("good_requests").sum(), pl.col("slo_missed_requests").sum(),
        (pl.col("input_tokens") + pl.col("output_tokens")).sum().alias("throughput_tokens"),
        (pl.col("good_input_tokens") + pl.col("good_output_tokens")).sum().alias("goodput_tokens"),
        (pl.col("aborted_tokens") + pl.col("error_tokens")).sum().alias("wasted_tokens"),
    )
    return out.with_columns(
        pl.when(pl.col("throughput_tokens") > 0)
          .then(pl.col("goodput_tokens") / pl.col("throughput_tokens")).otherwise(None).alias("goodput_ratio"),
    ).sort("tier")


def slo_table(latency: pl.DataFrame, tiers: Iterable[TierInfo]) -> pl.DataFrame:
    """Latency percentiles per tier beside the tier's SLOs, from
    :meth:`~kvmeter.ledger.window_queries.WindowQueries.latency_by_tier` rows.

    Adds ``ttft_slo_s``, ``itl_slo_s`` (``None``: no promise), ``ttft_p95_within_slo`` and
    ``itl_p95_within_slo`` (bool, ``None`` without an SLO or without data).
    """
    slos = pl.DataFrame([{"tier": t.name, "ttft_slo_s": t.ttft_slo_s, "itl_slo_s": t.itl_slo_s} for t in tiers],
                        schema={"tier": pl.String, "ttft_slo_s": pl.Float64, "itl_slo_s": pl.Float64})
    df = latency.join(slos, on="tier", how="left")
    return df.with_columns(
        (pl.col("ttft_p95_s") <= pl.col("ttft_slo_s")).alias("ttft_p95_within_slo"),
        (pl.col("itl_p95_s") <= pl.col("itl_slo_s")).alias("itl_p95_within_slo"),
    )


def reservation_drift(df: pl.DataFrame) -> pl.DataFrame:
    """Reservation vs actual per row of :meth:`~kvmeter.ledger.window_queries.WindowQueries.reservation_by_tenant`.

    Adds ``reserved_tokens``, ``actual_tokens``, ``drift_tokens`` (reserved − actual: > 0 means
    admission held back capacity nobody used), ``drift_ratio`` (drift ÷ reserved, ``None`` when
    nothing was reserved) and ``output_use_ratio`` (output used ÷ output reserved).
    """
    return df.with_columns(
        (pl.col("reserved_input_tokens") + pl.col("reserved_output_tokens")).alias("reserved_tokens"),
        (pl.col("input_tokens") + pl.col("output_tokens")).alias("actual_tokens"),
    ).with_columns(
        (pl.col("reserved_tokens").cast(pl.Int64) - pl.col("actual_tokens").cast(pl.Int64)).alias("drift_tokens"),
    ).with_columns(
        pl.when(pl.col("reserved_tokens") > 0).then(pl.col("drift_tokens") / pl.col("reserved_tokens"))
          .otherwise(None).alias("drift_ratio"),
        pl.when(pl.col("reserved_output_tokens") > 0)
          .then(pl.col("output_tokens") / pl.col("reserved_output_tokens"))
          .otherwise(None).alias("output_use_ratio"),
    )


def long(df: pl.DataFrame, columns: Mapping[str, str], *, index: Sequence[str] = ("ts",),
         name: str = "series", value: str = "value") -> pl.DataFrame:
    """Wide → long for a multi-line chart: each column of ``columns`` (column → legend label)
    becomes rows ``(*index, series=label, value)``."""
    present = [c for c in columns if c in df.columns]
    out = df.select([*index, *present]).unpivot(index=list(index), on=present, variable_name=name, value_name=value)
    return out.with_columns(pl.col(name).replace_strict(dict(columns), default=pl.col(name)))


def to_csv_bytes(df: pl.DataFrame) -> bytes:
    """CSV (UTF-8, header row) of a frame; exact decimals are written as decimal text."""
    return df.write_csv().encode("utf-8")


def to_parquet_bytes(df: pl.DataFrame) -> bytes:
    """Parquet of a frame (decimals stay ``Decimal(38, 18)``)."""
    buf = io.BytesIO()
    df.write_parquet(buf)
    return buf.getvalue()
