"""The attribution of a request: on whose bill its usage goes, and what it was for.

An :class:`Attribution` is built once per request, right after authentication, by
:meth:`kvmeter.serving.tenancy.Principal.attribution` (the API key's principal plus the request's
agent run id, the served model and the endpoint), and carried by reference into everything that
records or reports the request: the quota's estimate, the scheduler's job, the engine request (the
engine stamps it on the stats it publishes), the usage event, the attempt record, the gateway's and
the quota's stats. Nothing copies its fields one by one; the ledger flattens it into columns at one
boundary (:func:`kvmeter.ledger.records.column_getter`).

What belongs in it, and why: exactly the dimensions usage is **billed, limited, grouped or
labelled by**, all fixed when the request is admitted —

* ``tenant_id`` — the billed party: the organisation at the top of the principal tree (the one id
  of the tenant; the tree's top level is called ``org`` only as a quota level name);
* ``workspace_id``, ``project_id``, ``api_key_id`` — the rest of the key's path (invoice lines,
  quota levels, ``group_by``); ``api_key_id`` is the key's public id, never the secret;
* ``tier`` — the tenant's tier at admission (price discount, fairness weight, SLOs, labels);
* ``agent_run_id`` — the agent run the call belongs to, or ``""`` (run budgets, ``group_by``);
* ``model`` — the served model name (prices, invoice lines, labels);
* ``endpoint`` — ``chat.completions``, ``completions`` or ``agent_runs.tool_calls``
  (``group_by``, refusal labels).

What does not belong: the request id, the ``Idempotency-Key`` and the attempt number identify
*which* logical request and which try of it this is (deduplication, not attribution: two attempts
of one logical request share their attribution); ``stream`` says how it was answered; the
principal's ``admin`` flag is authorisation, not billing. An :class:`~kvmeter.ledger.records.Adjustment`
carries an attribution narrowed to the tenant (and optionally its workspace, project or key), with
the per-request fields empty.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Attribution", "ATTRIBUTION_FIELDS", "UNATTRIBUTED"]


@dataclass(frozen=True, slots=True)
class Attribution:
    """Who is billed for a request, and what for (see the module docstring for why these fields).

    Attributes:
        tenant_id: the billed tenant (the organisation); ``""`` only in :data:`UNATTRIBUTED`.
        workspace_id, project_id, api_key_id: the API key's path below the tenant (``""`` when
            not narrowed, e.g. on an adjustment for the whole tenant).
        tier: the tenant's tier at admission.
        agent_run_id: the agent run (``X-Agent-Run-Id``), or ``""``.
        model: the served model name.
        endpoint: ``chat.completions``, ``completions``, ``agent_runs.tool_calls`` or ``""``.
    Raises:
        TypeError: a field that is not a ``str``.
    """

    tenant_id: str
    workspace_id: str = ""
    project_id: str = ""
    api_key_id: str = ""
    tier: str = ""
    agent_run_id: str = ""
    model: str = ""
    endpoint: str = ""

    def __post_init__(self) -> None:
        for name in ATTRIBUTION_FIELDS:
            value = getattr(self, name)
            if type(value) is not str:
                raise TypeError(f"Attribution.{name} must be a str, got {value!r}")


#: The field names, in order (the ledger's attribution columns carry the same names).
ATTRIBUTION_FIELDS: tuple[str, ...] = ("tenant_id", "workspace_id", "project_id", "api_key_id", "tier",
                                       "agent_run_id", "model", "endpoint")
assert ATTRIBUTION_FIELDS == tuple(f.name for f in fields(Attribution))

#: The attribution of engine work no request claimed (stats of a request the engine adapter never
#: received from the gateway: a benchmark, a test driving the engine directly). Its tenant is
#: ``""``, which reconciliation reports as unattributed engine work.
UNATTRIBUTED = Attribution(tenant_id="")
