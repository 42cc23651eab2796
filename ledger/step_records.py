"""Per-step engine work as ledger rows: :class:`~kvmeter.stats.EngineStepShares` → the
``engine_steps`` table (migration 0007), through the spool's ``steps`` stream.

One :class:`~kvmeter.stats.EngineStepShares` (one engine step) becomes one row per tenant entry::

    ts, replica, engine_idx, model, tenant_id, tier, duration_s,
    prefill_tokens, decode_tokens, kv_tokens, requests, prefill_request_ids

``ts`` is the step's wall clock (epoch seconds, as received by the frontend), ``replica`` names
the serve process hosting the engine (:func:`default_replica`), ``model`` the served model. The
counts are the stats' own (their definitions: :mod:`kvmeter.collectors.vllm_step_shares`).

Writing never blocks the engine loop: :meth:`kvmeter.ledger.Ledger.record_step_shares` encodes
the rows (msgspec, a few µs per tenant) and queues them on the spool stream; the stream's
committer thread writes and fsyncs them in groups, and the drain inserts them in batches like
every other stream. Cost: ≈ 120 bytes per tenant per step in the spool (a 5-tenant engine at 50
steps/s: ≈ 30 KB/s).
"""

from __future__ import annotations

import os
import socket
from typing import Annotated

import msgspec
from msgspec import Meta

from kvmeter.stats import EngineStepShares

from .errors import InvalidRecord
from .records import StreamSpec, _convert, _encoder

__all__ = ["STEP_COLUMNS", "STEP_STREAM", "encode_step_shares", "default_replica"]

STEP_COLUMNS: tuple[str, ...] = (
    "ts", "replica", "engine_idx", "model", "tenant_id", "tier", "duration_s",
    "prefill_tokens", "decode_tokens", "kv_tokens", "requests", "prefill_request_ids",
)
#: The spool stream of step rows (drained into ``engine_steps``).
STEP_STREAM = StreamSpec("steps", "engine_steps", 1, {1: STEP_COLUMNS})

_MIN_TS = 946_684_800.0
_MAX_TS = 7_258_118_400.0
_Str = Annotated[str, Meta(max_length=4096)]
_U32 = Annotated[int, Meta(ge=0, le=2**32 - 1)]


class _StepRow(msgspec.Struct, array_like=True, gc=False):
    ts: Annotated[float, Meta(ge=_MIN_TS, lt=_MAX_TS)]
    replica: _Str
    engine_idx: Annotated[int, Meta(ge=0, le=65535)]
    model: _Str
    tenant_id: _Str
    tier: _Str
    duration_s: Annotated[float, Meta(ge=0, lt=1e12)]
    prefill_tokens: _U32
    decode_tokens: _U32
    kv_tokens: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    requests: _U32
    prefill_request_ids: list[_Str]


assert tuple(_StepRow.__struct_fields__) == STEP_COLUMNS, "_StepRow out of step with STEP_COLUMNS"


def default_replica(worker: int | None = None) -> str:
    """The replica name of this serve process: ``<hostname>`` (``<hostname>/w<slot>`` for a
    ``--workers`` slot); ``$KVMETER_REPLICA`` overrides it."""
    name = os.environ.get("KVMETER_REPLICA") or socket.gethostname() or "local"
    return name if worker is None else f"{name}/w{worker}"


def encode_step_shares(shares: EngineStepShares, *, model: str, replica: str) -> list[bytes]:
    """One JSON array (no newline) per tenant entry of a step, in :data:`STEP_COLUMNS` order.

    Args:
        shares: one engine step's per-tenant work.
        model: the served model's name.
        replica: the serve process's name (:func:`default_replica`).
    Returns:
        The encoded rows (empty for a step without tenants).
    Raises:
        InvalidRecord: naming the field and value (a timestamp outside 2000..2200, a negative count).
    """
    if type(shares) is not EngineStepShares:
        raise InvalidRecord(f"expected EngineStepShares, got {type(shares).__name__}")
    out = []
    for t in shares.tenants:
        values = (shares.wall_ts, replica, shares.engine_idx, model, t.tenant_id, t.tier, shares.duration_s,
                  t.prefill_tokens, t.decode_tokens, t.kv_tokens, t.requests, list(t.prefill_request_ids))
        out.append(_encoder.encode(_convert(values, _StepRow, STEP_COLUMNS, "EngineStepShares")))
    return out
