"""RFC 8785 JSON Canonicalization Scheme (JCS): the bytes Talos signs.

See docs/DESIGN.md "Canonical encoding".

Two paths give identical bytes (a hypothesis test holds them to it):

* fast: when the value holds only str / bool / None / ints within ±2**53 / dict /
  list / tuple and no object key lies outside the BMP, ``orjson`` with sorted
  keys already emits JCS: its string escaping is JCS's (section 3.2.2.2), and for
  BMP-only keys code-point order equals UTF-16 code-unit order (section 3.2.3).
* exact: everything else, including floats (ECMAScript ``Number.prototype.toString``,
  section 3.2.2.3) and keys sorted by UTF-16 code units, with errors that name
  the path to the offending value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import orjson

from talos_sdk.errors import EncodingError

__all__ = ["canonical_json_bytes", "format_number"]

# Integers up to 2**53 are exact doubles, so they print the same as ECMAScript would.
_SAFE_INT = 2**53
_MAX_DEPTH = 500
_escape: Callable[[str], str] = json.encoder.encode_basestring


def canonical_json_bytes(obj: Any) -> bytes:
    """Serialise ``obj`` to RFC 8785 canonical JSON (UTF-8 bytes).

    Accepts dict (str keys), list, tuple, str, int, float, bool and None. Raises
    :class:`EncodingError` naming the path for NaN/Infinity, non-string keys,
    lone surrogates, integers not exactly representable as a double, and any
    other type.
    """
    if _fast_ok(obj, 0):
        try:
            return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
        except orjson.JSONEncodeError:
            pass  # e.g. a lone surrogate: let the exact path name it
    out: list[str] = []
    _encode(obj, "$", out, 0)
    return "".join(out).encode("utf-8")


def _fast_ok(o: Any, depth: int) -> bool:
    """True when orjson's output for ``o`` is already canonical (see module docstring)."""
    t = type(o)
    if t is str or o is None or t is bool:
        return True
    if t is int:
        return -_SAFE_INT <= o <= _SAFE_INT
    if depth > 64:
        return False
    if t is dict:
        for k, v in o.items():
            if type(k) is not str or (not k.isascii() and max(k) > "\uffff"):
                return False
            if type(v) is str or v is None or v is True or v is False:
                continue
            if not _fast_ok(v, depth + 1):
                return False
        return True
    if t is list or t is tuple:
        for v in o:
            if type(v) is str or v is None or v is True or v is False:
                continue
            if not _fast_ok(v, depth + 1):
                return False
        return True
    return False


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{json.dumps(key)}]"


def _utf16_key(item: tuple[str, Any]) -> bytes:
    # Big-endian UTF-16 bytes compare exactly as the code-unit sequences do.
    return item[0].encode("utf-16-be", "surrogatepass")


def _string(s: str, path: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise EncodingError(
            f"{path}: string contains a lone surrogate, not valid I-JSON (RFC 8785 3.2.2.2)"
        ) from None
    return _escape(s)


def _encode(o: Any, path: str, out: list[str], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise EncodingError(f"{path}: nested deeper than {_MAX_DEPTH} levels (or circular)")
    if o is None:
        out.append("null")
    elif o is True:
        out.append("true")
    elif o is False:
        out.append("false")
    elif isinstance(o, str):
        out.append(_string(o, path))
    elif isinstance(o, int):
        out.append(_integer(int(o), path))
    elif isinstance(o, float):
        try:
            out.append(format_number(float(o)))
        except EncodingError as exc:
            raise EncodingError(f"{path}: {exc}") from None
    elif isinstance(o, dict):
        for k in o:
            if not isinstance(k, str):
                raise EncodingError(
                    f"{path}: object key {k!r} is a {type(k).__name__}; JSON keys must be str"
                )
        out.append("{")
        first = True
        for k, v in sorted(o.items(), key=_utf16_key):
            if not first:
                out.append(",")
            first = False
            child = _child(path, k)
            out.append(_string(k, child))
            out.append(":")
            _encode(v, child, out, depth + 1)
        out.append("}")
    elif isinstance(o, list | tuple):
        out.append("[")
        for i, v in enumerate(o):
            if i:
                out.append(",")
            _encode(v, f"{path}[{i}]", out, depth + 1)
        out.append("]")
    else:
        raise EncodingError(f"{path}: {type(o).__name__} is not a JSON type (RFC 8785)")


def _integer(n: int, path: str) -> str:
    if -_SAFE_INT <= n <= _SAFE_INT:
        return str(n)
    # JCS serialises every number as an IEEE 754 double; refuse silent rounding.
    try:
        as_float = float(n)
    except OverflowError:
        as_float = math.inf
    if math.isinf(as_float) or int(as_float) != n:
        # A huge int by its size: str() of one raises ValueError past 4300 digits.
        shown = str(n) if n.bit_length() <= 256 else f"of {n.bit_length()} bits"
        raise EncodingError(
            f"{path}: integer {shown} is not exactly representable as an IEEE 754 double "
            "(RFC 8785 3.2.2.3); send it as a string"
        )
    return format_number(as_float)


def format_number(x: float) -> str:
    """Format a double as ECMAScript ``Number.prototype.toString`` does (RFC 8785 3.2.2.3).

    Python's ``repr`` already yields the shortest round-tripping digits; only the
    placement of the decimal point and exponent differ from ECMAScript's.
    """
    if math.isnan(x) or math.isinf(x):
        raise EncodingError(f"{x!r} is not allowed in JSON (RFC 8785 3.2.2.3)")
    if x == 0:
        return "0"  # also -0.0
    sign = "-" if x < 0 else ""
    text = repr(abs(x))
    mantissa, _, exp_text = text.partition("e")
    int_part, _, frac_part = mantissa.partition(".")
    digits = int_part + frac_part
    # n = position of the decimal point relative to the digit string (ECMA-262 6.1.6.1.20).
    n = len(int_part) + (int(exp_text) if exp_text else 0)
    stripped = digits.lstrip("0")
    n -= len(digits) - len(stripped)
    digits = stripped.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + digits
    e = n - 1
    exp = f"e{'+' if e >= 0 else '-'}{abs(e)}"
    if k == 1:
        return sign + digits + exp
    return sign + digits[0] + "." + digits[1:] + exp
