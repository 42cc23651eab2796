"""The parity harness's own logic without a server: what the comparison normalises, what it must
still catch, the stream merge, SSE parsing, and that the case table covers issue 13's features."""

from __future__ import annotations

import copy
import fnmatch

import pytest

from bench.parity.allowlist import ALLOWLIST
from bench.parity.cases import CASES, CHAT, COMPLETIONS, Case, case_named
from bench.parity.compare import MISSING, Allowed, by_choice, compare_case, diff, merge_chunks, view
from bench.parity.exchange import Answer, parse_sse

PLAIN = case_named("chat_plain")
RID_CASE = case_named("chat_x_request_id")  # sends X-Request-Id: parity-0001


def _completion(rid: str = "3f2a", created: int = 1796147740, fp: str | None = "vllm-0.32.0-8678c920",
                cached: int = 0, content: str = "Paris.", tool_id: str | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_id:
        message["tool_calls"] = [{"id": tool_id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "system_fingerprint": fp,
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def _json(body, status: int = 200, rid: str = "a1b2") -> Answer:
    return Answer(status, {"content-type": "application/json", "x-request-id": rid, "date": "x"}, "json", body)


def _sse(events, rid: str = "a1b2") -> Answer:
    return Answer(200, {"content-type": "text/event-stream; charset=utf-8", "x-request-id": rid}, "sse", events)


def _chunk(rid: str, delta: dict, finish=None, usage=None, index: int = 0) -> dict:
    chunk = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1796147740, "model": "m",
             "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def _stream(rid: str, pieces: list[str], ids: list[str] | None = None) -> list:
    ids = ids or [rid] * (len(pieces) + 2)
    events = [_chunk(ids[0], {"role": "assistant", "content": ""})]
    events += [_chunk(ids[i + 1], {"content": p}) for i, p in enumerate(pieces)]
    events.append(_chunk(ids[-1], {}, finish="stop"))
    return events + ["[DONE]"]


def test_ids_timestamps_fingerprints_and_cache_counts_are_normalised():
    a = _json(_completion(rid="aaaa", created=1, fp="vllm-0.32.0-x", cached=0, tool_id="chatcmpl-tool-1"))
    b = _json(_completion(rid="bbbb", created=2, fp=None, cached=16, tool_id="call_9"), rid="ffff")
    result = compare_case(PLAIN, a, b)
    assert result.verdict == "same", result.differences
    v = view(a, PLAIN)["body"]
    assert v["id"] == "chatcmpl-<id:1>" and v["created"] == "<created>"
    assert v["choices"][0]["message"]["tool_calls"][0]["id"] == "<tool_call_id:1>"
    assert v["usage"]["prompt_tokens_details"]["cached_tokens"] == "<cached_tokens>"


def test_what_is_not_an_id_still_counts():
    a = _json(_completion())
    for change in (lambda b: b["choices"][0]["message"].update(content="Lyon."),
                   lambda b: b.update(object="text_completion"),
                   lambda b: b.update(created="1796147740"),  # a string timestamp is not normalised
                   lambda b: b.update(id="kvm-123"),  # the chatcmpl- prefix is part of the shape
                   lambda b: b["usage"].update(completion_tokens=3),
                   lambda b: b["usage"]["prompt_tokens_details"].update(cached_tokens=-1),
                   lambda b: b.pop("system_fingerprint")):
        body = _completion()
        change(body)
        assert compare_case(PLAIN, a, _json(body)).verdict == "different", body


def test_a_status_or_content_type_difference_fails():
    a = _json(_completion())
    assert [d.path for d in compare_case(PLAIN, a, _json(_completion(), status=201)).differences] == ["status"]
    b = _json(_completion())
    b.headers["content-type"] = "application/json; charset=utf-8"
    assert [d.path for d in compare_case(PLAIN, a, b).differences] == ["headers.content-type"]


def test_headers_outside_the_openai_surface_are_not_compared():
    a, b = _json(_completion()), _json(_completion())
    b.headers.update({"x-ratelimit-remaining-requests": "9", "x-kvmeter-tenant": "t", "server": "kvmeter"})
    assert compare_case(PLAIN, a, b).verdict == "same"


def test_the_clients_request_id_must_be_echoed_in_the_header_and_the_id():
    ref = _json(_completion(rid="parity-0001"), rid="parity-0001")
    assert view(ref, RID_CASE)["body"]["id"] == "chatcmpl-<x-request-id>"
    own = _json(_completion(rid="kvm-77"), rid="kvm-77")  # a server that ignores the client's id
    paths = {d.path for d in compare_case(RID_CASE, ref, own).differences}
    assert paths == {"body.id", "headers.x-request-id"}
    missing = _json(_completion(rid="parity-0001"))
    del missing.headers["x-request-id"]
    assert [d.path for d in compare_case(PLAIN, ref, missing).differences] == ["headers.x-request-id"]


def test_a_stream_whose_chunks_disagree_on_the_id_differs():
    ref = _sse(_stream("aaaa", ["Par", "is"]))
    assert compare_case(case_named("chat_stream"), ref, _sse(_stream("bbbb", ["Par", "is"]))).verdict == "same"
    split = _sse(_stream("bbbb", ["Par", "is"], ids=["bbbb", "bbbb", "cccc", "bbbb"]))
    result = compare_case(case_named("chat_stream"), ref, split)
    assert [d.path for d in result.differences] == ["body.2.id"]


def test_scalars_compare_as_json_values():
    assert diff(1, 1.0) == []
    assert [d.path for d in diff({"n": True}, {"n": 1})] == ["n"]
    assert [d.path for d in diff({"n": None}, {"n": 0})] == ["n"]
    assert diff("1", 1) != []


def test_missing_keys_and_items_are_reported_on_the_side_that_lacks_them():
    out = diff({"a": 1, "l": [1, 2]}, {"b": 2, "l": [1]})
    assert {(d.path, d.reference, d.target) for d in out} == {
        ("a", 1, MISSING), ("b", MISSING, 2), ("l.1", 2, MISSING)}


def test_the_allow_list_sets_aside_only_what_it_names():
    err = lambda msg, code: _json({"error": {"message": msg, "type": "BadRequestError", "param": "max_tokens",  # noqa: E731
                                             "code": code}}, status=400)
    case = case_named("bad_max_tokens_type")
    entries = [Allowed("bad_*", "body.error.message", "wording")]
    same_but_words = compare_case(case, err("1 validation error ...", 400), err("max_tokens must be an integer", 400),
                                  entries)
    assert same_but_words.verdict == "allowed" and same_but_words.allowed[0][1] == "wording"
    other_code = compare_case(case, err("a", 400), err("b", "invalid_value"), entries)
    assert other_code.verdict == "different" and [d.path for d in other_code.differences] == ["body.error.code"]
    # the entry names bad_* cases only
    assert compare_case(PLAIN, err("a", 400), err("b", 400), entries).verdict == "different"


def test_a_stream_cut_into_other_chunks_is_the_same_once_merged():
    ref = _sse(_stream("aaaa", ["Par", "is", " is", " nice"]))
    coalesced = _sse(_stream("bbbb", ["Par", "is is", " nice"]))
    result = compare_case(case_named("chat_stream"), ref, coalesced)
    assert result.verdict == "same" and "chunk boundaries differ (7 vs 6 events)" in result.note
    other_text = _sse(_stream("bbbb", ["Par", "is is", " nicer"]))
    assert compare_case(case_named("chat_stream"), ref, other_text).verdict == "different"


def test_a_terminal_chunk_with_the_fingerprint_merges_with_the_tokens_before_it():
    """vLLM stamps ``system_fingerprint`` on the terminal chunk only; on a busy machine one
    server's terminal chunk carries the last tokens too, the other's comes alone. Once merged the
    streams are the same (seen on the parity run: "'Étoile, la Mar" in one chunk on one side)."""
    fp = "vllm-0.32.0-x"
    lagged = _stream("aaaa", ["'"]) [:-2] + [{**_chunk("aaaa", {"content": "Étoile, la Mar"}, finish="length"),
                                              "system_fingerprint": fp}, "[DONE]"]
    steady = _stream("bbbb", ["'", "É", "to", "ile, la Mar"])[:-2] + [
        {**_chunk("bbbb", {}, finish="length"), "system_fingerprint": fp}, "[DONE]"]
    result = compare_case(case_named("chat_stream"), _sse(lagged), _sse(steady))
    assert result.verdict == "same", result.differences
    other = _stream("bbbb", ["'", "É", "to", "ile, la Mer"])[:-2] + [
        {**_chunk("bbbb", {}, finish="length"), "system_fingerprint": fp}, "[DONE]"]
    assert compare_case(case_named("chat_stream"), _sse(lagged), _sse(other)).verdict == "different"
    no_fp = steady[:-2] + [_chunk("bbbb", {}, finish="length"), "[DONE]"]
    assert compare_case(case_named("chat_stream"), _sse(lagged), _sse(no_fp)).verdict == "different"


def test_merging_keeps_the_role_chunk_usage_and_done_and_joins_tool_call_arguments():
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    events = [
        _chunk("a", {"role": "assistant", "content": ""}),
        _chunk("a", {"tool_calls": [{"index": 0, "id": "t1", "type": "function", "function": {"name": "f"}}]}),
        _chunk("a", {"tool_calls": [{"index": 0, "function": {"arguments": "{\"ci"}}]}, usage=usage),
        _chunk("a", {"tool_calls": [{"index": 0, "function": {"arguments": "ty\": 1}"}}]},
               usage={**usage, "completion_tokens": 2}),
        _chunk("a", {}, finish="tool_calls"),
        {"id": "chatcmpl-a", "choices": [], "usage": {**usage, "completion_tokens": 3}},
        "[DONE]",
    ]
    merged = merge_chunks(copy.deepcopy(events))
    assert len(merged) == 4 and merged[0] == events[0] and merged[-2:] == events[-2:]
    call = merged[1]["choices"][0]["delta"]["tool_calls"]
    assert call == [{"index": 0, "id": "t1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"city\": 1}"}}]
    assert merged[1]["choices"][0]["finish_reason"] == "tool_calls"
    assert merged[1]["usage"]["completion_tokens"] == 2


def test_chunks_of_different_choices_are_not_merged():
    events = [_chunk("a", {"content": "x"}, index=0), _chunk("a", {"content": "y"}, index=1)]
    assert merge_chunks(events) == events


def _n2(rid: str, order: list[tuple[int, str]], finish: str = "length") -> list:
    """An n=2 chat stream: both role chunks, the (choice, piece) chunks in ``order``, both finishes."""
    events = [_chunk(rid, {"role": "assistant", "content": ""}, index=i) for i in (0, 1)]
    events += [_chunk(rid, {"content": p}, index=i) for i, p in order]
    events += [_chunk(rid, {}, finish=finish, index=i) for i in (0, 1)]
    return events + ["[DONE]"]


def test_choices_interleaved_otherwise_are_the_same_once_gathered_and_merged():
    case = case_named("chat_n2_stream")
    ref = _sse(_n2("aaaa", [(0, "The"), (1, "The"), (0, " capital"), (1, " capital")]))
    # the target's reader lagged: choice 1's chunk of a step came first, and two steps coalesced
    lagged = _sse(_n2("bbbb", [(0, "The"), (1, "The capital"), (0, " capital")]))
    result = compare_case(case, ref, lagged)
    assert result.verdict == "same", result.differences
    assert "the interleaving of choices differ" in result.note
    # one choice's text differs: still different, however the chunks are gathered
    other = _sse(_n2("bbbb", [(1, "The capital"), (0, "The"), (0, " capitol")]))
    assert compare_case(case, ref, other).verdict == "different"
    # so does a finish reason
    assert compare_case(case, ref, _sse(_n2("bbbb", [(1, "The capital"), (0, "The capital")], "stop"))).verdict \
        == "different"


def test_by_choice_keeps_each_choice_in_order_and_the_rest_last():
    events = [_chunk("a", {"content": "x"}, index=1), {"id": "u", "choices": [], "usage": {}},
              _chunk("a", {"content": "y"}, index=0), _chunk("a", {"content": "z"}, index=1), "[DONE]"]
    assert by_choice(events) == [events[2], events[0], events[3], events[1], "[DONE]"]


def test_parse_sse_reads_data_events_done_comments_and_names():
    text = ('data: {"a": 1}\n\n: keep-alive\n\ndata: {"b":\ndata: 2}\n\nevent: error\ndata: {"c": 3}\n\n'
            'data: not json\n\ndata: [DONE]\n\n')
    assert parse_sse(text) == [{"a": 1}, {"b": 2}, {"event": "error", "data": {"c": 3}},
                               {"<unparsed>": "not json"}, "[DONE]"]
    assert parse_sse("data: {\"a\": 1}\r\n\r\ndata: [DONE]") == [{"a": 1}, "[DONE]"]


# -- the table -----------------------------------------------------------------------------------

def _bodies(endpoint: str | None = None):
    return [(c, c.body) for c in CASES if isinstance(c.body, dict) and (endpoint is None or c.endpoint == endpoint)]


def _some(pred, endpoint: str | None = None) -> bool:
    return any(pred(c, b) for c, b in _bodies(endpoint))


FEATURES = {
    "system + user": (lambda c, b: [m.get("role") for m in b.get("messages", [])][:2] == ["system", "user"], CHAT),
    "multi-turn": (lambda c, b: sum(m.get("role") == "user" for m in b.get("messages", [])) >= 2, CHAT),
    "tool_choice auto": (lambda c, b: b.get("tool_choice") == "auto" and "tools" in b, CHAT),
    "tool_choice none": (lambda c, b: b.get("tool_choice") == "none" and "tools" in b, CHAT),
    "tool_choice required": (lambda c, b: b.get("tool_choice") == "required", CHAT),
    "named function": (lambda c, b: isinstance(b.get("tool_choice"), dict) and not c.name.startswith("bad_"), CHAT),
    "parallel_tool_calls true": (lambda c, b: b.get("parallel_tool_calls") is True, CHAT),
    "parallel_tool_calls false": (lambda c, b: b.get("parallel_tool_calls") is False, CHAT),
    "streamed tool calls": (lambda c, b: c.stream and b.get("tool_choice") in ("required",) , CHAT),
    "tool-result turn": (lambda c, b: any(m.get("role") == "tool" and m.get("tool_call_id")
                                          for m in b.get("messages", []))
                         and any(m.get("tool_calls") and m.get("content") is None for m in b["messages"]), CHAT),
    "json_object": (lambda c, b: (b.get("response_format") or {}).get("type") == "json_object", CHAT),
    "json_schema strict": (lambda c, b: (b.get("response_format") or {}).get("json_schema", {}).get("strict") is True,
                           CHAT),
    "n=2 chat": (lambda c, b: b.get("n") == 2, CHAT),
    "n=2 completions": (lambda c, b: b.get("n") == 2, COMPLETIONS),
    "best_of": (lambda c, b: "best_of" in b, COMPLETIONS),
    "chat logprobs": (lambda c, b: b.get("logprobs") is True and b.get("top_logprobs"), CHAT),
    "completions logprobs 2": (lambda c, b: b.get("logprobs") == 2, COMPLETIONS),
    "echo": (lambda c, b: b.get("echo") is True, COMPLETIONS),
    "prompt list": (lambda c, b: b.get("prompt") == ["Hello", "World"], COMPLETIONS),
    "token-id prompt": (lambda c, b: isinstance(b.get("prompt"), list) and all(type(x) is int for x in b["prompt"]),
                        COMPLETIONS),
    "penalties 2.0 at temperature 0": (lambda c, b: b.get("presence_penalty") == 2.0
                                       and b.get("frequency_penalty") == 2.0 and b.get("temperature") == 0.0, CHAT),
    "top_k=1": (lambda c, b: b.get("top_k") == 1, CHAT),
    "min_p": (lambda c, b: "min_p" in b, None),
    "repetition_penalty": (lambda c, b: "repetition_penalty" in b, None),
    "logit_bias": (lambda c, b: "logit_bias" in b, None),
    "stop strings": (lambda c, b: bool(b.get("stop")), None),
    "stop_token_ids": (lambda c, b: bool(b.get("stop_token_ids")), None),
    "seed at temperature 1": (lambda c, b: "seed" in b and b.get("temperature") == 1.0, None),
    "min_tokens": (lambda c, b: b.get("min_tokens", 0) > 0, None),
    "max_completion_tokens": (lambda c, b: "max_completion_tokens" in b, CHAT),
    "include_usage": (lambda c, b: c.stream and (b.get("stream_options") or {}).get("include_usage"), None),
    "continuous_usage_stats": (lambda c, b: (b.get("stream_options") or {}).get("continuous_usage_stats"), None),
    "X-Request-Id": (lambda c, b: any(k.lower() == "x-request-id" for k in c.headers), None),
    "user": (lambda c, b: "user" in b, None),
    "metadata": (lambda c, b: "metadata" in b, None),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_the_table_covers_every_feature_of_issue_13(feature):
    pred, endpoint = FEATURES[feature]
    assert _some(pred, endpoint), f"no case covers {feature}"


BAD_INPUTS = ["bad_malformed_json", "bad_body_not_object", "bad_max_tokens_type", "bad_max_tokens_negative",
              "bad_unknown_model", "bad_prompt_past_window", "bad_max_tokens_past_window", "bad_tool_choice_unknown",
              "bad_n0", "bad_temperature_negative", "bad_invalid_utf8", "bad_empty_messages", "bad_unknown_role",
              "bad_tool_message_no_id"]


def test_the_table_has_each_bad_input():
    names = {c.name for c in CASES}
    assert [n for n in BAD_INPUTS if n not in names] == []
    assert all(isinstance(case_named(n).body, bytes) for n in ("bad_malformed_json", "bad_body_not_object",
                                                              "bad_invalid_utf8"))


def test_the_table_is_large_and_its_compared_texts_are_deterministic():
    assert len(CASES) >= 45
    for c, b in _bodies():
        if c.name.startswith("bad_"):
            continue
        assert b.get("temperature") == 0.0 or "seed" in b, f"{c.name}: neither greedy nor seeded"
        assert b.get("max_tokens", b.get("max_completion_tokens", 16)) <= 48, c.name


def test_invalid_utf8_is_really_invalid():
    with pytest.raises(UnicodeDecodeError):
        case_named("bad_invalid_utf8").body.decode("utf-8")


def test_every_allow_list_entry_names_a_case_and_gives_a_reason():
    for entry in ALLOWLIST:
        assert any(fnmatch.fnmatchcase(c.name, entry.case) for c in CASES), entry
        assert len(entry.reason) > 20, entry
    assert len(ALLOWLIST) <= 8, "the allow-list is meant to stay short"


def test_case_named_raises_for_an_unknown_case():
    with pytest.raises(KeyError):
        case_named("no_such_case")
    assert isinstance(case_named("chat_plain"), Case)


# -- the report ----------------------------------------------------------------------------------

def _outcome(case: Case, ref: Answer, tgt: Answer):
    from bench.parity.run import Outcome
    return Outcome(case, ref, tgt, compare_case(case, ref, tgt, ALLOWLIST))


def test_the_matrix_says_what_differs_first_and_counts_the_verdicts():
    from bench.parity.run import counts, matrix, render_markdown, results_json

    refused = _json({"error": {"message": "tool calling is not supported by this gateway", "type": "x",
                               "param": "tools", "code": "unsupported_parameter"}}, status=400)
    lean = _completion(content="Lyon.")
    lean["choices"][0]["message"]["refusal"] = None
    outcomes = [_outcome(PLAIN, _json(_completion()), _json(_completion())),
                _outcome(case_named("chat_tools_auto"), _json(_completion()), refused),
                _outcome(case_named("chat_multi_turn"), _json(lean), _json(_completion()))]
    assert counts(outcomes) == {"same": 1, "allowed": 0, "different": 2, "other_status": 1, "other_text": 1}
    rows = matrix(outcomes).splitlines()
    assert rows[2].startswith("| `chat_plain` | 200 | 200 | same |")
    assert "target answers 400: tool calling is not supported by this gateway" in rows[3]
    assert "1 changed: `body.choices.0.message.content`" in rows[4] and "missing: refusal" in rows[4]
    meta = {"command": "c", "started_utc": "now", "run_s": 1, "table_s": 1, "startup": "-", "load_before": [0],
            "machine": {"cores": 2, "cpu": "cpu", "platform": "p"}, "versions": {"python": "3"},
            "reference": "r", "target": "t", "allowlist": True}
    text = render_markdown(outcomes, meta)
    assert ("**3 cases: 1 same, 0 same with allowed differences, 2 different** (1 with another HTTP status; "
            "of the 1 with the same status, 1 generated another text") in text
    assert "missing on the target: `body.choices.*.message.refusal`" in text
    data = results_json(outcomes, meta)
    assert [c["verdict"] for c in data["cases"]] == ["same", "different", "different"]
    assert data["cases"][1]["n_differences"] == len(outcomes[1].result.differences)


def test_results_keep_a_bounded_number_of_clipped_differences():
    from bench.parity.run import MAX_KEPT, results_json

    ref = _json({"v": ["x" * 1000] * 40})
    tgt = _json({"v": ["y"] * 40})
    data = results_json([_outcome(PLAIN, ref, tgt)], {"k": 1})
    kept = data["cases"][0]["differences"]
    assert data["cases"][0]["n_differences"] == 40 and len(kept) == MAX_KEPT
    assert all(len(str(d["reference"])) <= 300 for d in kept)


def test_output_texts_join_a_streams_pieces_per_choice():
    from bench.parity.run import output_texts

    assert output_texts(_json(_completion(content="Paris."))) == {0: "Paris."}
    stream = _stream("a", ["Par", "is."]) + [_chunk("a", {"content": "x"}, index=1)]
    assert output_texts(_sse(stream)) == {0: "Paris.", 1: "x"}
    completions = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}
    assert output_texts(_json(completions)) == {0: "a", 1: "b"}
    assert output_texts(_json({"error": {"message": "m"}}, status=400)) == {}
