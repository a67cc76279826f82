"""Structured log formatting (talos/logging.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from talos.logging import JsonFormatter, KeyValueFormatter, Throttle, configure, event


def _record(fields: dict[str, object]) -> logging.LogRecord:
    rec = logging.LogRecord("talos.node", logging.INFO, __file__, 1, "link_up", None, None)
    rec.talos_fields = fields
    return rec


def test_key_value_lines_quote_when_needed() -> None:
    line = KeyValueFormatter().format(_record({"peer": "did:key:z1", "reason": "a b"}))
    assert "event=link_up" in line
    assert "peer=did:key:z1" in line
    assert 'reason="a b"' in line


def test_json_lines_keep_numbers_booleans_and_null_typed() -> None:
    fields = {"n": 3, "ok": False, "code": None, "delay": 0.5, "odd": float("nan"), "s": "3"}
    out = json.loads(JsonFormatter().format(_record(fields)))
    assert out["event"] == "link_up" and isinstance(out["ts"], float)
    assert out["n"] == 3 and out["ok"] is False and out["code"] is None and out["delay"] == 0.5
    assert out["odd"] == "nan" and out["s"] == "3"  # not JSON numbers: text


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """configure() rewires the root logger: put it back (pytest's caplog relies on it)."""
    loggers = [logging.getLogger(n) for n in ("", "talos", "mcp_proxy")]
    saved = [(lg.handlers[:], lg.propagate, lg.level) for lg in loggers]
    try:
        yield
    finally:
        for lg, (handlers, propagate, level) in zip(loggers, saved, strict=True):
            lg.handlers[:], lg.propagate = handlers, propagate
            lg.setLevel(level)


@pytest.mark.usefixtures("restore_logging")
def test_event_goes_through_configured_handler(capsys: pytest.CaptureFixture[str]) -> None:
    configure("kv")
    event(logging.getLogger("talos.test"), "hello", peer="x")
    assert "event=hello peer=x" in capsys.readouterr().err


@pytest.mark.usefixtures("restore_logging")
def test_configure_sets_level_per_root_and_libraries_stay_at_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure("json", "debug", roots=("talos", "mcp_proxy"))
    event(logging.getLogger("mcp_proxy.client"), "tunnel_link_up", logging.DEBUG, peer="p")
    logging.getLogger("websockets.client").info("chatty library line")
    logging.getLogger("websockets.client").warning("library warning\r\nforged")
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert [x["event"] for x in lines] == ["tunnel_link_up", "library warning\\x0d\\x0aforged"]
    assert lines[0] == {**lines[0], "level": "debug", "logger": "mcp_proxy.client", "peer": "p"}


HOSTILE = "ok\r\nts=forged level=info event=fake\x1b[2J\x1b]0;title\x07\x00\x7f\x85\x9b\u2028end"


def _no_controls(line: str) -> None:
    assert "\n" not in line and "\r" not in line
    bad = [c for c in line if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029"]
    assert bad == []


def test_key_value_escapes_control_characters_in_every_field() -> None:
    rec = _record({"reason": HOSTILE, "bad\nkey": "v", "plain": "a\\b"})
    rec.msg = "event\x1b[31m"
    rec.name = "talos.\rnode"
    line = KeyValueFormatter().format(rec)
    _no_controls(line)
    assert line.count(" ts=") == 0  # nothing forged a second record on the line
    assert "\\x0d\\x0ats=forged level=info event=fake\\x1b[2J\\x1b]0;title\\x07" in line
    assert "\\x00\\x7f\\x85\\x9b\\u2028end" in line
    assert 'event="event\\x1b[31m"' in line
    assert 'logger="talos.\\x0dnode"' in line
    assert "bad\\x0akey=v" in line
    assert 'plain="a\\\\b"' in line  # a literal backslash cannot fake an escape


def test_json_escapes_control_characters_in_every_field() -> None:
    rec = _record({"reason": HOSTILE, "bad\x1bkey": "v"})
    rec.msg = "event\r\n"
    try:
        raise ValueError("boom\x1b[2J\r\n")
    except ValueError:
        import sys

        rec.exc_info = sys.exc_info()
    line = JsonFormatter().format(rec)
    _no_controls(line)
    out = json.loads(line)
    assert out["reason"].startswith("ok\\x0d\\x0ats=forged")
    assert "\x1b" not in out["reason"] and "\\x1b[2J" in out["reason"]
    assert out["event"] == "event\\x0d\\x0a"
    assert out["bad\\x1bkey"] == "v"
    assert out["error"] == "boom\\x1b[2J\\x0d\\x0a"


def test_throttle_lets_a_burst_through_then_counts_until_the_period_ends() -> None:
    throttle = Throttle(burst=3, period=10.0, keys=2)
    assert [throttle.admit("a", t) for t in (0, 1, 2)] == [0, 0, 0]
    assert [throttle.admit("a", t) for t in (3, 4)] == [None, None]
    assert throttle.admit("b", 4) == 0  # keys are apart
    assert throttle.admit("a", 10) == 2  # a new period says how many were dropped
    throttle.admit("c", 11)  # a third key forgets the oldest
    assert throttle.admit("a", 12) == 0 and throttle.admit("b", 12) == 0
