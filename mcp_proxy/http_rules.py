"""Which MCP era an HTTP request belongs to, and the header rules of each (pure, no I/O).

MCP 2026-07-28 "Transports: Streamable HTTP" and its backward-compatibility
section: a request whose ``MCP-Protocol-Version`` header names a stateless
revision is served on its own (no ``initialize``, no ``Mcp-Session-Id``; the
version, client capabilities and client info ride ``params._meta``), one that
names a handshake-era revision, or none at all, is served by the 2025-11-25
session rules. A version outside both lists is refused with 400 and the list
of supported versions (error -32022). For a stateless request the transport
checks what only it can see, in the order the specification's validation
ladder gives: the ``_meta`` envelope is present, ``MCP-Protocol-Version``
equals its version, ``Mcp-Method`` equals the method and ``Mcp-Name`` the
tool name / prompt name / resource URI (-32020 otherwise).
See docs/adr/0008-http-front-eras.md.
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mcp_proxy.jsonrpc import Kind, Sniffed, meta_of

__all__ = [
    "HANDSHAKE_VERSIONS",
    "HEADER_MISMATCH",
    "INVALID_PARAMS",
    "MODERN_VERSIONS",
    "SUPPORTED_VERSIONS",
    "UNSUPPORTED_VERSION",
    "Era",
    "Rejection",
    "classify",
    "unsupported",
]

HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
MODERN_VERSIONS = ("2026-07-28",)
SUPPORTED_VERSIONS = (*HANDSHAKE_VERSIONS, *MODERN_VERSIONS)

INVALID_PARAMS = -32602
HEADER_MISMATCH = -32020
UNSUPPORTED_VERSION = -32022

VERSION_HEADER = "mcp-protocol-version"
METHOD_HEADER = "mcp-method"
NAME_HEADER = "mcp-name"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
# The params field each name-bearing method mirrors into Mcp-Name.
NAME_FIELDS = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
_B64 = re.compile(r"^=\?base64\?(?P<payload>.*)\?=$")


class Era(enum.Enum):
    """How a request is served: one stateless exchange, or inside a 2025-11-25 session."""

    STATELESS = "stateless"
    LEGACY = "legacy"


@dataclass(frozen=True, slots=True)
class Rejection:
    """A request refused before it reaches a tool: HTTP status and JSON-RPC error."""

    status: int
    code: int
    message: str
    data: Any = None


def unsupported(requested: str) -> Rejection:
    """400 naming every version this front speaks (the spec's -32022 payload)."""
    return Rejection(
        400,
        UNSUPPORTED_VERSION,
        "Unsupported protocol version",
        # Header bytes that were not UTF-8 arrive as surrogates, which JSON cannot carry.
        {"supported": list(SUPPORTED_VERSIONS), "requested": _printable(requested)},
    )


def _printable(text: str) -> str:
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _header_value(raw: str | None) -> str | None:
    """Undo the ``=?base64?...?=`` wrapping a client uses for values no header can carry."""
    if raw is None:
        return None
    match = _B64.fullmatch(raw)
    if match is None:
        return raw
    try:
        return base64.b64decode(match.group("payload"), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def classify(headers: Mapping[str, str], msg: Sniffed | None, has_session: bool) -> Era | Rejection:
    """Decide the era of one request; ``headers`` keyed by lower-case name, ``msg`` None on GET."""
    version = headers.get(VERSION_HEADER)
    if version is not None and version not in SUPPORTED_VERSIONS:
        return unsupported(version)
    if version is None or version in HANDSHAKE_VERSIONS:
        meta = meta_of(msg) if msg is not None and not has_session else {}
        if meta.get(META_VERSION) in MODERN_VERSIONS:
            # A stateless request without its routing header: say so, not "missing session".
            return Rejection(
                400, HEADER_MISMATCH, f"{VERSION_HEADER} header does not match _meta's version"
            )
        return Era.LEGACY
    if msg is None or msg.kind is not Kind.REQUEST:
        return Era.STATELESS  # GET, notifications, responses: the caller answers by kind
    meta = meta_of(msg)
    if META_VERSION not in meta or META_CAPABILITIES not in meta:
        return Rejection(
            400,
            INVALID_PARAMS,
            f"params._meta must carry {META_VERSION!r} and {META_CAPABILITIES!r}",
        )
    if meta[META_VERSION] != version:
        return Rejection(
            400, HEADER_MISMATCH, f"{VERSION_HEADER} header does not match _meta's version"
        )
    said = headers.get(METHOD_HEADER)
    if said != msg.method:
        what = "is missing" if said is None else "does not match the method"
        return Rejection(400, HEADER_MISMATCH, f"{METHOD_HEADER} header {what}")
    field = NAME_FIELDS.get(msg.method or "")
    if field is not None:
        value = msg.params.get(field) if isinstance(msg.params, dict) else None
        if value is not None and _header_value(headers.get(NAME_HEADER)) != value:
            return Rejection(
                400, HEADER_MISMATCH, f"{NAME_HEADER} header does not match params.{field}"
            )
    return Era.STATELESS
