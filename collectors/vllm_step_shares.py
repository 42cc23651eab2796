"""Per-step, per-request scheduled work of vLLM's engine core, and its per-tenant shares.

Two halves, neither importing vLLM (the scheduler hook in :mod:`kvmeter.collectors.vllm_hooks`
calls the engine-core half; the engine adapter calls the frontend half):

**Engine core** (:func:`step_rows`, called by the hook right after vLLM's ``Scheduler.schedule``,
vLLM 0.32 ``vllm/v1/core/sched/scheduler.py:591``). One row per request the step scheduled, plus
one per running request it did not (it still holds KV)::

    [engine_request_id: str, prefill_tokens: int, decode_tokens: int, kv_tokens: int]

* the step's tokens of the request are ``SchedulerOutput.num_scheduled_tokens[id]`` (spec-decode
  drafts included, as vLLM counts them);
* they are **prefill** when the request's chunk starts inside its prompt — ``num_computed_tokens``
  before the step (= after it − the step's tokens: vLLM advances it when it schedules,
  ``_update_after_schedule``, scheduler.py:1616) ``< num_prompt_tokens`` — else **decode**. A
  recompute after a preemption starts at 0 and so is prefill; a prefix-cache hit is never
  scheduled, so a request's prefill tokens summed over its steps are prompt − cached (vLLM
  recomputes the last prompt token of a full hit: it is then 1 scheduled, not cached);
* **kv_tokens** is ``num_computed_tokens`` after scheduling: the KV positions the request holds
  once the step has run (prompt and fed-back output, prefix-cache hits included). Requests waiting
  (never admitted, or preempted) hold none and have no row.

Rows cross to the frontend like the accounts do (``kv_connector_stats``, key
:data:`STEPS_STATS_KEY`), one entry ``{"dur": s, "rows": [...]}`` per step. Cost: one pass over the
scheduled and running requests per step (a few µs each) and about 40 bytes per running request
per step on the engine core → frontend transport (a 256-request batch: ~10 KB per step).

``dur`` (seconds, engine core's monotonic clock) is the step's span: from ``schedule`` to the end
of ``update_from_output``, starting no earlier than the previous step's end, so that with
asynchronous scheduling (step N+1 scheduled before N's output is processed) the spans tile time
without overlap. KV token-seconds = Σ over steps of kv_tokens × dur: the gaps between steps (the
engine core reading its input queue, idle time) are not counted.

**Frontend** (:func:`tenant_shares`): the rows of one step grouped by the attribution of each
request (engine ids mapped back with :func:`~kvmeter.collectors.vllm_hooks.external_request_id`'s
rule, passed in), into :class:`~kvmeter.stats.EngineStepShares`, each tenant's entry naming its
requests that had prefill tokens in the step (kvmeter ids; the ledger's ``engine_steps`` table
stores them, :mod:`kvmeter.ledger.step_records`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from kvmeter.attribution import UNATTRIBUTED, Attribution
from kvmeter.stats import EngineStepShares, TenantStepShare

__all__ = ["step_rows", "tenant_shares", "STEPS_STATS_KEY", "MAX_PENDING_STEPS"]

#: Key in ``SchedulerStats.kv_connector_stats`` under which the step rows cross to the frontend.
STEPS_STATS_KEY = "kvmeter.step_rows"
#: Steps held in the engine core while no step carries stats, newest kept.
MAX_PENDING_STEPS = 4096


def step_rows(requests: Mapping[str, Any], num_scheduled_tokens: Mapping[str, int],
              running: Iterable[Any]) -> list[list]:
    """The rows of one scheduled step (module docstring).

    Args:
        requests: vLLM's ``Scheduler.requests`` (engine request id → ``Request``).
        num_scheduled_tokens: ``SchedulerOutput.num_scheduled_tokens`` of the step.
        running: ``Scheduler.running`` after scheduling.
    Returns:
        ``[[id, prefill_tokens, decode_tokens, kv_tokens], ...]`` — plain ints and strings
        (msgpack-safe), scheduled requests first.
    """
    rows: dict[str, list] = {}
    for request_id, n in num_scheduled_tokens.items():
        request = requests.get(request_id)
        if request is None:
            continue
        kv = int(request.num_computed_tokens)
        n = int(n)
        prefill = n if kv - n < int(request.num_prompt_tokens) else 0
        rows[request_id] = [str(request_id), prefill, n - prefill, kv]
    for request in running:
        request_id = str(request.request_id)
        if request_id not in rows:
            rows[request_id] = [request_id, 0, 0, int(request.num_computed_tokens)]
    return list(rows.values())


def tenant_shares(step: Mapping[str, Any], *, wall_ts: float, engine_idx: int,
                  attribution_of: Callable[[str], Attribution | None],
                  external_id: Callable[[str], str]) -> EngineStepShares:
    """One step's rows (``{"dur", "rows"}`` as the engine core sent them) by tenant and tier.

    Args:
        step: the wire entry.
        wall_ts: wall-clock epoch seconds when the frontend received it.
        engine_idx: the data-parallel engine index.
        attribution_of: kvmeter request id → its attribution, ``None`` when unknown (grouped under
            :data:`~kvmeter.attribution.UNATTRIBUTED`, tenant ``""``).
        external_id: engine request id → kvmeter's.
    """
    totals: dict[tuple[str, str], list[int]] = {}
    prefilling: dict[tuple[str, str], list[str]] = {}
    for request_id, prefill, decode, kv in step["rows"]:
        rid = external_id(str(request_id))
        who = attribution_of(rid) or UNATTRIBUTED
        key = (who.tenant_id, who.tier)
        acc = totals.setdefault(key, [0, 0, 0, 0])
        acc[0] += int(prefill)
        acc[1] += int(decode)
        acc[2] += int(kv)
        acc[3] += 1
        if int(prefill) > 0:
            prefilling.setdefault(key, []).append(rid)
    return EngineStepShares(
        wall_ts=wall_ts, engine_idx=engine_idx, duration_s=max(0.0, float(step["dur"])),
        tenants=tuple(TenantStepShare(tenant_id=tenant, tier=tier, prefill_tokens=p, decode_tokens=d,
                                      kv_tokens=kv, requests=r,
                                      prefill_request_ids=tuple(sorted(prefilling.get((tenant, tier), ()))))
                      for (tenant, tier), (p, d, kv, r) in sorted(totals.items())))
