"""Tests for talos_sdk.canonical: RFC 8785 vectors, fast path == exact path, every bad input."""

from __future__ import annotations

import enum
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from talos_sdk import canonical
from talos_sdk.canonical import canonical_json_bytes, format_number
from talos_sdk.errors import EncodingError

VEC_DIR = Path(__file__).parent.parent / "vectors" / "jcs"


def _load(name: str) -> list[dict[str, Any]]:
    data = json.loads((VEC_DIR / name).read_text(encoding="utf-8"))
    assert data["source"]
    return list(data["vectors"])


def _exact(obj: Any) -> bytes:
    """The exact (slow) path alone, bypassing the orjson fast path."""
    out: list[str] = []
    canonical._encode(obj, "$", out, 0)
    return "".join(out).encode("utf-8")


NUMBERS = _load("rfc8785_numbers.json")


@pytest.mark.parametrize("vec", NUMBERS, ids=[v["ieee"] for v in NUMBERS])
def test_rfc8785_appendix_b_numbers(vec: dict[str, Any]) -> None:
    (value,) = struct.unpack(">d", bytes.fromhex(vec["ieee"]))
    if vec["expected"] is None:
        with pytest.raises(EncodingError, match=r"not allowed in JSON"):
            canonical_json_bytes(value)
        with pytest.raises(EncodingError, match=r"\$\.x\[0\]: .*not allowed"):
            canonical_json_bytes({"x": [value]})
    else:
        assert format_number(value) == vec["expected"]
        assert canonical_json_bytes([value]) == f"[{vec['expected']}]".encode()


SAMPLES = _load("rfc8785_samples.json") + _load("edge_cases.json")


@pytest.mark.parametrize("vec", SAMPLES, ids=[v["name"] for v in SAMPLES])
def test_samples_and_edge_cases(vec: dict[str, Any]) -> None:
    value = json.loads(vec["input"])
    if vec["expected"] is None:
        with pytest.raises(EncodingError, match="not exactly representable"):
            canonical_json_bytes(value)
    else:
        assert canonical_json_bytes(value) == vec["expected"].encode("utf-8")
        assert _exact(value) == vec["expected"].encode("utf-8")


def test_small_message_object_takes_fast_path() -> None:
    msg = {"type": "msg", "from": "did:key:z6Mk", "seq": 12, "ts": 1700000000, "ok": True}
    assert canonical._fast_ok(msg, 0)
    assert canonical_json_bytes(msg) == (
        b'{"from":"did:key:z6Mk","ok":true,"seq":12,"ts":1700000000,"type":"msg"}'
    )


def test_tuple_and_list_are_arrays() -> None:
    assert canonical_json_bytes((1, [2, ()])) == b"[1,[2,[]]]"


def test_bool_is_not_int() -> None:
    assert canonical_json_bytes([True, False, 1, 0]) == b"[true,false,1,0]"
    assert canonical_json_bytes({"a": True}) != canonical_json_bytes({"a": 1})


def test_subclasses_of_json_types() -> None:
    class Colour(enum.IntEnum):
        RED = 1

    class Name(str):
        pass

    assert canonical_json_bytes({"c": Colour.RED, Name("n"): Name("x")}) == b'{"c":1,"n":"x"}'


# JSON values as Python builds them; keys and strings over the whole code-point range
# (surrogates excluded: they are errors, tested below).
_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=20,
)


@given(_json)
def test_fast_path_equals_exact_path(value: Any) -> None:
    try:
        expected = _exact(value)
    except EncodingError:
        with pytest.raises(EncodingError):
            canonical_json_bytes(value)
        return
    assert canonical_json_bytes(value) == expected
    if canonical._fast_ok(value, 0):
        import orjson

        assert orjson.dumps(value, option=orjson.OPT_SORT_KEYS) == expected


@given(_json)
def test_output_parses_back_to_same_value(value: Any) -> None:
    try:
        out = canonical_json_bytes(value)
    except EncodingError:
        return
    # JCS numbers are doubles, so compare as doubles (2**55 prints as 36028797018963970).
    assert json.loads(out, parse_int=float) == json.loads(json.dumps(value), parse_int=float)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_number_round_trips(x: float) -> None:
    text = format_number(x)
    assert float(text) == x or (x == 0 and float(text) == 0)
    assert "e+0" not in text and "e-0" not in text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, r"^\$: nan is not allowed"),
        ({"a": [1, math.inf]}, r"^\$\.a\[1\]: inf is not allowed"),
        ({"a": -math.inf}, r"^\$\.a: -inf is not allowed"),
        ({1: "x"}, r"^\$: object key 1 is a int"),
        ({"ok": {None: 1}}, r"^\$\.ok: object key None is a NoneType"),
        ({"a": {(1, 2): 1}}, r"key \(1, 2\) is a tuple"),
        ({"b": b"bytes"}, r"^\$\.b: bytes is not a JSON type"),
        ([{1, 2}], r"^\$\[0\]: set is not a JSON type"),
        ({"weird key": object()}, r'^\$\["weird key"\]: object is not a JSON type'),
        ({"s": "a\ud800b"}, r"^\$\.s: string contains a lone surrogate"),
        ({"\udfff": 1}, r"lone surrogate"),
        ([2**53 + 1], r"^\$\[0\]: integer 9007199254740993 is not exactly representable"),
        ([10**5000], r"^\$\[0\]: integer of 16610 bits is not exactly representable"),
        (-(2**53) - 1, r"integer -9007199254740993 is not exactly"),
        (10**400, r"is not exactly representable"),
    ],
)
def test_bad_inputs(value: Any, message: str) -> None:
    with pytest.raises(EncodingError, match=message):
        canonical_json_bytes(value)


def test_circular_reference() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(EncodingError, match="nested deeper than"):
        canonical_json_bytes(loop)


def test_deep_but_legal_nesting() -> None:
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    assert canonical_json_bytes(deep) == b"[" * 300 + b"1" + b"]" * 300
