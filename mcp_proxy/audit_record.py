"""Audit records of the tunnel and the key they are committed under
(docs/PROTOCOL.md "MCP tunnel", Audit record; docs/adr/0009-mcp-judged-bytes-and-audit.md).

:class:`AuditRecord` is one event of a serve side; :func:`pack` puts a batch of
them into block-log records, as many events as fit sharing one (version 3,
docs/adr/0014-audit-batch-records.md), the RFC 8785 bodies stored (and
Merkle-hashed) in the block log. Parameters and
results enter a record only as HMAC-SHA256 under the home's :class:`AuditKey`
(32 random bytes, kept 0600), over their RFC 8785 form: whoever holds the key can
prove what was called, while a reader of the log cannot recover small arguments
by hashing guesses. :data:`Facts` is what the hot path queues instead of a
record (mcp_proxy/audit.py builds the records per batch).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple

import orjson

from talos_sdk.canonical import canonical_json_bytes
from talos_sdk.errors import EncodingError, UsageError

__all__ = [
    "AUDIT_KEY_FILE",
    "BATCH_VERSION",
    "INLINE_SLOW_LIMIT",
    "MAX_COMMITMENT",
    "MAX_EXTRA",
    "RECORD_KIND",
    "RECORD_VERSION",
    "AuditKey",
    "AuditRecord",
    "Event",
    "Facts",
    "HeavyDigestError",
    "Hmac256",
    "Packed",
    "pack",
]

RECORD_KIND: Final = "mcp"
RECORD_VERSION: Final = 2
#: A batch record: several events' entries in one block-log record.
BATCH_VERSION: Final = 3
AUDIT_KEY_FILE: Final = "proxy-audit.key"
# The block format's bounds (talos/chain/block.py MAX_COMMITMENT, MAX_EXTRA).
MAX_COMMITMENT = 4096
MAX_EXTRA = 4096
# A reason or name in a record is cut here: records must fit the block format.
MAX_TEXT = 256
# Integers up to 2**53 print the same in RFC 8785 and orjson (talos_sdk/canonical.py).
_SAFE_INT = 2**53


class Event(enum.StrEnum):
    """What an audit record is about (docs/PROTOCOL.md "MCP tunnel", Audit record)."""

    CALL = "call"
    REQUEST = "request"
    SESSION = "session"
    REFUSAL = "refusal"


#: An event's text in a commitment (a plain str: no enum property lookup per record).
_EVENT_TEXT: Final = {e: e.value for e in Event}


#: A number token orjson writes for a float ("1.0", "1e21"); also met inside strings
#: ("v1.2"), which only sends those values down the general path.
_FLOATISH: Final = re.compile(rb"[0-9][.eE]")
_FAST: Final = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER
#: JSON above this size that needs the general (pure-Python) encoder is not digested on
#: the event loop: 8 MB of floats took it 2.5 s (:class:`HeavyDigestError`).
INLINE_SLOW_LIMIT: Final = 16 * 1024


class HeavyDigestError(UsageError):
    """A value whose canonical form is long to compute, asked for with ``inline=True``."""


def _stable_json(value: Any, inline: bool = False) -> bytes:
    """RFC 8785 bytes (docs/DESIGN.md "Canonical encoding") so any JCS library recomputes them.

    First orjson with sorted keys, accepted when its output is provably JCS's
    (talos_sdk/canonical.py): integers within 53 bits (``OPT_STRICT_INTEGER``
    raises otherwise), no float (no digit followed by ``.`` or ``e``), ASCII only
    (so no key outside the BMP, whose order would differ). That check scans bytes
    in C instead of walking the value in Python: two digests per call, 1.3 -> 0.6 us
    each for a small tools/call. Anything else takes the general path. JSON-RPC may
    carry integers JCS cannot represent exactly (beyond 2**53); such a value falls
    back to sorted-key JSON rather than losing the audit record.
    """
    try:
        data = orjson.dumps(value, option=_FAST)
    except orjson.JSONEncodeError:
        pass
    else:
        if data.isascii() and _FLOATISH.search(data) is None:
            return data
        if inline and len(data) > INLINE_SLOW_LIMIT:
            raise HeavyDigestError
    try:
        return canonical_json_bytes(value)
    except EncodingError:
        try:
            return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # beyond 64 bits: only the stdlib encoder takes it
            return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


class Hmac256:
    """HMAC-SHA256 (RFC 2104) under one key, keyed once: each MAC copies two SHA-256 states.

    The same bytes as ``hmac.new(key, data, "sha256")``, in half its time here
    (3.3 us vs 5.7 us per 40-byte value on this machine: ``HMAC.copy`` duplicates
    an OpenSSL MAC context, a ``sha256`` copy is a memcpy of its state).
    """

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > 64:  # RFC 2104 section 2: a key longer than the block is hashed first
            key = hashlib.sha256(key).digest()
        block = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(block.translate(_IPAD))
        self._outer = hashlib.sha256(block.translate(_OPAD))

    def mac(self, data: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


_IPAD = bytes(b ^ 0x36 for b in range(256))
_OPAD = bytes(b ^ 0x5C for b in range(256))


class AuditKey:
    """The node's audit key: params and results are committed as HMAC-SHA256 under it."""

    __slots__ = ("_mac",)

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise UsageError("an audit key is 32 bytes")
        # Keyed once: no re-keying per digest.
        self._mac = Hmac256(key)

    @classmethod
    def generate(cls) -> AuditKey:
        return cls(secrets.token_bytes(32))

    @classmethod
    def load(cls, home: Path) -> AuditKey:
        """The key in ``home`` (``proxy-audit.key``, hex), created 0600 on first use."""
        path = home / AUDIT_KEY_FILE
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            key = secrets.token_bytes(32)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(key.hex() + "\n")
            tmp.replace(path)
            return cls(key)
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise UsageError(f"{path} does not hold a 64-hex-digit audit key") from None

    def digest(self, value: Any, inline: bool = False) -> bytes:
        """HMAC-SHA256 of a JSON value's canonical form; empty for an absent value.
        ``inline``: raise HeavyDigestError rather than take long (the event loop asks)."""
        if value is None:
            return b""
        return self._mac.mac(_stable_json(value, inline))


def _cut(text: str | None, keep: int = MAX_TEXT) -> str | None:
    return None if text is None else text[:keep]


class AuditRecord(NamedTuple):
    """One audited event (see the module docstring for events and outcomes).

    A named tuple rather than a frozen dataclass: records are built in batches
    (:meth:`Auditor.note`), and a frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field) cost 8.7 us a record here, a tuple 1 us.
    """

    caller: str
    server: str
    method: str
    tool: str | None
    request_id: int | str | None
    params_hmac: bytes
    result_hmac: bytes
    latency_us: int
    outcome: str
    timestamp_ms: int
    plaintext: bytes = b""
    event: Event = Event.CALL
    session: int = 0
    pid: int | None = None
    detail: str = ""

    def _encode(self, body: dict[str, Any], limit: int) -> bytes:
        """RFC 8785 of ``body``, names cut if it exceeds ``limit``.

        Its values are strings, small integers and null, for which orjson's output
        is JCS's (talos_sdk/canonical.py) without walking the value first; an id
        beyond 2**53 or a string orjson refuses takes the general path.
        """
        rid = self.request_id
        if type(rid) is not int or -_SAFE_INT <= rid <= _SAFE_INT:
            try:
                data = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
            except orjson.JSONEncodeError:  # a lone surrogate: the general path says so
                data = _stable_json(body)
        else:
            data = _stable_json(body)
        keep = MAX_TEXT
        while len(data) > limit and keep:
            # Only a pathological name gets here; keep the digests, cut the names.
            # A character may take 6 bytes escaped (a control character, a lone
            # surrogate), so names a caller chose can overflow even when cut to
            # MAX_TEXT: cut shorter until the record fits, or the block log would
            # refuse it and the whole batch, other callers' events too, be lost.
            body["server"] = _cut(self.server, keep)
            body["method"] = _cut(self.method, keep)
            body["tool"] = _cut(self.tool, keep)
            body["id"] = _cut(None if rid is None else str(rid), keep)
            body["detail"] = _cut(self.detail, keep)
            data = _stable_json(body)
            keep //= 2
        return data

    def _body(self) -> dict[str, Any]:
        """The fields a version 2 record and a batch entry share."""
        (_, server, method, tool, rid, params_hmac, result_hmac, latency_us, outcome, _,
         _, event, session, pid, detail) = self  # fmt: skip
        return {
            "detail": detail,
            "event": _EVENT_TEXT[event],
            "id": rid,
            "latency_us": latency_us,
            "method": method,
            "outcome": outcome,
            "params_hmac": params_hmac.hex(),
            "pid": pid,
            "result_hmac": result_hmac.hex(),
            "server": server,
            "session": session,
            "tool": tool,
        }

    def commitment(self) -> bytes:
        """The version 2 body: one record per event (kept for ``--audit-plaintext``)."""
        body = self._body()
        body["caller"] = self.caller
        body["v"] = RECORD_VERSION
        return self._encode(body, MAX_COMMITMENT)

    def entry(self) -> bytes:
        """This event's entry in a batch record (version 3): the v2 body with its own
        ``timestamp_ms``, without ``v`` and without ``caller``, which is the record's
        recipient (docs/adr/0014-audit-batch-records.md)."""
        body = self._body()
        body["timestamp_ms"] = self.timestamp_ms
        return self._encode(body, _ROOM)


class Packed(NamedTuple):
    """One block-log record of an audit batch: its recipient, commitment, time and extra."""

    recipient: str
    commitment: bytes
    timestamp_ms: int
    extra: bytes


_HEAD: Final = b'{"calls":['
_TAIL: Final = b'],"v":%d}' % BATCH_VERSION
#: Bytes a batch record's entries may fill (the commas between them included).
_ROOM: Final = MAX_COMMITMENT - len(_HEAD) - len(_TAIL)


def pack(records: Sequence[AuditRecord]) -> list[Packed]:
    """The block-log records of a batch (docs/adr/0014-audit-batch-records.md).

    Consecutive events of one caller share a version 3 record, as many as fit a
    commitment (4096 bytes, about ten calls), in order: ``{"calls":[entry,...],"v":3}``,
    RFC 8785 as a whole since each entry is. The record's recipient is that
    caller, its time the earliest event's. An event that carries plaintext keeps
    a version 2 record of its own (``extra`` is the event's).
    """
    out: list[Packed] = []
    chunk: list[bytes] = []
    size = 0
    caller = ""
    first_ms = 0
    for rec in records:
        if rec.plaintext:
            entry = b""
        else:
            entry = rec.entry()
            if chunk and caller == rec.caller and size + 1 + len(entry) <= _ROOM:
                chunk.append(entry)
                size += 1 + len(entry)
                first_ms = min(first_ms, rec.timestamp_ms)
                continue
        if chunk:
            out.append(Packed(caller, b"".join((_HEAD, b",".join(chunk), _TAIL)), first_ms, b""))
            chunk = []
        if entry:
            chunk, size, caller, first_ms = [entry], len(entry), rec.caller, rec.timestamp_ms
        else:
            out.append(
                Packed(rec.caller, rec.commitment(), rec.timestamp_ms, rec.plaintext[:MAX_EXTRA])
            )
    if chunk:
        out.append(Packed(caller, b"".join((_HEAD, b",".join(chunk), _TAIL)), first_ms, b""))
    return out


#: What :meth:`Auditor.note` queues on the hot path: an :class:`AuditRecord`'s
#: fields in its order, with the params and the result as parsed in place of
#: their digests (computed when the batch is built).
Facts = tuple[
    str, str, str, str | None, int | str | None, Any, Any, int, str, int, bytes,
    Event, int, int | None, str,
]  # fmt: skip
