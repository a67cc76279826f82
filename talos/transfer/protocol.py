"""File transfer protocol, pure and sans-I/O (docs/PROTOCOL.md "File transfer").

Everything here is deterministic given its inputs: the control messages that
travel on the ratchet-sealed app channel ``"file"``, the bulk-path handshake
and frame headers, the chunk-stream bookkeeping that says which chunk is legal
next, the transfer state machine (as a transition table, in the style of h11),
and the file-name sanitiser. The asyncio code in :mod:`talos.transfer.bulk` and
:mod:`talos.transfer.manager` only moves bytes and waits.

Keys: the sender draws a random 32-byte *transfer key* and sends it inside the
OFFER, which the node seals with the peers' Double Ratchet session, so only
the peer holding that session learns it. Each sending *attempt* (epoch) seals
its chunks with a fresh key ``derive_stream_key(transfer_key, label)`` where
the label binds transfer id, epoch and start offset, so a resumed attempt
never reuses a (key, nonce) pair even if the source file changed.
"""

from __future__ import annotations

import enum
import hmac
import struct
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from talos_sdk.binfmt import ByteReader, pack_u8, pack_u16, pack_u32, pack_u64, pack_var16
from talos_sdk.errors import MalformedFrameError, OversizeError, ProtocolError, UsageError

__all__ = [
    "APP_NAME",
    "BULK_CHUNK",
    "COMMIT_LEN",
    "FALLBACK_CHUNK",
    "TID_LEN",
    "Accept",
    "Cancel",
    "Chunk",
    "ChunkPlan",
    "Credit",
    "Done",
    "Failed",
    "Offer",
    "Pending",
    "Reject",
    "TransferMessage",
    "TransferProtocolError",
    "TransferState",
    "bind_token",
    "bulk_client_proof",
    "bulk_server_proof",
    "decode_commit",
    "decode_message",
    "encode_commit",
    "encode_message",
    "file_commitment",
    "next_state",
    "numbered_name",
    "safe_name",
    "stream_label",
]

APP_NAME: Final = "file"
TID_LEN: Final = 16
KEY_LEN: Final = 32
TOKEN_LEN: Final = 32
NONCE_LEN: Final = 32
#: Bulk path writes 1 MiB sealed chunks (docs/adr/0004-bulk-transfer-path.md: large writes).
BULK_CHUNK: Final = 1 << 20
#: App-channel fallback keeps each sealed chunk well under the link frame bound.
FALLBACK_CHUNK: Final = 256 << 10
#: Largest chunk a receiver accepts, whatever path it came over.
MAX_CHUNK: Final = BULK_CHUNK
#: Bound on a sanitised name, in UTF-8 bytes (ext4/NTFS limit 255, room for " (n)").
MAX_NAME_BYTES: Final = 200
MAX_REASON: Final = 512
MAX_MESSAGE: Final = FALLBACK_CHUNK + 4096

BULK_MAGIC: Final = b"TLSB\x01"


class TransferProtocolError(ProtocolError):
    """The peer broke the file-transfer protocol (bad size, extra chunk, ...)."""


# --------------------------------------------------------------------------- messages

T_OFFER: Final = 1
T_ACCEPT: Final = 2
T_PENDING: Final = 3
T_REJECT: Final = 4
T_DONE: Final = 5
T_FAILED: Final = 6
T_CHUNK: Final = 7
T_CREDIT: Final = 8
T_CANCEL: Final = 9

#: The fallback's per-chunk header, unpacked in one step (its tail is the sealed chunk).
_CHUNK = struct.Struct(">B16sIQ")


@dataclass(frozen=True, slots=True)
class Offer:
    """Sender -> receiver: "may I send you this file?" (re-sent to ask where to resume).

    No digest: the sender hashes while it streams and commits to the SHA-256
    in the stream's final chunk (:func:`encode_commit`), so no byte waits for
    a hashing pass over the whole file.
    """

    tid: bytes
    size: int
    key: bytes
    name: str


@dataclass(frozen=True, slots=True)
class Accept:
    """Receiver -> sender: start attempt ``epoch`` at byte ``offset``.

    ``window`` is the initial credit in chunks. ``bulk_port`` 0 means "no bulk
    listener, use the app channel"; otherwise the sender connects to ``bulk_port``
    at the address of its direct link with the receiver and proves ``token``
    (one-time, bound to this tid). ``bulk_host`` is carried but not dialled.
    """

    tid: bytes
    offset: int
    epoch: int
    window: int
    bulk_port: int
    token: bytes
    bulk_host: str


@dataclass(frozen=True, slots=True)
class Pending:
    """Receiver -> sender: the offer waits for a local ``talosd files accept``."""

    tid: bytes


@dataclass(frozen=True, slots=True)
class Reject:
    """Receiver -> sender: refused for good (policy, quota, disk)."""

    tid: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Done:
    """Receiver -> sender: whole file verified, fsync'd and visible."""

    tid: bytes


@dataclass(frozen=True, slots=True)
class Failed:
    """Either side: this attempt failed; the transfer may be offered again."""

    tid: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Cancel:
    """Either side: stop and forget this transfer."""

    tid: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Chunk:
    """Sender -> receiver on the app-channel fallback: one sealed chunk."""

    tid: bytes
    epoch: int
    index: int
    sealed: bytes


@dataclass(frozen=True, slots=True)
class Credit:
    """Receiver -> sender on the fallback: chunks with index < ``upto`` may be sent."""

    tid: bytes
    epoch: int
    upto: int


TransferMessage = Offer | Accept | Pending | Reject | Done | Failed | Cancel | Chunk | Credit


def _check_tid(tid: bytes) -> None:
    if len(tid) != TID_LEN:
        raise UsageError(f"transfer id must be {TID_LEN} bytes")


def _text(value: str, bound: int) -> bytes:
    return pack_var16(value.encode("utf-8", "replace")[:bound])


def encode_message(msg: TransferMessage) -> bytes:
    """Binary form: a type byte, the 16-byte transfer id, fixed fields, a tail."""
    _check_tid(msg.tid)
    if isinstance(msg, Chunk):
        return _CHUNK.pack(T_CHUNK, msg.tid, msg.epoch, msg.index) + msg.sealed
    if isinstance(msg, Offer):
        if len(msg.key) != KEY_LEN:
            raise UsageError("offer needs a 32-byte key")
        body = [pack_u64(msg.size), msg.key, _text(msg.name, 1024)]
    elif isinstance(msg, Accept):
        token = msg.token if msg.bulk_port else bytes(TOKEN_LEN)
        if len(token) != TOKEN_LEN:
            raise UsageError("bulk token must be 32 bytes")
        body = [
            pack_u64(msg.offset),
            pack_u32(msg.epoch),
            pack_u32(msg.window),
            pack_u16(msg.bulk_port),
            token,
            _text(msg.bulk_host, 255),
        ]
    elif isinstance(msg, Pending | Done):
        body = []
    elif isinstance(msg, Reject | Failed | Cancel):
        body = [_text(msg.reason, MAX_REASON)]
    elif isinstance(msg, Credit):
        body = [pack_u32(msg.epoch), pack_u64(msg.upto)]
    else:
        raise UsageError(f"not a transfer message: {type(msg).__name__}")
    return b"".join([pack_u8(_TYPES[type(msg)]), msg.tid, *body])


#: How each control message's fields follow its type byte and transfer id.
_PARSERS: dict[int, Callable[[bytes, ByteReader], TransferMessage]] = {
    T_OFFER: lambda tid, r: Offer(tid, r.u64(), r.take(KEY_LEN), r.text16()),
    T_ACCEPT: lambda tid, r: Accept(
        tid, r.u64(), r.u32(), r.u32(), r.u16(), r.take(TOKEN_LEN), r.text16()
    ),
    T_PENDING: lambda tid, r: Pending(tid),
    T_REJECT: lambda tid, r: Reject(tid, r.text16()),
    T_DONE: lambda tid, r: Done(tid),
    T_FAILED: lambda tid, r: Failed(tid, r.text16()),
    T_CREDIT: lambda tid, r: Credit(tid, r.u32(), r.u64()),
    T_CANCEL: lambda tid, r: Cancel(tid, r.text16()),
}
_TYPES: dict[type, int] = {
    Offer: T_OFFER,
    Accept: T_ACCEPT,
    Pending: T_PENDING,
    Reject: T_REJECT,
    Done: T_DONE,
    Failed: T_FAILED,
    Credit: T_CREDIT,
    Cancel: T_CANCEL,
}


def decode_message(data: bytes) -> TransferMessage:
    """Parse one app-channel payload; :class:`MalformedFrameError` on anything else."""
    if len(data) > MAX_MESSAGE:
        raise OversizeError(f"transfer message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    if len(data) < 1 + TID_LEN:
        raise MalformedFrameError("transfer message too short")
    kind = data[0]
    if kind == T_CHUNK:  # the fallback's data: one unpack, the sealed tail sliced once
        if len(data) < _CHUNK.size:
            raise MalformedFrameError("transfer chunk message truncated")
        _, tid, epoch, index = _CHUNK.unpack_from(data)
        return Chunk(tid, epoch, index, data[_CHUNK.size :])
    parse = _PARSERS.get(kind)
    if parse is None:
        raise MalformedFrameError(f"unknown transfer message type {kind}")
    reader = ByteReader(data, f"transfer message type {kind}")
    reader.take(1)
    msg = parse(reader.take(TID_LEN), reader)
    reader.end()
    return msg


# --------------------------------------------------------------------------- chunk plan


#: Plaintext of the final (commit) chunk: the whole-file SHA-256 || the sender's signature.
COMMIT_LEN: Final = 32 + 64


def encode_commit(sha256: bytes, signature: bytes) -> bytes:
    """Plaintext of the commit chunk that ends every attempt's sealed stream."""
    if len(sha256) != 32 or len(signature) != 64:
        raise UsageError("commit needs a 32-byte sha256 and a 64-byte signature")
    return sha256 + signature


def decode_commit(plain: bytes | memoryview) -> tuple[bytes, bytes]:
    """``(sha256, signature)`` from a commit chunk's plaintext."""
    if len(plain) != COMMIT_LEN:
        raise TransferProtocolError(f"commit chunk of {len(plain)} bytes, expected {COMMIT_LEN}")
    raw = bytes(plain)
    return raw[:32], raw[32:]


@dataclass(slots=True)
class ChunkPlan:
    """Receiver-side bookkeeping of one attempt: which sealed chunk may come next.

    An attempt's stream is data chunks covering ``[offset, size)`` followed by
    one *commit* chunk (sealed with the AEAD ``final`` flag) whose plaintext is
    :func:`encode_commit`. Data chunk lengths are the sender's choice (bulk
    1 MiB, fallback 256 KiB) but each is non-empty and at most
    :data:`MAX_CHUNK`; the commit may only come once the data reached the
    announced size. A sender that lies about the size fails here, not on disk.
    """

    size: int
    offset: int
    index: int = 0
    finished: bool = False

    def accept(self, length: int, final: bool) -> int:
        """Check the next chunk; returns the file offset a data chunk is written at."""
        if self.finished:
            raise TransferProtocolError("chunk after the final chunk")
        if length > MAX_CHUNK:
            raise OversizeError(f"chunk of {length} bytes exceeds {MAX_CHUNK}")
        at = self.offset
        self.index += 1
        if final:
            if at != self.size:
                raise TransferProtocolError(
                    f"stream ended at {at} bytes, the offer said {self.size}"
                )
            if length != COMMIT_LEN:
                raise TransferProtocolError(
                    f"commit chunk of {length} bytes, expected {COMMIT_LEN}"
                )
            self.finished = True
            return at
        end = at + length
        if end > self.size:
            raise TransferProtocolError(
                f"sender sent more than the announced size ({end} > {self.size} bytes)"
            )
        if length == 0:
            raise TransferProtocolError("empty data chunk")
        self.offset = end
        return at


def file_commitment(tid: bytes, sha256: bytes, size: int, sender: str, recipient: str) -> bytes:
    """The bytes the sender signs for a file (kept in both block-log records)."""
    parties = sender.encode() + b"\x00" + recipient.encode()
    return b"talos/file/v1" + tid + sha256 + struct.pack(">Q", size) + parties


def stream_label(tid: bytes, epoch: int, offset: int) -> bytes:
    """HKDF label of one attempt's stream key (binds transfer, attempt, start)."""
    return b"talos/file/v1" + tid + struct.pack(">IQ", epoch, offset)


# --------------------------------------------------------------------------- bulk handshake

#: client -> server: magic, tid, client nonce.
BULK_HELLO = struct.Struct(">5s16s32s")
#: server -> client: server nonce, server proof.
BULK_REPLY = struct.Struct(">32s32s")
#: client -> server: client proof (the token is one-time per attempt, so it names the epoch).
BULK_PROOF = struct.Struct(">32s")
#: sender -> receiver per chunk: sealed length.
BULK_FRAME = struct.Struct(">I")
#: receiver -> sender credit: chunks below this index may be sent.
BULK_CREDIT = struct.Struct(">Q")
#: credit values that end a bulk stream instead: verified / failed.
BULK_VERIFIED: Final = 2**64 - 1
BULK_FAILED: Final = 2**64 - 2


def _proof(role: bytes, token: bytes, tid: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.digest(token, b"talos/bulk/v1/" + role + tid + nc + ns, "sha256")


def bind_token(token: bytes, binding: bytes) -> bytes:
    """The token both bulk proofs use: the ACCEPT's token bound to the link's handshake hash.

    A token learnt any other way than over that very link (or after it was
    replaced) proves nothing; the transfer then falls back to the app channel.
    """
    return hmac.digest(token, b"talos/bulk/v1/binding" + binding, "sha256")


def bulk_server_proof(token: bytes, tid: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 the receiver proves the one-time token with."""
    return _proof(b"server", token, tid, client_nonce, server_nonce)


def bulk_client_proof(token: bytes, tid: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 the sender proves the one-time token with."""
    return _proof(b"client", token, tid, client_nonce, server_nonce)


# --------------------------------------------------------------------------- states


class TransferState(enum.StrEnum):
    """Where a transfer is; persisted as its string value."""

    OFFERED = "offered"  # out: offer sent, no reply yet
    PENDING = "pending"  # waiting for the receiving user to accept
    ACTIVE = "active"  # bytes flowing (or about to resume)
    COMPLETE = "complete"  # receiver verified the SHA-256; file visible
    FAILED = "failed"  # gave up (protocol error, hash mismatch, disk full)
    REJECTED = "rejected"  # policy or quota said no
    CANCELLED = "cancelled"


class Event(enum.StrEnum):
    """What can happen to a transfer."""

    HOLD = "hold"
    ACCEPT = "accept"
    DONE = "done"
    FAIL = "fail"
    REJECT = "reject"
    CANCEL = "cancel"


S, E = TransferState, Event
_FINAL = {S.COMPLETE, S.FAILED, S.REJECTED, S.CANCELLED}
_TRANSITIONS: dict[tuple[TransferState, Event], TransferState] = {
    (S.OFFERED, E.HOLD): S.PENDING,
    (S.OFFERED, E.ACCEPT): S.ACTIVE,
    (S.OFFERED, E.REJECT): S.REJECTED,
    (S.OFFERED, E.FAIL): S.FAILED,  # e.g. the source cannot be read, quota, a bad offer
    (S.PENDING, E.ACCEPT): S.ACTIVE,
    (S.PENDING, E.REJECT): S.REJECTED,
    (S.PENDING, E.HOLD): S.PENDING,
    (S.PENDING, E.FAIL): S.FAILED,
    (S.ACTIVE, E.ACCEPT): S.ACTIVE,  # resume: a new attempt
    (S.ACTIVE, E.DONE): S.COMPLETE,
    (S.ACTIVE, E.FAIL): S.FAILED,
    (S.ACTIVE, E.REJECT): S.REJECTED,
    (S.COMPLETE, E.DONE): S.COMPLETE,  # duplicate DONE after a resume race
    **{(s, E.CANCEL): S.CANCELLED for s in (S.OFFERED, S.PENDING, S.ACTIVE)},
}


def next_state(state: TransferState, event: Event) -> TransferState:
    """The state after ``event``; :class:`TransferProtocolError` if not allowed."""
    try:
        return _TRANSITIONS[(state, event)]
    except KeyError:
        raise TransferProtocolError(
            f"{event.value!r} not allowed in state {state.value!r}"
        ) from None


def is_final(state: TransferState) -> bool:
    """True once nothing more will happen to the transfer."""
    return state in _FINAL


# --------------------------------------------------------------------------- names

_RESERVED = {"CON", "PRN", "AUX", "NUL", "CLOCK$", "CONIN$", "CONOUT$"}
_RESERVED |= {f"{p}{i}" for p in ("COM", "LPT") for i in range(10)}
_FORBIDDEN = set('<>:"|?*\\/')


def _clip_utf8(text: str, limit: int) -> str:
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", "ignore")


def safe_name(raw: str) -> str:
    """A file name the sender proposes, made safe to create in the files dir.

    Keeps only the last path component (both ``/`` and ``\\``), drops control
    and format characters (incl. bidi overrides and NUL), replaces characters
    Windows forbids, strips leading dots (no hidden files, no ``..``) and
    trailing dots/spaces, renames device names (``CON``, ``NUL.txt``), bounds
    the length to :data:`MAX_NAME_BYTES` keeping the extension, and never
    returns an empty string.
    """
    text = unicodedata.normalize("NFC", raw.replace("\\", "/")).split("/")
    base = next((p for p in reversed(text) if p.strip(". ")), "")
    cleaned = "".join(
        "_" if ch in _FORBIDDEN else ch
        for ch in base
        if unicodedata.category(ch)[0] != "C" and ch not in "\u2028\u2029"
    )
    cleaned = _trimmed(cleaned)  # ". .x": one pass would leave a dot behind the space
    if not cleaned:
        return "file"
    stem, dot, ext = cleaned.rpartition(".")
    if not dot:
        stem, ext = cleaned, ""
    device = stem.split(".")[0].rstrip(" ").upper()  # Windows ignores the spaces: "CON .x"
    if device in _RESERVED or (not dot and cleaned.upper() in _RESERVED):
        stem = "_" + stem
    ext = _clip_utf8(ext, 20) if dot else ""
    suffix = f".{ext}" if dot and ext else ""
    stem = _clip_utf8(stem, MAX_NAME_BYTES - len(suffix.encode()))
    # A clip may end on a space or a dot (an extension "x\u3000y" cut after its space).
    return _trimmed((stem.rstrip(". ") or "file") + suffix) or "file"


def _trimmed(name: str) -> str:
    """``name`` without white space at either end, dots at its start or dots and
    spaces at its end, repeated until none is left (one pass can uncover more)."""
    trimmed = None
    while trimmed != name:
        trimmed, name = name, name.strip().lstrip(".").rstrip(". ")
    return name


def numbered_name(name: str, n: int) -> str:
    """``name`` for the n-th collision: ``report (2).pdf``; n=0 is ``name`` itself."""
    if n == 0:
        return name
    stem, dot, ext = name.rpartition(".")
    if not dot or not stem:
        return f"{name} ({n})"
    return f"{stem} ({n}).{ext}"
