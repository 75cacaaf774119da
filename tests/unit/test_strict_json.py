"""The edge's JSON parse (``pd_fsm.io_trio.strict_json``): valid JSON parses as ``json`` parses
it; everything Python's ``json`` accepts that JSON does not, and everything that exhausts a
parser, is a ``JsonError`` with a 4xx status naming the field."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_fsm.io_trio.strict_json import INT_MAX, INT_MIN, JsonError, JsonLimits, loads

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_scalars = st.none() | st.booleans() | st.integers(INT_MIN, INT_MAX) | _text | st.floats(
    allow_nan=False, allow_infinity=False)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(_text, inner, max_size=4), max_leaves=30)


@given(_values)
@settings(max_examples=300, deadline=None)
def test_valid_json_parses_exactly_as_json_does(value: Any) -> None:
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
        assert loads(text) == json.loads(text)
        assert loads(text.encode()) == json.loads(text)


# The rows of issue 34, and their kin: (body, status, words the message must hold).
HOSTILE: list[tuple[bytes, int, str]] = [
    (b'{"text":"hi","sampling_params":{"max_new_tokens":2,"temperature":NaN}}', 400,
     "body.sampling_params.temperature is NaN"),
    (b'{"text":"hi","rid":NaN}', 400, "body.rid is NaN"),
    (b'{"a":[1,{"b":Infinity}]}', 400, "body.a[1].b is Infinity"),
    (b'{"a":-Infinity}', 400, "body.a is -Infinity"),
    (b'{"sampling_params":{"max_new_tokens":1e400}}', 400,
     "body.sampling_params.max_new_tokens is 1e400"),
    (b'{"x":-1e400}', 400, "body.x is -1e400"),
    (b'{"text":"\\ud800\\udfff\\ud800"}', 400, "body.text has a lone surrogate U+D800"),
    (b'{"text":"\\udc00"}', 400, "body.text has a lone surrogate U+DC00"),
    (b'{"messages":[{"role":"user","content":"a\\udbff"}]}', 400,
     "body.messages[0].content has a lone surrogate U+DBFF"),
    (b'{"\\ud800":1}', 400, "a key of body has a lone surrogate"),
    (b'{"text":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "deeper than 64 levels"),
    (b'{"text":' + b"[" * 65 + b"]" * 65 + b"}", 400, "deeper than 64 levels"),
    (b"[" * 100_000, 400, "deeper than 64 levels"),
    (b'{"a":1,"a":2}', 400, "body has the key 'a' more than once"),
    (b'{"s":{"k":1,"k":1}}', 400, "body.s has the key 'k' more than once"),
    (b'{"n":' + b"9" * 20 + b"}", 400, "body.n is an integer outside 64 bits"),
    (b'{"n":' + b"1" * 5000 + b"}", 400, "4300"),
    (b"\xff{}", 400, "not UTF-8: byte 0 (0xff)"),
    ("\ufeff{}".encode(), 400, "byte order mark"),
    (b'{"a":', 400, "malformed JSON"),
    (b"", 400, "malformed JSON"),
]


@pytest.mark.parametrize(("raw", "status", "words"), HOSTILE,
                         ids=[h[2][:40] for h in HOSTILE])
def test_hostile_documents_are_refused_by_name(raw: bytes, status: int, words: str) -> None:
    with pytest.raises(JsonError) as info:
        loads(raw)
    assert info.value.status == status
    assert words in info.value.message
    info.value.message.encode("utf-8")  # the message itself can be answered


def test_limits_bound_depth_and_width_and_paired_surrogates_pass() -> None:
    assert loads(b'{"text":"\\ud83d\\ude00"}') == {"text": "\U0001f600"}
    assert loads("[" * 64 + "]" * 64) is not None
    limits = JsonLimits(max_depth=4, max_items=3)
    assert loads("[[[[]]]]", limits) == [[[[]]]]
    with pytest.raises(JsonError, match="deeper than 4"):
        loads("[[[[[]]]]]", limits)
    assert loads("[1,2,3]", limits) == [1, 2, 3]
    with pytest.raises(JsonError) as info:
        loads('{"ids":[1,2,3,4]}', limits)
    assert info.value.status == 413 and "body.ids has 4 members" in info.value.message
    assert loads(str(INT_MAX)) == INT_MAX and loads(str(INT_MIN)) == INT_MIN
    with pytest.raises(JsonError):
        loads(str(INT_MAX + 1))
    assert loads("1e308") == 1e308 and math.isfinite(loads("-1.5e-400"))  # type: ignore[arg-type]


_HOSTILE_FRAGMENTS = st.sampled_from([
    "NaN", "Infinity", "-Infinity", "1e400", "-1e999", '"\\ud800"', '"x\\udfff"',
    '{"k":1,"k":2}', "[" * 70 + "]" * 70, "123456789012345678901234567890",
])


@st.composite
def _planted(draw: st.DrawFn) -> tuple[str, str]:
    """A valid document with one hostile fragment planted at a random place, and that place's
    path."""
    path = "body"
    keys = draw(st.lists(st.sampled_from(["a", "text", "sampling_params", "x_1"]), min_size=1,
                         max_size=5))
    fragment = draw(_HOSTILE_FRAGMENTS)
    for key in reversed(keys):
        fragment = "{" + json.dumps(key) + ":" + fragment + ', "ok": [1, 2.5, "s"]}'
    path += "".join(f".{k}" for k in keys[:-1])
    return fragment, path


@given(_planted())
@settings(max_examples=200, deadline=None)
def test_a_hostile_fragment_anywhere_is_refused_naming_where(doc: tuple[str, str]) -> None:
    text, parent = doc
    with pytest.raises(JsonError) as info:
        loads(text)
    assert 400 <= info.value.status < 500
    assert parent in info.value.message, (text[:200], info.value.message)
