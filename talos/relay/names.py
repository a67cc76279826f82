"""What a node is called on the relay: opaque subjects and its NATS user (nkey).

docs/adr/0010-nats-relay.md, docs/PROTOCOL.md "Relay". Pure.

A node's *token* is ``base32(SHA-256("talos/relay/v1/token" || 0x00 || DID)[:20])``
(the digest's first 20 bytes) in lower case (32 characters). Everything the
relay routes for that node is named by the token, never by the DID: anyone
who knows a DID can compute its token (that is how a sender addresses a peer),
but an observer of the relay who sees only tokens cannot turn them back into
DIDs.

The node's NATS user is its own Ed25519 identity key written as a NATS *nkey*
(NATS "NKeys" spec: a prefix byte, the 32 key bytes, a CRC-16/XMODEM
little-endian, base32 without padding). ``U...`` is the public user key the
server configuration lists; ``SU...`` is the seed form that nats-py's nkey
authentication signs the server's nonce with.

Each node is a NATS account of its own (:attr:`RelayNames.account`), and
nats-server stamps every message that crosses from one account to another
through a service import with a ``Nats-Request-Info`` header naming the
publisher's account, replacing any such header the publisher set
(:func:`publisher_account`). That is how a node knows which node's account a
relay packet came from without trusting anything in it, once the server told
it that it is in an account of its own (:data:`USER_INFO_SUBJECT`): where
nodes share one account nothing crosses an import, and a header is whatever
its sender wrote.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from talos_sdk.did import public_key_from_did
from talos_sdk.errors import UsageError

__all__ = [
    "MAILBOX_CONSUMER",
    "REQUEST_INFO_HEADER",
    "USER_INFO_SUBJECT",
    "RelayNames",
    "crc16_xmodem",
    "nkey_public",
    "nkey_seed",
    "publisher_account",
    "relay_token",
    "user_info_account",
]

TOKEN_LABEL: Final = b"talos/relay/v1/token\x00"
TOKEN_BYTES: Final = 20
#: Durable pull consumer a node drains its own mailbox with.
MAILBOX_CONSUMER: Final = "talos"

#: The header nats-server writes on messages crossing a service import (its accounts.go).
REQUEST_INFO_HEADER: Final = "Nats-Request-Info"
#: nats-server's answer to "which user and account is this connection" (its events.go).
USER_INFO_SUBJECT: Final = "$SYS.REQ.USER.INFO"
# Longer than any header nats-server writes: refused unparsed.
_MAX_REQUEST_INFO = 4096

# NKeys prefix bytes (5 bits, shifted): 'S' seed, 'U' user.
_PREFIX_SEED: Final = 18 << 3
_PREFIX_USER: Final = 20 << 3


def crc16_xmodem(data: bytes) -> int:
    """CRC-16/XMODEM (poly 0x1021, init 0), the checksum of an nkey."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _b32(raw: bytes) -> str:
    body = raw + crc16_xmodem(raw).to_bytes(2, "little")
    return base64.b32encode(body).decode().rstrip("=")


def nkey_public(public_key: bytes) -> str:
    """The NATS user nkey (``U...``) of an Ed25519 public key."""
    if len(public_key) != 32:
        raise UsageError("an nkey holds a 32-byte Ed25519 public key")
    return _b32(bytes((_PREFIX_USER,)) + public_key)


def nkey_seed(seed: bytes) -> str:
    """The NATS user seed (``SU...``) of an Ed25519 seed; secret, never logged."""
    if len(seed) != 32:
        raise UsageError("an nkey seed holds a 32-byte Ed25519 seed")
    head = bytes((_PREFIX_SEED | (_PREFIX_USER >> 5), (_PREFIX_USER & 31) << 3))
    return _b32(head + seed)


def relay_token(did: str) -> str:
    """The opaque token that names ``did`` on the relay (not reversible without the DID)."""
    public_key_from_did(did)  # a clear DIDError for a malformed DID
    digest = hashlib.sha256(TOKEN_LABEL + did.encode()).digest()[:TOKEN_BYTES]
    return base64.b32encode(digest).decode().lower()


@dataclass(frozen=True, slots=True)
class RelayNames:
    """Every subject and stream name the relay uses for one node."""

    token: str

    @classmethod
    def for_did(cls, did: str) -> RelayNames:
        return cls(relay_token(did))

    @property
    def account(self) -> str:
        """This node's NATS account (talos/relay/serverconf.py): one per node."""
        return f"TALOS_{self.token.upper()}"

    @property
    def link(self) -> str:
        """Where link-stream packets for this node are published (core NATS)."""
        return f"talos.link.{self.token}"

    @property
    def mailbox(self) -> str:
        """Where sealed envelopes for this node are published (JetStream)."""
        return f"talos.mbox.{self.token}"

    @property
    def stream(self) -> str:
        """The JetStream stream that holds this node's mailbox."""
        return f"TALOS_MBOX_{self.token.upper()}"

    @property
    def inbox_prefix(self) -> str:
        """Reply subjects of this node's requests (its own, so nobody else reads them)."""
        return f"_INBOX.{self.token}"

    def permissions(self) -> dict[str, object]:
        """nats-server permissions: subscribe only to its own subjects (docs/operations.md)."""
        js = "$JS.API"
        return {
            "publish": {
                "allow": [
                    "talos.link.*",
                    "talos.mbox.*",
                    USER_INFO_SUBJECT,
                    f"{js}.INFO",
                    f"{js}.STREAM.*.{self.stream}",
                    f"{js}.CONSUMER.*.{self.stream}",
                    f"{js}.CONSUMER.*.{self.stream}.>",
                    f"{js}.CONSUMER.MSG.NEXT.{self.stream}.{MAILBOX_CONSUMER}",
                    f"$JS.ACK.{self.stream}.>",
                ]
            },
            "subscribe": {"allow": [self.link, f"{self.inbox_prefix}.>"]},
            "allow_responses": True,
        }


def publisher_account(headers: Mapping[str, str] | None) -> str | None:
    """The account nats-server says published a message; None if it crossed no import.

    None means the message came from within the receiver's own account: only
    its own node is in it, or the relay is configured with one shared account
    (docs/operations.md "Relay"), where nobody is vouched for. A header that
    does not parse gives ``""``, which matches no account.
    """
    raw = headers.get(REQUEST_INFO_HEADER) if headers else None
    if raw is None:
        return None
    if len(raw) > _MAX_REQUEST_INFO:
        return ""
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        return ""
    account = info.get("acc") if isinstance(info, dict) else None
    return account if isinstance(account, str) else ""


def user_info_account(reply: bytes) -> str | None:
    """The account in nats-server's answer on :data:`USER_INFO_SUBJECT` (None if none)."""
    try:
        info = json.loads(reply)
    except (ValueError, RecursionError):
        return None
    data = info.get("data") if isinstance(info, dict) else None
    account = data.get("account") if isinstance(data, dict) else None
    return account if isinstance(account, str) else None
