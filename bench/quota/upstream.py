"""A tiny OpenAI-compatible upstream that answers at once, and the bare JSON endpoint.

Routes (Starlette under uvicorn, one process):

* ``GET /v1/models`` — one model (``--model``) with ``max_model_len``.
* ``POST /v1/chat/completions`` — a fixed short answer; ``usage`` counts the prompt as
  characters / 4 (no tokenizer: it must cost nothing) and ``max_tokens`` completion tokens.
  Streaming (``stream: true``) sends one content chunk, the usage chunk and ``[DONE]``.
* ``POST /v1/completions`` — the same for a token-id (or text) prompt; a streamed answer carries
  ``token_ids`` (vLLM's ``return_token_ids`` extension) and the final usage chunk, which is what
  kvmeter's ``--engine remote`` reads. ``prompt_tokens`` is exact for a token-id prompt.
* ``POST /bare`` — reads the body and returns ``{"ok": true}``: the "bare Starlette JSON
  endpoint" the gateway's ceiling is compared with.

It is the common upstream of the LiteLLM-vs-kvmeter comparison in ``bench_gateway.py``::

    .venv/bin/python bench/quota/upstream.py --port 9100
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

ANSWER = "The request is not the unit of load."


def _json(obj: object) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


def create_app(model: str, max_model_len: int = 8192, delay_s: float = 0.0) -> Starlette:
    """The upstream's routes; ``delay_s`` (≥ 0) is each answer's service time, seconds: an engine
    that takes that long per request however many run at once (the fleet benches' engines)."""
    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                   "owned_by": "upstream", "max_model_len": max_model_len}]})

    async def bare(request: Request) -> Response:
        await request.body()
        return JSONResponse({"ok": True})

    async def answer(request: Request, chat: bool) -> Response:
        body = orjson.loads(await request.body())
        if delay_s:
            await asyncio.sleep(delay_s)
        n_out = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if chat:
            n_in = max(1, sum(len(str(m.get("content", ""))) for m in body.get("messages", ())) // 4)
        else:
            prompt = body.get("prompt", "")
            n_in = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        rid, created = f"up-{time.monotonic_ns()}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": ANSWER, "finish_reason": "length"})
            return _json({"id": rid, "object": obj, "created": created, "model": model,
                          "choices": [choice], "usage": usage})
        choice = ({"index": 0, "delta": {"role": "assistant", "content": ANSWER}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": ANSWER, "token_ids": [1] * n_out, "finish_reason": "length"})
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        chunks = [{"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [choice]},
                  {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [],
                   "usage": usage}]
        payload = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"

        async def stream():
            yield payload

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def chat(request: Request) -> Response:
        return await answer(request, True)

    async def completions(request: Request) -> Response:
        return await answer(request, False)

    return Starlette(routes=[Route("/v1/models", models), Route("/bare", bare, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--delay-s", type=float, default=0.0, help="service time of each answer (s)")
    args = parser.parse_args()
    uvicorn.run(create_app(args.model, delay_s=args.delay_s), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
