"""What a simulation publishes on a :class:`~kvmeter.bus.StatsBus` — the stats the real serve
path publishes, from the simulated engine and scheduler, on the simulated clock — so the same
consumers (the Prometheus exporter, the ledger's step records, the noisy-neighbour detectors) run
on a simulated GPU deployment unchanged. The simulator never imports a consumer: whoever passes
the bus subscribes them (``bench/noisy/sim_scenarios.py``).

Published, with each field's source (``wall_ts`` = the simulation clock's wall reading):

* :class:`~kvmeter.stats.EngineStepShares` — every engine step (:mod:`.steps`);
* :class:`~kvmeter.stats.EngineStepStats` — one per completed step **or decode segment** (a
  segment of k steps is one record with the segment's sums; :func:`~.steps.step_stats`, the
  fields :class:`~.engine.SimEngine` fills), without per-token ITLs (a long segment would build
  one float per decode token; the segment's ITL sum goes to the scheduler as before);
* :class:`~kvmeter.stats.SchedulerStats` — the scheduler core's snapshot at each simulation
  sample (every ``sample_interval_s``, as :class:`~kvmeter.serving.scheduler.fair.FairScheduler`
  publishes every ``stats_interval_s``);
* :class:`~kvmeter.stats.RequestCompletion` — each completed request: engine-true tokens (input,
  cached input, output), TTFT, E2E and queue time from its arrival at the scheduler, ``slo_met`` by
  its tier's :meth:`~kvmeter.serving.tenancy.TierPolicy.meets_slo` with the mean ITL ``(finish −
  first token) ÷ (output − 1)``, its trace's agent run id, and its re-prefilled input tokens by the
  gateway's own tracker (:class:`~kvmeter.serving.gateway.reprefill.PrefixReuse`, probed at
  dispatch, settled at the end), on the trace's hash blocks: a prompt's tokens stand as each hash
  block's id repeated ``group_tokens`` times, then a filler unique to the request, so equal hash
  prefixes are equal prompts (the trace's only notion of prompt identity) and the tracker's blocks
  are the trace's. ``itls_s`` is left empty (per-token gaps stay in the segment log). Requests the
  scheduler refused or dropped publish nothing (the gateway's refusals are other records).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import Clock
from kvmeter.serving.gateway.reprefill import PrefixProbe, PrefixReuse
from kvmeter.stats import RequestCompletion
from kvmeter.tokens import TokenCounts

from .steps import step_stats

if TYPE_CHECKING:  # pragma: no cover
    from kvmeter.serving.scheduler.config import SchedulerConfig
    from kvmeter.serving.scheduler.core import SchedulerCore

    from .replica import SimReplica, SimRequest, StepOutcome

__all__ = ["SimPublisher"]


class SimPublisher:
    """Publishes one simulation's stats on ``bus`` (module docstring).

    Args:
        bus: where to publish.
        clock: the simulation's clock (wall readings stamp the records; the re-prefill tracker's
            window runs on its monotonic reading).
        model: the served model's name (attribution of completions).
        scheduler_config: the tiers' objectives (``slo_met``).
        group_tokens: tokens per trace hash block.
    """

    def __init__(self, bus: StatsBus, clock: Clock, *, model: str, scheduler_config: "SchedulerConfig",
                 group_tokens: int) -> None:
        self.bus = bus
        self.clock = clock
        self.model = model
        self.scfg = scheduler_config
        self.G = group_tokens
        self.reuse = PrefixReuse(group_tokens, clock=clock)
        self._probes: dict[str, PrefixProbe] = {}
        self._prefix: dict[int, tuple[int, int]] = {}  # replica → (queried, hit) tokens so far
        self._filler = 0

    def dispatched(self, req: "SimRequest") -> None:
        """``req`` was handed to a replica now: probe its warm prefix."""
        if not req.hashes:
            return
        n_full = min(len(req.hashes), req.input_tokens // self.G)
        prompt = [h for h in req.hashes[:n_full] for _ in range(self.G)]
        self._filler -= 1
        prompt += [self._filler] * (req.input_tokens - len(prompt))
        self._probes[req.request_id] = self.reuse.probe([prompt])

    def segment(self, rep: "SimReplica", outcome: "StepOutcome") -> None:
        """One completed step or decode segment of ``rep``: its :class:`EngineStepStats`
        (:func:`~.steps.step_stats`, without per-token ITLs)."""
        q0, h0 = self._prefix.get(rep.idx, (0, 0))
        self._prefix[rep.idx] = (rep.cache.queries_tokens, rep.cache.hits_tokens)
        self.bus.publish(step_stats(rep, outcome, prefix_queries0=q0, prefix_hits0=h0, wall_ts=self.clock.wall(),
                                    with_itls=False))

    def finished(self, req: "SimRequest", *, arrival_s: float, dispatch_s: float, agent_run_id: str = "") -> None:
        """``req`` generated its last token: its :class:`RequestCompletion` (times in virtual
        seconds; ``arrival_s`` at the scheduler)."""
        assert req.first_token_s is not None and req.finish_s is not None
        tokens = TokenCounts(input_tokens=req.input_tokens, cached_input_tokens=req.cached_tokens,
                             output_tokens=req.target)
        probe = self._probes.pop(req.request_id, None)
        reprefill = probe.settle(tokens) if probe is not None else 0
        ttft = req.first_token_s - arrival_s
        itl = (req.finish_s - req.first_token_s) / (req.target - 1) if req.target > 1 else None
        tier = self.scfg.tier(req.tier)
        self.bus.publish(RequestCompletion(
            attribution=Attribution(req.tenant_id, tier=req.tier, model=self.model, agent_run_id=agent_run_id),
            outcome="ok", tokens=tokens, ttft_s=ttft, e2e_s=req.finish_s - arrival_s,
            queue_s=dispatch_s - arrival_s, slo_met=tier.meets_slo(ttft, itl) if tier.has_slo else None,
            wall_ts=self.clock.wall(), stream=True, reprefill_input_tokens=reprefill))

    def sample(self, core: "SchedulerCore") -> None:
        """A periodic sample: the scheduler core's :class:`SchedulerStats`."""
        self.bus.publish(core.snapshot())
