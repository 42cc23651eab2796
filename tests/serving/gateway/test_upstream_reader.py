"""The remote proxy's reading of an upstream answer, without a server: which usage block bills, what
counts as exact, and what the client's view of a stream takes out (``serving/gateway/upstream.py``;
the same shapes over real HTTP: ``tests/serving/quota_http/test_remote_proxy_http.py``)."""

from __future__ import annotations

import orjson

from kvmeter.serving.gateway.upstream import DONE, UNKNOWN, AnswerReader, ClientView, parse_usage
from kvmeter.tokens import TokenCounts


def words(text: str) -> int:
    return len(text.split())


def chunk(text: str | None = None, *, index: int = 0, finish: str | None = None, usage: dict | None = None) -> dict:
    c: dict = {"object": "chat.completion.chunk",
               "choices": [{"index": index, "delta": {} if text is None else {"content": text},
                            "finish_reason": finish}]}
    if usage is not None:
        c["usage"] = usage
    return c


def use(prompt: int, completion: int, **extra) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, **extra}


def test_parse_usage_reads_the_wire_names_and_refuses_what_cannot_bill():
    assert parse_usage(use(40, 7, prompt_tokens_details={"cached_tokens": 16},
                           completion_tokens_details={"reasoning_tokens": 3})) == TokenCounts(40, 16, 7, 3)
    assert parse_usage(use(4, 2, prompt_tokens_details={"cached_tokens": 9})) == TokenCounts(4, 4, 2, 0)  # clamped
    for bad in (None, {}, use(-1, 2), use(3, "2"), use(True, 2), {"prompt_tokens": 3}):
        assert parse_usage(bad) is None, bad


def test_running_usage_per_choice_bills_each_choices_last_block():
    reader = AnswerReader(words, input_estimate=99)
    for i in range(8):  # choice 0: running 0..7; choice 1: running 0..4
        reader.on_event(chunk(f"w{i}", index=0, usage=use(40, i)))
        if i <= 4:
            reader.on_event(chunk(f"w{i}", index=1, usage=use(40, i)))
    assert reader.tokens() == TokenCounts(input_tokens=40, output_tokens=7 + 4)
    assert reader.exact()
    reader.on_event({"choices": [], "usage": use(40, 12, prompt_tokens_details={"cached_tokens": 8})})
    assert reader.tokens() == TokenCounts(40, 8, 12, 0)  # the final block wins


def test_without_usage_the_counts_are_the_streamed_text_and_the_prompt_estimate():
    reader = AnswerReader(words, input_estimate=21)
    for text in ("one two", " three", None):
        reader.on_event(chunk(text))
    reader.on_event(chunk(" four five", finish="length"))
    reader.on_event(DONE)
    assert reader.tokens() == TokenCounts(input_tokens=21, output_tokens=5)
    assert not reader.exact() and reader.done and reader.finish_reason() == "length"


def test_running_usage_that_misses_a_choice_or_a_prompt_is_an_estimate():
    reader = AnswerReader(words, input_estimate=30)
    reader.on_event(chunk("a b", index=0, usage=use(15, 2)))
    reader.on_event(chunk("c", index=1))
    assert reader.tokens().output_tokens == 3 and not reader.exact()
    several = AnswerReader(words, input_estimate=30, single_prompt=False)
    several.on_event(chunk("a b", usage=use(15, 2)))
    assert several.tokens().input_tokens == 30 and not several.exact()  # one prompt's count, not the sum


def test_an_error_event_and_a_whole_answer():
    reader = AnswerReader(words, input_estimate=5)
    reader.on_event(chunk("a"))
    reader.on_event({"error": {"message": "boom", "code": 500}})
    assert reader.error == {"message": "boom", "code": 500}
    whole = AnswerReader(words, input_estimate=5)
    whole.on_answer({"choices": [{"index": 0, "message": {"content": "x y", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}]})
    assert whole.tokens() == TokenCounts(input_tokens=5, output_tokens=2 + 1 + 1) and not whole.exact()  # each piece
    assert whole.finish_reason() == "tool_calls"


def _raw(payload) -> bytes:
    return b"data: " + (payload.encode() if isinstance(payload, str) else orjson.dumps(payload)) + b"\n\n"


def test_a_client_that_asked_for_usage_gets_every_event_unchanged():
    view = ClientView(strip_usage=False)
    for payload in (chunk("a", usage=use(3, 1)), {"choices": [], "usage": use(3, 1)}, DONE):
        assert view.event(_raw(payload), payload) == [_raw(payload)]


def test_kvmeters_usage_is_taken_out_and_the_fingerprint_put_back_on_the_last_chunks():
    view = ClientView(strip_usage=True)
    first, last = chunk("a"), chunk("b", finish="stop")
    assert view.event(_raw(first), first) == [_raw(first)]
    assert view.event(_raw(last), last) == []  # held: its fingerprint is on the usage chunk
    usage_chunk = {"choices": [], "usage": use(3, 2), "system_fingerprint": "fp-1"}
    released = view.event(_raw(usage_chunk), usage_chunk)
    assert [orjson.loads(r[6:]) for r in released] == [{**chunk("b", finish="stop"), "system_fingerprint": "fp-1"}]
    assert view.fingerprint == "fp-1"
    again = ClientView(strip_usage=True, fingerprint="fp-1")  # known: stamped at once
    last = chunk("b", finish="stop", usage=use(3, 2))
    assert orjson.loads(again.event(_raw(last), last)[0][6:]) == {**chunk("b", finish="stop"),
                                                                  "system_fingerprint": "fp-1"}
    none = ClientView(strip_usage=True)
    assert none.fingerprint is UNKNOWN
    held = chunk("c", finish="length")
    assert none.event(_raw(held), held) == []
    assert none.event(_raw(DONE), DONE) == [_raw(chunk("c", finish="length")), _raw(DONE)]  # never learnt: as it was
