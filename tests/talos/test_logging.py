"""Structured log formatting (talos/logging.py)."""

from __future__ import annotations

import json
import logging

import pytest

from talos.logging import JsonFormatter, KeyValueFormatter, configure, event


def _record(fields: dict[str, object]) -> logging.LogRecord:
    rec = logging.LogRecord("talos.node", logging.INFO, __file__, 1, "link_up", None, None)
    rec.talos_fields = fields
    return rec


def test_key_value_lines_quote_when_needed() -> None:
    line = KeyValueFormatter().format(_record({"peer": "did:key:z1", "reason": "a b"}))
    assert "event=link_up" in line
    assert "peer=did:key:z1" in line
    assert 'reason="a b"' in line


def test_json_lines() -> None:
    out = json.loads(JsonFormatter().format(_record({"n": 3})))
    assert out["event"] == "link_up"
    assert out["n"] == "3"


def test_event_goes_through_configured_handler(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger("talos")
    saved = (root.handlers[:], root.propagate, root.level)
    try:
        configure("kv")
        event(logging.getLogger("talos.test"), "hello", peer="x")
        assert "event=hello peer=x" in capsys.readouterr().err
    finally:  # other tests rely on propagation to pytest's caplog
        root.handlers[:], root.propagate = saved[0], saved[1]
        root.setLevel(saved[2])
