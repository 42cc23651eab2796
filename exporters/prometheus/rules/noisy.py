"""The noisy-neighbour detectors: their thresholds (one definition), the predicate each applies,
and ``noisy.yml``, the Prometheus rules generated from them.

    python -m kvmeter.exporters.prometheus.rules.noisy            # rewrites noisy.yml (defaults)
    python -m kvmeter.exporters.prometheus.rules.noisy --check    # exit 1 if noisy.yml is stale
    python -m kvmeter.exporters.prometheus.rules.noisy --cache-hit-ratio-below 0.1 --out my.yml

The shapes of issue 14 (:data:`SHAPES`, :data:`DETECTORS`), each per tenant (bounded labels:
top-K + ``other``; ``other`` is recorded but never alerted on, it is many tenants). Each has a
predicate on totals over a span (``NoisyThresholds.*_score``: None, or how far past the threshold),
stated again in PromQL by :func:`render` and applied to two ``/metrics`` scrapes by
:mod:`.noisy_eval` (:func:`~.noisy_eval.rank`, the short-window evaluator of benches):

* **Prompt-cache hit ratio** = cached input tokens ÷ input tokens (both engine-true, every
  attempt that ended: cache work is engine work, not billing), from ``kvmeter_tokens_total``.
  The detector fires for a tenant whose ratio is below :attr:`NoisyThresholds.cache_hit_ratio_below`
  while it sends at least :attr:`NoisyThresholds.cache_min_input_tokens_per_s` input tokens per
  second (a quiet tenant does not fire). A low ratio is repeated prefill: the tenant's prompts share
  no cached prefix — unique prompts, or prefixes evicted before they are reused (thrash); this
  signal alone does not tell the two apart, nor whether a neighbour's work evicted them.
* **Retries per logical request** = retries ÷ logical requests sent with an ``Idempotency-Key``
  (``kvmeter_gateway_retries_total`` ÷ ``kvmeter_gateway_idempotent_requests_total``; only a
  keyed request can be recognised as a retry, a request without a key is a new logical request
  every time). The detector fires above :attr:`NoisyThresholds.retries_per_request_above` while
  the tenant retries at least :attr:`NoisyThresholds.retries_min_per_s` times per second.

* **Slow streaming clients** = streams cut because their client read nothing for
  ``server.stream_stall_timeout_s`` (``kvmeter_stream_stall_cut_requests_total``; each cut aborted an
  engine request that the reader had kept alive, holding KV). The detector fires while the tenant's
  cuts run at least :attr:`NoisyThresholds.stall_cuts_min_per_s` per second.

* **Prefill / decode pressure** = the tenant's share of the prefill (decode) tokens the engines
  scheduled for a model (``kvmeter_engine_tenant_scheduled_{prefill,decode}_tokens_total``, vLLM's
  per-step rows, :mod:`kvmeter.collectors.vllm_step_shares`; the same share as engine.yml's 5-minute
  records, here at the detectors' window, by model and tenant). Fires above
  :attr:`NoisyThresholds.prefill_share_above` while the model gets at least
  :attr:`NoisyThresholds.prefill_min_tokens_per_s` (decode: the ``decode_*`` pair). A tenant alone
  on a busy engine has share 1 and fires: it is the one whose work the others would wait behind.
* **KV pressure** is ``KvmeterTenantKvShareHigh`` of ``tenants.yml`` (active-KV share above
  :attr:`NoisyThresholds.kv_share_above` while the fullest KV cache is above
  :attr:`NoisyThresholds.kv_watermark_above`), in :data:`DETECTORS` by reference: one definition.
  :func:`main` refuses thresholds whose :func:`kv_share_expr` is not what tenants.yml states.
* **Queue pressure (bursts)** = the tenant's share of the requests waiting in the fair queues
  (``kvmeter_scheduler_queue_depth_requests``, mean over the window), above
  :attr:`NoisyThresholds.queue_share_above` while at least :attr:`NoisyThresholds.queue_min_requests` wait.
* **Prompt-cache thrash** = input tokens prefilled again after their cached prefix was evicted
  (``kvmeter_prompt_reprefill_tokens_total``, measured by :mod:`kvmeter.serving.gateway.reprefill`)
  ÷ input tokens, above :attr:`NoisyThresholds.reprefill_ratio_above` while the tenant
  sends at least :attr:`NoisyThresholds.cache_min_input_tokens_per_s`. Unlike a low hit ratio, this
  tells thrash from unique prompts.
* **Agent loops** = model calls of agent runs ÷ runs first seen in the window, at least one
  (``kvmeter_agent_run_model_calls_total`` ÷ ``kvmeter_agent_runs_seen_total``,
  :mod:`kvmeter.exporters.prometheus.agents`; a run older than the window counts as one, so a run
  looping for hours fires), above
  :attr:`NoisyThresholds.agent_calls_per_run_above` at :attr:`NoisyThresholds.agent_min_calls_per_s`
  calls/s or more.

Prometheus evaluates them over :attr:`NoisyThresholds.window` and fires after
:attr:`NoisyThresholds.for_`; the dashboards' "Noisy neighbours" page applies the same predicates
(:meth:`NoisyThresholds.cache_hit_low`, :meth:`NoisyThresholds.retrying`) to the ledger's totals
over the page's window (:class:`~kvmeter.ledger.noisy_queries.NoisyQueries`). The two counts of
retries differ on purpose: the gateway's counter counts every retry it saw (replays, joins and
refused conflicts included), the ledger only the retries that did engine work (a usage row each),
so the page's number can be lower than the alert's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from .generate_slo import _BlockDumper  # multi-line expressions as YAML block scalars, as in slo.yml

__all__ = ["NoisyThresholds", "THRESHOLDS", "Detector", "DETECTORS", "SHAPES", "records", "kv_share_expr",
           "tenants_kv_expr", "render", "main"]

_DURATION_S = {"s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True, slots=True)
class Detector:
    """One noisy-neighbour detector: its shape, its alert and the rules file that defines it.

    Attributes:
        shape: one of :data:`SHAPES`.
        alert: the alert's name (its labels name the tenant).
        rule_file: ``noisy.yml`` (generated here) or the hand-written file holding it.
    """

    shape: str
    alert: str
    rule_file: str


#: The detectors, one per shape. KV pressure is ``KvmeterTenantKvShareHigh`` of ``tenants.yml``,
#: listed here by reference (one definition; :func:`kv_share_expr` is checked against it).
DETECTORS = (
    Detector("prompt_cache_hit_low", "KvmeterTenantPromptCacheHitLow", "noisy.yml"),
    Detector("retries", "KvmeterTenantRetriesHigh", "noisy.yml"),
    Detector("slow_clients", "KvmeterTenantSlowClientCuts", "noisy.yml"),
    Detector("prefill_pressure", "KvmeterTenantPrefillShareHigh", "noisy.yml"),
    Detector("decode_pressure", "KvmeterTenantDecodeShareHigh", "noisy.yml"),
    Detector("kv_pressure", "KvmeterTenantKvShareHigh", "tenants.yml"),
    Detector("queue_pressure", "KvmeterTenantQueueShareHigh", "noisy.yml"),
    Detector("prompt_cache_thrash", "KvmeterTenantPromptCacheThrash", "noisy.yml"),
    Detector("agent_loops", "KvmeterTenantAgentCallsPerRunHigh", "noisy.yml"),
)
#: The shapes, in :data:`DETECTORS` order.
SHAPES = tuple(d.shape for d in DETECTORS)


def _above(value: float, threshold: float) -> float | None:
    """How far ``value`` is past ``threshold`` (> fires): ``(value − threshold) ÷ threshold``
    (``value`` itself for a 0 threshold); None when not above."""
    if not value > threshold:
        return None
    return (value - threshold) / threshold if threshold > 0 else value


def _at_least(value: float, threshold: float) -> float | None:
    """As :func:`_above` with ≥: ``value == threshold`` fires with score 0."""
    if not value >= threshold:
        return None
    return (value - threshold) / threshold if threshold > 0 else value


@dataclass(frozen=True, slots=True)
class NoisyThresholds:
    """The detectors' thresholds, and the predicates that apply them to totals over a time span.

    Every ``*_score`` method is one detector's condition on totals (counter increases, or gauge
    values) over ``seconds``: None when the detector does not fire, else how far past its main
    threshold the tenant is — the relative excess ``(value − threshold) ÷ threshold`` (≥ 0; for a
    *below* threshold ``(threshold − value) ÷ threshold``, in (0, 1]). The Prometheus rules of
    :func:`render` state the same conditions over :attr:`window`; :mod:`.noisy_eval` applies these
    methods to two ``/metrics`` scrapes; the dashboards' page to the ledger's totals.

    Attributes:
        cache_hit_ratio_below: the prompt-cache detector fires below this hit ratio (0–1).
        cache_min_input_tokens_per_s: ... only while the tenant sends at least this many input
            tokens per second (≥ 0); the prompt-cache thrash detector's minimum too.
        retries_per_request_above: the retry detector fires above this many retries per keyed
            logical request (≥ 0).
        retries_min_per_s: ... only while the tenant retries at least this often, per second (≥ 0).
        stall_cuts_min_per_s: the slow-client detector fires while the tenant's streams are cut for
            a stalled reader at least this often, per second (≥ 0; 0.005/s is 4.5 cuts in 15 min).
        prefill_share_above: the prefill-pressure detector fires above this share (0–1) of the
            prefill tokens the engines scheduled for a model ...
        prefill_min_tokens_per_s: ... while they schedule at least this many prefill tokens/s for
            it, all tenants (the engine is busy; ≥ 0).
        decode_share_above, decode_min_tokens_per_s: the same for decode tokens.
        kv_share_above: the KV-pressure detector (``KvmeterTenantKvShareHigh``, tenants.yml) fires
            above this share (0–1) of the active KV tokens ...
        kv_watermark_above: ... while the fullest engine's KV cache is above this ratio (0–1).
        queue_share_above: the queue-pressure (burst) detector fires above this share (0–1) of the
            requests waiting in the fair queues (mean over the window) ...
        queue_min_requests: ... while at least this many requests wait, all tenants (≥ 0).
        reprefill_ratio_above: the prompt-cache thrash detector fires above this ratio (≥ 0) of
            input tokens prefilled again after their cached prefix was evicted
            (``kvmeter_prompt_reprefill_tokens_total``) to input tokens, while the tenant sends at
            least :attr:`cache_min_input_tokens_per_s`.
        agent_calls_per_run_above: the agent-loop detector fires above this many model calls per
            agent run (calls ÷ runs first seen in the span, at least one run; ≥ 0) ...
        agent_min_calls_per_s: ... while the tenant's runs make at least this many calls/s (≥ 0).
        window: the rate window of the recording rules (a Prometheus duration: ``15m``).
        for_: how long a condition holds before the alert fires (a Prometheus duration).
    Raises:
        ValueError: a threshold out of range or a malformed duration, naming the field.
    """

    cache_hit_ratio_below: float = 0.25
    cache_min_input_tokens_per_s: float = 500.0
    retries_per_request_above: float = 0.5
    retries_min_per_s: float = 0.1
    stall_cuts_min_per_s: float = 0.005
    prefill_share_above: float = 0.5
    prefill_min_tokens_per_s: float = 1000.0
    decode_share_above: float = 0.5
    decode_min_tokens_per_s: float = 100.0
    kv_share_above: float = 0.5
    kv_watermark_above: float = 0.7
    queue_share_above: float = 0.5
    queue_min_requests: float = 10.0
    reprefill_ratio_above: float = 0.3
    agent_calls_per_run_above: float = 50.0
    agent_min_calls_per_s: float = 0.2
    window: str = "15m"
    for_: str = "10m"

    def __post_init__(self) -> None:
        if not 0.0 < self.cache_hit_ratio_below <= 1.0:
            raise ValueError(f"cache_hit_ratio_below must be in (0, 1], got {self.cache_hit_ratio_below}")
        for name in ("prefill_share_above", "decode_share_above", "kv_share_above", "kv_watermark_above",
                     "queue_share_above"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("cache_min_input_tokens_per_s", "retries_per_request_above", "retries_min_per_s",
                     "stall_cuts_min_per_s", "prefill_min_tokens_per_s", "decode_min_tokens_per_s",
                     "queue_min_requests", "reprefill_ratio_above", "agent_calls_per_run_above",
                     "agent_min_calls_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("window", "for_"):
            _seconds(name, getattr(self, name))

    @property
    def window_s(self) -> int:
        """:attr:`window` in seconds."""
        return _seconds("window", self.window)

    # -- the predicates: one per shape, on totals over ``seconds`` ------------------------------
    def cache_hit_low_score(self, input_tokens: float, cached_input_tokens: float, seconds: float) -> float | None:
        """Prompt-cache hit low: ``cached ÷ input`` below :attr:`cache_hit_ratio_below` while
        ``input ÷ seconds`` ≥ :attr:`cache_min_input_tokens_per_s`. None with no input or no time."""
        if input_tokens <= 0 or seconds <= 0 or input_tokens / seconds < self.cache_min_input_tokens_per_s:
            return None
        ratio = cached_input_tokens / input_tokens
        if not ratio < self.cache_hit_ratio_below:
            return None
        return (self.cache_hit_ratio_below - ratio) / self.cache_hit_ratio_below

    def cache_hit_low(self, input_tokens: int, cached_input_tokens: int, seconds: float) -> bool:
        """:meth:`cache_hit_low_score` fires."""
        return self.cache_hit_low_score(input_tokens, cached_input_tokens, seconds) is not None

    def retries_score(self, retries: float, keyed_requests: float, seconds: float) -> float | None:
        """Retries: ``retries ÷ keyed logical requests`` above :attr:`retries_per_request_above`
        while ``retries ÷ seconds`` ≥ :attr:`retries_min_per_s`. None with no keyed request or no time."""
        if keyed_requests <= 0 or seconds <= 0 or retries / seconds < self.retries_min_per_s:
            return None
        return _above(retries / keyed_requests, self.retries_per_request_above)

    def retrying(self, retries: int, keyed_requests: int, seconds: float) -> bool:
        """:meth:`retries_score` fires."""
        return self.retries_score(retries, keyed_requests, seconds) is not None

    def slow_client_score(self, stall_cuts: float, seconds: float) -> float | None:
        """Slow clients: ``stall cuts ÷ seconds`` ≥ :attr:`stall_cuts_min_per_s` (and > 0)."""
        if seconds <= 0 or stall_cuts <= 0:
            return None
        return _at_least(stall_cuts / seconds, self.stall_cuts_min_per_s)

    def prefill_pressure_score(self, tenant_tokens: float, model_tokens: float, seconds: float) -> float | None:
        """Prefill pressure: the tenant's share of the prefill tokens scheduled for a model
        (``tenant ÷ model``, all tenants) above :attr:`prefill_share_above` while
        ``model ÷ seconds`` ≥ :attr:`prefill_min_tokens_per_s`."""
        return _share_score(tenant_tokens, model_tokens, seconds, self.prefill_share_above,
                            self.prefill_min_tokens_per_s)

    def decode_pressure_score(self, tenant_tokens: float, model_tokens: float, seconds: float) -> float | None:
        """Decode pressure: as :meth:`prefill_pressure_score` with decode tokens and
        :attr:`decode_share_above`, :attr:`decode_min_tokens_per_s`."""
        return _share_score(tenant_tokens, model_tokens, seconds, self.decode_share_above,
                            self.decode_min_tokens_per_s)

    def kv_pressure_score(self, tenant_kv_tokens: float, all_kv_tokens: float,
                          max_kv_watermark_ratio: float) -> float | None:
        """KV pressure (``KvmeterTenantKvShareHigh``): the tenant's share of the active KV tokens
        above :attr:`kv_share_above` while the fullest engine's KV watermark is above
        :attr:`kv_watermark_above` (gauges, at one instant)."""
        if all_kv_tokens <= 0 or not max_kv_watermark_ratio > self.kv_watermark_above:
            return None
        return _above(tenant_kv_tokens / all_kv_tokens, self.kv_share_above)

    def queue_pressure_score(self, tenant_queued: float, all_queued: float) -> float | None:
        """Queue pressure (bursts): the tenant's share of the requests waiting in the fair queues
        above :attr:`queue_share_above` while ``all_queued`` ≥ :attr:`queue_min_requests` (gauge
        means over the span)."""
        if all_queued <= 0 or all_queued < self.queue_min_requests:
            return None
        return _above(tenant_queued / all_queued, self.queue_share_above)

    def thrash_score(self, reprefill_tokens: float, input_tokens: float, seconds: float) -> float | None:
        """Prompt-cache thrash: ``re-prefilled ÷ input tokens`` above
        :attr:`reprefill_ratio_above` while ``input ÷ seconds`` ≥ :attr:`cache_min_input_tokens_per_s`."""
        if input_tokens <= 0 or seconds <= 0 or input_tokens / seconds < self.cache_min_input_tokens_per_s:
            return None
        return _above(reprefill_tokens / input_tokens, self.reprefill_ratio_above)

    def agent_loop_score(self, model_calls: float, runs: float, seconds: float) -> float | None:
        """Agent loops: ``model calls ÷ max(runs, 1)`` above :attr:`agent_calls_per_run_above` while
        ``calls ÷ seconds`` ≥ :attr:`agent_min_calls_per_s` (``runs``: runs first seen in the span;
        a run older than the span counts as one)."""
        if seconds <= 0 or model_calls <= 0 or model_calls / seconds < self.agent_min_calls_per_s:
            return None
        return _above(model_calls / max(runs, 1.0), self.agent_calls_per_run_above)


def _share_score(tenant: float, total: float, seconds: float, share_above: float, min_per_s: float) -> float | None:
    if total <= 0 or seconds <= 0 or total / seconds < min_per_s:
        return None
    return _above(tenant / total, share_above)


def _seconds(name: str, duration: str) -> int:
    unit = duration[-1:]
    if unit not in _DURATION_S or not duration[:-1].isdigit() or int(duration[:-1]) <= 0:
        raise ValueError(f"{name} must be a Prometheus duration like 15m, got {duration!r}")
    return int(duration[:-1]) * _DURATION_S[unit]


#: The thresholds ``noisy.yml`` ships with.
THRESHOLDS = NoisyThresholds()


def records(t: NoisyThresholds = THRESHOLDS) -> dict[str, str]:
    """The recorded series' names at ``t.window``, by key: ``input_rate``, ``cache_hit_ratio``,
    ``retry_rate``, ``retries_per_request``, ``stall_cut_rate``, ``prefill_share``, ``prefill_rate``,
    ``decode_share``, ``decode_rate``, ``queue_share``, ``queue_depth``, ``reprefill_ratio``,
    ``agent_call_rate``, ``agent_calls_per_run``."""
    w = t.window
    return {"input_rate": f"kvmeter:tenant_input_tokens:rate{w}",
            "cache_hit_ratio": f"kvmeter:tenant_prompt_cache_hit:ratio_rate{w}",
            "retry_rate": f"kvmeter:tenant_retries:rate{w}",
            "retries_per_request": f"kvmeter:tenant_retries_per_logical_request:ratio_rate{w}",
            "stall_cut_rate": f"kvmeter:tenant_stream_stall_cut_requests:rate{w}",
            "prefill_share": f"kvmeter:tenant_engine_scheduled_prefill_tokens:share_rate{w}",
            "prefill_rate": f"kvmeter:model_engine_scheduled_prefill_tokens:rate{w}",
            "decode_share": f"kvmeter:tenant_engine_scheduled_decode_tokens:share_rate{w}",
            "decode_rate": f"kvmeter:model_engine_scheduled_decode_tokens:rate{w}",
            "queue_share": f"kvmeter:tenant_scheduler_queue_depth_requests:share_avg{w}",
            "queue_depth": f"kvmeter:scheduler_queue_depth_requests:avg{w}",
            "reprefill_ratio": f"kvmeter:tenant_prompt_reprefill:ratio_rate{w}",
            "agent_call_rate": f"kvmeter:tenant_agent_run_model_calls:rate{w}",
            "agent_calls_per_run": f"kvmeter:tenant_agent_model_calls_per_run:ratio_increase{w}"}


def kv_share_expr(t: NoisyThresholds = THRESHOLDS) -> str:
    """The expression of ``KvmeterTenantKvShareHigh`` (tenants.yml) at ``t``'s KV thresholds:
    :func:`main` checks that tenants.yml states exactly this (whitespace aside)."""
    return ("(\n  sum by (tenant) (kvmeter_tenant_active_kv_tokens{tenant!=\"other\"})\n"
            "  / scalar(sum(kvmeter_tenant_active_kv_tokens))\n"
            f") > {_num(t.kv_share_above)}\n"
            f"and on () max(kvmeter_engine_kv_watermark_ratio) > {_num(t.kv_watermark_above)}")


def tenants_kv_expr(path: Path | None = None) -> str:
    """``KvmeterTenantKvShareHigh``'s expression as ``tenants.yml`` (default: beside this module) states it.

    Raises:
        KeyError: the file has no such alert.
    """
    path = path or Path(__file__).with_name("tenants.yml")
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "KvmeterTenantKvShareHigh":
                return str(rule["expr"])
    raise KeyError(f"KvmeterTenantKvShareHigh not in {path}")


def _same_expr(a: str, b: str) -> bool:
    return a.split() == b.split()


def _num(x: float) -> str:
    return f"{x:g}"


def render(t: NoisyThresholds = THRESHOLDS) -> str:
    """The full text of a rules file for thresholds ``t``."""
    w, r = t.window, records(t)
    tokens = "kvmeter_tokens_total"
    input_rate = f'sum by (tenant) (rate({tokens}{{type="input"}}[{w}]))'
    cached_rate = f'sum by (tenant) (rate({tokens}{{type="cached_input"}}[{w}]))'
    retries = f"sum by (tenant) (rate(kvmeter_gateway_retries_total[{w}]))"
    keyed = f"sum by (tenant) (rate(kvmeter_gateway_idempotent_requests_total[{w}]))"
    rules: list[dict[str, object]] = [
        {"record": r["input_rate"], "expr": input_rate},
        # a tenant whose prompts never hit has no cached_input series at all: 0, not absent
        {"record": r["cache_hit_ratio"],
         "expr": f"(\n  {cached_rate}\n  or 0 * {input_rate}\n)\n/ ({input_rate} > 0)"},
        {"record": r["retry_rate"], "expr": retries},
        {"record": r["retries_per_request"], "expr": f"{retries}\n/ ({keyed} > 0)"},
        {"record": r["stall_cut_rate"],
         "expr": f"sum by (tenant) (rate(kvmeter_stream_stall_cut_requests_total[{w}]))"},
        {"alert": "KvmeterTenantPromptCacheHitLow",
         "expr": (f'{r["cache_hit_ratio"]}{{tenant!="other"}} < {_num(t.cache_hit_ratio_below)}\n'
                  f'and on (tenant) {r["input_rate"]} >= {_num(t.cache_min_input_tokens_per_s)}'),
         "for": t.for_,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": ("Tenant {{ $labels.tenant }} hits the prompt cache for only "
                         "{{ $value | humanizePercentage }} of its input"),
             "description": (
                 f"Over {w}, under {t.cache_hit_ratio_below:.0%} of the tenant's input tokens came from the "
                 f"prefix cache while it sent at least {_num(t.cache_min_input_tokens_per_s)} input tokens/s "
                 "(thresholds: kvmeter.exporters.prometheus.rules.noisy). Its prompts are prefilled again: "
                 "unique prompts, or prefixes evicted before reuse (cache thrash). Prefill pressure raises "
                 "every tenant's TTFT; see the dashboards' Noisy neighbours page."),
         }},
        {"alert": "KvmeterTenantRetriesHigh",
         "expr": (f'{r["retries_per_request"]}{{tenant!="other"}} > {_num(t.retries_per_request_above)}\n'
                  f'and on (tenant) {r["retry_rate"]} >= {_num(t.retries_min_per_s)}'),
         "for": t.for_,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": ("Tenant {{ $labels.tenant }} retries {{ $value | printf \"%.2f\" }} times "
                         "per logical request"),
             "description": (
                 f"Over {w}, the tenant sent more than {_num(t.retries_per_request_above)} retries (same "
                 "Idempotency-Key) per logical request with a key, at least "
                 f"{_num(t.retries_min_per_s)} retries/s (thresholds: kvmeter.exporters.prometheus.rules.noisy). "
                 "A client or agent loop retrying on timeouts multiplies load when the system is slow; "
                 "check its Retry-After handling."),
         }},
        {"alert": "KvmeterTenantSlowClientCuts",
         "expr": f'{r["stall_cut_rate"]}{{tenant!="other"}} >= {_num(t.stall_cuts_min_per_s)}',
         "for": t.for_,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": ("Tenant {{ $labels.tenant }}'s streams are cut for slow clients "
                         "{{ $value | printf \"%.3f\" }} times/s"),
             "description": (
                 f"Over {w}, the tenant's streamed answers were cut at least {_num(t.stall_cuts_min_per_s)} "
                 "times/s because their client read nothing for server.stream_stall_timeout_s (thresholds: "
                 "kvmeter.exporters.prometheus.rules.noisy). Each cut aborted an engine request the stalled "
                 "reader kept alive, holding KV (billed as a disconnect); see "
                 "kvmeter_stream_send_blocked_seconds_total for its back-pressure. Check the client's SSE "
                 "reading loop."),
         }},
    ]
    rules += _engine_share_rules(t, "prefill", t.prefill_share_above, t.prefill_min_tokens_per_s,
                                 "KvmeterTenantPrefillShareHigh",
                                 "Prefill is compute-bound: it delays every other tenant's first token (TTFT) "
                                 "on these engines. Look for huge prompts, cache misses or a burst of new sessions.")
    rules += _engine_share_rules(t, "decode", t.decode_share_above, t.decode_min_tokens_per_s,
                                 "KvmeterTenantDecodeShareHigh",
                                 "Decode fills the batch: every other tenant's inter-token latency (ITL) grows "
                                 "with it. Look for long completions (max_tokens) or many parallel streams.")
    depth = "kvmeter_scheduler_queue_depth_requests"
    rules += [
        {"record": r["queue_depth"], "expr": f"sum(avg_over_time({depth}[{w}]))"},
        {"record": r["queue_share"],
         "expr": (f"sum by (tenant) (avg_over_time({depth}[{w}]))\n"
                  f"/ on () group_left () ({r['queue_depth']} > 0)")},
        {"alert": "KvmeterTenantQueueShareHigh",
         "expr": (f'{r["queue_share"]}{{tenant!="other"}} > {_num(t.queue_share_above)}\n'
                  f'and on () {r["queue_depth"]} >= {_num(t.queue_min_requests)}'),
         "for": t.for_,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": ("Tenant {{ $labels.tenant }} has {{ $value | humanizePercentage }} of the requests "
                         "waiting in the fair queues"),
             "description": (
                 f"Over {w}, more than {t.queue_share_above:.0%} of the requests waiting in the scheduler's fair "
                 f"queues were the tenant's while at least {_num(t.queue_min_requests)} requests waited "
                 "(thresholds: kvmeter.exporters.prometheus.rules.noisy). A burst above its share: its own "
                 "queue wait grows first, the weighted fair queues keep the others' bounded; check its "
                 "concurrency and request limits."),
         }},
        {"record": r["reprefill_ratio"],
         "expr": (f"sum by (tenant) (rate(kvmeter_prompt_reprefill_tokens_total[{w}]))\n"
                  f"/ ({input_rate} > 0)")},
        {"alert": "KvmeterTenantPromptCacheThrash",
         "expr": (f'{r["reprefill_ratio"]}{{tenant!="other"}} > {_num(t.reprefill_ratio_above)}\n'
                  f'and on (tenant) {r["input_rate"]} >= {_num(t.cache_min_input_tokens_per_s)}'),
         "for": t.for_,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": ("Tenant {{ $labels.tenant }} prefills {{ $value | humanizePercentage }} of its input "
                         "again after its cached prefix was evicted"),
             "description": (
                 f"Over {w}, more than {t.reprefill_ratio_above:.0%} of the tenant's input tokens were prompt "
                 "tokens it had had cached before, prefilled again after eviction, while it sent at least "
                 f"{_num(t.cache_min_input_tokens_per_s)} input tokens/s (thresholds: "
                 "kvmeter.exporters.prometheus.rules.noisy). Its working set of prefixes does not fit the "
                 "prefix cache beside the other tenants' (cache thrash): every eviction is recomputed prefill."),
         }},
    ]
    calls = f"sum by (tenant) (increase(kvmeter_agent_run_model_calls_total[{w}]))"
    runs = f"sum by (tenant) (increase(kvmeter_agent_runs_seen_total[{w}]))"
    rules += [
        {"record": r["agent_call_rate"],
         "expr": f"sum by (tenant) (rate(kvmeter_agent_run_model_calls_total[{w}]))"},
        # runs first seen in the window, at least one: a run older than the window still counts as one
        {"record": r["agent_calls_per_run"],
         "expr": f"{calls}\n/ clamp_min(\n  {runs}\n  or 0 * {calls},\n  1\n)"},
        {"alert": "KvmeterTenantAgentCallsPerRunHigh",
         "expr": (f'{r["agent_calls_per_run"]}{{tenant!="other"}} > {_num(t.agent_calls_per_run_above)}\n'
                  f'and on (tenant) {r["agent_call_rate"]} >= {_num(t.agent_min_calls_per_s)}'),
         "for": t.for_,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": ("Tenant {{ $labels.tenant }}'s agent runs make {{ $value | printf \"%.0f\" }} model "
                         "calls per run"),
             "description": (
                 f"Over {w}, the tenant's agent runs made more than {_num(t.agent_calls_per_run_above)} model "
                 f"calls per run (runs first seen in the window, at least one) at {_num(t.agent_min_calls_per_s)} "
                 "calls/s or more (thresholds: kvmeter.exporters.prometheus.rules.noisy). An agent looping "
                 "without being stopped as a loop (KvmeterAgentRunLoopStopped); check its loop stops and "
                 "max_tool_calls."),
         }},
    ]
    thresholds = ", ".join(f"{f.name.rstrip('_')}={getattr(t, f.name)}" for f in fields(t))
    header = (
        "# GENERATED by `python -m kvmeter.exporters.prometheus.rules.noisy` — do not edit by hand.\n"
        "# Noisy-neighbour detectors per tenant (issue 14): prompt-cache hit ratio (cached_input / input\n"
        "# tokens, engine-true, every attempt), retries per logical request (retries / logical\n"
        "# requests sent with an Idempotency-Key), streams cut for a stalled reader (slow clients,\n"
        "# kvmeter_stream_stall_cut_requests_total), shares of the prefill and decode tokens the engines\n"
        "# scheduled per model, share of the fair queues (bursts), re-prefilled / input tokens (prompt-cache\n"
        "# thrash) and model calls per agent run. KV pressure is KvmeterTenantKvShareHigh (tenants.yml).\n"
        "# Each alert names the tenant and fires only while the tenant (or the engine) is busy enough to\n"
        "# matter; tenant \"other\" (the bounded-label bucket) is recorded, never alerted on.\n"
        f"# Thresholds: {thresholds}\n")
    return header + yaml.dump({"groups": [{"name": "kvmeter-noisy-neighbours", "rules": rules}]},
                              Dumper=_BlockDumper, sort_keys=False, width=120, allow_unicode=True)


def _engine_share_rules(t: NoisyThresholds, kind: str, share_above: float, min_per_s: float, alert: str,
                        why: str) -> list[dict[str, object]]:
    """The share record, the model's rate record and the alert of the prefill or decode detector."""
    w, r = t.window, records(t)
    counter = f"kvmeter_engine_tenant_scheduled_{kind}_tokens_total"
    model_rate = f"sum by (model) (rate({counter}[{w}]))"
    return [
        {"record": r[f"{kind}_rate"], "expr": model_rate},
        {"record": r[f"{kind}_share"],
         "expr": (f"sum by (model, tenant) (rate({counter}[{w}]))\n"
                  f"/ on (model) group_left () ({r[f'{kind}_rate']} > 0)")},
        {"alert": alert,
         "expr": (f'{r[f"{kind}_share"]}{{tenant!="other"}} > {_num(share_above)}\n'
                  f'and on (model) {r[f"{kind}_rate"]} >= {_num(min_per_s)}'),
         "for": t.for_,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": (f"Tenant {{{{ $labels.tenant }}}} gets {{{{ $value | humanizePercentage }}}} of the {kind} "
                         "tokens scheduled for {{ $labels.model }}"),
             "description": (
                 f"Over {w}, more than {share_above:.0%} of the {kind} tokens the engines scheduled for the model "
                 f"were the tenant's while they scheduled at least {_num(min_per_s)} {kind} tokens/s "
                 f"(thresholds: kvmeter.exporters.prometheus.rules.noisy). {why}"),
         }},
    ]


def main(argv: list[str] | None = None) -> int:
    """Write (or ``--check``) the rules file; flags override the default thresholds."""
    defaults = NoisyThresholds()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    for f in fields(NoisyThresholds):
        flag = "--" + f.name.rstrip("_").replace("_", "-")
        p.add_argument(flag, dest=f.name, type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name))
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("noisy.yml"))
    p.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = p.parse_args(argv)
    t = NoisyThresholds(**{f.name: getattr(args, f.name) for f in fields(NoisyThresholds)})
    if not _same_expr(kv_share_expr(t), tenants_kv_expr()):
        print("the KV thresholds differ from KvmeterTenantKvShareHigh in tenants.yml (the KV detector's one "
              f"definition): edit that rule to\n{kv_share_expr(t)}", file=sys.stderr)
        return 1
    text = render(t)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python -m kvmeter.exporters.prometheus.rules.noisy", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
