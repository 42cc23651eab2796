"""The refusals of agent-run policy, each a :class:`~kvmeter.errors.Refusal` the gateway answers
in the OpenAI error shape (:func:`kvmeter.serving.gateway.errors.api_error`).

=================================  ======  ================================================================
code                               status  when
=================================  ======  ================================================================
``tool_blocked``                   403     a ``block`` pattern of the key's chain matches the tool
``tool_not_allowed``               403     the allow list in force does not match the tool
``approval_rejected``              403     an approver rejected this call (until the approval expires)
``approval_forbidden``             403     the key may not read or decide this approval
``approval_not_found``             404     no such approval (or dropped a day after its expiry)
``approval_pending``               409     a model call of a run with an undecided approval
``approval_mismatch``              409     the named approval is bound to another run, key, tool,
                                           arguments or policy version
``approval_used``                  409     the named approval already gave its one permit
``approval_expired``               409     the named approval expired before it was decided or used
``approval_already_decided``       409     deciding an approval twice
``agent_run_stopped``              409     the run was stopped as a loop or retry storm
``idempotency_key_reused``         422     the call's idempotency key was used for another call
``run_budget_exceeded``            429     the run's ``max_tool_calls`` is spent (level ``agent_run``)
``agent_store_unavailable``        503     the shared run store is down (fail closed; retry after 1 s)
=================================  ======  ================================================================

Every 409, and the 429 ``run_budget_exceeded``, carries ``x-should-retry: false``: OpenAI's SDKs
retry 409s and 429s on their own, and none of these changes by retrying the same request (an
approval is a person's decision; a stopped run stays stopped; a spent budget is not given back).
The error body names what it is about beside OpenAI's four fields: ``tool`` and ``rule``,
``approval_id``, ``reason`` / ``detail`` of a stop, ``mismatch``.
"""

from __future__ import annotations

from typing import Any

from kvmeter.errors import NO_RETRY_HEADERS, Refusal
from kvmeter.serving.quota.base import QuotaRejected

__all__ = ["AgentRefusal", "ModelCallRefused", "NO_RETRY"]

#: The header telling OpenAI's SDKs not to retry a refusal (:data:`kvmeter.errors.NO_RETRY_HEADERS`).
NO_RETRY = NO_RETRY_HEADERS


class AgentRefusal(Refusal):
    """A refused tool call, approval request or run (see the module docstring for the codes).

    Args:
        message: for the client; never contains arguments (only their digest) or secrets.
        status_code, code: the HTTP answer.
        fields: extra fields of the error body (``tool``, ``rule``, ``approval_id``, ...).
        param: the request field it is about.
        retry_after_s: for 503.
    """

    def __init__(self, message: str, *, status_code: int, code: str, fields: dict[str, Any] | None = None,
                 param: str | None = None, retry_after_s: float | None = None) -> None:
        # a 409, or a spent run budget (429): the same call is refused the same way however often it is sent
        headers = dict(NO_RETRY) if status_code == 409 or code == "run_budget_exceeded" else None
        super().__init__(message, status_code=status_code, code=code, param=param, headers=headers,
                         retry_after_s=retry_after_s, level="agent_run")
        self.fields = dict(fields or {})

    def body_fields(self) -> dict[str, Any]:
        return dict(self.fields)


class ModelCallRefused(QuotaRejected):
    """A model call of a run refused by agent-run policy: ``agent_run_stopped`` or
    ``approval_pending`` (409, level ``agent_run``; the body adds ``approval_id`` or the stop's
    ``reason`` and ``detail``), ``agent_store_unavailable`` (503).

    A :class:`~kvmeter.serving.quota.QuotaRejected`, so the gateway answers it wherever it answers
    quota refusals (admission step 5) and publishes it as an admission decision.
    """

    def __init__(self, message: str, *, status_code: int, reason: str, dimension: str,
                 fields: dict[str, Any] | None = None, retry_after_s: float | None = None) -> None:
        headers = dict(NO_RETRY) if status_code == 409 else {}
        super().__init__(message, status_code=status_code, reason=reason, level="agent_run", dimension=dimension,
                         retry_after_s=retry_after_s, headers=headers)
        self.fields = dict(fields or {})

    def body_fields(self) -> dict[str, Any]:
        return {**super().body_fields(), **self.fields}
