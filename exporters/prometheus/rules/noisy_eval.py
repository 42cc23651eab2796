"""The noisy-neighbour detectors over a short window: two scrapes of kvmeter's ``/metrics`` text,
the same predicates as the Prometheus rules (the ``*_score`` methods of
:class:`~.noisy.NoisyThresholds`, one definition), the tenants ranked per shape.

    before = scrape(); clock advances 30 s; after = scrape()
    ranked = rank(before, after, seconds=30.0)
    ranked["prefill_pressure"]  # [("hog", 0.5), ...]: most past its threshold first

What is measured between the two scrapes, per tenant (``sum by (tenant)`` as in ``noisy.yml``;
a counter that went down between them restarted, so its increase is its ``after`` value):

============================  ===========================================================================
shape                         inputs (increases of counters unless said)
============================  ===========================================================================
``prompt_cache_hit_low``      ``kvmeter_tokens_total`` input and cached_input
``retries``                   ``kvmeter_gateway_retries_total``, ``kvmeter_gateway_idempotent_requests_total``
``slow_clients``              ``kvmeter_stream_stall_cut_requests_total``
``prefill_pressure``          ``kvmeter_engine_tenant_scheduled_prefill_tokens_total`` by (model, tenant)
                              and by model; a tenant's score is its highest over models
``decode_pressure``           the same with ``..._decode_tokens_total``
``kv_pressure``               gauges of ``after``: ``kvmeter_tenant_active_kv_tokens`` (the tenant's, all
                              tenants') and the highest ``kvmeter_engine_kv_watermark_ratio``
``queue_pressure``            gauge ``kvmeter_scheduler_queue_depth_requests``, mean of the two scrapes
``prompt_cache_thrash``       ``kvmeter_prompt_reprefill_tokens_total`` ÷ ``kvmeter_tokens_total`` input
``agent_loops``               ``kvmeter_agent_run_model_calls_total``, ``kvmeter_agent_runs_seen_total``
============================  ===========================================================================

Only the window differs from the alerts': ``seconds`` here, :attr:`~.noisy.NoisyThresholds.window`
there (and no ``for``). Tenant ``other`` (many tenants in the bounded label) is never ranked.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from .noisy import SHAPES, THRESHOLDS, NoisyThresholds

__all__ = ["Snapshot", "parse", "rank"]

#: (labels as sorted (name, value) pairs) → value, per sample name
_Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One parsed ``/metrics`` scrape: every sample's value by sample name and labels (``_created``
    samples left out)."""

    samples: _Samples

    def series(self, name: str, **match: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The samples called ``name`` whose labels include ``match``."""
        return {k: v for k, v in self.samples.get(name, {}).items()
                if all((lk, lv) in k for lk, lv in match.items())}


def parse(text: str) -> Snapshot:
    """Parse Prometheus text exposition (``/metrics``) with prometheus-client's parser.

    Raises:
        ValueError: from the parser, on malformed text.
    """
    samples: _Samples = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            samples[s.name][tuple(sorted(s.labels.items()))] = float(s.value)
    return Snapshot(dict(samples))


def _by(values: dict[tuple[tuple[str, str], ...], float], keys: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for labels, v in values.items():
        d = dict(labels)
        out[tuple(d.get(k, "") for k in keys)] += v
    return out


def _increase(before: Snapshot, after: Snapshot, name: str, keys: tuple[str, ...] = ("tenant",),
              **match: str) -> dict[tuple[str, ...], float]:
    """Per-series increase from ``before`` to ``after`` (a restarted counter: its ``after`` value),
    summed by ``keys``."""
    old = before.series(name, **match)
    inc = {k: (v - old.get(k, 0.0) if v >= old.get(k, 0.0) else v) for k, v in after.series(name, **match).items()}
    return _by(inc, keys)


def _tenant(d: dict[tuple[str, ...], float]) -> dict[str, float]:
    return {k[0]: v for k, v in d.items()}


def rank(before: str | Snapshot, after: str | Snapshot, seconds: float,
         thresholds: NoisyThresholds = THRESHOLDS) -> dict[str, list[tuple[str, float]]]:
    """The tenants each detector fires for between two scrapes, most past the threshold first.

    Args:
        before, after: ``/metrics`` text (or :func:`parse` d snapshots) of the same process(es),
            ``after`` scraped ``seconds`` later.
        seconds: the time between the two scrapes (> 0).
        thresholds: the detectors' thresholds (default: those ``noisy.yml`` ships with).
    Returns:
        Every shape of :data:`~.noisy.SHAPES` → ``[(tenant, score), ...]`` sorted by score
        descending, then tenant; empty when the detector fires for nobody. The score is the
        predicate's relative excess over its threshold (≥ 0; see
        :class:`~.noisy.NoisyThresholds`): comparable within a shape, not across shapes. Tenant
        ``other`` is left out.
    Raises:
        ValueError: ``seconds`` ≤ 0, or malformed exposition text.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    b = before if isinstance(before, Snapshot) else parse(before)
    a = after if isinstance(after, Snapshot) else parse(after)
    t, s = thresholds, seconds
    scores: dict[str, dict[str, float | None]] = {shape: {} for shape in SHAPES}

    def each(shape: str, tenants: dict[str, float], score: Callable[[str], float | None]) -> None:
        for tenant in tenants:
            scores[shape][tenant] = score(tenant)

    tokens = "kvmeter_tokens_total"
    inputs = _tenant(_increase(b, a, tokens, type="input"))
    cached = _tenant(_increase(b, a, tokens, type="cached_input"))
    each("prompt_cache_hit_low", inputs, lambda n: t.cache_hit_low_score(inputs[n], cached.get(n, 0.0), s))

    retries = _tenant(_increase(b, a, "kvmeter_gateway_retries_total"))
    keyed = _tenant(_increase(b, a, "kvmeter_gateway_idempotent_requests_total"))
    each("retries", retries, lambda n: t.retries_score(retries[n], keyed.get(n, 0.0), s))

    cuts = _tenant(_increase(b, a, "kvmeter_stream_stall_cut_requests_total"))
    each("slow_clients", cuts, lambda n: t.slow_client_score(cuts[n], s))

    for kind, score in (("prefill", t.prefill_pressure_score), ("decode", t.decode_pressure_score)):
        name = f"kvmeter_engine_tenant_scheduled_{kind}_tokens_total"
        per_model = _increase(b, a, name, ("model", "tenant"))
        model = _increase(b, a, name, ("model",))
        best: dict[str, float | None] = {}
        for (m, tenant), v in per_model.items():  # a tenant's highest score over the models
            x, prev = score(v, model[(m,)], s), best.get(tenant)
            best[tenant] = x if prev is None or (x is not None and x > prev) else prev
        scores[f"{kind}_pressure"] = best

    kv = _tenant(_by(a.series("kvmeter_tenant_active_kv_tokens"), ("tenant",)))
    watermark = max(a.series("kvmeter_engine_kv_watermark_ratio").values(), default=0.0)
    each("kv_pressure", kv, lambda n: t.kv_pressure_score(kv[n], sum(kv.values()), watermark))

    depth = "kvmeter_scheduler_queue_depth_requests"
    q0, q1 = (_tenant(_by(x.series(depth), ("tenant",))) for x in (b, a))
    queued = {n: (q0.get(n, 0.0) + q1.get(n, 0.0)) / 2 for n in q0.keys() | q1.keys()}
    each("queue_pressure", queued, lambda n: t.queue_pressure_score(queued[n], sum(queued.values())))

    reprefill = _tenant(_increase(b, a, "kvmeter_prompt_reprefill_tokens_total"))
    each("prompt_cache_thrash", reprefill, lambda n: t.thrash_score(reprefill[n], inputs.get(n, 0.0), s))

    calls = _tenant(_increase(b, a, "kvmeter_agent_run_model_calls_total"))
    runs = _tenant(_increase(b, a, "kvmeter_agent_runs_seen_total"))
    each("agent_loops", calls, lambda n: t.agent_loop_score(calls[n], runs.get(n, 0.0), s))

    return {shape: sorted(((n, x) for n, x in scores[shape].items() if x is not None and n != "other"),
                          key=lambda p: (-p[1], p[0]))
            for shape in SHAPES}
