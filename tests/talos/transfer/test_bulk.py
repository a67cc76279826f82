"""Tests for the bulk TCP path (talos.transfer.bulk, talos.transfer.bulk_data) over real
sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from talos.transfer import bulk_data
from talos.transfer.bulk import BulkListener, BulkStream, connect_bulk
from talos.transfer.bulk_data import PIPELINE_SLOTS, receive_chunks, send_chunks, send_verdict
from talos.transfer.pipeline import Slot
from talos.transfer.protocol import (
    BULK_CHUNK,
    BULK_FRAME,
    BULK_HELLO,
    BULK_MAGIC,
    BULK_PROOF,
    BULK_REPLY,
    NONCE_LEN,
    bulk_client_proof,
)
from talos.transfer.receiver import PARTIAL_DIR, IncomingAttempt, IncomingFile
from talos.transfer.sender import OutgoingAttempt, SourceChangedError
from talos_sdk.errors import DecryptionError, HandshakeError

TID = os.urandom(16)
KEY = os.urandom(32)
TOKEN = os.urandom(32)


def _sign(digest: bytes) -> bytes:
    """Stand-in signer: the bulk path only carries the commit (the manager verifies it)."""
    return b"\x05" * 64


def _source(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    return path, hashlib.sha256(data).digest()


async def _serve_file(
    listener: BulkListener,
    files: Path,
    size: int,
    digest: bytes,
    window: int,
    process_hook: Callable[[], None] | None = None,
) -> asyncio.Future[Path]:
    """Register a receiving attempt; the future resolves to the verified file."""
    done: asyncio.Future[Path] = asyncio.get_running_loop().create_future()
    inc = IncomingFile(files, TID, size)
    att = IncomingAttempt(inc, KEY, TID, 0)

    def write(slot: Slot) -> None:
        if process_hook is not None:
            process_hook()
        att.write(slot)

    async def handler(stream: BulkStream) -> None:
        try:
            await receive_chunks(stream, [att.open, att.hash, write], window)
            path = inc.finish(digest, "out.bin")
        except Exception as exc:
            inc.discard()
            await send_verdict(stream, False)
            done.set_exception(exc)
        else:
            await send_verdict(stream, True)
            done.set_result(path)
        finally:
            await stream.close()

    listener.expect(TID, TOKEN, handler)
    return done


async def _send(port: int, src: Path, size: int, window: int, chunk: int = BULK_CHUNK) -> bool:
    out = OutgoingAttempt(src, size, KEY, TID, 0, 0, chunk, _sign)
    stream = await connect_bulk("127.0.0.1", port, TID, TOKEN)
    try:
        return await send_chunks(stream, out.stages, out.slots(PIPELINE_SLOTS), window)
    finally:
        await stream.close()
        out.close()


@pytest.fixture
async def listener() -> AsyncIterator[BulkListener]:
    lst = BulkListener("127.0.0.1", 0)
    await lst.start()
    yield lst
    await lst.close()


@pytest.mark.parametrize("size", [0, 5, BULK_CHUNK, 3 * BULK_CHUNK + 17])
async def test_bulk_round_trip(tmp_path: Path, listener: BulkListener, size: int) -> None:
    src, digest = _source(tmp_path, size)
    done = await _serve_file(listener, tmp_path / "files", size, digest, window=4)
    async with asyncio.timeout(20):
        assert await _send(listener.port, src, size, window=4)
        path = await done
    assert path.read_bytes() == src.read_bytes()


async def test_wrong_token_is_refused(tmp_path: Path, listener: BulkListener) -> None:
    src, digest = _source(tmp_path, 10)
    done = await _serve_file(listener, tmp_path / "files", 10, digest, window=4)
    async with asyncio.timeout(10):
        with pytest.raises(HandshakeError):
            await connect_bulk("127.0.0.1", listener.port, TID, os.urandom(32))
        with pytest.raises(HandshakeError, match="refused"):
            await connect_bulk("127.0.0.1", listener.port, os.urandom(16), TOKEN)
        # the legitimate sender can still attach afterwards
        assert await _send(listener.port, src, 10, window=4)
        await done
    assert listener.refused == 2


async def test_token_is_one_time(tmp_path: Path, listener: BulkListener) -> None:
    src, digest = _source(tmp_path, 10)
    done = await _serve_file(listener, tmp_path / "files", 10, digest, window=4)
    async with asyncio.timeout(10):
        assert await _send(listener.port, src, 10, window=4)
        await done
        with pytest.raises(HandshakeError):
            await connect_bulk("127.0.0.1", listener.port, TID, TOKEN)


async def _flip_proxy(
    target_port: int, flip_at: int
) -> tuple[asyncio.Server, Callable[[], Awaitable[None]]]:
    """A real TCP relay that flips one byte of the sender->receiver stream."""

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, flip: int | None) -> None:
        seen = 0
        try:
            while data := await r.read(1 << 16):
                if flip is not None and seen <= flip < seen + len(data):
                    buf = bytearray(data)
                    buf[flip - seen] ^= 0x40
                    data = bytes(buf)
                seen += len(data)
                w.write(data)
                await w.drain()
        except OSError:
            pass
        finally:
            w.close()

    tasks: set[asyncio.Task[None]] = set()

    async def on_conn(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", target_port)
        for t in (pipe(cr, sw, flip_at), pipe(sr, cw, None)):
            task = asyncio.create_task(t)
            tasks.add(task)

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)

    async def close() -> None:
        server.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    return server, close


async def test_flipped_byte_on_the_wire_is_rejected(tmp_path: Path, listener: BulkListener) -> None:
    size = 3 * BULK_CHUNK
    src, digest = _source(tmp_path, size)
    files = tmp_path / "files"
    done = await _serve_file(listener, files, size, digest, window=4)
    # sender -> receiver: 53-byte hello, 32-byte proof, then (u32 | 25 + 1 MiB sealed) frames;
    # flip a ciphertext byte inside the second chunk
    second = 53 + 32 + (4 + 25 + BULK_CHUNK)
    server, close = await _flip_proxy(listener.port, second + 4 + 9 + 5000)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(20):
            with contextlib.suppress(ConnectionError):  # a reset may overtake the verdict
                assert await _send(port, src, size, window=4) is False
            with pytest.raises(DecryptionError):
                await done
    finally:
        await close()
    assert [p.name for p in files.iterdir() if p.name != PARTIAL_DIR] == []
    assert list((files / PARTIAL_DIR).iterdir()) == []


async def test_a_flipped_length_on_the_wire_breaks_the_attempt_only(
    tmp_path: Path, listener: BulkListener
) -> None:
    # A frame's length is not authenticated: one damaged to a huge size is a broken
    # connection (the transfer tries again from its checkpoint), not a verdict on it.
    size = 2 * BULK_CHUNK
    src, digest = _source(tmp_path, size)
    done = await _serve_file(listener, tmp_path / "files", size, digest, window=4)
    server, close = await _flip_proxy(listener.port, 53 + 32)  # the first frame's length
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(20):
            with contextlib.suppress(ConnectionError):
                assert await _send(port, src, size, window=4) is False
            with pytest.raises(ConnectionError, match="exceeds"):
                await done
    finally:
        await close()


def _receiver_expecting_failure(
    listener: BulkListener, files: Path, size: int
) -> tuple[IncomingFile, asyncio.Future[BaseException]]:
    """A receiving attempt whose future gets the error that ends its stream (it then
    reports failure to the sender); the partial file is the caller's to inspect."""
    inc = IncomingFile(files, TID, size)
    att = IncomingAttempt(inc, KEY, TID, 0)
    failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def handler(stream: BulkStream) -> None:
        try:
            await receive_chunks(stream, att.stages, window=8)
        except Exception as exc:
            failed.set_result(exc)
            await send_verdict(stream, False)
        finally:
            await stream.close()

    listener.expect(TID, TOKEN, handler)
    return inc, failed


async def test_tampered_chunk_stops_the_pipeline_before_it_is_written(
    tmp_path: Path, listener: BulkListener
) -> None:
    """Chunks behind a forged one are already received into the ring; none of them,
    nor the forged one, reaches the disk, and what is on disk is the verified prefix."""
    size = 6 * BULK_CHUNK
    src, _ = _source(tmp_path, size)
    files = tmp_path / "files"
    inc, failed = _receiver_expecting_failure(listener, files, size)
    third = 53 + 32 + 2 * (4 + 25 + BULK_CHUNK)
    server, close = await _flip_proxy(listener.port, third + 4 + 9 + 100)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(20):
            # The receiver closes with chunks unread, so the sender may see the reset
            # before the verdict; either way it does not count the file as delivered.
            with contextlib.suppress(ConnectionError):
                assert await _send(port, src, size, window=8) is False
            assert isinstance(await failed, DecryptionError)
    finally:
        await close()
    assert inc.written in (0, BULK_CHUNK, 2 * BULK_CHUNK)
    # The partial file is preallocated: past the verified prefix nothing was written.
    on_disk = inc.path.read_bytes()
    assert on_disk[: inc.written] == src.read_bytes()[: inc.written]
    assert on_disk[inc.written :].count(0) == len(on_disk) - inc.written
    assert [p.name for p in files.iterdir() if p.name != PARTIAL_DIR] == []  # not promoted
    inc.close()


async def test_source_shrinking_mid_stream_stops_the_sending_pipeline(
    tmp_path: Path, listener: BulkListener
) -> None:
    """The read stage fails (the file lost its tail after the first chunk was read); the
    sender raises that error, the receiver sees its stream cut and promotes nothing."""
    size = 8 * BULK_CHUNK
    src, _ = _source(tmp_path, size)
    files = tmp_path / "files"
    inc, failed = _receiver_expecting_failure(listener, files, size)
    out = OutgoingAttempt(src, size, KEY, TID, 0, 0, BULK_CHUNK, _sign)
    read = out.read

    def read_then_shrink(slot: Slot) -> None:
        read(slot)
        if slot.offset == 0:
            os.truncate(src, 2 * BULK_CHUNK)

    stages = (read_then_shrink, out.hash, out.seal)
    async with asyncio.timeout(20):
        stream = await connect_bulk("127.0.0.1", listener.port, TID, TOKEN)
        try:
            with pytest.raises(SourceChangedError, match="shrank"):
                await send_chunks(stream, stages, out.slots(PIPELINE_SLOTS), window=8)
        finally:
            await stream.close()
            out.close()
        assert isinstance(await failed, ConnectionError)
    assert inc.written <= 2 * BULK_CHUNK
    assert [p.name for p in files.iterdir() if p.name != PARTIAL_DIR] == []
    inc.close()


async def test_slow_receiver_holds_the_sender_to_its_window(
    tmp_path: Path, listener: BulkListener
) -> None:
    chunk = 64 * 1024
    size = 40 * chunk
    window = 3
    src, digest = _source(tmp_path, size)
    lock = threading.Lock()
    counts = {"sent": 0, "processed": 0, "max_ahead": 0}

    def slow() -> None:
        threading.Event().wait(0.002)
        with lock:
            counts["processed"] += 1

    done = await _serve_file(listener, tmp_path / "files", size, digest, window, slow)
    out = OutgoingAttempt(src, size, KEY, TID, 0, 0, chunk, _sign)

    def on_sent(_: int) -> None:
        with lock:
            counts["sent"] += 1
            ahead = counts["sent"] - counts["processed"]
            counts["max_ahead"] = max(counts["max_ahead"], ahead)

    async with asyncio.timeout(20):
        stream = await connect_bulk("127.0.0.1", listener.port, TID, TOKEN)
        slots = out.slots(PIPELINE_SLOTS)
        assert await send_chunks(stream, out.stages, slots, window, on_sent)
        await stream.close()
        await done
    out.close()
    assert counts["sent"] == 40 + 1  # data chunks, then the commit chunk
    # at most `window` granted-but-unprocessed chunks, plus the one being processed
    assert counts["max_ahead"] <= window + 1


async def test_unreachable_listener_raises_oserror() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    async with asyncio.timeout(10):
        with pytest.raises(OSError):
            await connect_bulk("127.0.0.1", port, TID, TOKEN)


async def test_unauthenticated_connections_are_capped(tmp_path: Path) -> None:
    """Silent connections cannot hold the listener: the excess is closed at once."""
    lst = BulkListener("127.0.0.1", 0, max_unauthenticated=8, max_per_address=3)
    await lst.start()
    src, digest = _source(tmp_path, 10)
    try:
        done = await _serve_file(lst, tmp_path / "files", 10, digest, window=4)
        async with asyncio.timeout(20):
            silent = [await asyncio.open_connection("127.0.0.1", lst.port) for _ in range(3)]
            reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
            assert await reader.read() == b""  # closed without a word
            writer.close()
            assert lst.refused == 1
            for _, w in silent:
                w.close()
                await w.wait_closed()
            # Once they are gone the legitimate sender gets in.
            while True:
                try:
                    assert await _send(lst.port, src, 10, window=4)
                    break
                except HandshakeError:  # a slot not freed yet: the listener refused us
                    await asyncio.sleep(0.05)
            await done
    finally:
        await lst.close()


def test_bound_token_depends_on_the_link() -> None:
    from talos.transfer.protocol import bind_token

    one, two = bind_token(TOKEN, b"\x01" * 32), bind_token(TOKEN, b"\x02" * 32)
    assert len(one) == 32 and one != two and one != TOKEN
    assert bind_token(TOKEN, b"\x01" * 32) == one


async def test_a_stream_proved_for_a_replaced_attempt_is_not_handed_to_the_next(
    listener: BulkListener,
) -> None:
    # The sender of attempt A is mid-handshake when A is replaced by B (forget, then
    # expect with B's token): its proof with A's token must not give it B's handler.
    tid = os.urandom(16)
    token_a, token_b = os.urandom(32), os.urandom(32)
    handed: list[str] = []

    def handler(name: str) -> Callable[[BulkStream], Awaitable[None]]:
        async def take(stream: BulkStream) -> None:
            handed.append(name)
            await stream.close()

        return take

    listener.expect(tid, token_a, handler("A"))
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", listener.port))
        nonce = os.urandom(NONCE_LEN)
        await loop.sock_sendall(sock, BULK_HELLO.pack(BULK_MAGIC, tid, nonce))
        server_nonce, _ = BULK_REPLY.unpack(await loop.sock_recv(sock, BULK_REPLY.size))
        listener.forget(tid)
        listener.expect(tid, token_b, handler("B"))
        proof = bulk_client_proof(token_a, tid, nonce, server_nonce)
        await loop.sock_sendall(sock, BULK_PROOF.pack(proof))
        async with asyncio.timeout(10):
            assert await loop.sock_recv(sock, 1) == b""  # closed: handed to nobody
    finally:
        sock.close()
    assert handed == []


async def test_a_second_cancel_still_waits_for_the_receiving_threads() -> None:
    """Cancelled twice, receive_chunks returns only once its stage threads have ended:
    a thread left writing into a file the caller then closes would corrupt it."""
    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(server.getsockname())
    mine, _ = server.accept()
    server.close()
    entered, release, left = threading.Event(), threading.Event(), threading.Event()

    def stalled_write(slot: Slot) -> None:
        entered.set()
        release.wait(30)
        left.set()

    seen_at_end: list[bool] = []
    task = asyncio.create_task(receive_chunks(BulkStream(TID, mine), [stalled_write], window=4))
    task.add_done_callback(lambda _: seen_at_end.append(left.is_set()))
    try:
        peer.sendall(BULK_FRAME.pack(32) + bytes(32))
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen_at_end == [True]
    finally:
        release.set()
        peer.close()
        mine.close()


async def test_a_peer_trickling_a_frame_cannot_hold_the_stream_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each read makes progress, yet the frame is not complete within IDLE_TIMEOUT plus its
    length at MIN_RATE: the receive fails while the trickle goes on (a per-read timeout
    alone never fires)."""
    monkeypatch.setattr(bulk_data, "IDLE_TIMEOUT", 0.5)
    monkeypatch.setattr(bulk_data, "MIN_RATE", 1 << 20)  # 4 KiB in 4 ms
    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(server.getsockname())
    mine, _ = server.accept()
    server.close()
    mine.settimeout(5)  # the per-read timeout: never reached while bytes come
    stop = threading.Event()
    sent: list[int] = []

    def trickle() -> None:
        frame = BULK_FRAME.pack(4096) + bytes(4096)
        for i in range(200):  # 10 s of trickle at most
            if stop.wait(0.05):
                return
            try:
                peer.sendall(frame[i : i + 1])
            except OSError:
                return
            sent.append(i)

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        with pytest.raises(TimeoutError, match="not complete"):
            await receive_chunks(BulkStream(TID, mine), [lambda slot: None], window=4)
        assert len(sent) < 200, "the stream stayed open as long as bytes came"
    finally:
        stop.set()
        await asyncio.to_thread(feeder.join, 30)
        peer.close()
        mine.close()
