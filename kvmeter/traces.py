"""Real request traces: load them into one shape. kvmeter's single trace loader — the replay, the
demo, the dashboards' synthetic history and the simulator all read traces through here.

Supported (provenance and licences: ``data/SOURCES.md``):

* ``azure-conv`` / ``azure-code`` — Azure LLM inference trace 2023 (CSV: ``TIMESTAMP`` with 7
  fractional digits, ``ContextTokens``, ``GeneratedTokens``), ~1 h each.
* ``mooncake`` — Mooncake conversation trace (JSONL: ``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token prefix blocks).
* kvmeter's own CSV: ``arrival_s, input_tokens, output_tokens`` (``prompt_tokens``, the name
  kvmeter wrote before, is read as ``input_tokens``) and optional ``tenant_id``, ``tier``,
  ``deadline_s`` (seconds from the trace start) — what a tenant-attributed workload is written in.
* any path to a file in one of those formats.

Lengths below 1 are raised to 1 (a replayed request needs a prompt token and an output token).

The data folder — traces, GPU captures, vLLM ``/metrics`` pages, GPU profiles — is found here and
only here (:func:`data_dir`): ``$KVMETER_DATA_DIR`` when set, else ``data/`` at the repository
root, beside this package. Everything else that reads real data asks :func:`data_dir` or
:func:`data_file`. (ServeGen's per-client rates are also named in :data:`TRACE_FILES`; the
simulator's tenant mapping reads them, :mod:`kvmeter.serving.simulator.tenants`.)
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["TraceRequest", "load_trace", "write_poisson_trace", "data_dir", "data_file", "trace_path",
           "TRACE_FILES", "REQUEST_TRACES", "DATA_DIR_ENV", "DataNotFoundError", "TraceError", "TraceNotFoundError"]

#: The environment variable that overrides the data folder (:func:`data_dir`).
DATA_DIR_ENV = "KVMETER_DATA_DIR"

TRACE_FILES = {
    "azure-conv": "traces/AzureLLMInferenceTrace_conv_2023.csv",
    "azure-code": "traces/AzureLLMInferenceTrace_code_2023.csv",
    "mooncake": "traces/mooncake_conversation_trace.jsonl",
    "servegen-rates": "traces/servegen_m-large_perclient_2days.csv",
}
#: The names in :data:`TRACE_FILES` that are request traces (loadable with :func:`load_trace`).
REQUEST_TRACES = ("azure-conv", "azure-code", "mooncake")


class DataNotFoundError(FileNotFoundError):
    """A file of the data folder is missing; the message says where kvmeter looked and how
    ``$KVMETER_DATA_DIR`` overrides it."""


class TraceError(ValueError):
    """A trace cannot be found or parsed; the message names the file and the problem."""


class TraceNotFoundError(TraceError, FileNotFoundError):
    """The named trace or file does not exist (also a :class:`FileNotFoundError`)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: seconds since the trace's first request (≥ 0, non-decreasing in a trace).
        input_tokens: prompt length in tokens (≥ 1).
        output_tokens: generated length in tokens (≥ 1).
        hash_ids: prefix-block hashes (Mooncake; 512 tokens per block), () when absent.
        tenant_id: the tenant it belongs to, when the trace says (kvmeter CSV) or a mapping set
            it; ``None`` otherwise (the public traces carry none).
        tier: the tenant's tier, or ``None`` (the consumer's default tier applies).
        deadline_s: deadline in seconds from the trace start, or ``None`` (the tier's applies).
        agent_run_id: the agent run the request is a model call of (``X-Agent-Run-Id`` on the
            serve path), or ``""``; the simulator stamps it on the request's attribution.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    tenant_id: str | None = None
    tier: str | None = None
    deadline_s: float | None = None
    agent_run_id: str = ""


def data_dir() -> Path:
    """kvmeter's data folder (see ``data/SOURCES.md`` for what is in it).

    Returns:
        ``$KVMETER_DATA_DIR`` when set and non-empty (``~`` expanded), else ``data/`` at the
        repository root: the folder beside this package (``kvmeter/``, a real directory, resolved
        through any link). The folder is not checked for existence here; :func:`data_file` does.
        A kvmeter installed from a wheel has no ``data/`` beside it: set ``$KVMETER_DATA_DIR``.
    """
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parent.parent / "data"


def _missing(what: str, path: Path) -> str:
    root = data_dir()
    origin = (f"${DATA_DIR_ENV}" if os.environ.get(DATA_DIR_ENV)
              else f"the repository's data/ folder; ${DATA_DIR_ENV} overrides it (a pip-installed "
                   f"kvmeter has no data/ folder)")
    return (f"{what} not found: looked for {path} in the data folder {root} ({origin}); see "
            f"data/SOURCES.md for the files it should hold")


def data_file(relative: str | os.PathLike) -> Path:
    """The path of a file in the data folder, e.g. ``data_file("gpu/dcgm/dcgm_v100_4gpu_issue250.prom")``.

    Raises:
        DataNotFoundError: no such file there (the message names the folder and the override).
    """
    path = data_dir() / relative
    if not path.is_file():
        raise DataNotFoundError(_missing(str(relative), path))
    return path


def trace_path(name_or_path: str | os.PathLike) -> Path:
    """The file of a named trace (:data:`TRACE_FILES`, in the data folder) or of an existing path.

    Raises:
        TraceNotFoundError: unknown name and no such file, or a named trace missing from the data
            folder (the message then names the folder and ``$KVMETER_DATA_DIR``).
    """
    key = str(name_or_path)
    if key in TRACE_FILES:
        path = data_dir() / TRACE_FILES[key]
        if not path.is_file():
            raise TraceNotFoundError(_missing(f"trace {key!r}", path))
        return path
    path = Path(key).expanduser()
    if not path.is_file():
        raise TraceNotFoundError(f"trace {key!r} not found: no such file {path}, and not a named trace "
                                 f"({', '.join(REQUEST_TRACES)})")
    return path


def _load_csv(path: Path, limit: int | None) -> list[TraceRequest]:
    import polars as pl

    try:
        columns = pl.read_csv(path, n_rows=0).columns
    except Exception as exc:  # noqa: BLE001 — polars raises several kinds
        raise TraceError(f"{path}: not a readable CSV ({exc})") from exc
    if "TIMESTAMP" in columns:
        return _load_azure(path, limit)
    if "arrival_s" in columns:
        return _load_kvmeter_csv(path, limit, columns)
    raise TraceError(f"{path}: unknown CSV trace columns {columns}; expected the Azure format "
                     "(TIMESTAMP, ContextTokens, GeneratedTokens) or kvmeter's (arrival_s, "
                     "input_tokens, output_tokens[, tenant_id, tier, deadline_s])")


def _load_azure(path: Path, limit: int | None) -> list[TraceRequest]:
    import polars as pl

    try:
        frame = pl.read_csv(path, n_rows=limit, schema_overrides={"TIMESTAMP": pl.Utf8})
        ts = frame["TIMESTAMP"].str.to_datetime("%Y-%m-%d %H:%M:%S%.f", time_unit="us")
    except Exception as exc:  # noqa: BLE001 — polars raises several kinds
        raise TraceError(f"{path}: not an Azure LLM trace CSV ({exc})") from exc
    for col in ("ContextTokens", "GeneratedTokens"):
        if col not in frame.columns:
            raise TraceError(f"{path}: missing column {col}")
    seconds = (ts - ts.min()).dt.total_microseconds() / 1e6
    return [TraceRequest(float(t), max(1, int(i)), max(1, int(o)))
            for t, i, o in zip(seconds, frame["ContextTokens"], frame["GeneratedTokens"], strict=True)]


def _load_kvmeter_csv(path: Path, limit: int | None, columns: list[str]) -> list[TraceRequest]:
    import polars as pl

    input_col = "prompt_tokens" if "prompt_tokens" in columns and "input_tokens" not in columns else "input_tokens"
    for col in (input_col, "output_tokens"):
        if col not in columns:
            raise TraceError(f"{path}: kvmeter CSV trace needs column {col!r}, has {columns}")
    try:
        frame = pl.read_csv(path, n_rows=limit, schema_overrides={
            "arrival_s": pl.Float64, input_col: pl.Int64, "output_tokens": pl.Int64,
            **{c: pl.Utf8 for c in ("tenant_id", "tier") if c in columns},
            **({"deadline_s": pl.Float64} if "deadline_s" in columns else {})})
    except Exception as exc:  # noqa: BLE001
        raise TraceError(f"{path}: bad kvmeter CSV trace ({exc})") from exc
    if frame.is_empty():
        return []
    first = frame["arrival_s"].min()  # a Float64 column: a float, or None when every arrival_s is empty
    if not isinstance(first, float):
        raise TraceError(f"{path}: empty arrival_s / token count in a row")
    t0 = first
    n = frame.height
    tenants = frame["tenant_id"].to_list() if "tenant_id" in columns else [None] * n
    tiers = frame["tier"].to_list() if "tier" in columns else [None] * n
    deadlines = frame["deadline_s"].to_list() if "deadline_s" in columns else [None] * n
    out = []
    for t, i, o, tenant, tier, dl in zip(frame["arrival_s"], frame[input_col], frame["output_tokens"],
                                         tenants, tiers, deadlines, strict=True):
        if t is None or i is None or o is None:
            raise TraceError(f"{path}: empty arrival_s / token count in a row")
        out.append(TraceRequest(float(t) - t0, max(1, int(i)), max(1, int(o)), (), tenant or None,
                                tier or None, None if dl is None else float(dl) - t0))
    return out


def _load_mooncake(path: Path, limit: int | None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(TraceRequest(float(row["timestamp"]) / 1000.0, max(1, int(row["input_length"])),
                                        max(1, int(row["output_length"])),
                                        tuple(int(h) for h in row.get("hash_ids", ()))))
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: bad Mooncake row ({exc})") from exc
    if out:
        t0 = min(r.arrival_s for r in out)
        out = [TraceRequest(r.arrival_s - t0, r.input_tokens, r.output_tokens, r.hash_ids) for r in out]
    return out


def _shift(r: TraceRequest, dt: float) -> TraceRequest:
    return TraceRequest(r.arrival_s - dt, r.input_tokens, r.output_tokens, r.hash_ids, r.tenant_id, r.tier,
                        None if r.deadline_s is None else r.deadline_s - dt)


def load_trace(name_or_path: str | os.PathLike, limit: int | None = None, *,
               duration_s: float | None = None, start_s: float = 0.0) -> list[TraceRequest]:
    """Load a trace, sorted by arrival.

    Args:
        name_or_path: ``azure-conv``, ``azure-code``, ``mooncake`` or a file path (``.csv`` Azure
            or kvmeter format, ``.jsonl`` Mooncake format).
        limit: at most this many requests: the first rows of the file when no window is given,
            else the first requests of the window.
        duration_s: keep only arrivals in ``[start_s, start_s + duration_s)`` seconds from the
            trace's first request (> 0).
        start_s: the window's start (≥ 0); arrivals are then shifted to start at 0 there.
    Returns:
        Requests with ``arrival_s`` relative to the first one (to ``start_s`` with a window).
    Raises:
        TraceNotFoundError: unknown name or missing file.
        TraceError: unparseable content, a bad window or a ``limit`` below 1.
    """
    if limit is not None and limit < 1:
        raise TraceError(f"bad trace limit {limit!r}: at least 1 request")
    if start_s < 0 or (duration_s is not None and not duration_s > 0):
        raise TraceError(f"bad trace window: start_s={start_s!r}, duration_s={duration_s!r}")
    windowed = start_s > 0 or duration_s is not None
    path = trace_path(name_or_path)
    read_limit = None if windowed else limit
    if path.suffix == ".csv":
        rows = _load_csv(path, read_limit)
    elif path.suffix == ".jsonl":
        rows = _load_mooncake(path, read_limit)
    else:
        raise TraceError(f"{path}: unknown trace format (expected .csv Azure/kvmeter or .jsonl Mooncake)")
    rows.sort(key=lambda r: r.arrival_s)
    if windowed:
        end = float("inf") if duration_s is None else start_s + duration_s
        rows = [_shift(r, start_s) for r in rows if start_s <= r.arrival_s < end]
        if limit is not None:
            rows = rows[:limit]
    return rows


def write_poisson_trace(path: str | os.PathLike, rates: Mapping[str, float], seconds: float, *, seed: int = 0,
                        input_tokens: Mapping[str, int] | None = None, output_tokens: int = 256) -> int:
    """Write a kvmeter CSV trace of independent Poisson arrivals, one stream per tenant.

    Each tenant's inter-arrival times are exponential with mean ``1 / rate`` (a Poisson process of
    ``rate`` requests per second), drawn from one ``numpy.random.default_rng(seed)`` tenant after
    tenant in the order of ``rates``, so a seed gives the same file. Arrivals in ``[0, seconds)``
    are kept, rounded to the microsecond and sorted. Columns: ``arrival_s, input_tokens,
    output_tokens, tenant_id`` — the kvmeter CSV :func:`load_trace` reads (it shifts the first
    arrival to 0).

    Args:
        path: the file to write (replaced).
        rates: tenant id → arrivals per second (finite, > 0).
        seconds: length of the trace, seconds (≥ 0).
        seed: the generator's seed.
        input_tokens: tenant id → prompt length in tokens; a tenant not named gets 256.
        output_tokens: every request's output length in tokens.
    Returns:
        The number of requests written.
    Raises:
        ValueError: a rate that is not a finite number > 0, or a negative ``seconds``.
    """
    import numpy as np

    for tenant, rate in rates.items():
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate of tenant {tenant!r} must be a finite number > 0 (req/s), got {rate!r}")
    if not seconds >= 0:
        raise ValueError(f"seconds must be >= 0, got {seconds!r}")
    rng = np.random.default_rng(seed)
    rows = []
    for tenant, rate in rates.items():
        prompt = (input_tokens or {}).get(tenant, 256)
        t = rng.exponential(1 / rate)
        while t < seconds:
            rows.append((round(float(t), 6), prompt, output_tokens, tenant))
            t += rng.exponential(1 / rate)
    rows.sort()
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrival_s", "input_tokens", "output_tokens", "tenant_id"])
        w.writerows(rows)
    return len(rows)
