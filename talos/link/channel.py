"""The sealed link channel: every frame after the handshake.

Specified in docs/PROTOCOL.md "Link protocol", Sealed frames.

Pure. One :class:`~talos_sdk.noise.CipherState` per direction from the Noise
handshake's Split. A sealed frame is exactly one WebSocket binary message::

    ChaCha20-Poly1305(k, nonce = 0x00000000 || LE64(n), ad = empty, link frame)

``n`` counts frames in that direction from 0 and is never sent: WebSocket
over TCP delivers in order, so a dropped, reordered, replayed, injected or
altered frame fails to open, and :meth:`LinkChannel.open` raises the opaque
:class:`~talos_sdk.errors.DecryptionError`; the link then closes. Both sides
Rekey a direction (Noise spec section 11.3) after :data:`REKEY_FRAMES` frames
or :data:`REKEY_BYTES` plaintext bytes, whichever comes first, counted
identically on both ends, so no message announces it.
"""

from __future__ import annotations

from typing import Final

from talos_sdk.noise import TAGLEN, CipherState

__all__ = ["REKEY_BYTES", "REKEY_FRAMES", "TAGLEN", "LinkChannel"]

#: Frames per direction between rekeys.
REKEY_FRAMES: Final = 1 << 20
#: Plaintext bytes per direction between rekeys (1 GiB).
REKEY_BYTES: Final = 1 << 30


class _Direction:
    __slots__ = ("bytes_left", "cipher", "frames_left")

    def __init__(self, cipher: CipherState) -> None:
        self.cipher = cipher
        self.frames_left = REKEY_FRAMES
        self.bytes_left = REKEY_BYTES

    def count(self, size: int, frames: int, limit: int) -> None:
        self.frames_left -= 1
        self.bytes_left -= size
        if self.frames_left <= 0 or self.bytes_left <= 0:
            self.cipher.rekey()
            self.frames_left = frames
            self.bytes_left = limit


class LinkChannel:
    """Seal and open link frames with per-direction keys and counters."""

    __slots__ = ("_frames", "_limit", "_recv", "_send")

    def __init__(
        self,
        send: CipherState,
        recv: CipherState,
        *,
        rekey_frames: int = REKEY_FRAMES,
        rekey_bytes: int = REKEY_BYTES,
    ) -> None:
        self._send = _Direction(send)
        self._recv = _Direction(recv)
        self._frames = rekey_frames
        self._limit = rekey_bytes
        for d in (self._send, self._recv):
            d.frames_left, d.bytes_left = rekey_frames, rekey_bytes

    def seal(self, frame: bytes) -> bytes:
        """The sealed form of one plaintext link frame (call in wire order)."""
        d = self._send
        out = d.cipher.encrypt_with_ad(b"", frame)
        d.count(len(frame), self._frames, self._limit)
        return out

    def open(self, data: bytes) -> bytes:
        """The plaintext link frame; DecryptionError if it is not the next sealed frame."""
        d = self._recv
        frame = d.cipher.decrypt_with_ad(b"", data)
        d.count(len(frame), self._frames, self._limit)
        return frame

    @property
    def frames_sent(self) -> int:
        return self._send.cipher.n

    @property
    def frames_received(self) -> int:
        return self._recv.cipher.n
