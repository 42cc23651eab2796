"""Argument digests: RFC 8785 canonical JSON (the RFC's own examples), equal digests for equal
arguments, and the loop detector's cycle function."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmeter.serving.agents import ArgumentsError, arguments_digest, canonical_json, prompt_digest
from kvmeter.serving.agents.loops import cycle_repeats


@pytest.mark.parametrize("value, text", [
    # RFC 8785 appendix B: IEEE 754 doubles as ECMAScript writes them
    (0.0, "0"), (-0.0, "0"), (1.0, "1"), (5e-324, "5e-324"), (1.7976931348623157e308, "1.7976931348623157e+308"),
    (9007199254740992.0, "9007199254740992"), (9007199254740994.0, "9007199254740994"),
    (1e21, "1e+21"), (1e20, "100000000000000000000"), (1e-7, "1e-7"), (0.000001, "0.000001"),
    (0.00001, "0.00001"), (123.456, "123.456"), (-1.5e-7, "-1.5e-7"), (333333333.3333333, "333333333.3333333"),
    (2 ** 60, "1152921504606847000"),  # the shortest digits of the double, as JavaScript
    (10 ** 30, "1e+30"), (True, "true"), (None, "null"),
])
def test_numbers_and_literals_as_rfc_8785(value, text):
    assert canonical_json(value) == text


def test_rfc_8785_section_3_2_3_example_sorting():
    # the RFC's sorting example: keys ordered by UTF-16 code units
    value = {"\u20ac": "Euro Sign", "\r": "Carriage Return", "\ufb33": "Hebrew Letter Dalet With Dagesh",
             "1": "One", "\U0001f600": "Emoji: Grinning Face", "\u0080": "Control",
             "\u00f6": "Latin Small Letter O With Diaeresis"}
    keys = [k for k in json.loads(canonical_json(value))]
    assert keys == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 60), max_value=2 ** 60)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(JSON)
def test_the_fast_path_writes_what_the_reference_encoder_writes(value):
    from kvmeter.serving.agents.digest import canonical_json_slow

    assert canonical_json(value) == canonical_json_slow(value)
    # and it means the same JSON (every number read as the double JCS takes it to be)
    as_doubles = dict(parse_int=float, parse_float=float)
    assert json.loads(canonical_json(value), **as_doubles) == json.loads(json.dumps(value), **as_doubles)


def test_equal_arguments_have_one_digest():
    a = arguments_digest({"to": "a@b", "n": 1, "tags": ["x", "y"]})
    assert a == arguments_digest('{"tags":["x","y"], "n": 1.0, "to":"a@b"}')
    assert a != arguments_digest({"to": "a@b", "n": 2, "tags": ["x", "y"]})
    assert a != arguments_digest({"to": "a@b", "n": 1, "tags": ["y", "x"]})  # order of a list matters
    assert arguments_digest(None) == arguments_digest({}) == hashlib.sha256(b"{}").hexdigest()
    for bad in ("{nope", '{"x": NaN}', float("nan")):
        with pytest.raises(ArgumentsError):
            arguments_digest(bad)


def test_prompt_digest_is_of_the_token_ids():
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3)) != prompt_digest([1, 2, 4])
    assert len(prompt_digest([])) == 64


@pytest.mark.parametrize("history, expected", [
    (["A"], (0, 0)),
    (["A", "B", "A"], (1, 2)),                 # A → B → A: one repeat of a 2-cycle
    (["B", "A", "B", "A"], (2, 2)),
    (["A", "C", "B", "A"], (1, 3)),            # a 3-cycle returning to A
    (["A", "A", "A", "A"], (0, 0)),            # identical calls are not a cycle
    (["C", "B", "A", "C", "B", "A", "C"], (4, 3)),
    (["A", "B", "C", "D", "E"], (0, 0)),       # progress
])
def test_cycle_repeats(history, expected):
    assert cycle_repeats(history, 4) == expected
