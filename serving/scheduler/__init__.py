"""Fair scheduling: per-tenant queues ordered by consumed work (VTC), KV budgets, engine gating,
bounded queues, deadlines and shedding by tier.

``FairScheduler`` is what the gateway calls (the :class:`Scheduler` contract in ``base``);
``SchedulerCore`` is the synchronous core it wraps, which the simulator drives directly. Its
published stats (:class:`~kvmeter.stats.SchedulerStats`) live in :mod:`kvmeter.stats.scheduler`.
"""

from .base import Grant, Job, PassThroughScheduler, Scheduler, SchedulerRejected
from .config import SchedulerConfig
from .core import CoreGrant, SchedulerCore
from .fair import FairScheduler
from .fairness import jain_index
from .policy import POLICIES, FCFSPolicy, OrderingPolicy, RPMLimitPolicy, VTCPolicy, make_policy

__all__ = [
    "Job", "Grant", "Scheduler", "SchedulerRejected", "PassThroughScheduler",
    "SchedulerConfig",
    "SchedulerCore", "CoreGrant", "FairScheduler",
    "OrderingPolicy", "VTCPolicy", "FCFSPolicy", "RPMLimitPolicy", "make_policy", "POLICIES",
    "jain_index",
]
