"""Records, blocks and the rules that make a block valid (docs/DESIGN.md "Block log").

Pure: no I/O, no clock. docs/PROTOCOL.md "Block log" is the normative text;
this module is its implementation.

Record (binary, big-endian, every variable field length-prefixed)::

    u8 version=1 | u8 len kind | u8 len record_id | u16 len sender DID
    | u16 len recipient DID | u64 timestamp_ms | u16 len commitment
    | u8 len signature (0 or 64) | u16 len extra

The record keeps the exact commitment bytes its sender signed, so anyone can
re-check ``verify(sender, commitment, signature)`` years later. A record with an
empty signature is one the node authored itself (audit records): its sender
must be the node, and the block signature is what vouches for it.

Block = header || signature of the node over the header::

    b"TLBK" | u8 version | u64 height | u64 timestamp_ms | 32 prev_hash
    | 32 merkle_root | u32 record_count | u16 len node DID [| 32 key_id]

Version 1 (classical node): no ``key_id``, 64-byte Ed25519 signature. Version 2
(hybrid node, ADR 0005): ``key_id`` is the node's hybrid key id and
the signature is the 3373-byte Ed25519 + ML-DSA-65 one (``Wallet.sign_auth``).
The ML-DSA-65 key itself is not in the block: a verifier must bring it (from
the node's wallet or a pin), else a forger of Ed25519 could bring their own.

``merkle_root`` is the RFC 6962 tree hash over the *encoded records* as leaf
data. ``Block.hash()`` is SHA-256 of the whole encoding *including* the
signature, so the next block's ``prev_hash`` pins the exact bytes stored.
Height 0 links to 32 zero bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from talos_sdk.binfmt import pack_u8, pack_u64, pack_var8, pack_var16, utf8
from talos_sdk.canonical import canonical_json_bytes
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import ChainError, MalformedFrameError, UsageError
from talos_sdk.hybrid import HYBRID_SIGNATURE_SIZE, HybridPublicKey
from talos_sdk.merkle import merkle_root, verify_inclusion
from talos_sdk.wallet import verify, verify_auth

__all__ = [
    "GENESIS_PREV",
    "MAX_BLOCK_RECORDS",
    "MAX_COMMITMENT",
    "MAX_EXTRA",
    "Block",
    "BlockHeightError",
    "BlockLinkError",
    "BlockNodeError",
    "BlockSignatureError",
    "ChainDefect",
    "MalformedChainDataError",
    "MerkleRootError",
    "Record",
    "RecordCountError",
    "RecordSignatureError",
    "block_signature_problem",
    "check_record_signature",
    "collect_block_defects",
    "head_signing_bytes",
    "head_statement",
    "validate_block",
    "verify_head_statement",
    "verify_inclusion_proof",
]

GENESIS_PREV = bytes(32)
MAX_COMMITMENT = 4096
MAX_EXTRA = 4096
#: Records one block holds at most (``seal_count`` is bounded by it): ``chain verify``
#: holds one block's records at a time, so a height that stores more is a defect, not
#: a reason to read them all into memory.
MAX_BLOCK_RECORDS = 4096
_SIG_LEN = 64
_RECORD_VERSION = 1
_BLOCK_MAGIC = b"TLBK"
_BLOCK_VERSION = 1
_BLOCK_VERSION_HYBRID = 2
_KEY_ID_LEN = 32
_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_HDR_FIXED = struct.Struct(">4sBQQ32s32sIH")  # through the node DID length
_HEAD_TYPE = "talos.chain.head/1"


# --- errors -------------------------------------------------------------------------------------


class ChainDefect(ChainError):
    """A defect at a place in the log: ``height`` and, for record-level defects, ``index``."""

    code: ClassVar[str] = "defect"

    def __init__(self, message: str, *, height: int | None, index: int | None = None) -> None:
        where = f"block {height}" if height is not None else "log"
        if index is not None:
            where += f", record {index}"
        super().__init__(f"{where}: {message}")
        self.height = height
        self.index = index
        self.detail = message


class MalformedChainDataError(ChainDefect, MalformedFrameError):
    """Stored bytes that do not decode as a block or record."""

    code = "malformed"


class BlockHeightError(ChainDefect):
    """A block sits at a height other than the one its header claims."""

    code = "height"


class BlockLinkError(ChainDefect):
    """``prev_hash`` does not name the previous block."""

    code = "prev_link"


class BlockNodeError(ChainDefect):
    """A block was authored by a DID other than this log's node."""

    code = "node"


class RecordCountError(ChainDefect):
    """The header's record count differs from the records stored for the block."""

    code = "record_count"


class MerkleRootError(ChainDefect):
    """The records do not hash to the header's Merkle root."""

    code = "merkle_root"


class BlockSignatureError(ChainDefect):
    """The node signature over the block header does not verify."""

    code = "block_signature"


class RecordSignatureError(ChainDefect):
    """A record's sender signature over its commitment does not verify."""

    code = "sender_signature"


# --- records ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """One entry of the log: who sent what to whom, and the sender's signed commitment."""

    kind: str
    record_id: bytes
    sender: str
    recipient: str
    commitment: bytes
    signature: bytes
    timestamp_ms: int
    extra: bytes = b""
    encoded: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kind = self.kind.encode("utf-8")
        if not 1 <= len(kind) <= 32:
            raise UsageError("record kind must be 1..32 bytes of UTF-8")
        if len(self.record_id) not in (16, 32):
            raise UsageError("record id must be 16 or 32 bytes")
        sender, recipient = self.sender.encode("utf-8"), self.recipient.encode("utf-8")
        if not sender or len(sender) > 0xFFFF or len(recipient) > 0xFFFF:
            raise UsageError("record sender must be a DID; DIDs are at most 65535 bytes")
        if len(self.commitment) > MAX_COMMITMENT:
            raise UsageError(f"record commitment above {MAX_COMMITMENT} bytes")
        if len(self.signature) not in (0, _SIG_LEN):
            raise UsageError("record signature must be empty or 64 bytes")
        if not 0 <= self.timestamp_ms < 1 << 64:
            raise UsageError("record timestamp out of range")
        if len(self.extra) > MAX_EXTRA:
            raise UsageError(f"record extra above {MAX_EXTRA} bytes")
        encoded = b"".join(
            (
                pack_u8(_RECORD_VERSION),
                pack_var8(kind),
                pack_var8(self.record_id),
                pack_var16(sender),
                pack_var16(recipient),
                pack_u64(self.timestamp_ms),
                pack_var16(self.commitment),
                pack_var8(self.signature),
                pack_var16(self.extra),
            )
        )
        object.__setattr__(self, "encoded", encoded)

    @property
    def commitment_hash(self) -> bytes:
        """SHA-256 of the signed commitment bytes."""
        return hashlib.sha256(self.commitment).digest()

    def to_bytes(self) -> bytes:
        """The canonical encoding (also the Merkle leaf data)."""
        return self.encoded

    @classmethod
    def from_bytes(cls, data: bytes) -> Record:
        """Decode; any deviation from the layout is :class:`MalformedFrameError`.

        One pass with no re-encoding (this is the hot loop of chain verification):
        the layout is canonical, so the input bytes *are* the encoding.
        """
        if type(data) is not bytes:
            data = bytes(data)
        n = len(data)
        try:
            if data[0] != _RECORD_VERSION:
                raise MalformedFrameError("unknown record version")
            end = 2 + data[1]
            kind_b = data[2:end]
            pos = end + 1
            end = pos + data[end]
            record_id = data[pos:end]
            pos = end + 2
            end = pos + _U16.unpack_from(data, end)[0]
            sender_b = data[pos:end]
            pos = end + 2
            end = pos + _U16.unpack_from(data, end)[0]
            recipient_b = data[pos:end]
            (timestamp_ms,) = _U64.unpack_from(data, end)
            pos = end + 10
            end = pos + _U16.unpack_from(data, end + 8)[0]
            commitment = data[pos:end]
            pos = end + 1
            end = pos + data[end]
            signature = data[pos:end]
            pos = end + 2
            end = pos + _U16.unpack_from(data, end)[0]
            extra = data[pos:end]
        except (IndexError, struct.error):
            raise MalformedFrameError("record truncated") from None
        if end != n:
            raise MalformedFrameError(
                "record truncated" if end > n else "trailing bytes after record"
            )
        if not 1 <= len(kind_b) <= 32 or len(record_id) not in (16, 32) or not sender_b:
            raise MalformedFrameError("record fields out of bounds: kind, id (16 or 32) or sender")
        if len(signature) not in (0, _SIG_LEN):
            raise MalformedFrameError("record fields out of bounds: signature")
        if len(commitment) > MAX_COMMITMENT or len(extra) > MAX_EXTRA:
            raise MalformedFrameError("record fields out of bounds: commitment or extra")
        try:  # one handler for the three texts; the slow path names the bad one
            kind, sender, recipient = kind_b.decode(), sender_b.decode(), recipient_b.decode()
        except UnicodeDecodeError:
            utf8(kind_b, "record kind")
            utf8(sender_b, "record sender")
            utf8(recipient_b, "record recipient")
            raise
        record = object.__new__(cls)
        init = object.__setattr__
        init(record, "kind", kind)
        init(record, "record_id", record_id)
        init(record, "sender", sender)
        init(record, "recipient", recipient)
        init(record, "commitment", commitment)
        init(record, "signature", signature)
        init(record, "timestamp_ms", timestamp_ms)
        init(record, "extra", extra)
        init(record, "encoded", data)
        return record


def check_record_signature(record: Record, node_did: str) -> str | None:
    """Why the record's sender signature is unacceptable, or ``None`` if it is fine."""
    if not record.signature:
        return None if record.sender == node_did else "unsigned record not authored by the node"
    try:
        ok = verify(record.sender, record.commitment, record.signature)
    except UsageError as exc:  # DIDError: a sender that is not a did:key we can check
        return f"sender DID unusable: {exc}"
    return None if ok else "sender signature does not verify"


# --- blocks -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Block:
    """A sealed block: header fields plus the node's signature over :meth:`header_bytes`."""

    height: int
    prev_hash: bytes
    timestamp_ms: int
    merkle_root: bytes
    record_count: int
    node_did: str
    signature: bytes = b""
    key_id: bytes | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.height < 1 << 64 or not 0 <= self.timestamp_ms < 1 << 64:
            raise UsageError("block height / timestamp out of range")
        if len(self.prev_hash) != 32 or len(self.merkle_root) != 32:
            raise UsageError("block prev_hash and merkle_root are 32 bytes")
        if not 0 <= self.record_count < 1 << 32:
            raise UsageError("block record count out of range")
        if self.key_id is not None and len(self.key_id) != _KEY_ID_LEN:
            raise UsageError("block key_id must be 32 bytes")
        sig_len = _SIG_LEN if self.key_id is None else HYBRID_SIGNATURE_SIZE
        if len(self.signature) not in (0, sig_len):
            raise UsageError(f"block signature must be {sig_len} bytes for this block version")
        if not self.node_did or len(self.node_did.encode("utf-8")) > 0xFFFF:
            raise UsageError("block node DID must be 1..65535 bytes")

    @property
    def version(self) -> int:
        """1 = classical Ed25519 block, 2 = hybrid (carries ``key_id``)."""
        return _BLOCK_VERSION if self.key_id is None else _BLOCK_VERSION_HYBRID

    def header_bytes(self) -> bytes:
        """The bytes the node signs."""
        did = self.node_did.encode("utf-8")
        return (
            _HDR_FIXED.pack(
                _BLOCK_MAGIC,
                self.version,
                self.height,
                self.timestamp_ms,
                self.prev_hash,
                self.merkle_root,
                self.record_count,
                len(did),
            )
            + did
            + (self.key_id or b"")
        )

    def to_bytes(self) -> bytes:
        """Header followed by the signature (64 bytes, or 3373 for version 2)."""
        if not self.signature:
            raise UsageError("an unsigned block has no stored form")
        return self.header_bytes() + self.signature

    def hash(self) -> bytes:
        """SHA-256 of :meth:`to_bytes` (signature included)."""
        return hashlib.sha256(self.to_bytes()).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> Block:
        """Decode; any deviation from the layout is :class:`MalformedFrameError`."""
        data = bytes(data)
        if len(data) < _HDR_FIXED.size + _SIG_LEN:
            raise MalformedFrameError("block truncated")
        magic, version, height, ts, prev, root, count, did_len = _HDR_FIXED.unpack_from(data)
        if magic != _BLOCK_MAGIC or version not in (_BLOCK_VERSION, _BLOCK_VERSION_HYBRID):
            raise MalformedFrameError("not a version 1 or 2 Talos block")
        hybrid = version == _BLOCK_VERSION_HYBRID
        key_len, sig_len = (_KEY_ID_LEN, HYBRID_SIGNATURE_SIZE) if hybrid else (0, _SIG_LEN)
        did_end = _HDR_FIXED.size + did_len
        if len(data) != did_end + key_len + sig_len:
            raise MalformedFrameError("block length does not match its DID length and version")
        did = utf8(data[_HDR_FIXED.size : did_end], "block node DID")
        key_id = data[did_end : did_end + key_len] if hybrid else None
        try:
            return cls(height, prev, ts, root, count, did, data[-sig_len:], key_id)
        except UsageError as exc:
            raise MalformedFrameError(f"block fields out of bounds: {exc}") from None


def block_signature_problem(
    block: Block, node_did: str, auth_key: HybridPublicKey | None
) -> str | None:
    """Why the node signature of ``block`` is unacceptable, or None.

    ``auth_key`` is the node's hybrid key when its blocks must be hybrid (a
    version 1 block is then a downgrade); None when they must be classical.
    """
    if auth_key is None:
        if block.key_id is not None:
            return "hybrid (version 2) block, but no ML-DSA-65 key was given to check it"
        ok = verify(node_did, block.header_bytes(), block.signature)
        return None if ok else "node signature over the header does not verify"
    if block.key_id is None:
        return "classical (version 1) block where the node signs hybrid: downgrade"
    if block.key_id != auth_key.key_id or auth_key.did != node_did:
        return f"block key_id {block.key_id.hex()[:16]} is not the node's hybrid key"
    if not auth_key.verify(block.header_bytes(), block.signature):
        return "hybrid node signature over the header does not verify"
    return None


def collect_block_defects(
    block: Block,
    records: Sequence[Record],
    prev_hash: bytes,
    node_did: str,
    *,
    expected_height: int | None = None,
    auth_key: HybridPublicKey | None = None,
) -> list[ChainDefect]:
    """Every rule ``block`` breaks, in the order :func:`validate_block` checks them.

    ``auth_key``: see :func:`block_signature_problem`.
    """
    # Defects are placed where the block is stored, not where its (maybe damaged)
    # header says: one flipped height bit put them at block 72057594037927937.
    h = block.height if expected_height is None else expected_height
    out: list[ChainDefect] = []
    if block.height != h:
        out.append(BlockHeightError(f"header says height {block.height}, expected {h}", height=h))
    if block.prev_hash != prev_hash:
        out.append(
            BlockLinkError(
                f"prev_hash {block.prev_hash.hex()[:16]}… does not match the previous block "
                f"{prev_hash.hex()[:16]}…",
                height=h,
            )
        )
    if block.node_did != node_did:
        out.append(BlockNodeError(f"authored by {block.node_did}, not {node_did}", height=h))
    if block.record_count != len(records):
        out.append(
            RecordCountError(
                f"header counts {block.record_count} records, {len(records)} stored", height=h
            )
        )
    if merkle_root([r.encoded for r in records]) != block.merkle_root:
        out.append(MerkleRootError("records do not hash to the header's Merkle root", height=h))
    sig_problem = block_signature_problem(block, node_did, auth_key)
    if sig_problem is not None:
        out.append(BlockSignatureError(sig_problem, height=h))
    for i, record in enumerate(records):
        why = check_record_signature(record, node_did)
        if why is not None:
            out.append(RecordSignatureError(why, height=h, index=i))
    return out


def validate_block(
    block: Block,
    records: Sequence[Record],
    prev_hash: bytes,
    node_did: str,
    *,
    expected_height: int | None = None,
    auth_key: HybridPublicKey | None = None,
) -> None:
    """Raise the :class:`ChainDefect` subclass for the first rule ``block`` breaks.

    Checks, in order: height, link to ``prev_hash``, author, record count,
    Merkle root, node signature (hybrid under ``auth_key`` when given), then
    every record's sender signature.
    """
    defects = collect_block_defects(
        block, records, prev_hash, node_did, expected_height=expected_height, auth_key=auth_key
    )
    if defects:
        raise defects[0]


# --- signed heads and inclusion proofs (JSON-able, for peers) -----------------------------------


def _head_body(node_did: str, height: int, block_hash: bytes, timestamp_ms: int) -> dict[str, Any]:
    return {
        "type": _HEAD_TYPE,
        "node": node_did,
        "height": height,
        "hash": block_hash.hex(),
        "timestamp_ms": timestamp_ms,
    }


def head_statement(
    node_did: str, height: int, block_hash: bytes, timestamp_ms: int, signature: bytes
) -> dict[str, Any]:
    """A signed head as a JSON-able dict; ``signature`` is over :func:`head_signing_bytes`."""
    body = _head_body(node_did, height, block_hash, timestamp_ms)
    body["signature"] = signature.hex()
    return body


def head_signing_bytes(node_did: str, height: int, block_hash: bytes, timestamp_ms: int) -> bytes:
    """RFC 8785 bytes of the head statement without its signature (what the node signs)."""
    return canonical_json_bytes(_head_body(node_did, height, block_hash, timestamp_ms))


def verify_head_statement(
    statement: dict[str, Any],
    node_did: str | None = None,
    mldsa65_public_key: bytes | None = None,
) -> bool:
    """True if ``statement`` is a well-formed head signed by its node (and by ``node_did``).

    Well-formed is exactly what :func:`head_statement` makes: its six keys, integer
    height and time, the hash as 64 lower-case hex digits. A statement spelt any
    other way (an upper-case hash, an extra field) is refused although its signature,
    over the values, would check: compared as given, it would read as another head.
    With ``mldsa65_public_key`` (the node's pinned ML-DSA-65 key) only a hybrid
    signature passes; without, only a classical one (``verify_auth``).
    """
    try:
        if statement.keys() != _HEAD_KEYS or statement["type"] != _HEAD_TYPE:
            return False
        did, height, hash_hex = statement["node"], statement["height"], statement["hash"]
        ts = statement["timestamp_ms"]
        if node_did is not None and did != node_did:
            return False
        if not (_is_u63(height) and _is_u63(ts) and isinstance(hash_hex, str)):
            return False
        block_hash = bytes.fromhex(hash_hex)
        if len(block_hash) != 32 or block_hash.hex() != hash_hex:
            return False
        body = head_signing_bytes(did, height, block_hash, ts)
        return verify_auth(did, mldsa65_public_key, body, bytes.fromhex(statement["signature"]))
    except (KeyError, TypeError, ValueError):  # UsageError is a ValueError too
        return False


_HEAD_KEYS = frozenset(("type", "node", "height", "hash", "timestamp_ms", "signature"))


def _is_u63(value: object) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def verify_inclusion_proof(
    proof: dict[str, Any], node_did: str, mldsa65_public_key: bytes | None = None
) -> bool:
    """True if ``proof`` (from ``BlockLog.inclusion_proof``) shows its record in a block
    signed by ``node_did``: the block verifies, its root and size match, and the RFC 6962
    audit path leads from the leaf to that root. A hybrid node's block needs its
    ``mldsa65_public_key``."""
    try:
        block = Block.from_bytes(bytes.fromhex(proof["block"]))
        leaf = bytes.fromhex(proof["leaf"])
        root = bytes.fromhex(proof["root"])
        path = [bytes.fromhex(p) for p in proof["proof"]]
        index, size = int(proof["index"]), int(proof["size"])
        if block.node_did != node_did or block.height != int(proof["height"]):
            return False
        if block.merkle_root != root or block.record_count != size:
            return False
        key = None
        if mldsa65_public_key is not None:
            key = HybridPublicKey(public_key_from_did(node_did), mldsa65_public_key)
        if block_signature_problem(block, node_did, key) is not None:
            return False
        Record.from_bytes(leaf)  # the leaf must be a record, not arbitrary data
        return bool(verify_inclusion(leaf, index, size, path, root))
    except (KeyError, TypeError, ValueError, MalformedFrameError):
        return False
