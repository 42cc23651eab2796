"""Parameters vLLM's engine refuses only when a request reaches ``AsyncLLM.add_request`` are
client errors, as every other 400: answered at once with vLLM's message (no wait for an engine
account that never comes), no usage row (no ``server_failure`` line on the bill), an ``invalid``
attempt, ``kvmeter_requests_total{outcome="error"}`` unchanged — on the real vLLM CPU engine,
through the official ``openai`` SDK.

* What its input processor's ``_validate_params`` refuses (``top_logprobs`` / ``logprobs`` /
  ``prompt_logprobs`` past ``max_logprobs``, a ``logit_bias`` or ``stop_token_ids`` id outside the
  vocabulary) is refused before admission, a stream before its 200.
* What only its ``process_inputs`` refuses, after the gateway admitted the request
  (``routed_experts_prompt_start`` past the prompt), is answered vLLM's 400 at once, a stream as
  vLLM's own server answers it (200, then ``data: {"error": ...}``), and recorded as a refusal.

Before the fix each took 2.0 s (the engine-account wait) and was recorded ``error`` /
``server_failure``; a stream answered 200, then ``data: {"error": ...}`` after the wait.
"""

from __future__ import annotations

import time

import openai
import pytest

from tests.serving.gateway.conftest import KEYS

pytestmark = [pytest.mark.engine]

ASK = [{"role": "user", "content": "Say hi."}]
#: well under the 2.0 s engine-account wait the bug spent on each (measured: a few ms to ~0.1 s)
FAST_S = 1.0


def _errors(stack) -> float:
    """Σ ``kvmeter_requests_total{outcome="error"}`` over every tier and tenant."""
    return sum(s.value for m in stack.runtime.registry.collect() if m.name == "kvmeter_requests"
               for s in m.samples if s.name == "kvmeter_requests_total" and s.labels.get("outcome") == "error")


def _cases(model: str) -> list[tuple[str, bool, bool, dict, str]]:
    """(name, chat, stream, arguments, a part of vLLM's message)."""
    chat = {"model": model, "messages": ASK, "max_tokens": 4}
    cmpl = {"model": model, "prompt": "Say hi.", "max_tokens": 4}
    over = "greater than max allowed: 20"
    return [
        ("chat top_logprobs 21", True, False, {**chat, "logprobs": True, "top_logprobs": 21}, over),
        ("chat top_logprobs 100, streamed", True, True, {**chat, "logprobs": True, "top_logprobs": 100}, over),
        ("chat logit_bias out of the vocabulary", True, False, {**chat, "logit_bias": {"99999999": 5}},
         "logit_bias"),
        ("chat logit_bias out of the vocabulary, streamed", True, True,
         {**chat, "logit_bias": {"99999999": 5}}, "logit_bias"),
        ("chat stop_token_ids out of the vocabulary", True, False,
         {**chat, "extra_body": {"stop_token_ids": [99999999]}}, "stop_token_ids"),
        ("completions logprobs 21", False, False, {**cmpl, "logprobs": 21}, over),
        ("completions logprobs 25, streamed", False, True, {**cmpl, "logprobs": 25}, over),
        ("completions prompt_logprobs 21", False, False, {**cmpl, "extra_body": {"prompt_logprobs": 21}}, over),
        ("completions logit_bias out of the vocabulary", False, False, {**cmpl, "logit_bias": {"99999999": 5}},
         "logit_bias"),
    ]


async def _late_refusals(stack, client: openai.AsyncOpenAI) -> list[str]:
    """``routed_experts_prompt_start`` past the prompt: only vLLM's ``process_inputs`` refuses it,
    in ``add_request``, after admission. The kvmeter request ids of the refused requests."""
    far = {"extra_body": {"routed_experts_prompt_start": 100_000}, "max_tokens": 4, "model": stack.model}
    ids = []
    for chat in (True, False):
        kwargs = {**far, "messages": ASK} if chat else {**far, "prompt": "Say hi."}
        create = client.chat.completions.with_raw_response.create if chat else \
            client.completions.with_raw_response.create
        start = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as caught:
            await create(**kwargs)  # type: ignore[call-overload]
        elapsed = time.perf_counter() - start
        assert "routed_experts_prompt_start" in str(caught.value), caught.value
        assert elapsed < FAST_S, f"late refusal ({'chat' if chat else 'completions'}): {elapsed:.2f} s"
        ids.append(caught.value.response.headers["x-kvmeter-request-id"])
        print(f"late refusal ({'chat' if chat else 'completions'}): 400 in {elapsed * 1000:.0f} ms")
    # streamed: vLLM's layer has sent the 200 before the engine is asked (as `vllm serve` does)
    start = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(**far, messages=ASK, stream=True)
    assert raw.http_response.status_code == 200
    with pytest.raises(openai.APIError) as failed:
        async for _ in raw.parse():
            pass
    elapsed = time.perf_counter() - start
    assert "routed_experts_prompt_start" in str(failed.value), failed.value
    assert elapsed < FAST_S, f"late refusal (streamed): {elapsed:.2f} s"
    ids.append(raw.http_response.headers["x-kvmeter-request-id"])
    print(f"late refusal (streamed): error event in {elapsed * 1000:.0f} ms")
    return ids


async def test_engine_validated_parameters_are_client_errors_answered_at_once(stack):
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=KEYS["globex"], max_retries=0,
                                timeout=60)
    errors_before = _errors(stack)
    refused: list[str] = []
    for name, chat, stream, kwargs, message in _cases(stack.model):
        create = client.chat.completions.create if chat else client.completions.create
        start = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as caught:
            answer = await create(stream=stream, **kwargs)  # type: ignore[call-overload]
            if stream:  # a 200 before the refusal: the SDK raises only on the error event
                async for _ in answer:
                    pass
        elapsed = time.perf_counter() - start
        err = caught.value
        assert err.status_code == 400, name
        assert message in str(err.body.get("message") if isinstance(err.body, dict) else err), f"{name}: {err}"
        assert elapsed < FAST_S, f"{name}: answered after {elapsed:.2f} s (the engine-account wait?)"
        refused.append(err.response.headers["x-kvmeter-request-id"])
        print(f"{name}: 400 in {elapsed * 1000:.0f} ms")
    refused += await _late_refusals(stack, client)
    # nothing billed, nothing recorded as a server failure: each is an invalid attempt, as any 400
    rows = stack.rows("SELECT request_id, outcome, undelivered_cause FROM usage_events FINAL "
                      "WHERE request_id IN {r:Array(String)}", r=refused)
    assert rows == []
    attempts = stack.rows("SELECT status, reason, status_code FROM attempts FINAL "
                          "WHERE request_id IN {r:Array(String)}", r=refused)
    assert attempts == [{"status": "invalid", "reason": "invalid_value", "status_code": 400}] * len(refused)
    assert _errors(stack) == errors_before
    # and the engine still serves this tenant's next request
    ok = await client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=2, logprobs=True,
                                              top_logprobs=20)
    assert ok.choices[0].logprobs is not None
