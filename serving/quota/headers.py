"""Response headers: OpenAI-style ``x-ratelimit-*`` and ``Retry-After``.

OpenAI documents (platform.openai.com/docs/guides/rate-limits, "Rate limits in headers")::

    x-ratelimit-limit-requests / x-ratelimit-remaining-requests / x-ratelimit-reset-requests
    x-ratelimit-limit-tokens   / x-ratelimit-remaining-tokens   / x-ratelimit-reset-tokens

with resets as durations such as ``1s``, ``6m0s``, ``20ms`` (time until the limit is back to its
full value). kvmeter counts input and output tokens separately, so it adds
``x-ratelimit-{limit,remaining,reset}-{input,output}-tokens``; the plain ``-tokens`` headers
describe whichever token limit is closest to binding (lowest remaining fraction). Across levels,
each header describes the level with the fewest remaining units — the one that binds first.
Remaining values are as of after the request that receives them.

``Retry-After`` is whole seconds rounded up (RFC 9110 §10.2.3); ``retry-after-ms`` (as sent by
OpenAI) carries the unrounded value in milliseconds (:func:`kvmeter.errors.retry_after_headers`,
re-exported here).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from kvmeter.errors import retry_after_headers
from kvmeter.serving.quota.gcra import gcra_remaining, gcra_reset_s
from kvmeter.serving.quota.plan import RATE, PlanItem

__all__ = ["format_reset", "ratelimit_headers", "retry_after_headers", "rate_item_headers"]

_SUFFIX = {"requests_per_minute": "requests", "input_tokens_per_minute": "input-tokens",
           "output_tokens_per_minute": "output-tokens"}


def format_reset(seconds: float) -> str:
    """Duration in OpenAI's header style: ``0ms``, ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds <= 0:
        return "0ms"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    ms = math.ceil(seconds * 1000)
    h, rem = divmod(ms, 3_600_000)
    m, rem = divmod(rem, 60_000)
    s = rem / 1000
    s_txt = f"{s:.3f}".rstrip("0").rstrip(".")
    if h:
        return f"{h}h{m}m{s_txt}s"
    if m:
        return f"{m}m{s_txt}s"
    return f"{s_txt}s"


def _put(out: dict[str, str], suffix: str, limit: int, remaining: int, reset_s: float) -> None:
    out[f"x-ratelimit-limit-{suffix}"] = str(limit)
    out[f"x-ratelimit-remaining-{suffix}"] = str(remaining)
    out[f"x-ratelimit-reset-{suffix}"] = format_reset(reset_s)


def ratelimit_headers(items: Sequence[PlanItem], states: Sequence[Any], now: float) -> dict[str, str]:
    """``x-ratelimit-*`` for an admitted reservation.

    Args:
        items: the reservation's items; only the rate items of principal levels are read
            (agent-run limits are not advertised).
        states: the store's post-reservation states: the new TAT of each rate item, in order.
        now: the store's ``now`` (seconds).
    """
    best: dict[str, tuple[int, float, int]] = {}  # dim → (remaining, reset, limit)
    floor = math.floor
    for it, st in zip([it for it in items if it.kind == RATE], states, strict=True):
        if st is None or it.level == "agent_run":
            continue
        tat = float(st)
        used = tat - now if tat > now else 0.0
        rem = floor((it.period_s - used) / it.interval_s + 1e-9)
        rem = 0 if rem < 0 else it.limit if rem > it.limit else rem
        cur = best.get(it.dimension)
        if cur is None or rem < cur[0]:
            best[it.dimension] = (rem, used, it.limit)
    out: dict[str, str] = {}
    for dim, (rem, reset, limit) in best.items():
        _put(out, _SUFFIX[dim], limit, rem, reset)
    tok = [best[d] for d in ("input_tokens_per_minute", "output_tokens_per_minute") if d in best]
    if tok:
        rem, reset, limit = min(tok, key=lambda t: t[0] / t[2] if t[2] else 0.0)
        _put(out, "tokens", limit, rem, reset)
    return out


def rate_item_headers(item: PlanItem, tat: float, now: float) -> dict[str, str]:
    """``x-ratelimit-*`` of the one rate item that refused a request (its remaining is what
    could be admitted now)."""
    if item.kind != RATE or item.dimension not in _SUFFIX:
        return {}
    out: dict[str, str] = {}
    rem = min(gcra_remaining(tat, now, item.interval_s, item.period_s), item.limit)
    reset = gcra_reset_s(tat, now)
    suffix = _SUFFIX[item.dimension]
    _put(out, suffix, item.limit, rem, reset)
    if suffix != "requests":
        _put(out, "tokens", item.limit, rem, reset)
    return out
