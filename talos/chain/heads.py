"""Signed heads exchanged between linked nodes: the rules and the rows
(docs/DESIGN.md "Block log"; docs/PROTOCOL.md "Block log").

Pure: bytes and LMDB transactions handed in, no loop, no clock. The service
that sends and receives them is :mod:`talos.chain.head_gossip`. A node sends
its latest signed head statement (:func:`talos.chain.block.head_statement`) on
the reserved app channel :data:`HEAD_CHANNEL` when a link comes up and
whenever its log grows. The peer
checks the signature and compares the statement with the latest head it kept
for that node: a head at the same height with another hash, or below a height
already seen, is an equivocation — the node rewrote or forked its history.

Stored rows (``meta`` database, RFC 8785 JSON values)::

    b"head:" || DID                 -> latest head statement seen from DID
    b"equiv:" || DID || 0x00 || u64 -> {"kept": statement, "presented": statement, "reason": str}
    b"equivn:" || DID               -> u64 alerts seen from DID (only the first
                                       MAX_EQUIVOCATIONS_KEPT are stored)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from talos.chain.block import verify_head_statement
from talos.store import Txn
from talos_sdk.canonical import canonical_json_bytes
from talos_sdk.errors import MalformedFrameError, ProtocolError

__all__ = [
    "HEAD_CHANNEL",
    "MAX_EQUIVOCATIONS_KEPT",
    "MAX_HEAD_BYTES",
    "Equivocation",
    "ForgedHeadError",
    "PeerHead",
    "decode_head",
    "encode_head",
    "equiv_count_key",
    "equiv_key",
    "equiv_prefix",
    "head_key",
    "judge",
    "judge_and_store",
    "load_head",
    "stored_equivocation_counts",
    "stored_equivocations",
    "stored_heads",
]

HEAD_CHANNEL: Final = "talos.head"
MAX_HEAD_BYTES: Final = 16384  # a hybrid head's signature is 3373 B, 6746 in hex
#: Alerts stored per peer; later ones only raise the count (a peer cannot fill the disk).
MAX_EQUIVOCATIONS_KEPT: Final = 16
_U64 = struct.Struct(">Q")


class ForgedHeadError(ProtocolError):
    """A head statement whose signature or signer is not the link peer's."""


@dataclass(frozen=True, slots=True)
class PeerHead:
    """A verified head statement of one node."""

    node: str
    height: int
    hash: str
    statement: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Equivocation:
    """Two signed heads of one node that cannot both belong to an append-only log."""

    kept: PeerHead
    presented: PeerHead
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.kept.node,
            "reason": self.reason,
            "kept": self.kept.statement,
            "presented": self.presented.statement,
        }


def encode_head(statement: dict[str, Any]) -> bytes:
    return canonical_json_bytes(statement)


def decode_head(payload: bytes, peer: str, mldsa65: bytes | None = None) -> PeerHead:
    """Parse and verify a head statement sent by ``peer`` over its link.

    ``mldsa65``: the ML-DSA-65 key pinned for ``peer`` (its heads must then be hybrid).
    """
    if len(payload) > MAX_HEAD_BYTES:
        raise MalformedFrameError(f"head statement above {MAX_HEAD_BYTES} bytes")
    try:
        statement = json.loads(payload)
    except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        raise MalformedFrameError("head statement is not JSON") from None
    if not isinstance(statement, dict):
        raise MalformedFrameError("head statement is not a JSON object")
    if not verify_head_statement(statement, peer, mldsa65):
        raise ForgedHeadError("head statement is not signed by the link peer")
    return PeerHead(peer, int(statement["height"]), str(statement["hash"]), statement)


def judge(kept: PeerHead | None, presented: PeerHead) -> tuple[PeerHead, Equivocation | None]:
    """The head to keep after ``presented`` arrives, and the equivocation it proves if any."""
    if kept is None or presented.height > kept.height:
        return presented, None
    if presented.height == kept.height:
        if presented.hash == kept.hash:
            return kept, None
        return kept, Equivocation(kept, presented, "same height, different block hash")
    return kept, Equivocation(kept, presented, "height below one already signed")


def head_key(did: str) -> bytes:
    return b"head:" + did.encode()


def equiv_prefix(did: str = "") -> bytes:
    return b"equiv:" + (did.encode() + b"\x00" if did else b"")


def equiv_key(did: str, n: int) -> bytes:
    return equiv_prefix(did) + _U64.pack(n)


def equiv_count_key(did: str) -> bytes:
    """Not under :func:`equiv_prefix` (``equivn:`` vs ``equiv:``): alert scans skip it."""
    return b"equivn:" + did.encode()


def load_head(raw: bytes | None, did: str) -> PeerHead | None:
    """A stored head row back as :class:`PeerHead` (it was verified before it was stored)."""
    if raw is None:
        return None
    statement = json.loads(raw)
    return PeerHead(did, int(statement["height"]), str(statement["hash"]), statement)


def _prefixed(txn: Txn, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    for key, value in txn.items("meta", prefix):
        if not key.startswith(prefix):
            return
        yield key, value


def judge_and_store(txn: Txn, did: str, presented: PeerHead) -> Equivocation | None:
    """Compare with the kept head, keep the better one, record a conflict (capped per peer)."""
    kept = load_head(txn.get("meta", head_key(did)), did)
    keep, conflict = judge(kept, presented)
    if keep is not kept:
        txn.put("meta", head_key(did), encode_head(keep.statement))
    if conflict is not None:
        count_key = equiv_count_key(did)
        raw = txn.get("meta", count_key)
        if raw is not None:
            n = _U64.unpack(raw)[0]
        else:  # a store from before the count: its rows are the count
            n = sum(1 for _ in _prefixed(txn, equiv_prefix(did)))
        if n < MAX_EQUIVOCATIONS_KEPT:
            txn.put("meta", equiv_key(did, n), encode_head(conflict.to_json()))
        txn.put("meta", count_key, _U64.pack(n + 1))
    return conflict


def stored_heads(txn: Txn) -> dict[str, dict[str, Any]]:
    """The latest verified head statement kept for each peer."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in _prefixed(txn, b"head:"):
        did = key[5:].decode()
        head = load_head(value, did)
        if head is not None:
            out[did] = head.statement
    return out


def stored_equivocation_counts(txn: Txn) -> dict[str, int]:
    """Alerts seen per peer, including those past the stored ones."""
    prefix = equiv_count_key("")
    return {k[len(prefix) :].decode(): _U64.unpack(v)[0] for k, v in _prefixed(txn, prefix)}


def stored_equivocations(txn: Txn) -> list[dict[str, Any]]:
    """Every equivocation alert stored, oldest first per peer."""
    return [json.loads(value) for _, value in _prefixed(txn, equiv_prefix())]
