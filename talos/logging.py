"""Structured logs: one event per line as ``key=value`` pairs or JSON (DESIGN.md "Conventions").

Callers pass an event name and fields; nothing here ever formats keys,
plaintext or tool arguments, and callers only pass identifiers and sizes.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["configure", "event"]

_FIELDS = "talos_fields"


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``name`` with ``fields`` (identifiers, counts, reasons; never secrets)."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={_FIELDS: fields})


def _quote(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="\n'):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=talos.node event=link_up peer=did:key:...``."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, _FIELDS, {})
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        head = f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()}"
        parts = [head, f"logger={record.name}", f"event={_quote(record.getMessage())}"]
        parts += [f"{k}={_quote(v)}" for k, v in fields.items()]
        if record.exc_info and record.exc_info[0] is not None:
            parts.append(f"error={_quote(record.exc_info[1])}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update({k: str(v) for k, v in getattr(record, _FIELDS, {}).items()})
        if record.exc_info and record.exc_info[0] is not None:
            out["error"] = str(record.exc_info[1])
        return json.dumps(out)


def configure(fmt: str = "kv", level: int = logging.INFO) -> None:
    """Send ``talos`` logs to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger("talos")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
