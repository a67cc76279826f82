"""Receiving side of a file transfer: the partial file on disk (docs/PROTOCOL.md "File transfer").

Synchronous on purpose: the asyncio layer runs these calls in a worker thread
(ChaCha20-Poly1305, SHA-256 and ``pwrite`` release the GIL on 1 MiB buffers),
so the event loop keeps reading the socket while the previous chunk is opened,
hashed and written.

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
import mmap
import os
from pathlib import Path
from typing import Final

from talos.transfer.protocol import (
    MAX_CHUNK,
    ChunkPlan,
    TransferProtocolError,
    decode_commit,
    numbered_name,
    stream_label,
)
from talos_sdk.aead import StreamOpener, derive_stream_key
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


def aligned_buffer(size: int) -> memoryview:
    """A page-aligned writable buffer (anonymous mmap) usable for ``O_DIRECT`` writes."""
    return memoryview(mmap.mmap(-1, max(size, 1)))


class IncomingFile:
    """The partial file of one incoming transfer, written strictly in order."""

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
        except BaseException:
            os.close(self._fd)
            raise
        self._direct = _open_direct(self.path)
        self.written = committed
        self.synced = committed

    def _rehash(self, upto: int) -> None:
        pos = 0
        while pos < upto:
            block = os.pread(self._fd, min(_REHASH_BLOCK, upto - pos), pos)
            if not block:
                raise StorageError(f"partial file {self.path} ended early")
            self._hash.update(block)
            pos += len(block)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Write the next bytes at ``offset`` (must equal :attr:`written`)."""
        if offset != self.written:
            raise UsageError(f"out-of-order write at {offset}, expected {self.written}")
        view = memoryview(data)
        fd = self._fd
        if self._direct >= 0 and _aligned(view, offset):
            fd = self._direct
        try:
            while view:
                n = os.pwrite(fd, view, offset)
                view = view[n:]
                offset += n
        except OSError as exc:
            raise _no_space(exc, self.path) from exc
        self._hash.update(data)
        self.written = offset

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
    """One sending attempt (epoch) into an :class:`IncomingFile`: open, check, write.

    :meth:`process_into` is the per-chunk work the bulk path and the app-channel
    fallback share; it runs in a worker thread and opens into one reused
    plaintext buffer. After the final chunk :attr:`commit` holds the sender's
    ``(sha256, signature)`` for :meth:`IncomingFile.finish` and the manager.
    """

    def __init__(self, file: IncomingFile, key: bytes, tid: bytes, epoch: int) -> None:
        label = stream_label(tid, epoch, file.written)
        self.file = file
        self.epoch = epoch
        self._opener = StreamOpener(derive_stream_key(key, label), label)
        self.plan = ChunkPlan(size=file.size, offset=file.written)
        self._plain = aligned_buffer(MAX_CHUNK)
        self.commit: tuple[bytes, bytes] | None = None

    def process_into(self, sealed: bytes | memoryview) -> bool:
        """Open one sealed chunk and write it; True when it was the final (commit) chunk.

        Raises :class:`~talos_sdk.errors.DecryptionError` (tampered, reordered, replayed) or
        :class:`TransferProtocolError` (size lies) before anything is written.
        """
        if len(sealed) > len(self._plain) + 25:
            raise TransferProtocolError(f"sealed chunk of {len(sealed)} bytes is too large")
        n = self._opener.open_into(sealed, self._plain)
        final = self._opener.finished
        view = memoryview(self._plain)[:n]
        at = self.plan.accept(n, final)
        if final:
            self.commit = decode_commit(view)
        else:
            self.file.write(at, view)
        return final

    def process(self, sealed: bytes) -> bool:
        """Same as :meth:`process_into` (kept for the app-channel fallback's whole chunks)."""
        return self.process_into(sealed)
