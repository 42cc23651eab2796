"""The OpenAI-API parity table: every request of issue 13 item 1, plus bad inputs, as plain data.

Each :class:`Case` is sent unchanged to vLLM's own OpenAI server and to the target (kvmeter serve)
on the same model; ``run.py`` compares the answers field by field (``compare.py``). Outputs are
compared exactly, so every case whose text is compared is deterministic: greedy (temperature 0)
or sampled with a fixed ``seed`` — ``top_k=1`` too: where two logits tie exactly (bf16), greedy
takes the lower token id but top-k keeps both and samples, so unseeded ``top_k=1`` is not
deterministic on this model (the capital question's first token is such a tie). ``max_tokens``
stays ≤ 24 so the whole table runs in a few minutes on two CPU cores, except where a tool call
must fit (:data:`TOOL_TOKENS`).

Token ids below are SmolLM2-135M-Instruct's (its tokenizer, vocabulary 49,152): 2 ``<|im_end|>``
(EOS), 7042 `` Paris``, 260 `` the``, 30 ``.``, 28 ``,``, 314 `` is``, 4461 `` blue``, 19556 ``Hello``.
The context window the servers run with is :data:`MAX_MODEL_LEN` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "CASES", "MODEL", "MAX_MODEL_LEN", "CHAT", "COMPLETIONS", "case_named"]

#: the served model name both servers answer to (``kvmeter.model.DEFAULT_MODEL_NAME``)
MODEL = "SmolLM2-135M-Instruct"
#: the context window both servers are started with (tokens)
MAX_MODEL_LEN = 2048
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class Case:
    """One request of the parity table.

    Attributes:
        name: unique, ``snake_case``; bad inputs start with ``bad_``.
        endpoint: :data:`CHAT` or :data:`COMPLETIONS`.
        body: the JSON body (a dict, serialised by the sender), or raw ``bytes`` sent as they are
            (malformed input).
        stream: whether the answer is read as server-sent events (mirrors ``body["stream"]``).
        headers: extra request headers (the sender adds ``content-type`` and ``authorization``).
        feature: what of issue 13 item 1 (or which bad input) the case covers.
        notes: anything a reader of the matrix should know.
    """

    name: str
    endpoint: str
    body: dict[str, Any] | bytes
    feature: str
    stream: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    notes: str = ""


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
#: long enough for one complete hermes tool call (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
#: is ~30 tokens), the one exception to the short outputs
TOOL_TOKENS = 48
WEATHER_Q = _user("What is the weather like in Paris today?")
BOTH_Q = _user("What is the weather and the local time in Paris and in Tokyo?")
#: how the n=2 cases sample. vLLM refuses n > 1 at temperature 0, and n=2 sampled at temperature 1
#: is not reproducible even with a seed: one choice's 14th token differed between two runs on the
#: same server (its children share engine steps, so their logits are not bit-stable). top_k=1 keeps
#: the support to the best token (both choices are the greedy text); the seed settles exact ties.
N_SAMPLING = {"temperature": 1.0, "top_k": 1, "seed": 42}
CAPITAL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                  "required": ["city", "country"], "additionalProperties": False}


def _body(defaults: dict[str, Any], params: dict[str, Any], stream: bool) -> dict[str, Any]:
    """``defaults`` updated with ``params``; a ``None`` value leaves the field out."""
    body = {**defaults, **params}
    if stream:
        body["stream"] = True
    return {k: v for k, v in body.items() if v is not None}


def chat(name: str, feature: str, *, stream: bool = False, headers: dict[str, str] | None = None,
         notes: str = "", **params: Any) -> Case:
    """A chat case: greedy, 16 tokens, the capital question unless ``messages`` says otherwise
    (``messages=None``: no messages field)."""
    defaults = {"model": MODEL, "messages": _user("What is the capital of France?"), "max_tokens": 16,
                "temperature": 0.0}
    return Case(name, CHAT, _body(defaults, params, stream), feature, stream=stream, headers=headers or {},
                notes=notes)


def completion(name: str, feature: str, *, stream: bool = False, headers: dict[str, str] | None = None,
               notes: str = "", **params: Any) -> Case:
    """A completions case: greedy, 12 tokens, ``prompt`` "The capital of France is" unless told
    otherwise (``prompt=None``: no prompt field)."""
    defaults = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0}
    return Case(name, COMPLETIONS, _body(defaults, params, stream), feature, stream=stream,
                headers=headers or {}, notes=notes)


_LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 260  # ≈ 2,600 tokens > MAX_MODEL_LEN

CASES: list[Case] = [
    # -- chat: messages -------------------------------------------------------------------------
    chat("chat_plain", "plain chat"),
    chat("chat_system_user", "system + user",
         messages=[{"role": "system", "content": "You answer in one short sentence."},
                   *_user("Name a primary colour.")]),
    chat("chat_multi_turn", "multi-turn",
         messages=[*_user("My name is Ada."), {"role": "assistant", "content": "Nice to meet you, Ada!"},
                   *_user("What is my name?")]),
    chat("chat_content_parts", "content as a list of text parts",
         messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                                {"type": "text", "text": " of France?"}]}]),
    chat("chat_developer_role", "developer message",
         messages=[{"role": "developer", "content": "Answer briefly."}, *_user("What is 2 + 2?")]),
    chat("chat_stream", "streamed chat", stream=True),
    # -- chat: tools ----------------------------------------------------------------------------
    chat("chat_tools_auto", "tools + tool_choice auto", messages=WEATHER_Q, tools=TOOLS, tool_choice="auto",
         max_tokens=24),
    chat("chat_tools_none", "tools + tool_choice none", messages=WEATHER_Q, tools=TOOLS, tool_choice="none"),
    chat("chat_tools_required", "tools + tool_choice required", messages=WEATHER_Q, tools=TOOLS,
         tool_choice="required", max_tokens=TOOL_TOKENS),
    chat("chat_tools_named", "tools + a named function", messages=WEATHER_Q, tools=TOOLS,
         tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=TOOL_TOKENS),
    chat("chat_tools_parallel_true", "parallel tool calls (parallel_tool_calls true)", messages=BOTH_Q,
         tools=TOOLS, tool_choice="required", parallel_tool_calls=True, max_tokens=TOOL_TOKENS),
    chat("chat_tools_parallel_false", "parallel_tool_calls false", messages=BOTH_Q, tools=TOOLS,
         tool_choice="required", parallel_tool_calls=False, max_tokens=TOOL_TOKENS),
    chat("chat_tools_stream_required", "streamed tool-call deltas (required)", messages=WEATHER_Q,
         tools=TOOLS, tool_choice="required", max_tokens=TOOL_TOKENS, stream=True),
    chat("chat_tools_stream_named", "streamed tool-call deltas (named function)", messages=WEATHER_Q,
         tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=TOOL_TOKENS,
         stream=True),
    chat("chat_tools_stream_auto", "streamed, tools + tool_choice auto (hermes parser on text)",
         messages=WEATHER_Q, tools=TOOLS, tool_choice="auto", max_tokens=24, stream=True),
    chat("chat_tool_result_turn", "tool-result turn (assistant tool_calls with null content, then tool)",
         messages=[*WEATHER_Q,
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_weather_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                   {"role": "tool", "tool_call_id": "call_weather_1",
                    "content": "{\"temperature_c\": 21, \"sky\": \"sunny\"}"}],
         tools=TOOLS, tool_choice="auto", max_tokens=24),
    # -- chat: structured outputs ---------------------------------------------------------------
    chat("chat_json_object", "response_format json_object",
         messages=_user("Give the capital of France as a JSON object with a key city."),
         response_format={"type": "json_object"}, max_tokens=24),
    chat("chat_json_schema_strict", "response_format json_schema (strict)",
         messages=_user("Give the capital of France and its country as JSON."),
         response_format={"type": "json_schema", "json_schema": {"name": "capital", "strict": True,
                                                                 "schema": CAPITAL_SCHEMA}}, max_tokens=24),
    chat("chat_json_schema_stream", "response_format json_schema, streamed",
         messages=_user("Give the capital of France and its country as JSON."),
         response_format={"type": "json_schema", "json_schema": {"name": "capital", "strict": True,
                                                                 "schema": CAPITAL_SCHEMA}}, max_tokens=24,
         stream=True),
    # -- chat: n, logprobs ----------------------------------------------------------------------
    chat("chat_n2", "n=2 (chat)", n=2, **N_SAMPLING, notes="two choices (see N_SAMPLING)"),
    chat("chat_n2_stream", "n=2 streamed", n=2, **N_SAMPLING, max_tokens=8, stream=True),
    chat("chat_logprobs", "logprobs + top_logprobs (chat)", logprobs=True, top_logprobs=2, max_tokens=8),
    chat("chat_logprobs_stream", "logprobs + top_logprobs, streamed", logprobs=True, top_logprobs=2,
         max_tokens=8, stream=True),
    # -- chat: sampling parameters --------------------------------------------------------------
    chat("chat_penalties", "presence_penalty / frequency_penalty 2.0 at temperature 0",
         messages=_user("Repeat the word hello ten times."), presence_penalty=2.0, frequency_penalty=2.0,
         max_tokens=20, notes="compare with chat_penalties_off: the text must change"),
    chat("chat_penalties_off", "the same prompt without penalties (control)",
         messages=_user("Repeat the word hello ten times."), max_tokens=20),
    chat("chat_top_k1", "top_k=1 at temperature 1 (greedy)", temperature=1.0, top_k=1, seed=5,
         notes="seeded: the first token's two best logits tie (see the module docstring)"),
    chat("chat_top_k1_again", "top_k=1 a second time (same text)", temperature=1.0, top_k=1, seed=6),
    chat("chat_min_p", "min_p", temperature=1.0, min_p=0.5, seed=3),
    chat("chat_repetition_penalty", "repetition_penalty", messages=_user("Repeat the word hello ten times."),
         repetition_penalty=1.8, max_tokens=20),
    chat("chat_logit_bias", "logit_bias", logit_bias={"7042": -100, "4461": 5}, max_tokens=12,
         notes="bans ' Paris' (7042)"),
    chat("chat_stop_strings", "stop strings", stop=[" is", "\n"], max_tokens=16),
    chat("chat_stop_token_ids", "stop_token_ids", stop_token_ids=[314, 30], max_tokens=16,
         notes="314 ' is', 30 '.'"),
    chat("chat_seed_temp1", "seed with temperature 1", temperature=1.0, seed=1234),
    chat("chat_min_tokens", "min_tokens (EOS held back)", messages=_user("Say yes."), min_tokens=10,
         max_tokens=12),
    chat("chat_max_completion_tokens", "max_completion_tokens", max_completion_tokens=5, max_tokens=None),
    chat("chat_stream_include_usage", "stream_options.include_usage", stream=True,
         stream_options={"include_usage": True}),
    chat("chat_stream_continuous_usage", "stream_options.continuous_usage_stats", stream=True, max_tokens=8,
         stream_options={"include_usage": True, "continuous_usage_stats": True}),
    chat("chat_x_request_id", "X-Request-Id header", headers={"X-Request-Id": "parity-0001"}, max_tokens=8,
         notes="vLLM builds the response id from it and, with --enable-request-id-headers, echoes it"),
    chat("chat_x_request_id_stream", "X-Request-Id header, streamed", headers={"X-Request-Id": "parity-0002"},
         max_tokens=6, stream=True),
    chat("chat_user_field", "user field", user="user-1234", max_tokens=8),
    chat("chat_metadata", "metadata field", metadata={"session": "parity"}, max_tokens=8,
         notes="not in vLLM's schema: ignored with a warning"),
    # -- completions ----------------------------------------------------------------------------
    completion("cmpl_plain", "plain completion"),
    completion("cmpl_stream_include_usage", "completions, streamed with include_usage", stream=True,
               stream_options={"include_usage": True}),
    completion("cmpl_stream_continuous_usage", "completions, continuous_usage_stats", stream=True,
               max_tokens=6, stream_options={"include_usage": True, "continuous_usage_stats": True}),
    completion("cmpl_n2", "n=2 (completions)", n=2, **N_SAMPLING),
    completion("cmpl_best_of", "best_of on completions", n=1, best_of=2),
    completion("cmpl_logprobs", "logprobs: 2 (completions)", logprobs=2, max_tokens=6),
    completion("cmpl_echo", "echo: true", echo=True, max_tokens=6),
    completion("cmpl_echo_logprobs", "echo with logprobs (prompt logprobs)", echo=True, logprobs=1, max_tokens=4),
    completion("cmpl_prompt_list", "prompt list", prompt=["Hello", "World"], max_tokens=6),
    completion("cmpl_token_ids", "token-id prompt", prompt=[504, 2365, 6354, 16438, 27003, 690, 260],
               max_tokens=6, notes="'The quick brown fox jumps over the'"),
    completion("cmpl_stop", "stop string (completions)", stop=["."], max_tokens=16),
    completion("cmpl_seed", "seed with temperature 1 (completions)", temperature=1.0, seed=7),
    completion("cmpl_stream_n2", "n=2 streamed (completions)", n=2, **N_SAMPLING, max_tokens=6, stream=True),
    # -- bad inputs -----------------------------------------------------------------------------
    Case("bad_malformed_json", CHAT, b'{"model": "SmolLM2-135M-Instruct", "messages": [', "malformed JSON"),
    Case("bad_body_not_object", CHAT, b'[{"role": "user", "content": "hi"}]', "body is a JSON array"),
    Case("bad_invalid_utf8", CHAT,
         b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "caf\xe9 \xff"}]}',
         "invalid UTF-8 bytes"),
    chat("bad_max_tokens_type", "max_tokens of the wrong type", max_tokens="x"),
    chat("bad_max_tokens_negative", "negative max_tokens", max_tokens=-1),
    chat("bad_unknown_model", "unknown model", model="no-such-model"),
    chat("bad_prompt_past_window", "prompt past the context window", messages=_user(_LONG_TEXT)),
    completion("bad_cmpl_prompt_past_window", "completions prompt past the context window", prompt=_LONG_TEXT),
    chat("bad_max_tokens_past_window", "max_tokens past the context window", max_tokens=100_000),
    chat("bad_tool_choice_unknown", "tool_choice names a function not in tools", messages=WEATHER_Q,
         tools=TOOLS, tool_choice={"type": "function", "function": {"name": "no_such_tool"}}),
    chat("bad_n0", "n=0", n=0),
    chat("bad_n2_greedy", "n=2 at temperature 0", n=2, notes="vLLM: 'n must be 1 when using greedy sampling'"),
    completion("bad_cmpl_n2_greedy", "n=2 at temperature 0 (completions)", n=2),
    completion("bad_cmpl_n0", "n=0 (completions)", n=0),
    chat("bad_temperature_negative", "temperature -1", temperature=-1.0),
    chat("bad_empty_messages", "empty messages list", messages=[]),
    chat("bad_unknown_role", "a message with an unknown role", messages=[{"role": "wizard", "content": "hi"}]),
    chat("bad_tool_message_no_id", "tool message without tool_call_id",
         messages=[*WEATHER_Q, {"role": "tool", "content": "21 C"}], tools=TOOLS),
    chat("bad_missing_messages", "no messages field", messages=None),
    completion("bad_cmpl_missing_prompt", "completions without a prompt", prompt=None),
    completion("bad_cmpl_logprobs_too_many", "completions logprobs above the server's maximum", logprobs=100),
]


def case_named(name: str) -> Case:
    """The case called ``name``. Raises ``KeyError``."""
    for case in CASES:
        if case.name == name:
            return case
    raise KeyError(name)


def _check() -> None:
    names = [c.name for c in CASES]
    dupes = {n for n in names if names.count(n) > 1}
    assert not dupes, f"duplicate case names: {dupes}"
    for c in CASES:
        assert c.endpoint in (CHAT, COMPLETIONS), c.name
        assert c.stream == (isinstance(c.body, dict) and bool(c.body.get("stream"))), c.name


_check()
