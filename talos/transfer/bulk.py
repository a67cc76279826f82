"""The dedicated bulk TCP path for file data (docs/adr/0004-bulk-transfer-path.md).

The receiver runs one :class:`BulkListener`; for each accepted attempt it
registers a one-time 32-byte token (sent to the sender inside the
ratchet-sealed ACCEPT). The sender connects and both sides prove the token
with HMAC over fresh nonces (:func:`~talos.transfer.protocol.bulk_client_proof`),
so only the peer that holds the session can attach, and the sender knows it
reached the right receiver. After that the stream carries::

    sender   -> receiver: ( u32 length | sealed chunk )*      (talos_sdk.aead layout)
    receiver -> sender:   ( u64 credit )*  then u64 BULK_VERIFIED / BULK_FAILED

Credits are chunk indices: the sender may send chunk ``i`` only while
``i < credit``, so a slow receiver slows the sender and neither side holds
more than ``window`` chunks (the kernel's socket buffers are the queue).

The handshake runs on the event loop with ``loop.sock_*`` calls on the raw
socket (no stream read-ahead, so nothing of the data phase is swallowed).
The data phase then runs in dedicated threads on the blocking socket, as a
:class:`~talos.transfer.pipeline.Pipeline` per side: read -> hash -> seal ->
``sendmsg`` on the sender, ``recv_into`` -> open -> hash -> ``pwrite`` on the
receiver, one thread per step over a ring of reused buffers (ChaCha20-Poly1305,
SHA-256 and the syscalls release the GIL), so the loop is not woken per chunk,
no page is freshly allocated per chunk, and the steps of one side overlap each
other as the kernel socket buffers overlap the two processes. Cancelling the
awaiting task shuts the socket down, which wakes the threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from talos.link.admission import Admission
from talos.transfer.pipeline import Pipeline, Slot, Stage
from talos.transfer.protocol import (
    BULK_CREDIT,
    BULK_FAILED,
    BULK_FRAME,
    BULK_HELLO,
    BULK_MAGIC,
    BULK_PROOF,
    BULK_REPLY,
    BULK_VERIFIED,
    MAX_CHUNK,
    NONCE_LEN,
    TOKEN_LEN,
    bulk_client_proof,
    bulk_server_proof,
)
from talos_sdk.aead import CHUNK_HEADER_SIZE, TAG_SIZE
from talos_sdk.errors import HandshakeError, OversizeError, ProtocolError, UsageError

__all__ = [
    "MAX_UNAUTHENTICATED",
    "MAX_UNAUTHENTICATED_PER_ADDRESS",
    "BulkListener",
    "BulkStream",
    "connect_bulk",
    "receive_chunks",
    "send_chunks",
    "send_verdict",
]

MAX_SEALED: Final = MAX_CHUNK + CHUNK_HEADER_SIZE + TAG_SIZE
HANDSHAKE_TIMEOUT: Final = 10.0
#: Connections still proving a token, in total and from one source address;
#: more are closed at once (each holds a socket and a task until its timeout).
MAX_UNAUTHENTICATED: Final = 32
MAX_UNAUTHENTICATED_PER_ADDRESS: Final = 8
#: A data-phase socket call that makes no progress this long ends the attempt.
IDLE_TIMEOUT: Final = 60.0
#: Chunks in flight inside one process: one per pipeline stage plus slack for jitter.
PIPELINE_SLOTS: Final = 6
#: Receiver threads writing to disk at once: two positional writes in flight hide
#: the per-write latency of the disk (ADR 0004, "Pipeline").
WRITERS: Final = 2
#: Socket buffers sized for a few sealed chunks in flight on a fast link.
SOCKET_BUFFER: Final = 4 << 20
log = logging.getLogger(__name__)
_FINAL_FLAG_AT: Final = 8  # flags byte of the aead chunk header
_T = TypeVar("_T")


def _tune(sock: socket.socket) -> None:
    # Credits are 8-byte writes: without NODELAY they can wait for a delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)


@dataclass(frozen=True, slots=True)
class BulkStream:
    """An authenticated bulk connection for one transfer attempt."""

    tid: bytes
    sock: socket.socket

    def abort(self) -> None:
        """Shut the connection down (wakes any thread blocked on it)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    async def close(self) -> None:
        """Shut down and close the socket (errors on a dead socket are irrelevant here)."""
        self.abort()
        self.sock.close()


BulkHandler = Callable[[BulkStream], Awaitable[None]]


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise asyncio.IncompleteReadError(bytes(buf[:got]), n)
        got += k
    return bytes(buf)


def _to_data_phase(sock: socket.socket) -> None:
    sock.settimeout(IDLE_TIMEOUT)


class BulkListener:
    """The receiver's bulk TCP listener; attaches each connection to a registered attempt."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
        max_per_address: int = MAX_UNAUTHENTICATED_PER_ADDRESS,
    ) -> None:
        self.host = host
        self._port = port
        # Connections that have not proved a token yet, in total and per source address.
        self._admission = Admission(max_unauthenticated, max_per_address)
        self._expected: dict[bytes, tuple[bytes, BulkHandler]] = {}
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.refused = 0

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._sock is None:
            raise UsageError("bulk listener not started")
        return int(self._sock.getsockname()[1])

    async def start(self) -> None:
        """Bind and listen."""
        infos = await asyncio.get_running_loop().getaddrinfo(
            self.host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _tune(sock)  # before listen(): accepted sockets inherit the window scale
            sock.bind(address)
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._accepting = asyncio.create_task(self._accept_loop(sock))

    def expect(self, tid: bytes, token: bytes, handler: BulkHandler) -> None:
        """Accept one connection proving ``token`` for ``tid`` and hand it to ``handler``."""
        if len(token) != TOKEN_LEN:
            raise UsageError("bulk token must be 32 bytes")
        self._expected[tid] = (token, handler)

    def forget(self, tid: bytes) -> None:
        """Withdraw the token of ``tid`` (attempt over or replaced)."""
        self._expected.pop(tid, None)

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(lsock)
            except OSError:  # e.g. EMFILE: back off instead of spinning
                await asyncio.sleep(0.1)
                continue
            address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            if not self._admission.enter(address):
                self.refused += 1
                conn.close()
                continue
            task = asyncio.create_task(self._on_connect(conn, address))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _on_connect(self, conn: socket.socket, address: str) -> None:
        try:
            stream = await asyncio.wait_for(self._authenticate(conn), HANDSHAKE_TIMEOUT)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ProtocolError):
            self.refused += 1
            conn.close()
            return
        except asyncio.CancelledError:
            conn.close()
            raise
        finally:
            self._admission.leave(address)
        token_handler = self._expected.pop(stream.tid, None)
        if token_handler is None:  # raced with forget()
            await stream.close()
            return
        await token_handler[1](stream)

    async def _authenticate(self, conn: socket.socket) -> BulkStream:
        loop = asyncio.get_running_loop()
        hello = await _recv_exact(loop, conn, BULK_HELLO.size)
        magic, tid, client_nonce = BULK_HELLO.unpack(hello)
        entry = self._expected.get(tid)
        if magic != BULK_MAGIC or entry is None:
            raise HandshakeError("unknown bulk transfer")
        token = entry[0]
        server_nonce = os.urandom(NONCE_LEN)
        proof = bulk_server_proof(token, tid, client_nonce, server_nonce)
        await loop.sock_sendall(conn, BULK_REPLY.pack(server_nonce, proof))
        (client_proof,) = BULK_PROOF.unpack(await _recv_exact(loop, conn, BULK_PROOF.size))
        expected = bulk_client_proof(token, tid, client_nonce, server_nonce)
        if not hmac.compare_digest(client_proof, expected):
            raise HandshakeError("bad bulk token proof")
        _to_data_phase(conn)
        return BulkStream(tid, conn)

    async def close(self) -> None:
        """Stop listening; connections already handed to handlers are theirs to close."""
        self._expected.clear()
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def connect_bulk(
    host: str, port: int, tid: bytes, token: bytes, timeout: float = HANDSHAKE_TIMEOUT
) -> BulkStream:
    """Dial the receiver's bulk listener and run the token handshake.

    :class:`HandshakeError` if the listener refuses or proves the wrong token;
    ``OSError`` / ``TimeoutError`` if it cannot be reached (caller falls back).
    """
    loop = asyncio.get_running_loop()

    async def dial() -> BulkStream:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            _tune(sock)
            await loop.sock_connect(sock, address)
            client_nonce = os.urandom(NONCE_LEN)
            await loop.sock_sendall(sock, BULK_HELLO.pack(BULK_MAGIC, tid, client_nonce))
            try:
                reply = await _recv_exact(loop, sock, BULK_REPLY.size)
            except (asyncio.IncompleteReadError, ConnectionResetError):
                raise HandshakeError("bulk listener refused the transfer") from None
            server_nonce, proof = BULK_REPLY.unpack(reply)
            if not hmac.compare_digest(
                proof, bulk_server_proof(token, tid, client_nonce, server_nonce)
            ):
                raise HandshakeError("bulk listener did not prove the transfer token")
            client_proof = bulk_client_proof(token, tid, client_nonce, server_nonce)
            await loop.sock_sendall(sock, BULK_PROOF.pack(client_proof))
            _to_data_phase(sock)
            return BulkStream(tid, sock)
        except BaseException:
            sock.close()
            raise

    return await asyncio.wait_for(dial(), timeout)


# --------------------------------------------------------------------------- data phase


async def _in_thread(stream: BulkStream, fn: Callable[[], _T], name: str) -> _T:
    """Run ``fn`` in a dedicated thread; cancelling aborts the stream and waits for it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result = fn()
        except BaseException as exc:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(settle, None, exc)
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name=name, daemon=True).start()
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        # Never leave a thread writing into a file the caller is about to close.
        stream.abort()
        with contextlib.suppress(BaseException):
            await fut
        raise


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("bulk stream closed mid-frame")
        got += n


class _Credits:
    """Credit and verdict state of a sending stream, fed by a reader thread."""

    def __init__(self, window: int) -> None:
        self.cond = threading.Condition()
        self.credit = window
        self.verdict: bool | None = None
        self.closed = False

    def read(self, sock: socket.socket) -> None:
        buf = bytearray(BULK_CREDIT.size)
        try:
            while True:
                _recv_into(sock, memoryview(buf))
                (value,) = BULK_CREDIT.unpack(buf)
                with self.cond:
                    if value in (BULK_VERIFIED, BULK_FAILED):
                        self.verdict = value == BULK_VERIFIED
                        return
                    self.credit = max(self.credit, value)
                    self.cond.notify_all()
        except OSError:
            pass
        finally:
            with self.cond:
                self.closed = True
                self.cond.notify_all()

    def wait_for(self, index: int) -> bool:
        """Until chunk ``index`` may be sent (True) or the stream ended (False)."""
        with self.cond:
            self.cond.wait_for(
                lambda: index < self.credit or self.verdict is not None or self.closed,
                IDLE_TIMEOUT,
            )
            return index < self.credit and self.verdict is None and not self.closed

    def result(self) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.verdict is not None or self.closed, IDLE_TIMEOUT)
            if self.verdict is None:
                raise ConnectionError("bulk stream closed before the verdict")
            return self.verdict


def _log_busy(side: str, pipeline: Pipeline, names: Sequence[str]) -> None:
    """Each step's busy seconds at debug level: the slowest one bounds the rate."""
    if log.isEnabledFor(logging.DEBUG):
        steps = ", ".join(f"{n} {t:.2f}s" for n, t in zip(names, pipeline.busy, strict=False))
        log.debug("bulk %s busy: %s", side, steps)


def _sendmsg_all(sock: socket.socket, parts: list[memoryview]) -> None:
    """``sendall`` of several buffers with one ``sendmsg`` each round (no concatenation)."""
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


async def send_chunks(
    stream: BulkStream,
    stages: Sequence[Stage],
    slots: Sequence[Slot],
    window: int,
    on_sent: Callable[[int], None] | None = None,
) -> bool:
    """Send sealed chunks until the final one, honouring credits; True if the receiver verified.

    ``stages`` fill a slot's ``sealed`` buffer (read, hash, seal: the first is
    the pipeline's source and marks the final slot ``last``); each runs in its
    own thread over the ring ``slots``, and a last stage here frames and sends
    the chunk. Returns False if the receiver reported failure; raises
    ``ConnectionError`` if the stream ends without a verdict.
    """
    if any(len(slot.sealed) > MAX_SEALED for slot in slots):
        raise UsageError(f"sealed buffers larger than {MAX_SEALED} bytes")
    credits = _Credits(window)
    sock = stream.sock
    reader = threading.Thread(target=credits.read, args=(sock,), name="bulk-credits", daemon=True)
    head = bytearray(BULK_FRAME.size)
    index = 0

    def send(slot: Slot) -> None:
        nonlocal index
        if not credits.wait_for(index):
            raise ConnectionError("bulk stream ended before the final chunk")
        BULK_FRAME.pack_into(head, 0, slot.sealed_size)
        _sendmsg_all(sock, [memoryview(head), slot.sealed[: slot.sealed_size]])
        index += 1
        if on_sent is not None:
            on_sent(slot.sealed_size)

    def run() -> bool:
        pipeline = Pipeline(slots, [*stages[1:], send], stream.abort)
        try:
            pipeline.run(stages[0], "bulk-send")
        except ConnectionError:
            if credits.verdict is None:
                raise
            # The receiver ended the stream early; its verdict says how.
        finally:
            _log_busy("send", pipeline, (*(s.__name__ for s in stages), "sendmsg"))
        return credits.result()

    reader.start()
    try:
        return await _in_thread(stream, run, "bulk-send")
    finally:
        stream.abort()  # ends the credit reader
        await asyncio.to_thread(reader.join)


async def receive_chunks(
    stream: BulkStream,
    stages: Sequence[Stage],
    window: int,
    on_chunk: Callable[[], None] | None = None,
    slots: int = PIPELINE_SLOTS,
) -> None:
    """Receive sealed chunks up to the final one, granting credits as they are processed.

    A source here fills each slot's ``sealed`` from the socket; ``stages``
    (open + check, hash, write) then run one thread each over a ring of
    ``slots``; the first must set ``last`` on the final chunk. After the last
    stage ``on_chunk`` (a cheap, thread-safe checkpoint trigger) runs and the
    credit grows, so a slow disk slows the sender. Errors of any stage
    (``DecryptionError``, protocol errors, disk full) propagate and nothing
    after the failing chunk is written. Returns once the final chunk passed
    every stage; the caller then verifies and calls :func:`send_verdict`.
    """
    sock = stream.sock
    head = bytearray(BULK_FRAME.size)
    processed = 0
    granted = window
    step = max(1, window // 4)
    credit_lock = threading.Lock()  # the last stage runs in WRITERS threads

    def receive(slot: Slot) -> None:
        _recv_into(sock, memoryview(head))
        (length,) = BULK_FRAME.unpack(head)
        if length > min(len(slot.sealed), MAX_SEALED):
            raise OversizeError(f"sealed chunk of {length} bytes exceeds {MAX_SEALED}")
        _recv_into(sock, slot.sealed[:length])
        slot.sealed_size = length
        # Unauthenticated here, so only a hint to stop reading: the open stage
        # checks the flag (it is in the AD) and fails the stream if it lied.
        slot.last = length > _FINAL_FLAG_AT and bool(slot.sealed[_FINAL_FLAG_AT] & 1)

    def credit(slot: Slot) -> None:
        nonlocal processed, granted
        with credit_lock:
            processed += 1
            if on_chunk is not None:
                on_chunk()
            if not slot.last and processed + window - granted >= step:
                granted = processed + window
                sock.sendall(BULK_CREDIT.pack(granted))

    *first, final = stages

    def final_then_credit(slot: Slot) -> None:
        final(slot)
        credit(slot)

    def wake() -> None:
        # Only the reading half: the verdict still has to reach the sender.
        sock.shutdown(socket.SHUT_RD)

    def run() -> None:
        ring = Slot.ring(slots, MAX_CHUNK, MAX_SEALED)
        pipeline = Pipeline(ring, [*first, final_then_credit], wake, last_workers=WRITERS)
        try:
            pipeline.run(receive, "bulk-receive")
        finally:
            _log_busy("receive", pipeline, ("recv", *(s.__name__ for s in stages)))

    await _in_thread(stream, run, "bulk-receive")


async def send_verdict(stream: BulkStream, verified: bool) -> None:
    """Tell the sender over the bulk stream whether the file verified."""
    data = BULK_CREDIT.pack(BULK_VERIFIED if verified else BULK_FAILED)
    with contextlib.suppress(OSError):
        await asyncio.to_thread(stream.sock.sendall, data)
