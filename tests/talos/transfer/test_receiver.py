"""Tests for the sender/receiver file logic (talos.transfer.sender / receiver), no network."""

from __future__ import annotations

import hashlib
import os
import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from talos.transfer.protocol import TransferProtocolError
from talos.transfer.receiver import (
    PARTIAL_DIR,
    IncomingAttempt,
    IncomingFile,
    IntegrityError,
    NoSpaceError,
)
from talos.transfer.sender import OutgoingAttempt, SourceChangedError, hash_fd
from talos_sdk.errors import DecryptionError, StorageError, UsageError

TID = bytes(range(16))
KEY = b"k" * 32
SIG = b"\x05" * 64


def _sign(digest: bytes) -> bytes:
    """Stand-in signer: the file layer only carries the signature (the manager verifies it)."""
    return SIG


def _source(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = os.urandom(size)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    return src, hashlib.sha256(data).digest()


def _visible(files: Path) -> list[str]:
    return sorted(p.name for p in files.iterdir() if p.name != PARTIAL_DIR)


def _pump(out: OutgoingAttempt, att: IncomingAttempt) -> None:
    while not out.finished:
        att.process(out.next_sealed())


@pytest.mark.parametrize("size", [0, 1, 1000, 4096, 4097, 3 * 4096 + 5])
def test_round_trip_sizes(tmp_path: Path, size: int) -> None:
    src, digest = _source(tmp_path, size)
    files = tmp_path / "files"
    inc = IncomingFile(files, TID, size)
    out = OutgoingAttempt(src, size, KEY, TID, 0, 0, 4096, _sign)
    att = IncomingAttempt(inc, KEY, TID, 0)
    _pump(out, att)
    assert att.commit == (digest, SIG)  # hashed while sealing, carried by the commit chunk
    final = inc.finish(digest, "doc.bin")
    assert final == files / "doc.bin"
    assert final.read_bytes() == src.read_bytes()
    assert list((files / PARTIAL_DIR).iterdir()) == []
    with src.open("rb") as f:
        assert hash_fd(f.fileno(), str(src)) == (size, digest)


def test_resume_from_committed_offset_with_new_epoch(tmp_path: Path) -> None:
    size = 10 * 4096 + 7
    src, digest = _source(tmp_path, size)
    files = tmp_path / "files"
    inc = IncomingFile(files, TID, size)
    out = OutgoingAttempt(src, size, KEY, TID, 0, 0, 4096, _sign)
    att = IncomingAttempt(inc, KEY, TID, 0)
    for _ in range(3):
        att.process(out.next_sealed())
    committed = inc.sync()
    att.process(out.next_sealed())  # written but never committed: dropped on resume
    inc.close()
    out.close()

    inc2 = IncomingFile(files, TID, size, committed=committed)
    assert inc2.written == 3 * 4096
    out2 = OutgoingAttempt(src, size, KEY, TID, 1, committed, 4096, _sign)
    att2 = IncomingAttempt(inc2, KEY, TID, 1)
    _pump(out2, att2)
    out2.close()
    # the resumed sender hashed the whole file in the background for its commit
    assert att2.commit == (digest, SIG)
    assert inc2.finish(digest, "r.bin").read_bytes() == src.read_bytes()


def test_chunk_from_old_epoch_is_rejected(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, 9000)
    inc = IncomingFile(tmp_path / "files", TID, 9000)
    old = OutgoingAttempt(src, 9000, KEY, TID, 0, 0, 4096, _sign)
    att = IncomingAttempt(inc, KEY, TID, 1)
    with pytest.raises(DecryptionError):
        att.process(old.next_sealed())
    assert inc.written == 0


def test_tampered_chunk_rejected_nothing_written(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, 9000)
    inc = IncomingFile(tmp_path / "files", TID, 9000)
    out = OutgoingAttempt(src, 9000, KEY, TID, 0, 0, 4096, _sign)
    att = IncomingAttempt(inc, KEY, TID, 0)
    sealed = bytearray(out.next_sealed())
    sealed[100] ^= 1
    with pytest.raises(DecryptionError):
        att.process(bytes(sealed))
    assert inc.written == 0


def test_truncated_stream_detected(tmp_path: Path) -> None:
    src, digest = _source(tmp_path, 9000)
    files = tmp_path / "files"
    inc = IncomingFile(files, TID, 9000)
    out = OutgoingAttempt(src, 9000, KEY, TID, 0, 0, 4096, _sign)
    att = IncomingAttempt(inc, KEY, TID, 0)
    att.process(out.next_sealed())
    out.next_sealed()  # dropped in transit
    with pytest.raises(DecryptionError):
        att.process(out.next_sealed())
    with pytest.raises(TransferProtocolError, match="ended at 4096 of 9000"):
        inc.finish(digest, "x")
    inc.discard()
    assert _visible(files) == []
    assert list((files / PARTIAL_DIR).iterdir()) == []


def test_wrong_total_hash_leaves_nothing_visible(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, 5000)
    files = tmp_path / "files"
    inc = IncomingFile(files, TID, 5000)
    _pump(
        OutgoingAttempt(src, 5000, KEY, TID, 0, 0, 4096, _sign), IncomingAttempt(inc, KEY, TID, 0)
    )
    with pytest.raises(IntegrityError):
        inc.finish(b"\x00" * 32, "x.bin")
    inc.discard()
    assert _visible(files) == []


def test_sender_lying_about_size_more_bytes(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, 9000)
    inc = IncomingFile(tmp_path / "files", TID, 5000)  # offer said 5000
    out = OutgoingAttempt(src, 9000, KEY, TID, 0, 0, 4096, _sign)
    att = IncomingAttempt(inc, KEY, TID, 0)
    att.process(out.next_sealed())
    with pytest.raises(TransferProtocolError, match="more than the announced size"):
        att.process(out.next_sealed())
    assert inc.written == 4096


def test_sender_lying_about_size_fewer_bytes(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, 3000)
    inc = IncomingFile(tmp_path / "files", TID, 5000)
    att = IncomingAttempt(inc, KEY, TID, 0)
    with pytest.raises(TransferProtocolError, match="stream ended at 3000"):
        _pump(OutgoingAttempt(src, 3000, KEY, TID, 0, 0, 4096, _sign), att)


def test_collision_picks_numbered_name_and_never_follows_symlink(tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.txt").write_bytes(b"mine")
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    (files / "a (1).txt").symlink_to(outside)
    src, digest = _source(tmp_path, 10)
    inc = IncomingFile(files, TID, 10)
    _pump(OutgoingAttempt(src, 10, KEY, TID, 0, 0, 4096, _sign), IncomingAttempt(inc, KEY, TID, 0))
    assert inc.finish(digest, "a.txt") == files / "a (2).txt"
    assert (files / "a.txt").read_bytes() == b"mine"
    assert outside.read_bytes() == b"precious"


def test_source_changed_size(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, 100)
    with pytest.raises(SourceChangedError):
        OutgoingAttempt(src, 99, KEY, TID, 0, 0, 4096, _sign)


def test_bad_arguments(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, 100)
    with pytest.raises(UsageError):
        OutgoingAttempt(src, 100, KEY, TID, 0, 101, 4096, _sign)
    with pytest.raises(UsageError):
        IncomingFile(tmp_path / "f", TID, 10, committed=11)
    with open("/dev/null", "rb") as null, pytest.raises(UsageError):
        hash_fd(null.fileno(), "/dev/null")
    inc = IncomingFile(tmp_path / "f", TID, 10)
    with pytest.raises(UsageError, match="out-of-order"):
        inc.write(5, b"x")


def test_partial_shorter_than_recorded_progress(tmp_path: Path) -> None:
    inc = IncomingFile(tmp_path / "f", TID, 100)
    inc.close()
    os.truncate(inc.path, 10)  # lost its tail (the file itself is preallocated)
    with pytest.raises(StorageError, match="shorter"):
        IncomingFile(tmp_path / "f", TID, 100, committed=50)


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """A real kernel write limit (RLIMIT_FSIZE): writes past it fail with EFBIG."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_disk_full_is_a_clear_error(tmp_path: Path) -> None:
    limit = 64 * 1024
    size = 4 * limit
    src, _ = _source(tmp_path, size)
    files = tmp_path / "files"
    inc = IncomingFile(files, TID, size)
    att = IncomingAttempt(inc, KEY, TID, 0)
    out = OutgoingAttempt(src, size, KEY, TID, 0, 0, 16 * 1024, _sign)
    with file_size_limit(limit), pytest.raises(NoSpaceError, match="no space left"):
        _pump(out, att)
    inc.discard()
    assert _visible(files) == []


def test_checkpoint_claims_only_bytes_written_before_the_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sync() may overlap writes (the stream keeps flowing): it returns the pre-fsync offset."""
    inc = IncomingFile(tmp_path / "f", TID, 3 * 4096)
    inc.write(0, os.urandom(4096))
    real = os.fdatasync

    def fsync_while_writing(fd: int) -> None:
        inc.write(4096, os.urandom(4096))  # lands while the fsync is in progress
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fsync_while_writing)
    assert inc.sync() == 4096
    assert inc.synced == 4096
    assert inc.written == 2 * 4096
    monkeypatch.setattr(os, "fdatasync", real)
    assert inc.sync() == 2 * 4096
    inc.discard()


def test_aligned_chunks_bypass_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = 64 * 1024
    size = 3 * chunk + 100  # three aligned chunks and an unaligned tail
    src, digest = _source(tmp_path, size)
    files = tmp_path / "files"
    inc = IncomingFile(files, TID, size)
    if inc._direct < 0:
        pytest.skip("this filesystem does not support O_DIRECT")
    used: list[tuple[int, int]] = []
    real = os.pwrite

    def spy(fd: int, data: Any, offset: int) -> int:
        used.append((fd, offset))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    direct, buffered = inc._direct, inc._fd
    _pump(
        OutgoingAttempt(src, size, KEY, TID, 0, 0, chunk, _sign), IncomingAttempt(inc, KEY, TID, 0)
    )
    assert used == [(direct, 0), (direct, chunk), (direct, 2 * chunk), (buffered, 3 * chunk)]
    assert inc.finish(digest, "d.bin").read_bytes() == src.read_bytes()
    # unaligned buffers (bytes from elsewhere) go through the buffered descriptor
    inc2 = IncomingFile(files, TID, 4096)
    used.clear()
    inc2.write(0, b"\x01" + bytes(4095))
    assert used == [(inc2._fd, 0)]
    inc2.discard()


def test_pieces_stored_out_of_order_advance_written_only_without_gaps(tmp_path: Path) -> None:
    """The receive pipeline's two writers may finish the second chunk first."""
    block = 4096
    data = os.urandom(3 * block)
    inc = IncomingFile(tmp_path / "f", TID, len(data))
    assert inc.path.stat().st_size == len(data)  # preallocated
    inc.store(block, data[block : 2 * block])
    assert inc.written == 0  # a gap before it: nothing may be claimed yet
    with pytest.raises(UsageError, match="out-of-order"):
        inc.store(block, data[block : 2 * block])  # stored twice
    inc.store(0, data[:block])
    assert inc.written == 2 * block
    with pytest.raises(UsageError, match="out-of-order"):
        inc.store(0, data[:block])  # behind the written prefix
    with pytest.raises(UsageError, match="out-of-order"):
        inc.store(2 * block, data)  # past the end of the file
    inc.store(2 * block, data[2 * block :])
    assert inc.written == len(data)
    inc.absorb(data)
    path = inc.finish(hashlib.sha256(data).digest(), "out.bin")
    assert path.read_bytes() == data


def test_a_file_too_large_for_the_disk_fails_before_any_data(tmp_path: Path) -> None:
    """Preallocation meets the real kernel limit (RLIMIT_FSIZE) when the file is opened."""
    limit = 64 * 1024
    with file_size_limit(limit), pytest.raises(NoSpaceError, match="no space left"):
        IncomingFile(tmp_path / "f", TID, 4 * limit)
