"""The remote engine's request validation without a server: every bad field is a 400 naming it, in
words a client can act on (``parse_request`` is what both completion routes call on ``--engine
remote``; the in-process engines validate with vLLM's own request models,
``tests/gateway/test_openai_layer.py``)."""

from __future__ import annotations

import pytest

from kvmeter.serving.gateway.errors import ApiError
from kvmeter.serving.gateway.remote_path import ChatCompletionRequest, CompletionRequest, parse_request

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit int: what vLLM's own server accepts
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _refused(data: dict, kind=ChatCompletionRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(data, kind)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


@pytest.mark.parametrize("seed", [2**63, 2**64, 2**70, SEED_MIN - 1])
def test_seed_outside_a_signed_64_bit_int_is_refused_naming_seed(seed):
    err = _refused({**CHAT, "seed": seed})
    assert err.param == "seed" and err.code == "invalid_value" and "seed" in err.message


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, SEED_MAX])
def test_seed_inside_the_range_is_forwarded(seed):
    assert parse_request({**CHAT, "seed": seed}, ChatCompletionRequest).seed == seed


@pytest.mark.parametrize("field", ["n", "max_tokens", "max_completion_tokens", "min_tokens", "seed"])
def test_a_boolean_is_not_an_integer(field):
    err = _refused({**CHAT, field: True})
    assert err.param == field and err.code == "invalid_value"


@pytest.mark.parametrize("n", [None, "1", 1.0, [1]])
def test_n_must_be_the_integer_1(n):
    err = _refused({**CHAT, "n": n})
    assert err.param == "n" and err.code == "invalid_value"
    assert parse_request({**CHAT, "n": 1}, ChatCompletionRequest).n == 1


def test_best_of_true_is_not_best_of_1():
    assert _refused({**CHAT, "best_of": True}).param == "best_of"


@pytest.mark.parametrize("prompt", [[-1], None, [], "", [True], [1.5], ["a"], {"text": "hi"}, 7])
def test_bad_prompt_says_what_a_prompt_may_be(prompt):
    err = _refused({"model": "m", "prompt": prompt}, CompletionRequest)
    assert err.param == "prompt" and err.code == "invalid_value"
    assert err.message.startswith("prompt must be a non-empty string or a non-empty list of token ids")
    assert "constrained" not in err.message


def test_bad_stop_and_content_name_the_field_not_the_union_member():
    err = _refused({**CHAT, "stop": 5})
    assert (err.param, err.message) == ("stop", "stop must be a string or a list of at most 4 strings")
    assert _refused({**CHAT, "stop": ["a"] * 5}).message.endswith("at most 4 stop sequences are allowed")
    err = _refused({**CHAT, "messages": [{"role": "user", "content": 5}]})
    assert err.param == "messages.0.content" and err.message.startswith("messages.0.content must be")
