"""The noisy-neighbour detectors: their thresholds (one definition), the predicate each applies,
and ``noisy.yml``, the Prometheus rules generated from them.

    python -m kvmeter.exporters.prometheus.rules.noisy            # rewrites noisy.yml (defaults)
    python -m kvmeter.exporters.prometheus.rules.noisy --check    # exit 1 if noisy.yml is stale
    python -m kvmeter.exporters.prometheus.rules.noisy --cache-hit-ratio-below 0.1 --out my.yml

Three shapes of issue 14 so far, each per tenant (bounded labels: top-K + ``other``; ``other`` is
recorded but never alerted on, it is many tenants):

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

__all__ = ["NoisyThresholds", "THRESHOLDS", "records", "render", "main"]

_DURATION_S = {"s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True, slots=True)
class NoisyThresholds:
    """The detectors' thresholds.

    Attributes:
        cache_hit_ratio_below: the prompt-cache detector fires below this hit ratio (0–1).
        cache_min_input_tokens_per_s: ... only while the tenant sends at least this many input
            tokens per second (≥ 0).
        retries_per_request_above: the retry detector fires above this many retries per keyed
            logical request (≥ 0).
        retries_min_per_s: ... only while the tenant retries at least this often, per second (≥ 0).
        stall_cuts_min_per_s: the slow-client detector fires while the tenant's streams are cut for
            a stalled reader at least this often, per second (≥ 0; 0.005/s is 4.5 cuts in 15 min).
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
    window: str = "15m"
    for_: str = "10m"

    def __post_init__(self) -> None:
        if not 0.0 < self.cache_hit_ratio_below <= 1.0:
            raise ValueError(f"cache_hit_ratio_below must be in (0, 1], got {self.cache_hit_ratio_below}")
        for name in ("cache_min_input_tokens_per_s", "retries_per_request_above", "retries_min_per_s",
                     "stall_cuts_min_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("window", "for_"):
            _seconds(name, getattr(self, name))

    @property
    def window_s(self) -> int:
        """:attr:`window` in seconds."""
        return _seconds("window", self.window)

    def cache_hit_low(self, input_tokens: int, cached_input_tokens: int, seconds: float) -> bool:
        """The prompt-cache detector on totals over ``seconds``: ``cached ÷ input`` below
        :attr:`cache_hit_ratio_below` while ``input ÷ seconds`` ≥
        :attr:`cache_min_input_tokens_per_s`. False with no input or no time."""
        if input_tokens <= 0 or seconds <= 0:
            return False
        return (cached_input_tokens / input_tokens < self.cache_hit_ratio_below
                and input_tokens / seconds >= self.cache_min_input_tokens_per_s)

    def retrying(self, retries: int, keyed_requests: int, seconds: float) -> bool:
        """The retry detector on totals over ``seconds``: ``retries ÷ keyed logical requests``
        above :attr:`retries_per_request_above` while ``retries ÷ seconds`` ≥
        :attr:`retries_min_per_s`. False with no keyed request or no time."""
        if keyed_requests <= 0 or seconds <= 0:
            return False
        return (retries / keyed_requests > self.retries_per_request_above
                and retries / seconds >= self.retries_min_per_s)


def _seconds(name: str, duration: str) -> int:
    unit = duration[-1:]
    if unit not in _DURATION_S or not duration[:-1].isdigit() or int(duration[:-1]) <= 0:
        raise ValueError(f"{name} must be a Prometheus duration like 15m, got {duration!r}")
    return int(duration[:-1]) * _DURATION_S[unit]


#: The thresholds ``noisy.yml`` ships with.
THRESHOLDS = NoisyThresholds()


def records(t: NoisyThresholds = THRESHOLDS) -> dict[str, str]:
    """The recorded series' names at ``t.window``: ``input_rate``, ``cache_hit_ratio``,
    ``retry_rate``, ``retries_per_request``, ``stall_cut_rate``."""
    w = t.window
    return {"input_rate": f"kvmeter:tenant_input_tokens:rate{w}",
            "cache_hit_ratio": f"kvmeter:tenant_prompt_cache_hit:ratio_rate{w}",
            "retry_rate": f"kvmeter:tenant_retries:rate{w}",
            "retries_per_request": f"kvmeter:tenant_retries_per_logical_request:ratio_rate{w}",
            "stall_cut_rate": f"kvmeter:tenant_stream_stall_cut_requests:rate{w}"}


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
    thresholds = ", ".join(f"{f.name.rstrip('_')}={getattr(t, f.name)}" for f in fields(t))
    header = (
        "# GENERATED by `python -m kvmeter.exporters.prometheus.rules.noisy` — do not edit by hand.\n"
        "# Noisy-neighbour detectors per tenant (issue 14): prompt-cache hit ratio (cached_input / input\n"
        "# tokens, engine-true, every attempt), retries per logical request (retries / logical\n"
        "# requests sent with an Idempotency-Key) and streams cut for a stalled reader (slow clients,\n"
        "# kvmeter_stream_stall_cut_requests_total). Each alert names the tenant and fires only while the\n"
        "# tenant is busy enough to matter; tenant \"other\" (the bounded-label bucket) is recorded,\n"
        "# never alerted on.\n"
        f"# Thresholds: {thresholds}\n")
    return header + yaml.dump({"groups": [{"name": "kvmeter-noisy-neighbours", "rules": rules}]},
                              Dumper=_BlockDumper, sort_keys=False, width=120, allow_unicode=True)


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
    text = render(NoisyThresholds(**{f.name: getattr(args, f.name) for f in fields(NoisyThresholds)}))
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python -m kvmeter.exporters.prometheus.rules.noisy", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
