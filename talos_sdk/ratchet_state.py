"""The persisted form of a Double Ratchet session (docs/PROTOCOL.md "Double Ratchet").

Pure codecs between a session's state (a dict of its fields plus its skipped
message keys) and the two stored forms: compact binary (magic ``TDRS\\x01``,
then each field length-prefixed) and JSON-safe (bytes as hex, ``version`` 1).
:class:`talos_sdk.ratchet.Session` builds and checks the session itself; the
decoders here only take the bytes apart and raise on truncation or garbage.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from talos_sdk.binfmt import ByteReader
from talos_sdk.errors import EncodingError

__all__ = ["Skipped", "state_from_bytes", "state_from_dict", "state_to_bytes", "state_to_dict"]

#: Skipped message keys by (peer ratchet public key, message number).
Skipped = dict[tuple[bytes, int], bytes]

_STATE_MAGIC = b"TDRS\x01"
_U32 = struct.Struct(">I")
_COUNTERS = struct.Struct(">IIII?")
_SKIPPED = struct.Struct(">32sI32s")
_TEXT_FIELDS = ("suite", "local_did", "peer_did")
_INT_FIELDS = ("ns", "nr", "pn", "ratchet_every")
_BYTES_FIELDS = (
    "peer_signing_key",
    "peer_identity_dh",
    "ad",
    "rk",
    "dhs_priv",
    "dhs_pub",
    "dhr",
    "cks",
    "ckr",
    "initial",
    "first_dh",
)


def state_to_bytes(s: Mapping[str, Any], skipped: Skipped) -> bytes:
    """The compact binary form."""
    out = [_STATE_MAGIC]
    for k in _TEXT_FIELDS:
        raw = s[k].encode()
        out.append(struct.pack(">H", len(raw)) + raw)
    for k in _BYTES_FIELDS:
        v = s[k]
        out.append(b"\xff\xff" if v is None else struct.pack(">H", len(v)) + v)
    out.append(_COUNTERS.pack(s["ns"], s["nr"], s["pn"], s["ratchet_every"], s["pending"]))
    out.append(_U32.pack(len(skipped)))
    out += [_SKIPPED.pack(dh, n, mk) for (dh, n), mk in skipped.items()]
    return b"".join(out)


def state_from_bytes(data: bytes) -> tuple[dict[str, Any], Skipped]:
    """Inverse of :func:`state_to_bytes`; truncation raises MalformedFrameError."""
    r = ByteReader(data, "session state")
    if r.take(len(_STATE_MAGIC)) != _STATE_MAGIC:
        raise EncodingError("session state: bad magic")
    s: dict[str, Any] = {k: r.text16() for k in _TEXT_FIELDS}
    for k in _BYTES_FIELDS:
        n = r.u16()
        s[k] = None if n == 0xFFFF else r.take(n)
    s["ns"], s["nr"], s["pn"], s["ratchet_every"], s["pending"] = _COUNTERS.unpack(
        r.take(_COUNTERS.size)
    )
    skipped: Skipped = {}
    for _ in range(r.u32()):
        dh, n, mk = _SKIPPED.unpack(r.take(_SKIPPED.size))
        skipped[(dh, n)] = mk
    r.end()
    return s, skipped


def state_to_dict(s: Mapping[str, Any], skipped: Skipped) -> dict[str, Any]:
    """The JSON-safe form (bytes as hex)."""
    d = {k: v.hex() if isinstance(v, bytes) else v for k, v in s.items()}
    d["version"] = 1
    d["skipped"] = [[dh.hex(), n, mk.hex()] for (dh, n), mk in skipped.items()]
    return d


def state_from_dict(d: Mapping[str, Any]) -> tuple[dict[str, Any], Skipped]:
    """Inverse of :func:`state_to_dict`; wrong types raise KeyError/TypeError/ValueError."""
    if d["version"] != 1:
        raise EncodingError("session state: unknown version")

    def b(key: str) -> bytes | None:
        v = d[key]
        return None if v is None else bytes.fromhex(v)

    skipped = {(bytes.fromhex(h), int(n)): bytes.fromhex(m) for h, n, m in d["skipped"]}
    s: dict[str, Any] = (
        {k: b(k) for k in _BYTES_FIELDS}
        | {k: d[k] for k in _TEXT_FIELDS}
        | {k: int(d[k]) for k in _INT_FIELDS}
        | {"pending": bool(d["pending"])}
    )
    # The counters go into u32 header fields, as in the binary form (state_from_bytes).
    for key in ("ns", "nr", "pn"):
        if not 0 <= s[key] <= 0xFFFFFFFF:
            raise EncodingError(f"session state: {key} {s[key]} out of range")
    if any(not 0 <= n <= 0xFFFFFFFF for _, n in skipped):
        raise EncodingError("session state: a skipped message number is out of range")
    return s, skipped
