"""Real request traces: load them into one shape.

Supported (see ``../shared/data/SOURCES.md`` for provenance):

* ``azure-conv`` / ``azure-code`` — Azure LLM inference trace 2023 (CSV: ``TIMESTAMP`` with 7
  fractional digits, ``ContextTokens``, ``GeneratedTokens``).
* ``mooncake`` — Mooncake conversation trace (JSONL: ``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token prefix blocks).
* any path to a file in one of those two formats.

The data directory is ``$KVMETER_DATA_DIR`` if set, else ``../shared/data`` next to the repository
(where this project keeps its shared real data), else ``./shared/data``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TraceRequest", "load_trace", "data_dir", "TRACE_FILES", "TraceError"]

TRACE_FILES = {
    "azure-conv": "traces/AzureLLMInferenceTrace_conv_2023.csv",
    "azure-code": "traces/AzureLLMInferenceTrace_code_2023.csv",
    "mooncake": "traces/mooncake_conversation_trace.jsonl",
    "servegen-rates": "traces/servegen_m-large_perclient_2days.csv",
    "servegen-client0": "traces/servegen_m-large_client0_dataset.json",
}


class TraceError(ValueError):
    """A trace cannot be found or parsed; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: seconds since the trace's first request (≥ 0, non-decreasing in a trace).
        input_tokens: prompt length in tokens (≥ 1).
        output_tokens: generated length in tokens (≥ 1).
        hash_ids: prefix-block hashes (Mooncake; 512 tokens per block), () when absent.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def data_dir() -> Path:
    """The shared data directory (see module docstring)."""
    env = os.environ.get("KVMETER_DATA_DIR")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[1]
    for candidate in (repo.parent / "shared" / "data", Path.cwd() / ".." / "shared" / "data",
                      Path.cwd() / "shared" / "data"):
        if candidate.is_dir():
            return candidate
    return repo.parent / "shared" / "data"


def _resolve(name_or_path: str | os.PathLike) -> Path:
    key = str(name_or_path)
    if key in TRACE_FILES:
        path = data_dir() / TRACE_FILES[key]
    else:
        path = Path(key).expanduser()
    if not path.is_file():
        raise TraceError(f"trace {key!r} not found at {path} (set KVMETER_DATA_DIR to the data folder)")
    return path


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
            for t, i, o in zip(seconds, frame["ContextTokens"], frame["GeneratedTokens"])]


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


def load_trace(name_or_path: str | os.PathLike, limit: int | None = None) -> list[TraceRequest]:
    """Load a trace, sorted by arrival.

    Args:
        name_or_path: ``azure-conv``, ``azure-code``, ``mooncake`` or a file path (``.csv`` Azure
            format, ``.jsonl`` Mooncake format).
        limit: read at most this many rows (from the start of the file).
    Returns:
        Requests with ``arrival_s`` relative to the first one.
    Raises:
        TraceError: unknown name, missing file, or unparseable content.
    """
    path = _resolve(name_or_path)
    if path.suffix == ".csv":
        rows = _load_azure(path, limit)
    elif path.suffix == ".jsonl":
        rows = _load_mooncake(path, limit)
    else:
        raise TraceError(f"{path}: unknown trace format (expected .csv Azure or .jsonl Mooncake)")
    rows.sort(key=lambda r: r.arrival_s)
    return rows
