"""Structured logs: one event per line as ``key=value`` pairs or JSON
(docs/DESIGN.md "Conventions").

Callers pass an event name and fields; nothing here ever formats keys,
plaintext or tool arguments, and callers only pass identifiers and sizes.
Fields may still carry text a peer chose (a refusal reason, a tool name), so
every field of both formats has its control characters (C0, DEL, C1, U+2028,
U+2029) escaped: one event is always one line and never a terminal command.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from typing import Any

__all__ = ["FORMATS", "LEVELS", "Throttle", "add_arguments", "configure", "event"]

_FIELDS = "talos_fields"


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``name`` with ``fields`` (identifiers, counts, reasons; never secrets)."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={_FIELDS: fields})


class Throttle:
    """At most ``burst`` log lines per key in each ``period`` seconds; the rest are counted.

    For events a stranger can cause at will (a failed handshake from an address):
    without it, one flood wrote tens of thousands of warning lines a minute. The
    metrics still count every one. At most ``keys`` keys are remembered.
    """

    def __init__(self, burst: int = 10, period: float = 60.0, keys: int = 1024) -> None:
        self.burst, self.period, self.keys = burst, period, keys
        self._windows: dict[str, list[float]] = {}  # key -> [start, lines, suppressed]

    def admit(self, key: str, now: float) -> int | None:
        """None: drop this line. Else log it, saying how many lines were dropped before it."""
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.period:
            if window is None and len(self._windows) >= self.keys:
                del self._windows[next(iter(self._windows))]  # the oldest key
            dropped = int(window[2]) if window is not None else 0
            self._windows[key] = [now, 1, 0]
            return dropped
        if window[1] < self.burst:
            window[1] += 1
            return 0
        window[2] += 1
        return None


# C0 controls, DEL, C1 controls and the Unicode line/paragraph separators: any of
# them could end a line, move the cursor or drive a terminal reading the log.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_KV_SPECIAL = re.compile(r'[\x00-\x20\x7f-\x9f\u2028\u2029="\\]')


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    return f"\\x{ord(c):02x}" if ord(c) <= 0xFF else f"\\u{ord(c):04x}"


def escape(value: Any) -> str:
    """``str(value)`` with every control character written as a visible escape."""
    return _CONTROL.sub(_escape_char, str(value))


def _quote(value: Any) -> str:
    """A key=value token: bare when safe, else quoted with ``\\``, ``\"`` and controls escaped."""
    text = str(value)
    if text and not _KV_SPECIAL.search(text):
        return text
    return '"' + escape(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=talos.node event=link_up peer=did:key:...``."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, _FIELDS, {})
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        head = f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()}"
        parts = [head, f"logger={_quote(record.name)}", f"event={_quote(record.getMessage())}"]
        parts += [f"{escape(k)}={_quote(v)}" for k, v in fields.items()]
        if record.exc_info and record.exc_info[0] is not None:
            parts.append(f"error={_quote(record.exc_info[1])}")
        return " ".join(parts)


def _json_value(value: Any) -> Any:
    """A field as JSON: numbers, booleans and null as themselves, anything else as escaped text."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return escape(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (Unix time, seconds), ``level``, ``logger``,
    ``event``, then the event's fields, typed where JSON has the type."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": escape(record.name),
            "event": escape(record.getMessage()),
        }
        out.update({escape(k): _json_value(v) for k, v in getattr(record, _FIELDS, {}).items()})
        if record.exc_info and record.exc_info[0] is not None:
            out["error"] = escape(record.exc_info[1])
        # ensure_ascii (the default) also writes every other non-ASCII character as \uXXXX.
        return json.dumps(out)


#: ``--log-level`` choices, lowest first (the stdlib level names).
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("kv", "json")


def add_arguments(
    parser: argparse.ArgumentParser, *, inherit: bool = False, format_default: str = "kv"
) -> None:
    """``--log-format`` and ``--log-level``, alike on ``talosd`` and ``talos-proxy``.

    ``inherit``: a subcommand's copy, which only overrides the value given
    before the subcommand (``talos-proxy --log-level WARNING connect ...``).
    """
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=argparse.SUPPRESS if inherit else None,
        help=f"stderr log lines as key=value pairs or JSON objects (default {format_default})",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        default=argparse.SUPPRESS if inherit else None,
        metavar="LEVEL",
        help="least severe event logged: debug, info, warning, error (default info)",
    )


def configure(
    fmt: str | None = "kv",
    level: int | str | None = logging.INFO,
    roots: tuple[str, ...] = ("talos",),
) -> None:
    """Send logs to stderr in the chosen format: ``roots`` at ``level``, libraries at WARNING.

    The handler sits on the root logger so that a library's warning (websockets,
    asyncio) is one escaped line in the same format rather than a bare message.
    """
    if level is None:
        level = logging.INFO
    elif isinstance(level, str):
        level = int(logging.getLevelName(level.upper()))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level, logging.WARNING))
    for name in roots:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.setLevel(level)
        logger.propagate = True
