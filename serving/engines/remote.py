"""An external OpenAI-compatible server (e.g. ``vllm serve`` on GPUs) as kvmeter's engine.

kvmeter tokenizes (for quota estimation) with the model's own tokenizer and sends the prompt as
token ids to ``POST /v1/completions`` (vLLM's server accepts a token-id list), streaming with
``stream_options.include_usage`` so the final usage chunk gives the server's engine-true counts.
``min_tokens``/``ignore_eos`` are passed through (vLLM extensions). Closing the stream closes the
HTTP response, which a vLLM server turns into an engine abort.

The remote engine's load (KV watermark, running, waiting) comes from scraping its ``/metrics``
with :class:`kvmeter.collectors.remote_vllm.RemoteVllmScraper`, wired by the serve runtime.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator

import httpx

from kvmeter.serving.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Tokenizer
from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
from kvmeter.stats import EngineLoad

__all__ = ["RemoteEngine"]


class RemoteEngine(Engine):
    """Args:
        base_url: the server, e.g. ``http://gpu-node:8000``.
        model_dir: local directory with the served model's tokenizer (and config.json).
        model_name: the model name the server serves (and kvmeter's clients use).
        max_model_len: context window; default: the server's ``/v1/models`` ``max_model_len``.
        api_key: bearer key for the upstream, if it needs one.
        timeout_s: per-read timeout.
    """

    def __init__(self, base_url: str, *, model_dir: str | Path, model_name: str,
                 max_model_len: int | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.max_model_len = max_model_len or 0
        self._model_dir = model_dir
        self._tokenizer: HFTokenizer | None = None
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                         timeout=httpx.Timeout(timeout_s, connect=10.0),
                                         limits=httpx.Limits(max_connections=1024,
                                                             max_keepalive_connections=256))
        self._load = EngineLoad()

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineError("engine not started")
        return self._tokenizer

    async def start(self) -> None:
        self._tokenizer = HFTokenizer(self._model_dir)
        try:
            resp = await self._client.get("/v1/models")
            resp.raise_for_status()
            models = {m["id"]: m for m in resp.json().get("data", [])}
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise EngineError(f"remote engine {self.base_url} is not answering /v1/models: {exc}",
                              retryable=True) from exc
        if self.model_name not in models:
            raise EngineError(f"remote engine serves {sorted(models)}, not {self.model_name!r}")
        if not self.max_model_len:
            self.max_model_len = int(models[self.model_name].get("max_model_len") or 0)
        if not self.max_model_len:
            raise EngineError("remote engine did not report max_model_len; set engine.max_model_len")

    async def shutdown(self) -> None:
        await self._client.aclose()

    async def abort(self, request_id: str) -> None:
        return None  # closing the response stream aborts upstream

    def load(self) -> EngineLoad:
        return self._load

    def update_load(self, load: EngineLoad) -> None:
        """Set the load snapshot (from the remote /metrics scraper)."""
        self._load = load

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        body = {"model": self.model_name, "prompt": list(request.prompt_token_ids),
                "max_tokens": request.max_tokens, "temperature": request.temperature,
                "top_p": request.top_p, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}  # vLLM extension: exact per-chunk token ids
        if request.min_tokens:
            body["min_tokens"] = request.min_tokens
        if request.ignore_eos:
            body["ignore_eos"] = True
        if request.stop:
            body["stop"] = list(request.stop)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.priority:
            body["priority"] = request.priority
        prompt_tokens = len(request.prompt_token_ids)
        generated = 0
        finish: str | None = None
        final: EngineOutput | None = None
        try:
            async with self._client.stream("POST", "/v1/completions", json=body,
                                           headers={"x-request-id": request.request_id}) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread())[:300].decode("utf-8", "replace")
                    raise EngineError(f"remote engine answered {resp.status_code}: {detail}",
                                      retryable=resp.status_code >= 500)
                async for line in resp.aiter_lines():
                    if final is not None or not line.startswith("data: ") or line == "data: [DONE]":
                        # read the stream to its end (``[DONE]``): a response closed before its
                        # body is fully read closes the connection instead of returning it to
                        # the pool, and every request would open a new TCP connection
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage")
                    if usage:  # the final chunk: the server's own counts
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        final = EngineOutput(new_token_ids=(), new_text="",
                                             num_output_tokens=int(usage["completion_tokens"]),
                                             num_prompt_tokens=int(usage["prompt_tokens"]),
                                             num_cached_tokens=int(cached), finished=True,
                                             finish_reason=finish or "stop")
                        continue
                    for choice in chunk.get("choices", ()):
                        text = choice.get("text", "")
                        ids = choice.get("token_ids")
                        # Exact with vLLM's return_token_ids; otherwise an estimate by re-tokenizing
                        # (only used for an aborted stream: a finished one bills the usage chunk).
                        new = len(ids) if ids is not None else (len(self.tokenizer.encode(text)) if text else 0)
                        generated += new
                        finish = choice.get("finish_reason") or finish
                        yield EngineOutput(new_token_ids=ids if ids is not None else (0,) * new, new_text=text,
                                           num_output_tokens=generated, num_prompt_tokens=prompt_tokens)
        except httpx.HTTPError as exc:
            raise EngineError(f"remote engine failed: {type(exc).__name__}: {exc}", retryable=True) from exc
        if final is None:
            raise EngineError("remote engine stream ended without a usage chunk")
        yield final
