"""Sending side of a file transfer: reading and sealing chunks (docs/PROTOCOL.md "File transfer").

Synchronous; the asyncio layer runs :meth:`OutgoingAttempt.next_sealed` in a
worker thread so the next chunk is read and sealed while the previous one is
on the socket. Memory stays at a couple of chunks whatever the file size.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Final

from talos.transfer.protocol import TransferProtocolError, stream_label
from talos_sdk.aead import StreamSealer, derive_stream_key
from talos_sdk.errors import UsageError

__all__ = ["OutgoingAttempt", "SourceChangedError", "hash_file"]

_HASH_BLOCK: Final = 4 << 20


class SourceChangedError(TransferProtocolError):
    """The file being sent changed size or content since it was offered."""


def hash_file(path: Path) -> tuple[int, bytes]:
    """Size and SHA-256 of a regular file, read in bounded blocks."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path} is not a regular file")
        digest = hashlib.sha256()
        size = 0
        while block := os.read(fd, _HASH_BLOCK):
            digest.update(block)
            size += len(block)
        return size, digest.digest()
    finally:
        os.close(fd)


class OutgoingAttempt:
    """Read ``[offset, size)`` of a file in chunks and seal them for one attempt (epoch)."""

    def __init__(
        self, path: Path, size: int, key: bytes, tid: bytes, epoch: int, offset: int, chunk: int
    ) -> None:
        if not 0 <= offset <= size or chunk <= 0:
            raise UsageError("bad offset or chunk size")
        label = stream_label(tid, epoch, offset)
        self._sealer = StreamSealer(derive_stream_key(key, label), label)
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        if os.fstat(self._fd).st_size != size:
            os.close(self._fd)
            raise SourceChangedError(f"{path} changed size since it was offered")
        self.size = size
        self.offset = offset
        self.chunk = chunk

    @property
    def finished(self) -> bool:
        """True once the final chunk was sealed."""
        return self._sealer.finished

    @property
    def index(self) -> int:
        """Index (within this attempt) of the next chunk."""
        return self._sealer.counter

    def next_sealed(self) -> bytes:
        """Read and seal the next chunk (the last one carries the final flag)."""
        want = min(self.chunk, self.size - self.offset)
        data = os.pread(self._fd, want, self.offset) if want else b""
        if len(data) != want:
            raise SourceChangedError("source file shrank while it was being sent")
        self.offset += want
        return self._sealer.seal(data, final=self.offset == self.size)

    def close(self) -> None:
        """Release the file descriptor."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
