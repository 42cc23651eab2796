"""A tiny gateway stand-in for the multi-worker test: each uvicorn worker installs the exporter,
``POST /publish`` publishes one RequestCompletion in whichever worker took the connection, and
``GET /metrics`` serves the merged multiprocess view. Run with PROMETHEUS_MULTIPROC_DIR set."""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.exporters.prometheus import install_prometheus, metrics_asgi_app
from kvmeter.stats import EngineStepStats, RequestCompletion
from kvmeter.tokens import TokenCounts

bus = StatsBus()
install_prometheus(bus)  # the global REGISTRY; values land in this worker's multiprocess files


async def publish(request):
    tokens = int(request.query_params.get("tokens", "1"))
    bus.publish(
        RequestCompletion(
            attribution=Attribution(request.query_params.get("tenant", "acme"), tier="free", model="m"),
            tokens=TokenCounts(input_tokens=tokens, output_tokens=1),
            outcome="ok",
            ttft_s=0.1,
            e2e_s=0.5,
        )
    )
    bus.publish(EngineStepStats(wall_ts=0.0, engine_idx=os.getpid() % 1000, kv_watermark_ratio=0.5))
    return JSONResponse({"pid": os.getpid()})


app = Starlette(routes=[Route("/publish", publish, methods=["POST"]),
                        Route("/metrics", endpoint=metrics_asgi_app())])
