"""The run store boundary: where an agent run's tool-call permits, approvals, idempotency records
and loop state live, and the atomic operations on them.

One small abstract class (:class:`AgentStore`) with an in-memory implementation for one process
(:class:`~kvmeter.serving.agents.memory.MemoryAgentStore`) and a Redis one shared by every gateway
replica (:class:`~kvmeter.serving.agents.redis_store.RedisAgentStore`, one Lua script per
operation). Each operation is **atomic**: it reads and writes everything it decides on — the run's
stop, its permitted-call history, the approval, the idempotency record and the run's tool-call
counter (the same counter the quota's ``max_tool_calls`` check reads) — as one step, so concurrent
reports of one run can never both take the last permit of a budget or the one permit of an
approval. The same tests run on both implementations.

The decision of :meth:`AgentStore.report`, in order (see :class:`ReportResult` for the outcomes):

1. **replay** — a ``side_effect`` or ``high_risk`` call with an idempotency key already permitted
   under that key (same tool and arguments, else ``idempotency_conflict``), or a ``side_effect``
   call without a key whose signature was permitted in the run within ``side_effect_window_s``:
   the first permit's answer (``replayed``), nothing counted;
2. **stopped run** — ``run_stopped``;
3. **approval** (``high_risk``) — the approval named by ``approval_id``, else the one bound to
   (run, key, tool, argument digest, policy version): pending → ``pending_approval``; rejected →
   ``approval_rejected``; approved and unexpired → step 4 with it; otherwise (none, consumed,
   expired) a new pending approval is created → ``pending_approval``. With an explicit
   ``approval_id``: ``approval_not_found``, ``approval_mismatch`` (another run, key, tool, argument
   digest or policy version), ``approval_used`` or ``approval_expired`` instead of a new one;
4. **loop stops** — identical calls and cycles (:mod:`.loops`): the run is stopped → ``loop_stopped``;
5. **budget** — the run's tool-call counter is incremented; over ``max_tool_calls`` →
   ``budget_exceeded`` (the counter keeps the call, so the run's next model call is refused too);
6. **permit** — ``allowed``: the signature joins the run's history, the approval is consumed, the
   idempotency record written, the repeated-prompt count reset.

With ``decide_only`` (a call the *model emitted*, not yet reported: the report is the permit)
steps 1 and 4–6 are skipped: after step 3 the answer is ``approval_granted`` (an approved
``high_risk`` call; nothing consumed) or ``allowed`` (any other class).

Times are wall-clock epoch seconds from the caller's clock (several gateway processes sharing a
Redis store agree on them).
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import asdict, dataclass
from typing import Mapping

from kvmeter.attribution import Attribution
from kvmeter.serving.tenancy.limits import LoopStops

from .loops import cycle_detail, identical_detail, prompt_detail

__all__ = ["AgentStore", "ReportRequest", "ReportResult", "Approval", "RunStop", "ModelCallResult",
           "DecideResult", "AgentStoreUnavailable", "REPORT_OUTCOMES", "APPROVAL_STATES",
           "binding_key", "RUN_STATE_TTL_S", "IDEMPOTENCY_KEY_TTL_S", "APPROVAL_RETENTION_S"]

#: Outcomes of :meth:`AgentStore.report`.
REPORT_OUTCOMES = ("allowed", "replayed", "pending_approval", "approval_granted", "approval_rejected",
                   "approval_expired", "approval_used", "approval_mismatch", "approval_not_found",
                   "idempotency_conflict", "budget_exceeded", "loop_stopped", "run_stopped")
#: States of an approval (``expired`` is derived: a pending or approved one past its expiry).
APPROVAL_STATES = ("pending", "approved", "rejected", "consumed")

#: Seconds a run's state lives after its last write (the quota's run counters live 7 days).
RUN_STATE_TTL_S = 7 * 86_400
#: Seconds a tool call's explicit idempotency key is remembered (as the gateway's own keys).
IDEMPOTENCY_KEY_TTL_S = 86_400
#: Seconds an approval stays readable after its expiry (the ledger keeps it for good).
APPROVAL_RETENTION_S = 86_400


class AgentStoreUnavailable(ConnectionError):
    """The shared run store cannot be reached. Tool-call permits fail closed on it (a 503): an
    approval or a side-effect call must never be permitted twice because a replica could not
    check."""


def binding_key(tenant_id: str, api_key_id: str, run_id: str, tool: str, arguments_sha256: str,
                policy_version: str) -> str:
    """The hex SHA-256 that binds an approval to its run, key, tool, arguments and policy version."""
    raw = "\x1f".join((tenant_id, api_key_id, run_id, tool, arguments_sha256, policy_version))
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class RunStop:
    """Why a run was stopped.

    Attributes:
        reason: ``identical_tool_calls``, ``tool_cycle`` or ``repeated_prompt``.
        tool: the tool of the call that stopped it (``""`` for a repeated prompt).
        period: the cycle's length in calls (``tool_cycle``), else 0.
        limit: the threshold that was crossed.
        ts: wall-clock epoch seconds of the stop.
    """

    reason: str
    tool: str = ""
    period: int = 0
    limit: int = 0
    ts: float = 0.0

    @property
    def detail(self) -> str:
        """One sentence for the client and the ledger."""
        if self.reason == "identical_tool_calls":
            return identical_detail(self.tool, self.limit)
        if self.reason == "tool_cycle":
            return cycle_detail(self.tool, self.period, self.limit)
        return prompt_detail(self.limit)


@dataclass(frozen=True, slots=True)
class Approval:
    """An approval request for one high-risk tool call and its decision.

    Attributes:
        approval_id: its id (a UUID).
        tenant_id, workspace_id, project_id, api_key_id: the requesting key.
        run_id, tool, risk_class, arguments_sha256, policy_version: what it is bound to.
        created_ts, expires_ts: wall-clock epoch seconds; it must be decided and used before
            ``expires_ts``.
        state: ``pending``, ``approved``, ``rejected`` or ``consumed`` (approved and used).
        decided_by: the deciding key's id; decided_ts: when (0 when undecided).
        reason: the approver's reason (required for a rejection).
        tool_call_id: the permit it was consumed by.
    """

    approval_id: str
    tenant_id: str
    workspace_id: str
    project_id: str
    api_key_id: str
    run_id: str
    tool: str
    risk_class: str
    arguments_sha256: str
    policy_version: str
    created_ts: float
    expires_ts: float
    state: str = "pending"
    decided_by: str = ""
    decided_ts: float = 0.0
    reason: str = ""
    tool_call_id: str = ""

    def attribution(self, tier: str) -> Attribution:
        """The requesting key's attribution, bound to the approval's run, at ``tier``."""
        return Attribution(tenant_id=self.tenant_id, workspace_id=self.workspace_id, project_id=self.project_id,
                           api_key_id=self.api_key_id, tier=tier, agent_run_id=self.run_id)

    def status(self, now: float) -> str:
        """``state``, or ``expired`` for a pending or approved approval at or past its expiry."""
        if self.state in ("pending", "approved") and now >= self.expires_ts:
            return "expired"
        return self.state

    def to_dict(self, now: float) -> dict[str, object]:
        """The API's JSON object of it (with ``status`` at ``now``)."""
        d = asdict(self)
        d["agent_run_id"] = d.pop("run_id")
        d["status"] = self.status(now)
        return d

    @classmethod
    def from_fields(cls, raw: Mapping[str, object]) -> "Approval":
        """From a mapping of field name → value (strings accepted for the numbers)."""
        floats = ("created_ts", "expires_ts", "decided_ts")
        return cls(**{f: (float(raw[f]) if f in floats else str(raw[f]))  # type: ignore[arg-type]
                      for f in cls.__dataclass_fields__ if f in raw})


@dataclass(frozen=True, slots=True)
class ReportRequest:
    """One tool call to decide (everything :meth:`AgentStore.report` needs, policy already applied).

    Attributes:
        tenant_id, workspace_id, project_id, api_key_id, run_id: who and which run.
        tool, risk_class, arguments_sha256, policy_version: the call and the policy it was
            classified under.
        idempotency_key: the client's key for the call (``""``: none).
        approval_id: the approval the report names (``""``: the one bound to the call).
        new_tool_call_id: the id a permit gets; new_approval_id: the id a new approval gets.
        approval_ttl_s, side_effect_window_s: from the key's tool policy (seconds, > 0).
        max_tool_calls: the run's tool-call budget (None: unlimited).
        tool_calls_key: the quota's counter of the run's tool calls.
        loop_stops: the tier's loop stops (None: none).
        decide_only: decide without a permit (module docstring).
        now: wall-clock epoch seconds.
    """

    tenant_id: str
    workspace_id: str
    project_id: str
    api_key_id: str
    run_id: str
    tool: str
    risk_class: str
    arguments_sha256: str
    policy_version: str
    new_tool_call_id: str
    new_approval_id: str
    tool_calls_key: bytes
    now: float
    idempotency_key: str = ""
    approval_id: str = ""
    approval_ttl_s: float = 3_600.0
    side_effect_window_s: float = 3_600.0
    max_tool_calls: int | None = None
    loop_stops: LoopStops | None = None
    decide_only: bool = False

    @property
    def binding(self) -> str:
        """The approval binding of this call (:func:`binding_key`)."""
        return binding_key(self.tenant_id, self.api_key_id, self.run_id, self.tool, self.arguments_sha256,
                           self.policy_version)

    def new_approval(self) -> Approval:
        """The pending approval this call creates when it needs one."""
        return Approval(self.new_approval_id, self.tenant_id, self.workspace_id, self.project_id,
                        self.api_key_id, self.run_id, self.tool, self.risk_class, self.arguments_sha256,
                        self.policy_version, self.now, self.now + self.approval_ttl_s)

    def mismatch(self, a: Approval) -> str:
        """The first binding field in which approval ``a`` differs from this call, or ``""``."""
        for name, mine, theirs in (("tenant", self.tenant_id, a.tenant_id), ("agent_run_id", self.run_id, a.run_id),
                                   ("api_key", self.api_key_id, a.api_key_id), ("tool", self.tool, a.tool),
                                   ("arguments", self.arguments_sha256, a.arguments_sha256),
                                   ("policy_version", self.policy_version, a.policy_version)):
            if mine != theirs:
                return name
        return ""


@dataclass(frozen=True, slots=True)
class ReportResult:
    """The decision of :meth:`AgentStore.report`.

    Attributes:
        outcome: one of :data:`REPORT_OUTCOMES` (module docstring).
        tool_call_id: the permit's id (``allowed``; for ``replayed`` the first permit's; for
            ``approval_used`` the permit that used the approval).
        approval: the approval involved (pending, rejected, consumed, ...), if any.
        approval_created: True when this report created ``approval``.
        tool_calls: the run's tool-call counter after this report (``allowed`` /
            ``budget_exceeded``), else None.
        stop: the run's stop (``run_stopped`` / ``loop_stopped``).
        stopped_now: True when this report stopped the run.
        mismatch: for ``approval_mismatch`` the binding field that differs (``agent_run_id``,
            ``api_key``, ``tool``, ``arguments``, ``policy_version``).
    """

    outcome: str
    tool_call_id: str = ""
    approval: Approval | None = None
    approval_created: bool = False
    tool_calls: int | None = None
    stop: RunStop | None = None
    stopped_now: bool = False
    mismatch: str = ""


@dataclass(frozen=True, slots=True)
class ModelCallResult:
    """The decision of :meth:`AgentStore.model_call`.

    Attributes:
        outcome: ``ok``, ``run_stopped``, ``approval_pending`` or ``loop_stopped``.
        stop: the run's stop, if stopped.
        stopped_now: True when this call stopped the run (repeated prompt).
        approval_id: the oldest pending approval of the run (``approval_pending``).
        repeats: model calls in a row with this prompt digest, this one included (0 without one).
    """

    outcome: str
    stop: RunStop | None = None
    stopped_now: bool = False
    approval_id: str = ""
    repeats: int = 0


@dataclass(frozen=True, slots=True)
class DecideResult:
    """The answer of :meth:`AgentStore.decide`.

    Attributes:
        outcome: ``approved``, ``rejected``, ``not_found``, ``already_decided`` or ``expired``.
        approval: the approval after the decision (or as found), None when not found.
    """

    outcome: str
    approval: Approval | None = None


class AgentStore(abc.ABC):
    """Where agent-run state lives (see the module docstring). Every method is atomic.

    Raises (every method):
        AgentStoreUnavailable: a shared store cannot be reached (nothing was applied).
    """

    #: Short name for logs (``memory``, ``redis``).
    name: str = "store"

    @abc.abstractmethod
    async def report(self, req: ReportRequest) -> ReportResult:
        """Decide one tool call (module docstring)."""

    @abc.abstractmethod
    async def model_call(self, tenant_id: str, run_id: str, prompt_digest: str, max_repeated_prompts: int | None,
                         now: float) -> ModelCallResult:
        """Check a model call of a run: stopped → ``run_stopped``; a pending, unexpired approval →
        ``approval_pending``; with a ``prompt_digest`` (``""``: none), the repeated-prompt stop
        (:mod:`.loops`) → ``loop_stopped``; else ``ok`` (the prompt recorded)."""

    @abc.abstractmethod
    async def decide(self, approval_id: str, approve: bool, actor_key_id: str, reason: str,
                     now: float) -> DecideResult:
        """Approve or reject a pending, unexpired approval (``already_decided``, ``expired``,
        ``not_found`` otherwise)."""

    @abc.abstractmethod
    async def get_approval(self, approval_id: str) -> Approval | None:
        """The approval, or None (unknown, or dropped ``APPROVAL_RETENTION_S`` after expiry)."""

    @abc.abstractmethod
    async def list_pending(self, tenant_id: str | None, now: float, limit: int) -> list[Approval]:
        """Up to ``limit`` pending, unexpired approvals of a tenant (None: every tenant), the
        soonest to expire first."""

    @abc.abstractmethod
    async def run_stop(self, tenant_id: str, run_id: str) -> RunStop | None:
        """The run's stop, or None while it runs."""

    async def aclose(self) -> None:
        """Release connections (no-op by default)."""
        return None

