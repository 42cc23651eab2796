"""``--engine remote`` as a transparent, metering proxy (issue 13 item 2, issue 15 item 4), against a
real upstream on loopback that sends exactly the chunk shapes each test needs (``scripted_upstream``:
it stands for a vLLM server whose behaviour the test must control), through a real ``kvmeter
serve`` stack (uvicorn, the fair scheduler, the quota, a chDB ledger).

What the client sends reaches the upstream as sent (kvmeter adds only
``stream_options.include_usage`` to a stream without it, and takes out of the stream what that
added); what the upstream answers reaches the client unchanged; the ledger bills the upstream's
usage — the last running block, a block on a text chunk, a block before the last text chunk — or,
without any, kvmeter's count of the prompt and of the streamed text (``token_source=estimate``).
``finish_reason: length`` is a normal end. Upstream 4xx pass through; 5xx and an unreachable
upstream are 502 / 503; nothing reaches the upstream before kvmeter's own checks pass."""

from __future__ import annotations

import json

import httpx
import orjson
import pytest

from kvmeter.serving.engines.remote import RemoteEngine
from kvmeter.serving.gateway.remote_path import chat_prompt_ids
from tests.serving.quota_http.conftest import MODEL, bearer, one_project_tenants, tenants, until
from tests.serving.quota_http.scripted_upstream import ScriptedUpstream, Stream, Whole, sse

KEY = "sk-test-proxy-001"
CFG = one_project_tenants(f"k1: {{key: {KEY}}}")
#: one key whose input-token budget holds one 15-token prompt at a time, not two
TIGHT = tenants(f"""
acme:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            k1: {{key: {KEY}, limits: {{input_tokens_per_minute: 20}}}}
""")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat_chunk(content: str | None = None, *, finish: str | None = None, usage: dict | None = None,
               role: bool = False, index: int = 0, fingerprint: str | None = None) -> dict:
    """A chat.completion.chunk as vLLM's server writes one."""
    delta: dict = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    chunk: dict = {"id": "chatcmpl-up-1", "object": "chat.completion.chunk", "created": 1796147740, "model": MODEL,
                   "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        chunk["usage"] = usage
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def text_chunk(text: str, *, finish: str | None = None) -> dict:
    return {"id": "cmpl-up-1", "object": "text_completion", "created": 1796147740, "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    block: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        block["prompt_tokens_details"] = {"cached_tokens": cached}
    return block


def events(raw: bytes) -> list:
    """The SSE ``data`` payloads of a response body, parsed (``"[DONE]"`` stays a string)."""
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def content(chunks: list) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if isinstance(c, dict) and c.get("choices"))


async def stack(serve, model_dir, up: ScriptedUpstream, cfg: str = CFG):
    await up.start()
    engine = RemoteEngine(up.url, model_dir=model_dir, model_name=MODEL, metrics_url=None, api_key="sk-upstream")
    return await serve(cfg, engine=engine)


async def post_stream(s, path: str, body: dict, **headers: str) -> tuple[httpx.Response, bytes]:
    async with s.client.stream("POST", path, json=body, headers=bearer(KEY, **headers)) as resp:
        return resp, await resp.aread()


def row(s) -> dict:
    rows = s.billed(api_key_id="k1")
    assert len(rows) == 1, rows
    return rows[0]


async def test_running_usage_bills_the_last_block_and_every_chunk_reaches_the_client(serve, model_dir):
    # vLLM's continuous_usage_stats: 40 prompt tokens, running completion 0, 1, ..., 7
    script = sse(chat_chunk(role=True, usage=usage(40, 0)),
                 *(chat_chunk(f" w{i}", usage=usage(40, i), finish="stop" if i == 7 else None) for i in range(1, 8)),
                 "[DONE]")
    up = ScriptedUpstream(MODEL, answer=Stream(script))
    s = await stack(serve, model_dir, up)
    try:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        resp, raw = await post_stream(s, CHAT, body)
        assert resp.status_code == 200
        assert raw == b"".join(script)  # the client asked for usage: its stream is the upstream's, byte for byte
        assert up.bodies == [body]
        r = row(s)
        assert (r["input_tokens"], r["output_tokens"], r["outcome"], r["finish_reason"], r["token_source"]) == \
            (40, 7, "ok", "stop", "frontend")
    finally:
        await up.stop()


async def test_usage_on_a_chunk_with_text_is_read_and_the_text_forwarded(serve, model_dir):
    script = sse(chat_chunk(role=True), chat_chunk("Hello"),
                 chat_chunk(" world", finish="stop", usage=usage(12, 3)), "[DONE]")
    up = ScriptedUpstream(MODEL, answer=Stream(script))
    s = await stack(serve, model_dir, up)
    try:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True}
        resp, raw = await post_stream(s, CHAT, body)
        assert resp.status_code == 200
        got = events(raw)
        assert content(got) == "Hello world" and got[-1] == "[DONE]"
        # kvmeter asked for the usage, not the client: no usage in what the client sees
        assert not any("usage" in c for c in got if isinstance(c, dict))
        assert up.bodies == [{**body, "stream_options": {"include_usage": True}}]  # the one change
        r = row(s)
        assert (r["input_tokens"], r["output_tokens"], r["outcome"], r["token_source"]) == (12, 3, "ok", "frontend")
    finally:
        await up.stop()


async def test_usage_before_the_last_text_chunk_is_billed_and_the_rest_forwarded(serve, model_dir):
    script = sse(chat_chunk(role=True), chat_chunk("Hel"), {**chat_chunk(), "choices": [], "usage": usage(10, 3, 4)},
                 chat_chunk("lo", finish="stop"), "[DONE]")
    up = ScriptedUpstream(MODEL, answer=Stream(script))
    s = await stack(serve, model_dir, up)
    try:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}
        resp, raw = await post_stream(s, CHAT, body)
        assert resp.status_code == 200 and raw == b"".join(script)
        assert content(events(raw)) == "Hello"
        r = row(s)
        assert (r["input_tokens"], r["output_tokens"], r["cached_input_tokens"], r["outcome"]) == (10, 3, 4, "ok")
    finally:
        await up.stop()


async def test_a_stream_without_usage_ending_at_length_is_no_error_and_bills_an_estimate(serve, model_dir, tokenizer):
    pieces = [" Paris", ",", " the", " city"]
    script = sse(*(text_chunk(p, finish="length" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)),
                 "[DONE]")  # an upstream that ignores include_usage
    up = ScriptedUpstream(MODEL, answer=Stream(script))
    s = await stack(serve, model_dir, up)
    try:
        prompt = [504, 2365, 6354, 16438, 27003, 690, 260]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
        resp, raw = await post_stream(s, COMPLETIONS, body)
        assert resp.status_code == 200
        got = events(raw)
        assert got[-1] == "[DONE]" and not any("error" in c for c in got if isinstance(c, dict))
        assert got[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in got[:-1]) == "".join(pieces)
        r = row(s)
        counted = sum(len(tokenizer.encode(p)) for p in pieces)
        assert (r["input_tokens"], r["output_tokens"], r["outcome"], r["finish_reason"], r["token_source"],
                r["status_code"]) == (len(prompt), counted, "ok", "length", "estimate", 200)
    finally:
        await up.stop()


async def test_a_json_answer_without_usage_at_length_is_a_200_billed_an_estimate(serve, model_dir, tokenizer):
    answer = {"id": "chatcmpl-up-2", "object": "chat.completion", "created": 1796147740, "model": MODEL,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "The capital of France is"},
                           "logprobs": None, "finish_reason": "length"}]}
    up = ScriptedUpstream(MODEL, answer=Whole(answer))
    s = await stack(serve, model_dir, up)
    try:
        resp = await s.client.post(CHAT, json={"model": MODEL, "messages": QUESTION, "max_tokens": 6},
                                   headers=bearer(KEY))
        assert resp.status_code == 200 and resp.content == orjson.dumps(answer)  # the upstream's bytes
        r = row(s)
        rendered = tokenizer.hf.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(rendered)
        assert (r["input_tokens"], r["output_tokens"], r["outcome"], r["finish_reason"], r["token_source"]) == \
            (len(prompt), len(tokenizer.encode("The capital of France is")), "ok", "length", "estimate")
    finally:
        await up.stop()


async def test_the_body_reaches_the_upstream_as_sent_and_its_answer_the_client(serve, model_dir):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    args = "{\"city\": \"Paris\"}"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    body = {"model": MODEL, "messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "tools": tools, "tool_choice": "auto", "n": 2, "temperature": 1.0, "top_k": 1, "seed": 42,
            "logprobs": True, "top_logprobs": 2, "max_tokens": 24, "logit_bias": {"7042": -100},
            "repetition_penalty": 1.2, "response_format": {"type": "json_object"}, "metadata": {"session": "x"}}
    call = {**call, "id": "chatcmpl-tool-1"}
    answer = {"id": "chatcmpl-parity-7", "object": "chat.completion", "created": 1796147740, "model": MODEL,
              "choices": [{"index": i, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                           "logprobs": None, "finish_reason": "tool_calls"} for i in range(2)],
              "usage": usage(130, 38, 16), "system_fingerprint": "vllm-0.32.0-x"}
    up = ScriptedUpstream(MODEL, answer=Whole(answer))
    s = await stack(serve, model_dir, up)
    try:
        resp = await s.client.post(CHAT, json=body, headers=bearer(KEY, **{"X-Request-Id": "parity-7"}))
        assert resp.status_code == 200, resp.text
        assert resp.content == orjson.dumps(answer)
        assert up.bodies == [body] and up.paths == [CHAT]
        sent = up.headers[0]
        assert sent["x-request-id"] == "parity-7"
        assert sent["authorization"] == "Bearer sk-upstream"  # the engine's key, never the client's
        assert resp.headers["x-request-id"] == "parity-7" and resp.headers["x-kvmeter-request-id"].startswith("kvm-")
        r = row(s)
        assert (r["input_tokens"], r["cached_input_tokens"], r["output_tokens"], r["finish_reason"]) == \
            (130, 16, 38, "tool_calls")
        assert r["reserved_output_tokens"] == 2 * 24  # n × max_tokens
    finally:
        await up.stop()


async def test_an_upstream_4xx_reaches_the_client_as_it_is_and_releases_the_reservation(serve, model_dir):
    error = {"error": {"message": "n must be 1 when using greedy sampling, got 2.", "type": "BadRequestError",
                       "param": "n", "code": 400}}
    up = ScriptedUpstream(MODEL, answer=Whole(error, status=400))
    s = await stack(serve, model_dir, up, TIGHT)
    try:
        # (a body kvmeter's own checks pass — greedy n=2 it refuses itself now, as vLLM would —
        # that the scripted upstream refuses)
        body = {"model": MODEL, "prompt": list(range(100, 115)), "max_tokens": 4, "n": 2, "temperature": 1.0}
        for _ in range(3):  # 3 × 15 reserved input tokens > the 20 a minute: only released ones fit
            resp = await s.client.post(COMPLETIONS, json=body, headers=bearer(KEY))
            assert resp.status_code == 400 and resp.json() == error
        assert len(up.bodies) == 3
        # every attempt has its usage row; none bills anything (0 tokens, and an error is absorbed)
        rows = s.usage_rows(api_key_id="k1")
        assert [(r["outcome"], r["status_code"], r["input_tokens"], r["output_tokens"]) for r in rows] == \
            [("error", 400, 0, 0)] * 3
    finally:
        await up.stop()


async def test_the_context_limit_is_per_sequence_on_the_remote_path_too(serve, model_dir):
    """``max_context_tokens`` (40 here) limits one prompt + max_tokens: two prompts of 15 tokens
    with n = 2 and max_tokens 20 (each sequence 35) reach the upstream; a sequence of 15 + 30 is
    refused by kvmeter before it."""
    error = {"error": {"message": "scripted", "type": "BadRequestError", "param": None, "code": 400}}
    up = ScriptedUpstream(MODEL, answer=Whole(error, status=400))
    short = CFG.replace(f"{{key: {KEY}}}", f"{{key: {KEY}, limits: {{max_context_tokens: 40}}}}")
    s = await stack(serve, model_dir, up, short)
    try:
        prompts = [list(range(100, 115)), list(range(200, 215))]
        body = {"model": MODEL, "prompt": prompts, "max_tokens": 20, "n": 2, "temperature": 1.0}
        resp = await s.client.post(COMPLETIONS, json=body, headers=bearer(KEY))
        assert resp.json() == error and len(up.bodies) == 1  # the upstream's answer: kvmeter let it through
        over = await s.client.post(COMPLETIONS, json={**body, "max_tokens": 30}, headers=bearer(KEY))
        assert over.status_code == 400
        err = over.json()["error"]
        assert (err["code"], err["dimension"]) == ("context_length_exceeded", "max_context_tokens")
        assert "you requested 45 tokens (15 in the prompt, 30 for the completion)" in err["message"]
        assert len(up.bodies) == 1
    finally:
        await up.stop()


async def test_an_upstream_5xx_is_a_502_and_an_unreachable_upstream_a_503(serve, model_dir):
    up = ScriptedUpstream(MODEL, answer=Whole({"error": {"message": "EngineCore died", "type": "InternalServerError",
                                                        "param": None, "code": 500}}, status=500))
    s = await stack(serve, model_dir, up)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}
    try:
        resp = await s.client.post(CHAT, json=body, headers=bearer(KEY))
        assert resp.status_code == 502
        err = resp.json()["error"]
        assert err["code"] == "upstream_error"
        assert "answered 500" in err["message"] and "EngineCore died" in err["message"]
    finally:
        await up.stop()
    resp = await s.client.post(CHAT, json={**body, "stream": True}, headers=bearer(KEY))
    assert resp.status_code == 503 and "unreachable" in resp.json()["error"]["message"]
    rows = s.usage_rows(api_key_id="k1")
    assert sorted((r["outcome"], r["status_code"], r["input_tokens"], r["output_tokens"]) for r in rows) == \
        [("error", 502, 0, 0), ("error", 503, 0, 0)]  # (one manual-clock instant: order by status)


async def test_kvmeters_own_usage_chunk_is_taken_out_and_the_fingerprint_put_back(serve, model_dir):
    # vLLM with include_usage moves system_fingerprint from each choice's last chunk to the usage chunk
    script = sse(chat_chunk(role=True), chat_chunk("Paris"), chat_chunk(".", finish="stop"),
                 {**chat_chunk(), "choices": [], "usage": usage(14, 2), "system_fingerprint": "vllm-0.32.0-fp"},
                 "[DONE]")
    up = ScriptedUpstream(MODEL, answer=Stream(script))
    s = await stack(serve, model_dir, up)
    try:
        for _ in range(2):  # learnt from the first stream, stamped at once on the second
            resp, raw = await post_stream(s, CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": 4,
                                                    "stream": True})
            got = events(raw)
            want = [*events(b"".join(script[:2])), {**chat_chunk(".", finish="stop"),
                                                    "system_fingerprint": "vllm-0.32.0-fp"}, "[DONE]"]
            assert got == want  # what vLLM sends a client that did not ask for usage
        assert [(r["input_tokens"], r["output_tokens"]) for r in s.billed(api_key_id="k1")] == [(14, 2)] * 2
    finally:
        await up.stop()


async def test_a_client_that_leaves_mid_stream_closes_the_upstream_stream(serve, model_dir, tokenizer):
    script = sse(chat_chunk(role=True), chat_chunk("Once"), chat_chunk(" upon"))
    up = ScriptedUpstream(MODEL, answer=Stream(script, hang=True))
    s = await stack(serve, model_dir, up)
    try:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 50, "stream": True}
        async with s.client.stream("POST", CHAT, json=body, headers=bearer(KEY)) as resp:
            seen = b""
            async for part in resp.aiter_bytes():
                seen += part
                if b" upon" in seen:
                    break  # the client leaves
        await until(lambda: up.abandoned == 1, "the upstream's stream to be closed")
        await until(lambda: len(s.billed(api_key_id="k1")) == 1, "the aborted request's usage event")
        r = row(s)
        counted = len(tokenizer.encode("Once")) + len(tokenizer.encode(" upon"))
        assert (r["outcome"], r["token_source"], r["output_tokens"]) == ("aborted", "estimate", counted)
    finally:
        await up.stop()


@pytest.mark.parametrize("path, body, status, param", [
    (CHAT, b'{"model": "x", "messages": [', 400, None),
    (CHAT, {"model": "no-such-model", "messages": QUESTION}, 404, "model"),
    (CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": "x"}, 400, "body.max_tokens"),  # vLLM's param
    (CHAT, {"model": MODEL, "messages": QUESTION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_completion_tokens": 5}, 400, "max_completion_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    (CHAT, b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
])
async def test_bad_input_is_refused_before_the_upstream(serve, model_dir, path, body, status, param):
    await _refused_before_the_upstream(serve, model_dir, path, body, status, param)


@pytest.mark.parametrize("path, body, message", [
    (CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": -1}, "max_tokens must be at least 1, got -1."),
    (CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": 0}, "max_tokens must be at least 1, got 0."),
    (CHAT, {"model": MODEL, "messages": QUESTION, "n": 0}, "n must be at least 1, got 0."),
    (CHAT, {"model": MODEL, "messages": QUESTION, "temperature": -5}, "temperature must be non-negative, got -5.0."),
    (CHAT, {"model": MODEL, "messages": QUESTION, "top_p": 7}, "top_p must be in (0, 1], got 7.0."),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": -1000000},
     "max_tokens must be at least 1, got -1000000."),
])
async def test_sampling_parameters_vllm_refuses_are_its_400_before_the_upstream(serve, model_dir, path, body,
                                                                                message):
    """The sampling parameters are checked as vLLM checks them (its ``SamplingParams``), with the
    output ceiling its ``get_max_tokens`` gives, as on the in-process path. Found by a newcomer:
    the remote path forwarded them, answered 200 and billed requests vLLM refuses (an upstream
    that checks nothing reported -1,000,000 output tokens; the reservation held 0)."""
    resp = await _refused_before_the_upstream(serve, model_dir, path, body, 400, None)
    assert message in resp.json()["error"]["message"]


async def _refused_before_the_upstream(serve, model_dir, path, body, status, param):  # noqa: ANN001, ANN202
    up = ScriptedUpstream(MODEL, answer=Whole({}))
    s = await stack(serve, model_dir, up)
    try:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = await s.client.post(path, content=content, headers=bearer(KEY, **{"content-type": "application/json"}))
        assert resp.status_code == status, resp.text
        if param is not None:
            assert resp.json()["error"]["param"] == param
        assert up.bodies == []  # never reached the upstream
        assert s.billed(api_key_id="k1") == []
        return resp
    finally:
        await up.stop()


#: one org per tier (the tier's engine priority is what the upstream must get)
TIERED = tenants("".join(f"""
org-{tier}:
  tier: {tier}
  workspaces: {{w: {{projects: {{p: {{api_keys: {{key-{tier}: {{key: sk-proxy-{tier}}}}}}}}}}}}}
""" for tier in ("enterprise", "paid_interactive", "batch", "free")))


async def test_the_upstream_gets_the_tiers_engine_priority_over_the_clients(serve, model_dir):
    """The in-process engines run each request at the scheduler's grant (the tier's priority), not
    the body's ``priority``; the proxy sends the same grant in vLLM's ``X-Vllm-Priority`` header
    (read by vLLM before the body), leaving the body as the client sent it."""
    from kvmeter.serving.tenancy import DEFAULT_TIERS

    answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
              "choices": [{"index": 0, "text": " Paris", "finish_reason": "stop"}], "usage": usage(5, 1)}
    up = ScriptedUpstream(MODEL, answer=Whole(answer))
    s = await stack(serve, model_dir, up, TIERED)
    try:
        tiers = ("enterprise", "paid_interactive", "batch", "free")
        for tier in tiers:
            body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "priority": -7}
            resp = await s.client.post(COMPLETIONS, json=body, headers=bearer(f"sk-proxy-{tier}"))
            assert resp.status_code == 200, resp.text
            assert up.bodies[-1] == body  # the body as sent, the client's priority in it
        sent = [h.get("x-vllm-priority") for h in up.headers]
        assert sent == [str(DEFAULT_TIERS[t].priority) for t in tiers] == ["0", "1", "2", "3"]
    finally:
        await up.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_each_choices_finish_reason_reaches_the_trace_as_the_upstream_answered_it(serve, model_dir, stream):
    """The request's :class:`~kvmeter.stats.RequestCompletion` (the span's
    ``gen_ai.response.finish_reasons``) has one reason per choice, as the upstream sent it:
    ``tool_calls`` for choice 0 and ``length`` for choice 1 of an ``n=2`` answer."""
    from kvmeter.stats import RequestCompletion

    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    if stream:
        answer: Stream | Whole = Stream(sse(
            chat_chunk(role=True), chat_chunk(role=True, index=1), chat_chunk(" Par", index=1),
            {**chat_chunk(), "choices": [{"index": 0, "delta": {"tool_calls": [{**call, "index": 0}]},
                                          "logprobs": None, "finish_reason": "tool_calls"}]},
            chat_chunk("is", index=1, finish="length"),
            {**chat_chunk(), "choices": [], "usage": usage(30, 3)}, "[DONE]"))
    else:
        answer = Whole({"id": "chatcmpl-up-1", "object": "chat.completion", "created": 1, "model": MODEL,
                        "choices": [{"index": 0, "logprobs": None, "finish_reason": "tool_calls",
                                     "message": {"role": "assistant", "content": None, "tool_calls": [call]}},
                                    {"index": 1, "message": {"role": "assistant", "content": " Paris"},
                                     "logprobs": None, "finish_reason": "length"}],
                        "usage": usage(30, 3)})
    up = ScriptedUpstream(MODEL, answer=answer)
    s = await stack(serve, model_dir, up)
    done: list[RequestCompletion] = []
    s.runtime.bus.subscribe(RequestCompletion, done.append)
    try:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "n": 2, "stream": stream,
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}
        if stream:
            resp, _ = await post_stream(s, CHAT, body)
        else:
            resp = await s.client.post(CHAT, json=body, headers=bearer(KEY))
        assert resp.status_code == 200, resp.text
        [completion] = done
        assert completion.finish_reasons == ("tool_calls", "length")
        assert completion.response_id == "chatcmpl-up-1"
    finally:
        await up.stop()


# -- the context window (kvmeter's, before admission: the upstream may check nothing) --------------
#: a small window, advertised by the upstream (which, scripted, enforces none of it)
WINDOW = 64


def chat_answer(completion_tokens: int) -> Whole:
    """A chat completion whose usage claims ``completion_tokens`` (what a server that does not hold
    the window may report)."""
    return Whole({"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": MODEL,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                               "finish_reason": "length", "logprobs": None}],
                  "usage": usage(10, completion_tokens)})


def refused(resp: httpx.Response, param: str) -> str:
    """vLLM's 400 body (its shape, its param); its message."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("BadRequestError", param, 400), err
    return err["message"]


@pytest.mark.parametrize("path, body, param, message", [
    (COMPLETIONS, {"prompt": list(range(100, 100 + WINDOW + 6)), "max_tokens": 4}, "input_tokens",
     f"This model's maximum context length is {WINDOW} tokens. However, your prompt contains {WINDOW + 6} input "
     "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt."),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 200}]}, "input_tokens",
     f"This model's maximum context length is {WINDOW} tokens. However, your prompt contains "),
    (CHAT, {"messages": QUESTION, "max_tokens": 100_000_000}, "max_tokens",
     f"max_tokens=100000000 cannot be greater than max_model_len={WINDOW}. Please request fewer output tokens."),
    (CHAT, {"messages": QUESTION, "max_completion_tokens": WINDOW + 1}, "max_completion_tokens",
     f"max_completion_tokens={WINDOW + 1} cannot be greater than max_model_len={WINDOW}."),
    (COMPLETIONS, {"prompt": list(range(100, 100 + WINDOW)), "max_tokens": 4}, None,
     f"The decoder prompt (length {WINDOW}) plus the number of requested output tokens (at least 1) is longer "
     f"than the maximum model length of {WINDOW}."),
])
async def test_what_does_not_fit_the_window_is_vllms_400_before_the_upstream_and_billed_nothing(
        serve, model_dir, path, body, param, message):
    """The newcomer's case: an upstream that does not hold the window would answer (and bill) anything;
    kvmeter refuses what vLLM's server would, before admission, in vLLM 0.32's words."""
    up = ScriptedUpstream(MODEL, max_model_len=WINDOW, answer=chat_answer(100_000_000))
    s = await stack(serve, model_dir, up)
    try:
        for stream in (False, True):
            resp = await s.client.post(path, json={"model": MODEL, **body, "stream": stream}, headers=bearer(KEY))
            if param is None:
                assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError", resp.text
                assert message in resp.json()["error"]["message"]
            else:
                assert message in refused(resp, param)
        assert up.bodies == []  # never reached the upstream
        assert s.billed(api_key_id="k1") == []
        assert all(r["output_tokens"] == 0 and r["status_code"] == 400 for r in s.usage_rows(api_key_id="k1"))
    finally:
        await up.stop()


async def test_a_max_tokens_past_what_the_prompt_leaves_is_forwarded_as_vllm_lowers_it(serve, model_dir, tokenizer):
    """max_tokens ≤ the window but past what the prompt leaves of it: vLLM's ``get_max_tokens``
    lowers it to that (no error); kvmeter reserves that and forwards no more than it reserved."""
    up = ScriptedUpstream(MODEL, max_model_len=WINDOW, answer=chat_answer(3))
    s = await stack(serve, model_dir, up)
    try:
        prompt = list(range(100, 140))  # 40 tokens: 24 left
        resp = await s.client.post(COMPLETIONS, json={"model": MODEL, "prompt": prompt, "max_tokens": 50},
                                   headers=bearer(KEY))
        assert resp.status_code == 200, resp.text
        assert up.bodies[-1]["max_tokens"] == WINDOW - 40
        # one that fits is forwarded as sent
        fits = {"model": MODEL, "prompt": prompt, "max_tokens": 24}
        assert (await s.client.post(COMPLETIONS, json=fits, headers=bearer(KEY))).status_code == 200
        assert up.bodies[-1] == fits
        # a chat's max_completion_tokens is lowered under its own name
        n_prompt = len(chat_prompt_ids(tokenizer, QUESTION))
        chat = {"model": MODEL, "messages": QUESTION, "max_completion_tokens": WINDOW}
        assert (await s.client.post(CHAT, json=chat, headers=bearer(KEY))).status_code == 200
        assert up.bodies[-1] == {**chat, "max_completion_tokens": WINDOW - n_prompt}
    finally:
        await up.stop()


async def test_without_max_tokens_the_quotas_context_limit_is_forwarded_as_the_ceiling(serve, model_dir, tokenizer):
    """A chat without max_tokens: vLLM runs to what the window leaves; under a tighter
    ``max_context_tokens`` kvmeter reserves (and, as the in-process path, sets) what that limit
    leaves — never more than it reserved."""
    up = ScriptedUpstream(MODEL, answer=chat_answer(3))  # window 4096
    short = CFG.replace(f"{{key: {KEY}}}", f"{{key: {KEY}, limits: {{max_context_tokens: 100}}}}")
    s = await stack(serve, model_dir, up, short)
    body = {"model": MODEL, "messages": QUESTION}
    try:
        assert (await s.client.post(CHAT, json=body, headers=bearer(KEY))).status_code == 200
        assert up.bodies == [{**body, "max_tokens": 100 - len(chat_prompt_ids(tokenizer, QUESTION))}]
    finally:
        await up.stop()


async def test_without_max_tokens_or_a_quota_limit_the_body_is_forwarded_as_sent(serve, model_dir):
    up = ScriptedUpstream(MODEL, answer=chat_answer(3))
    s = await stack(serve, model_dir, up)
    body = {"model": MODEL, "messages": QUESTION}
    try:  # vLLM's own default applies (what the window leaves, or the model's generation config's)
        assert (await s.client.post(CHAT, json=body, headers=bearer(KEY))).status_code == 200
        assert up.bodies == [body]
    finally:
        await up.stop()


async def test_the_configured_window_holds_when_the_upstreams_is_larger(serve, model_dir):
    """``engine.max_model_len`` below the upstream's (the newcomer's case a): kvmeter's window —
    the one its ``/v1/models`` advertises — is the one requests are held to."""
    up = ScriptedUpstream(MODEL, answer=chat_answer(3))  # the upstream says 4096
    await up.start()
    engine = RemoteEngine(up.url, model_dir=model_dir, model_name=MODEL, metrics_url=None, api_key="sk-upstream",
                          max_model_len=WINDOW)
    s = await serve(CFG, engine=engine)
    try:
        listed = (await s.client.get("/v1/models", headers=bearer(KEY))).json()
        assert listed["data"][0]["max_model_len"] == WINDOW
        long = {"model": MODEL, "prompt": list(range(100, 100 + WINDOW + 1)), "max_tokens": 1}
        assert f"maximum context length is {WINDOW} tokens" in refused(
            await s.client.post(COMPLETIONS, json=long, headers=bearer(KEY)), "input_tokens")
        ok = {"model": MODEL, "prompt": list(range(100, 110)), "max_tokens": 4}
        assert (await s.client.post(COMPLETIONS, json=ok, headers=bearer(KEY))).status_code == 200
        assert up.bodies == [ok]
    finally:
        await up.stop()
