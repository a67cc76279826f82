"""Rows of the ``pending`` database: records appended and not yet sealed (docs/PROTOCOL.md
"Block log", Pending records).

The sealer signs whatever it finds there as the node's, and a node's own records
(audit records, app records) carry no signature of their own: the block signature
vouches for them. So each row the node writes carries a tag only the node can make,
and the sealer quarantines a row whose tag does not verify: whoever holds the disk
but not the passphrase could otherwise write a record the node then signs. A row
without the mark was written by a version before the tags: only a signature on its
record (a peer's, or the node's own on a message it sent) can vouch for it::

    row = 0xA5 ‖ HMAC-SHA256(K, u64 seq ‖ record)[:16] ‖ record
    K   = HKDF-SHA256(seed, salt = "", info = "talos/log/pending/v1")

Pure.
"""

from __future__ import annotations

import hmac
import struct
from typing import Final

from talos_sdk.errors import MalformedFrameError
from talos_sdk.kdf import hkdf

__all__ = [
    "bare_record",
    "is_tagged",
    "pending_key",
    "pending_record",
    "pending_row",
    "tagged_record",
]

_MARK: Final = 0xA5  # never a record's first byte (its version, 1)
_TAG: Final = 16
_INFO: Final = b"talos/log/pending/v1"
_U64 = struct.Struct(">Q")


def pending_key(seed: bytes) -> bytes:
    """The node's key for its pending rows, from its identity seed."""
    return hkdf(seed, salt=b"", info=_INFO)


def _tag(key: bytes, seq: int, record: bytes) -> bytes:
    return hmac.digest(key, _U64.pack(seq) + record, "sha256")[:_TAG]


def pending_row(key: bytes, seq: int, record: bytes) -> bytes:
    """The row the node stores for encoded ``record`` at ``seq``."""
    return bytes((_MARK,)) + _tag(key, seq, record) + record


def tagged_record(key: bytes, seq: int, row: bytes) -> bytes:
    """The encoded record of a row the node wrote at ``seq``; MalformedFrameError if its
    tag does not verify (a row written by something else, or moved to another seq)."""
    record = pending_record(row)
    if not hmac.compare_digest(row[1 : 1 + _TAG], _tag(key, seq, record)):
        raise MalformedFrameError("pending row not written by this node (its tag does not verify)")
    return record


def bare_record(row: bytes) -> bytes:
    """The record bytes of a row, whatever its tag says, else the row as it is (what the
    quarantine keeps of a refused row, so that its listing can name the record)."""
    return row[1 + _TAG :] if is_tagged(row) and len(row) > 1 + _TAG else row


def is_tagged(row: bytes) -> bool:
    """Whether ``row`` has the mark of a tagged row (else: an older version's, or junk)."""
    return bool(row) and row[0] == _MARK


def pending_record(row: bytes) -> bytes:
    """The encoded record of a row, unchecked (readers without the node's key); an
    untagged row is returned whole (an older version wrote the bare record)."""
    if not is_tagged(row):
        return row
    if len(row) <= 1 + _TAG:
        raise MalformedFrameError("pending row truncated")
    return row[1 + _TAG :]
