"""Origin rules of the HTTP front: the DNS-rebinding check and CORS for allowed browser origins.

MCP "Streamable HTTP" (Security Warning): servers MUST validate ``Origin``.
A request without ``Origin`` is not from a browser and passes. With no
``--allow-origin`` configured, loopback origins pass (a local page); once an
allow list is given, only its exact origins do. The Fetch standard's CORS
protocol: a preflight (``OPTIONS`` with ``Access-Control-Request-Method``)
from an allowed origin is answered 204 with the methods and headers the
front accepts, and never needs the bearer token (browsers send no
credentials on a preflight); responses to an allowed origin carry
``Access-Control-Allow-Origin`` and expose ``Mcp-Session-Id``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

__all__ = ["LOOPBACK_HOSTS", "OriginRules"]

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
METHODS = "GET, POST, DELETE, OPTIONS"
# Request headers a browser client of MCP sends (2025-11-25 and 2026-07-28).
HEADERS = frozenset(
    {
        "authorization",
        "content-type",
        "accept",
        "last-event-id",
        "mcp-session-id",
        "mcp-protocol-version",
        "mcp-method",
        "mcp-name",
    }
)
PARAM_PREFIX = "mcp-param-"
EXPOSED = "Mcp-Session-Id, MCP-Protocol-Version"
MAX_AGE = "600"


def _normal(origin: str) -> str | None:
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


class OriginRules:
    """Which browser origins may use the front, and the CORS headers they get."""

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        normal: set[str] = set()
        for origin in allowed:
            value = _normal(origin)
            if value is None or origin.rstrip("/") != value:
                raise ValueError(f"--allow-origin needs SCHEME://HOST[:PORT], got {origin!r}")
            normal.add(value)
        self.allowed = frozenset(normal)

    def admits(self, origin: str | None) -> bool:
        """May a request with this ``Origin`` header reach the endpoint at all?"""
        if origin is None:
            return True
        value = _normal(origin)
        if value is None:
            return False
        if self.allowed:
            return value in self.allowed
        host = urlsplit(value).hostname
        return host in LOOPBACK_HOSTS

    def cors(self, origin: str | None) -> dict[str, str]:
        """Headers for a response to ``origin``; empty unless it is explicitly allowed."""
        value = _normal(origin) if origin is not None else None
        if value is None or value not in self.allowed:
            return {}
        return {
            "Access-Control-Allow-Origin": origin or "",
            "Access-Control-Expose-Headers": EXPOSED,
            "Vary": "Origin",
        }

    def preflight(self, headers: Mapping[str, str]) -> dict[str, str] | None:
        """The 204's headers for a preflight the front accepts; None to refuse it (403)."""
        origin = headers.get("Origin")
        cors = self.cors(origin)
        if not cors:
            return None
        method = headers.get("Access-Control-Request-Method", "")
        if method not in ("GET", "POST", "DELETE"):
            return None
        wanted = [
            h.strip().lower()
            for h in headers.get("Access-Control-Request-Headers", "").split(",")
            if h.strip()
        ]
        if any(h not in HEADERS and not h.startswith(PARAM_PREFIX) for h in wanted):
            return None
        return {
            **cors,
            "Access-Control-Allow-Methods": METHODS,
            "Access-Control-Allow-Headers": ", ".join(wanted) or "content-type",
            "Access-Control-Max-Age": MAX_AGE,
        }
