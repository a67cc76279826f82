"""Sending side of a file transfer: reading, hashing and sealing chunks.

docs/PROTOCOL.md "File transfer". Synchronous; the bulk path runs the three
steps of :class:`OutgoingAttempt` (:meth:`~OutgoingAttempt.read`,
:meth:`~OutgoingAttempt.hash`, :meth:`~OutgoingAttempt.seal`) as stages of a
:class:`~talos.transfer.pipeline.Pipeline`, each in its own thread over a ring
of reused buffers, so no page is freshly allocated per chunk and memory stays
at a few chunks whatever the file size; the app-channel fallback runs them one
after the other (:meth:`~OutgoingAttempt.seal_next_into`). The stream ends
with a commit chunk carrying the SHA-256 and the sender's signature over
:func:`~talos.transfer.protocol.file_commitment`.

The digest must cover the whole file. An attempt from offset 0 hashes the
bytes it seals, in the same pass. A resumed attempt cannot (SHA-256 state
cannot be rebuilt from a digest of the prefix), so a second thread hashes the
whole file from its own descriptor concurrently with the stream; the commit
waits for it. If the file changed between the two reads the receiver's
hash check fails the transfer, which is the safe outcome.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

from talos.transfer.pipeline import Slot, Stage, aligned_buffer
from talos.transfer.protocol import COMMIT_LEN, TransferProtocolError, encode_commit, stream_label
from talos_sdk.aead import CHUNK_HEADER_SIZE, TAG_SIZE, StreamSealer, derive_stream_key
from talos_sdk.errors import UsageError

__all__ = ["OutgoingAttempt", "SourceChangedError", "file_size", "hash_fd"]

_HASH_BLOCK: Final = 4 << 20

#: ``sign(sha256) -> signature`` over the file commitment; may persist the pair first.
Signer = Callable[[bytes], bytes]


class SourceChangedError(TransferProtocolError):
    """The file being sent changed size or content since it was offered."""


def file_size(path: Path) -> int:
    """Size of a regular file (:class:`UsageError` for anything else)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path} is not a regular file")
    return st.st_size


def hash_fd(fd: int, name: str, stop: threading.Event | None = None) -> tuple[int, bytes]:
    """Size and SHA-256 of the regular file open as ``fd`` (``name``: for errors), read in
    bounded blocks by position (its file offset is not moved, so ``fd`` may share it
    with a reader); ``stop`` aborts early."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise UsageError(f"{name} is not a regular file")
    digest = hashlib.sha256()
    size = 0
    block = bytearray(_HASH_BLOCK)
    view = memoryview(block)
    while not (stop is not None and stop.is_set()):
        n = os.preadv(fd, [block], size)
        if not n:
            break
        digest.update(view[:n])
        size += n
    return size, digest.digest()


class _WholeFileHash:
    """SHA-256 of the whole file computed in a background thread (resumed attempts), from
    the attempt's own open file: reopened by name, it could be another file by then."""

    def __init__(self, fd: int, name: str) -> None:
        self._stop = threading.Event()
        self._result: tuple[int, bytes] | None = None
        self._error: BaseException | None = None
        fd = os.dup(fd)
        self._thread = threading.Thread(target=self._run, args=(fd, name), daemon=True)
        self._thread.start()

    def _run(self, fd: int, name: str) -> None:
        try:
            self._result = hash_fd(fd, name, self._stop)
        except BaseException as exc:  # handed to the thread that needs the digest
            self._error = exc
        finally:
            os.close(fd)

    def result(self) -> tuple[int, bytes]:
        self._thread.join()
        if self._error is not None:
            raise SourceChangedError(f"cannot hash the source: {self._error}")
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        self._stop.set()
        self._thread.join()


class OutgoingAttempt:
    """Read ``[offset, size)`` of a file in chunks and seal them for one attempt (epoch).

    :attr:`stages` are the per-chunk steps in order; each keeps its own
    position, so the three may run in three threads as long as every slot
    passes them in the same order.
    """

    def __init__(
        self,
        path: Path,
        size: int,
        key: bytes,
        tid: bytes,
        epoch: int,
        offset: int,
        chunk: int,
        sign: Signer,
    ) -> None:
        if not 0 <= offset <= size or chunk <= 0:
            raise UsageError("bad offset or chunk size")
        label = stream_label(tid, epoch, offset)
        self._sealer = StreamSealer(derive_stream_key(key, label), label)
        # Non-blocking: a FIFO put in the file's place would block this open, on the loop,
        # until a writer came; regular files ignore the flag.
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            os.close(self._fd)
            raise SourceChangedError(f"{path} changed since it was offered (size or type)")
        # Read-ahead for a front-to-back read; harmless where unsupported.
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(self._fd, offset, size - offset, os.POSIX_FADV_SEQUENTIAL)
        self.size = size
        self.offset = offset
        self.chunk = chunk
        self._sign = sign
        self._plain: memoryview | None = None  # the fallback's buffer, made on first use
        self._hash = hashlib.sha256() if offset == 0 else None
        self._whole = None if offset == 0 else _WholeFileHash(self._fd, str(path))
        self._read_done = False
        self.digest = b""

    @property
    def sealed_max(self) -> int:
        """Smallest sealed buffer a slot needs."""
        return max(self.chunk, COMMIT_LEN) + CHUNK_HEADER_SIZE + TAG_SIZE

    @property
    def plain_max(self) -> int:
        """Smallest plaintext buffer a slot needs."""
        return max(self.chunk, COMMIT_LEN)

    @property
    def finished(self) -> bool:
        """True once the commit chunk was sealed."""
        return self._sealer.finished

    @property
    def index(self) -> int:
        """Index (within this attempt) of the next chunk to seal."""
        return self._sealer.counter

    @property
    def stages(self) -> tuple[Stage, Stage, Stage]:
        """``read``, ``hash``, ``seal``: what one chunk goes through, in order."""
        return (self.read, self.hash, self.seal)

    def read(self, slot: Slot) -> None:
        """Stage 1: the next data chunk into ``slot.plain``; after the data, mark the
        commit slot (``last``) whose plaintext :meth:`hash` writes."""
        if self._read_done:
            raise UsageError("stream already read to its end")
        want = min(self.chunk, self.size - self.offset)
        slot.offset = self.offset
        if want == 0:
            self._read_done = True
            slot.size = 0
            slot.last = True
            return
        view = slot.plain[:want]
        got = 0
        while got < want:
            n = os.preadv(self._fd, [view[got:]], self.offset + got)
            if n == 0:
                raise SourceChangedError("source file shrank while it was being sent")
            got += n
        self.offset += want
        slot.size = want

    def hash(self, slot: Slot) -> None:
        """Stage 2: feed the whole-file SHA-256; the commit slot gets the commit plaintext."""
        if slot.last:
            slot.plain[:COMMIT_LEN] = self._commit()
            slot.size = COMMIT_LEN
        elif self._hash is not None:
            self._hash.update(slot.plain[: slot.size])

    def seal(self, slot: Slot) -> None:
        """Stage 3: seal ``slot.plain`` into ``slot.sealed`` (the commit with the final flag)."""
        slot.sealed_size = self._sealer.seal_into(
            slot.plain[: slot.size], slot.sealed, final=slot.last
        )

    def slots(self, count: int) -> list[Slot]:
        """A ring of ``count`` slots sized for this attempt."""
        return Slot.ring(count, self.plain_max, self.sealed_max)

    def seal_next_into(self, buf: bytearray | memoryview) -> int:
        """Read, hash and seal the next chunk into ``buf``; returns the sealed length.

        Data chunks until ``size``, then the final commit chunk.
        """
        if self._plain is None:
            self._plain = aligned_buffer(self.plain_max)
        slot = Slot(self._plain, memoryview(buf))
        for stage in self.stages:
            stage(slot)
        return slot.sealed_size

    def next_sealed(self) -> bytes:
        """:meth:`seal_next_into` into a fresh buffer (the app-channel fallback's path)."""
        buf = bytearray(self.sealed_max)
        return bytes(memoryview(buf)[: self.seal_next_into(buf)])

    def _commit(self) -> bytes:
        if self._hash is not None:
            digest = self._hash.digest()
        else:
            assert self._whole is not None
            size, digest = self._whole.result()
            if size != self.size:
                raise SourceChangedError("source file changed size while it was being sent")
        self.digest = digest
        return encode_commit(digest, self._sign(digest))

    def identity(self) -> tuple[int, int]:
        """(device, inode) of the file this attempt reads, as opened."""
        st = os.fstat(self._fd)
        return st.st_dev, st.st_ino

    def close(self) -> None:
        """Release the file descriptor and stop a background hash."""
        if self._whole is not None:
            self._whole.cancel()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
