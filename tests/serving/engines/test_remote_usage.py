""":meth:`RemoteEngine.generate` reads its upstream's usage right (issue 15 item 4), against a real
upstream on loopback that sends exactly the chunk shapes each case needs (``scripted_upstream``):
running usage on every chunk (vLLM's ``continuous_usage_stats``) bills the last block and every
text reaches the caller; usage on a chunk that also carries text, and usage before the last text
chunk, are read and the text kept; without any usage the streamed tokens are counted and a
``finish_reason`` of ``length`` is a normal end, forwarded as the upstream sent it.

(The gateway's ``--engine remote`` path reads usage in :mod:`kvmeter.serving.gateway.upstream`,
tested through a serve stack in ``tests/serving/quota_http/test_remote_proxy_http.py``.)
"""

from __future__ import annotations

from kvmeter.serving.engines.base import EngineOutput, EngineRequest
from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
from kvmeter.serving.engines.remote import RemoteEngine
from tests.serving.quota_http.scripted_upstream import ScriptedUpstream, Stream, sse

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [504, 2365, 6354, 16438, 27003, 690, 260]


def chunk(text: str | None = None, *, ids: list[int] | None = None, finish: str | None = None,
          usage: dict | None = None) -> dict:
    """A text_completion chunk as vLLM's server writes one (``text`` None: no choices)."""
    out: dict = {"id": "cmpl-up-1", "object": "text_completion", "created": 1796147740, "model": MODEL,
                 "choices": []}
    if text is not None:
        choice: dict = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if ids is not None:
            choice["token_ids"] = ids
        out["choices"].append(choice)
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    block: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        block["prompt_tokens_details"] = {"cached_tokens": cached}
    return block


async def generate(model_dir, script: list[bytes], max_tokens: int = 8) -> tuple[list[EngineOutput], dict]:
    """Every output of one ``generate`` against an upstream that answers ``script``, and the body
    the upstream got."""
    up = ScriptedUpstream(MODEL, answer=Stream(script))
    await up.start()
    engine = RemoteEngine(up.url, model_dir=model_dir, model_name=MODEL, metrics_url=None)
    try:
        await engine.start()
        outs = [o async for o in engine.generate(EngineRequest("req-1", list(PROMPT), max_tokens=max_tokens))]
    finally:
        await engine.shutdown()
        await up.stop()
    [body] = up.bodies
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    return outs, body


def text(outs: list[EngineOutput]) -> str:
    return "".join(o.new_text for o in outs)


def final(outs: list[EngineOutput]) -> EngineOutput:
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]  # one end, the last output
    return outs[-1]


async def test_running_usage_on_every_chunk_bills_the_last_block_and_keeps_every_text(model_dir):
    # continuous_usage_stats: 40 prompt tokens, running completion 0, 1, ..., 7
    script = sse(chunk("", usage=usage(40, 0)),
                 *(chunk(f" w{i}", ids=[i], usage=usage(40, i), finish="stop" if i == 7 else None)
                   for i in range(1, 8)), "[DONE]")
    outs, _ = await generate(model_dir, script)
    assert text(outs) == "".join(f" w{i}" for i in range(1, 8))
    end = final(outs)
    assert (end.num_input_tokens, end.num_output_tokens, end.finish_reason) == (40, 7, "stop")


async def test_usage_on_a_chunk_with_text_is_read_and_the_text_kept(model_dir):
    script = sse(chunk("Hello", ids=[1, 2]), chunk(" world", ids=[3], finish="stop", usage=usage(12, 3)), "[DONE]")
    outs, _ = await generate(model_dir, script)
    assert text(outs) == "Hello world"
    end = final(outs)
    assert (end.num_input_tokens, end.num_output_tokens, end.finish_reason) == (12, 3, "stop")


async def test_usage_before_the_last_text_chunk_is_billed_and_the_rest_kept(model_dir):
    script = sse(chunk("Hel", ids=[1, 2]), chunk(usage=usage(10, 3, 4)), chunk("lo", ids=[3], finish="stop"),
                 "[DONE]")
    outs, _ = await generate(model_dir, script)
    assert text(outs) == "Hello"
    end = final(outs)
    assert (end.num_input_tokens, end.num_output_tokens, end.num_cached_input_tokens, end.finish_reason) == \
        (10, 3, 4, "stop")


async def test_without_usage_a_length_end_is_no_error_and_counts_the_streamed_tokens(model_dir):
    pieces = [(" Paris", [3681]), (",", [28]), (" the", [260]), (" city", [1645])]
    script = sse(*(chunk(t, ids=ids, finish="length" if i == len(pieces) - 1 else None)
                   for i, (t, ids) in enumerate(pieces)), "[DONE]")  # an upstream that ignores include_usage
    outs, _ = await generate(model_dir, script, max_tokens=4)
    assert text(outs) == " Paris, the city"
    end = final(outs)
    # the prompt as sent and the streamed token ids (exact with vLLM's return_token_ids)
    assert (end.num_input_tokens, end.num_output_tokens, end.finish_reason) == (len(PROMPT), 4, "length")


async def test_without_usage_or_token_ids_the_streamed_text_is_counted_by_the_tokenizer(model_dir):
    pieces = [" Paris", ",", " the", " city"]
    script = sse(*(chunk(t, finish="length" if i == len(pieces) - 1 else None) for i, t in enumerate(pieces)),
                 "[DONE]")
    outs, _ = await generate(model_dir, script, max_tokens=4)
    end = final(outs)
    tokenizer = HFTokenizer(model_dir)  # the engine's own count of the text: an estimate
    assert (end.num_output_tokens, end.finish_reason) == (sum(len(tokenizer.encode(p)) for p in pieces), "length")
