"""Histogram bucket boundaries for LLM latencies and sizes (upper bounds, ascending).

Chosen for LLM serving, where a "fast" HTTP bucket set (5 ms – 10 s) would put every long prompt
into ``+Inf``:

* TTFT spans 100 µs to 10 minutes (a 150k-token prompt queued behind others); the boundaries are
  dense around 0.1–3 s where interactive SLOs sit. The lowest ones (0.1–5 ms) are below any real
  prefill, so a sub-millisecond TTFT — a metering bug, an engine that did not compute — shows in
  its own bucket instead of hiding in "under 10 ms" (the self-check
  ``kvmeter_selfcheck_ttft_below_floor_requests_total`` counts them against the physical floor).
* ITL spans 100 µs (small models, speculative decoding, several tokens per chunk) to 5 s (a stall
  under preemption), dense at 10–100 ms where a stream starts to feel slow.
* The SLO thresholds used by the alert rules (TTFT 2 s / 30 s, ITL 0.1 s / 0.5 s) are bucket
  boundaries here, so burn-rate rules read ``_bucket{le="..."}`` exactly instead of interpolating.
"""

from __future__ import annotations

__all__ = [
    "TTFT_SECONDS", "ITL_SECONDS", "E2E_SECONDS", "QUEUE_SECONDS", "PHASE_SECONDS",
    "BATCH_REQUESTS", "STEP_TOKENS", "APPROVAL_WAIT_SECONDS", "STREAM_SECONDS",
]

TTFT_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 300.0, 600.0)
ITL_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_SECONDS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
               120.0, 180.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
QUEUE_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0,
                 60.0, 120.0, 300.0, 600.0)
#: engine-side prefill / decode phases of one request
PHASE_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
                 120.0, 300.0, 600.0, 1800.0)
BATCH_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
#: a person deciding an approval: seconds to a day
APPROVAL_WAIT_SECONDS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0,
                         28800.0, 86400.0)
#: a streamed answer's duration; few boundaries, as the histogram carries a (bounded) tenant label
STREAM_SECONDS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
