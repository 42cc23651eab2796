"""A real OpenAI-compatible upstream on loopback whose answers a test scripts exactly: it stands for a
vLLM server whose chunk shapes, usage blocks, statuses and failures the test must control.

``await ScriptedUpstream.start()``; set :attr:`ScriptedUpstream.answer` to a :class:`Stream` (SSE
events, sent as written), a :class:`Whole` (one body with a status) or :data:`HANG` (a stream that
sends its events, then waits until the client leaves); read back the bodies and headers it got.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.conftest import free_port, start_uvicorn

__all__ = ["ScriptedUpstream", "Stream", "Whole", "sse"]


def sse(*events: Any) -> list[bytes]:
    """Each event as ``data: <json>\\n\\n`` (a str is sent as it is: ``"[DONE]"``)."""
    return [b"data: " + (e.encode() if isinstance(e, str) else orjson.dumps(e)) + b"\n\n" for e in events]


@dataclass
class Stream:
    """A 200 ``text/event-stream`` answer: ``events`` (bytes, each sent as one write); with
    ``hang``, the stream then waits until the client goes away instead of ending."""

    events: list[bytes]
    hang: bool = False


@dataclass
class Whole:
    """A whole answer: ``body`` (a JSON value, or bytes) with ``status``."""

    body: Any
    status: int = 200


@dataclass
class ScriptedUpstream:
    model: str
    max_model_len: int = 4096
    answer: Stream | Whole | None = None
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    #: streams whose client left (the upstream's generator was closed before its end)
    abandoned: int = 0

    def __post_init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def _models(self, request: Request) -> Response:
        models = {"object": "list", "data": [{"id": self.model, "max_model_len": self.max_model_len}]}
        return Response(orjson.dumps(models), media_type="application/json")

    async def _complete(self, request: Request) -> Response:
        self.paths.append(request.url.path)
        self.bodies.append(orjson.loads(await request.body()))
        self.headers.append(dict(request.headers))
        answer = self.answer
        if isinstance(answer, Whole):
            body = answer.body if isinstance(answer.body, bytes) else orjson.dumps(answer.body)
            return Response(body, status_code=answer.status, media_type="application/json")
        assert isinstance(answer, Stream), "the test set no answer"

        async def events():
            finished = False
            try:
                for event in answer.events:
                    yield event
                if answer.hang:
                    await asyncio.Event().wait()  # until the client leaves (cancelled)
                finished = True
            finally:
                if not finished:
                    self.abandoned += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def start(self) -> "ScriptedUpstream":
        app = Starlette(routes=[Route("/v1/models", self._models),
                                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                                Route("/v1/completions", self._complete, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.task = await start_uvicorn(self.server)
        return self

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task
