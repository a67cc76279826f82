"""Receiving side of a file transfer: the partial file on disk (docs/PROTOCOL.md "File transfer").

Synchronous on purpose: the bulk path runs the steps of
:class:`IncomingAttempt` (:meth:`~IncomingAttempt.open`,
:meth:`~IncomingAttempt.hash`, :meth:`~IncomingAttempt.write`) as stages of a
:class:`~talos.transfer.pipeline.Pipeline`, each in its own thread
(ChaCha20-Poly1305, SHA-256 and ``pwrite`` release the GIL on 1 MiB buffers);
the app-channel fallback runs them one after the other in a worker thread.

Visibility rule (docs/adr/0004-bulk-transfer-path.md): bytes land in ``<files>/.partial/<tid>.part``
(a hidden folder, 0700); only after the whole-file SHA-256 matched and the
data was fsync'd does :meth:`IncomingFile.finish` ``link()`` it under its
final name, which never overwrites (``link`` fails on any existing entry,
symlinks included) and so picks ``name (1).ext`` on a collision.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import hmac
import os
import threading
from pathlib import Path
from typing import Final

from talos.transfer.pipeline import Slot, Stage, aligned_buffer
from talos.transfer.protocol import (
    MAX_CHUNK,
    ChunkPlan,
    TransferProtocolError,
    decode_commit,
    numbered_name,
    stream_label,
)
from talos_sdk.aead import CHUNK_HEADER_SIZE, TAG_SIZE, StreamOpener, derive_stream_key
from talos_sdk.errors import StorageError, UsageError

__all__ = ["PARTIAL_DIR", "IncomingAttempt", "IncomingFile", "IntegrityError", "NoSpaceError"]

PARTIAL_DIR: Final = ".partial"
_REHASH_BLOCK: Final = 4 << 20
_MAX_COLLISIONS: Final = 10_000
_DIRECT_ALIGN: Final = 4096


class IntegrityError(TransferProtocolError):
    """The received bytes do not hash to the SHA-256 the sender announced."""


class NoSpaceError(StorageError):
    """The disk (or file-size limit) cannot hold the incoming file."""


def _no_space(exc: OSError, path: Path) -> StorageError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return NoSpaceError(f"no space left to receive into {path.parent}: {exc.strerror}")
    return StorageError(f"cannot write {path}: {exc.strerror}")


def _open_direct(path: Path) -> int:
    """A second, ``O_DIRECT`` descriptor on the partial file, or -1 where unsupported.

    Aligned chunks are written through it: on this kind of host (a VM) filling
    fresh page-cache pages runs at ~200 MB/s while direct writes reach
    ~1.5 GB/s, and the received bytes are not read back (the SHA-256 is taken
    from the buffer), so caching them buys nothing. Unaligned pieces (the
    tail, odd resume offsets) go through the buffered descriptor; the kernel
    keeps the two coherent and one ``fdatasync`` covers both.
    """
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return -1
    try:
        return os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | direct)
    except OSError:  # e.g. tmpfs: EINVAL
        return -1


def _aligned(view: memoryview, offset: int) -> bool:
    if offset % _DIRECT_ALIGN or view.nbytes % _DIRECT_ALIGN or view.readonly:
        return False  # read-only buffers (bytes) are not ours and rarely aligned
    return _address(view) % _DIRECT_ALIGN == 0


def _address(view: memoryview) -> int:
    # The buffer's address: O_DIRECT needs it aligned as well as offset and length.
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class IncomingFile:
    """The partial file of one incoming transfer; :attr:`written` is its gapless prefix."""

    def __init__(self, files_dir: Path, tid: bytes, size: int, committed: int = 0) -> None:
        """Open (or create) the partial file and rewind it to ``committed`` bytes.

        Bytes past ``committed`` were never fsync'd and recorded, so they are
        dropped; the running SHA-256 is rebuilt from the committed prefix.
        """
        if not 0 <= committed <= size:
            raise UsageError("committed offset outside the file")
        self.files_dir = files_dir
        self.size = size
        partial = files_dir / PARTIAL_DIR
        partial.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = partial / f"{tid.hex()}.part"
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise _no_space(exc, self.path) from exc
        self._hash = hashlib.sha256()
        try:
            if os.fstat(self._fd).st_size < committed:
                raise StorageError(
                    f"partial file {self.path} is shorter than its recorded progress"
                )
            os.ftruncate(self._fd, committed)
            self._rehash(committed)
            self._preallocate(committed)
        except BaseException:
            os.close(self._fd)
            raise
        self._direct = _open_direct(self.path)
        self.written = committed
        self.synced = committed
        # Pieces stored but not yet joined to the written prefix: offset -> end.
        self._ahead: dict[int, int] = {}
        self._lock = threading.Lock()

    def _preallocate(self, start: int) -> None:
        """Reserve the rest of the file's blocks up front.

        A disk too small fails here, before any data moves, and the direct
        writes then fill allocated blocks instead of extending the file each
        time (1 MiB ``O_DIRECT`` writes on this VM: ~240 -> ~340 MB/s with two
        in flight, measured in the ADR). Filesystems without the call skip it.
        """
        if self.size <= start:
            return
        try:
            os.posix_fallocate(self._fd, start, self.size - start)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise _no_space(exc, self.path) from exc

    def _rehash(self, upto: int) -> None:
        pos = 0
        while pos < upto:
            block = os.pread(self._fd, min(_REHASH_BLOCK, upto - pos), pos)
            if not block:
                raise StorageError(f"partial file {self.path} ended early")
            self._hash.update(block)
            pos += len(block)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Write the next bytes at ``offset`` (must equal :attr:`written`) and hash them."""
        if offset != self.written:
            raise UsageError(f"out-of-order write at {offset}, expected {self.written}")
        self.store(offset, data)
        self.absorb(data)

    def absorb(self, data: bytes | memoryview) -> None:
        """Feed the next bytes to the running SHA-256 (in file order)."""
        self._hash.update(data)

    def store(self, offset: int, data: bytes | memoryview) -> None:
        """Write bytes at ``offset``, unhashed; :attr:`written` is the end of the gapless prefix.

        Two threads may store at once (the receive pipeline keeps two writes in
        flight), each piece handed out in file order by the chunk plan, so a
        piece may land before the one in front of it; :attr:`written` (what a
        checkpoint may claim) only moves over pieces with nothing missing
        before them. A piece must start at or past :attr:`written` and fit the
        file; rewriting stored bytes is misuse.
        """
        view = memoryview(data)
        start, end = offset, offset + view.nbytes
        with self._lock:
            if start < self.written or end > self.size or start in self._ahead:
                raise UsageError(f"out-of-order write at {start}, written {self.written}")
            self._ahead[start] = -1  # claimed; the end is set once stored
        fd = self._fd
        if self._direct >= 0 and _aligned(view, offset):
            fd = self._direct
        try:
            while view:
                n = os.pwrite(fd, view, offset)
                view = view[n:]
                offset += n
        except OSError as exc:
            with self._lock:
                del self._ahead[start]
            raise _no_space(exc, self.path) from exc
        with self._lock:
            self._ahead[start] = end
            while self._ahead.get(self.written, -1) >= 0:
                self.written = self._ahead.pop(self.written)

    def sync(self) -> int:
        """fsync the data written so far; returns the offset that is now safe to record.

        May run in one thread while :meth:`write` continues in another (the
        receive pipeline does not stop for a checkpoint): only the offset
        written *before* the fsync started is claimed as durable.
        """
        target = self.written
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            raise _no_space(exc, self.path) from exc
        self.synced = max(self.synced, target)
        return target

    def finish(self, expected_sha256: bytes, name: str) -> Path:
        """Verify size and SHA-256, fsync, and make the file visible; returns its path."""
        if self.written != self.size:
            raise TransferProtocolError(f"file ended at {self.written} of {self.size} bytes")
        if not hmac.compare_digest(self._hash.digest(), expected_sha256):
            raise IntegrityError("received file does not match the announced SHA-256")
        self.sync()
        self.close()
        final = self._place(name)
        os.unlink(self.path)
        dir_fd = os.open(self.files_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return final

    def _place(self, name: str) -> Path:
        for n in range(_MAX_COLLISIONS):
            target = self.files_dir / numbered_name(name, n)
            try:
                os.link(self.path, target, follow_symlinks=False)
            except FileExistsError:
                continue
            except OSError as exc:
                raise _no_space(exc, target) from exc
            return target
        raise StorageError(f"too many files named like {name!r} in {self.files_dir}")

    def close(self) -> None:
        """Close the descriptors, keeping the partial file for a later resume."""
        for fd in (self._fd, self._direct):
            if fd >= 0:
                os.close(fd)
        self._fd = self._direct = -1

    def discard(self) -> None:
        """Close and delete the partial file (transfer failed or was cancelled)."""
        self.close()
        self.path.unlink(missing_ok=True)


class IncomingAttempt:
    """One sending attempt (epoch) into an :class:`IncomingFile`: open, hash, write.

    :attr:`stages` are the per-chunk steps in order, shared by the bulk path
    (one thread each) and the app-channel fallback (:meth:`process`). After the
    final chunk :attr:`commit` holds the sender's ``(sha256, signature)`` for
    :meth:`IncomingFile.finish` and the manager.
    """

    def __init__(self, file: IncomingFile, key: bytes, tid: bytes, epoch: int) -> None:
        label = stream_label(tid, epoch, file.written)
        self.file = file
        self.epoch = epoch
        self._opener = StreamOpener(derive_stream_key(key, label), label)
        self.plan = ChunkPlan(size=file.size, offset=file.written)
        self._plain: memoryview | None = None  # the fallback's buffer, made on first use
        self.commit: tuple[bytes, bytes] | None = None

    @property
    def stages(self) -> tuple[Stage, Stage, Stage]:
        """``open``, ``hash``, ``write``: what one sealed chunk goes through, in order."""
        return (self.open, self.hash, self.write)

    def open(self, slot: Slot) -> None:
        """Stage 1: open ``slot.sealed`` into ``slot.plain`` and check it against the plan.

        Raises :class:`~talos_sdk.errors.DecryptionError` (tampered, reordered,
        replayed) or :class:`TransferProtocolError` (size lies), so a bad chunk
        never reaches :meth:`write`. Sets ``slot.last`` on the commit chunk and
        keeps its plaintext in :attr:`commit`.
        """
        sealed = slot.sealed[: slot.sealed_size]
        if len(sealed) > len(slot.plain) + CHUNK_HEADER_SIZE + TAG_SIZE:
            raise TransferProtocolError(f"sealed chunk of {len(sealed)} bytes is too large")
        n = self._opener.open_into(sealed, slot.plain)
        final = self._opener.finished
        slot.offset = self.plan.accept(n, final)
        slot.size = n
        slot.last = final
        if final:
            self.commit = decode_commit(slot.plain[:n])

    def hash(self, slot: Slot) -> None:
        """Stage 2: feed a data chunk to the file's running SHA-256."""
        if not slot.last:
            self.file.absorb(slot.plain[: slot.size])

    def write(self, slot: Slot) -> None:
        """Stage 3: write a data chunk at its offset."""
        if not slot.last:
            self.file.store(slot.offset, slot.plain[: slot.size])

    def process(self, sealed: bytes | memoryview) -> bool:
        """All stages for one whole sealed chunk (the fallback); True for the final chunk."""
        if self._plain is None:
            self._plain = aligned_buffer(MAX_CHUNK)
        slot = Slot(self._plain, memoryview(sealed), sealed_size=len(sealed))
        for stage in self.stages:
            stage(slot)
        return slot.last
