"""Peers as a person names them: DIDs, ``ws://HOST:PORT#DID`` addresses, peer names.

Given on the command line, in config.json or in a policy file, each DID is
parsed in full (talos_sdk/did.py: ``did:key``, multibase ``z``, multicodec
``ed25519-pub`` 0xed01, a 32-byte key) before anything runs, and a bad one is
refused with an error naming where it came from and what is wrong::

    --allow did:key:z6MkTYPO: not a valid did:key: did:key is not valid base58btc: ...

The error is a :class:`~talos_sdk.errors.DIDError`, a usage error (exit code
2, talos/exit_codes.py). A peer name is checked for form here and resolved to
its DID by talos/peer_names.py. Addresses pin the identity the link handshake
must prove (docs/PROTOCOL.md "Link protocol").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from talos_sdk.did import public_key_from_did
from talos_sdk.errors import DIDError, UsageError

__all__ = [
    "PeerAddr",
    "check_did",
    "check_peer_addr",
    "check_peer_ref",
    "host_port_url",
    "is_did",
    "parse_peer_addr",
    "shown",
    "validate_name",
]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

_SHOWN = 80


def shown(value: str) -> str:
    """``value`` as an error shows it: bounded, and quoted when it holds odd characters."""
    cut = value if len(value) <= _SHOWN else value[:_SHOWN] + "..."
    return cut if cut.isprintable() and " " not in cut and cut else repr(cut)


def _at(where: str, value: str) -> str:
    return f"{where} {shown(value)}" if where else shown(value)


def check_did(value: str, where: str = "") -> str:
    """``value`` if it is a well-formed did:key; else DIDError("WHERE VALUE: not a valid ...")."""
    try:
        public_key_from_did(value)
    except DIDError as exc:
        raise DIDError(f"{_at(where, value)}: not a valid did:key: {exc}") from None
    return value


def is_did(ref: str) -> bool:
    return ref.startswith("did:")


def validate_name(name: str) -> str:
    """A name is 1..64 of ``A-Z a-z 0-9 _ . -``, starting with a letter or digit."""
    if is_did(name) or not _NAME.fullmatch(name):
        raise UsageError(
            f"peer name must be 1-64 letters, digits, '_', '.' or '-' (not a DID), got {name!r}"
        )
    return name


def check_peer_ref(value: str, where: str = "") -> str:
    """A DID (checked in full) or a peer name (checked for form): either one is returned."""
    if is_did(value):
        return check_did(value, where)
    try:
        return validate_name(value)
    except UsageError as exc:
        # "127.0.0.1:7400" or "ws://host:7400": an address, which says which DID to expect.
        hint = "; an address must look like ws://HOST:PORT#DID" if ":" in value else ""
        raise UsageError(
            f"{_at(where, value)}: neither a did:key nor a peer name: {exc}{hint}"
        ) from None


@dataclass(frozen=True, slots=True)
class PeerAddr:
    """A dialable peer: WebSocket URL plus the DID it must prove."""

    url: str
    did: str

    def __str__(self) -> str:
        return f"{self.url}#{self.did}"


def host_port_url(
    value: str,
    schemes: tuple[str, ...],
    what: str,
    shape: str,
    error: type[UsageError] = UsageError,
) -> SplitResult:
    """``value`` split, with one of ``schemes``, a host and a port (``error`` otherwise).

    ``what`` names the value in the errors, ``shape`` shows what it must look like. The
    one check behind peer addresses, relay URLs and dialable addresses (talos/discovery.py).
    """
    try:
        parts = urlsplit(value)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise error(f"{shape}, got {value!r} ({exc})") from None
    if parts.scheme not in schemes or not parts.hostname:
        raise error(f"{shape}, got {value!r}")
    try:
        port = parts.port
    except ValueError:
        raise error(f"bad port in {what} {value!r}") from None
    if port is None:
        raise error(f"{what} needs a port: {value!r}")
    return parts


def parse_peer_addr(addr: str) -> PeerAddr:
    """Parse ``ws://HOST:PORT#DID`` (``wss://`` too); the DID fragment is required."""
    parts = host_port_url(
        addr, ("ws", "wss"), "peer address", "peer address must look like ws://HOST:PORT#DID"
    )
    if not parts.fragment:
        raise UsageError(f"peer address needs the peer's DID after '#': {addr!r}")
    public_key_from_did(parts.fragment)  # raises DIDError for a malformed DID
    url = addr.split("#", 1)[0]
    return PeerAddr(url, parts.fragment)


def check_peer_addr(value: str, where: str = "") -> str:
    """A ``ws://HOST:PORT#DID`` address whose DID parses in full; errors name ``where``."""
    try:
        parse_peer_addr(value)
    except DIDError as exc:
        raise DIDError(f"{_at(where, value)}: not a valid did:key after '#': {exc}") from None
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}" if where else str(exc)) from None
    return value
