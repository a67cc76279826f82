"""The exception tree drawn in talos_sdk/errors.py names every exception class of
the product, and the local-misuse / remote-protocol split holds where promised."""

from __future__ import annotations

import ast
from pathlib import Path

import talos_sdk.errors as errors
from talos import pipeline as pl
from talos_sdk.errors import ProtocolError, StorageError, UsageError

ROOT = Path(__file__).resolve().parents[1]


def _exception_classes() -> dict[str, str]:
    """Class name -> module path, for every class deriving (by name) from an exception."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for package in ("talos_sdk", "talos", "mcp_proxy"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                    classes[node.name] = (str(path.relative_to(ROOT)), bases)
    known = {"Exception", "ValueError", "KeyError", "ConnectionError", "TimeoutError"}
    found: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, (where, bases) in classes.items():
            if name not in found and any(b in known or b in found for b in bases):
                found[name] = where
                changed = True
    return found


def test_the_docstring_tree_names_every_exception_class() -> None:
    classes = _exception_classes()
    assert {"TalosError", "NotConnectedError", "TunnelFrameError"} <= set(classes)
    doc = errors.__doc__ or ""
    missing = {name: where for name, where in classes.items() if name not in doc}
    assert missing == {}


def test_a_callers_oversize_text_is_misuse_not_a_protocol_error() -> None:
    assert issubclass(pl.MessageTooLargeError, UsageError)
    assert not issubclass(pl.MessageTooLargeError, ProtocolError)


def test_a_corrupt_stored_row_is_a_storage_error() -> None:
    import pytest

    with pytest.raises(StorageError) as caught:
        pl.decode_inbox(pl.inbox_key(1), b"\x00" * 3)
    assert not isinstance(caught.value, ProtocolError)
