"""The dedicated bulk TCP path for file data (docs/adr/0004-bulk-transfer-path.md).

The receiver runs one :class:`BulkListener`; for each accepted attempt it
registers a one-time 32-byte token (sent to the sender inside the
ratchet-sealed ACCEPT). The sender connects and both sides prove the token
with HMAC over fresh nonces (:func:`~talos.transfer.protocol.bulk_client_proof`),
so only the peer that holds the session can attach, and the sender knows it
reached the right receiver. The data phase that follows (credits, the
pipelines of each side) is :mod:`talos.transfer.bulk_data`.

The handshake runs on the event loop with ``loop.sock_*`` calls on the raw
socket (no stream read-ahead, so nothing of the data phase is swallowed);
:func:`_to_data_phase` then makes the socket blocking for the data threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from talos.link.admission import Admission
from talos.transfer.protocol import (
    BULK_HELLO,
    BULK_MAGIC,
    BULK_PROOF,
    BULK_REPLY,
    MAX_CHUNK,
    NONCE_LEN,
    TOKEN_LEN,
    bulk_client_proof,
    bulk_server_proof,
)
from talos_sdk.aead import CHUNK_HEADER_SIZE, TAG_SIZE
from talos_sdk.errors import HandshakeError, ProtocolError, UsageError

__all__ = [
    "MAX_UNAUTHENTICATED",
    "MAX_UNAUTHENTICATED_PER_ADDRESS",
    "BulkListener",
    "BulkStream",
    "connect_bulk",
]

MAX_SEALED: Final = MAX_CHUNK + CHUNK_HEADER_SIZE + TAG_SIZE
HANDSHAKE_TIMEOUT: Final = 10.0
#: Connections still proving a token, in total and from one source address;
#: more are closed at once (each holds a socket and a task until its timeout).
MAX_UNAUTHENTICATED: Final = 32
MAX_UNAUTHENTICATED_PER_ADDRESS: Final = 8
#: A data-phase socket call that makes no progress this long ends the attempt.
IDLE_TIMEOUT: Final = 60.0
#: Socket buffers sized for a few sealed chunks in flight on a fast link.
SOCKET_BUFFER: Final = 4 << 20
log = logging.getLogger(__name__)


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
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                stream, entry = await self._authenticate(conn)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ProtocolError):
            self.refused += 1
            conn.close()
            return
        except asyncio.CancelledError:
            conn.close()
            raise
        finally:
            self._admission.leave(address)
        # Only to the attempt whose token it proved: the entry may have been withdrawn,
        # or replaced by the next attempt's, while the handshake ran.
        if self._expected.get(stream.tid) is not entry:
            await stream.close()
            return
        del self._expected[stream.tid]
        await entry[1](stream)

    async def _authenticate(
        self, conn: socket.socket
    ) -> tuple[BulkStream, tuple[bytes, BulkHandler]]:
        """Run the token proof; the stream and the expected entry it proved."""
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
        return BulkStream(tid, conn), entry

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

    async with asyncio.timeout(timeout):
        return await dial()
