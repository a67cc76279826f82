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
``i < credit``, so a slow receiver slows the sender and neither side buffers
more than ``window`` chunks. Sealing, opening, hashing and disk I/O run in a
worker thread, overlapped with the socket I/O of the neighbouring chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

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
    "BulkListener",
    "BulkStream",
    "connect_bulk",
    "receive_chunks",
    "send_chunks",
    "send_verdict",
]

MAX_SEALED: Final = MAX_CHUNK + CHUNK_HEADER_SIZE + TAG_SIZE
HANDSHAKE_TIMEOUT: Final = 10.0
_STREAM_LIMIT: Final = 4 << 20
_FINAL_FLAG_AT: Final = 8  # flags byte of the aead chunk header


@dataclass(frozen=True, slots=True)
class BulkStream:
    """An authenticated bulk connection for one transfer attempt."""

    tid: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def close(self) -> None:
        """Close the TCP connection (errors on a dead socket are irrelevant here)."""
        self.writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await self.writer.wait_closed()


BulkHandler = Callable[[BulkStream], Awaitable[None]]


def _tune(writer: asyncio.StreamWriter) -> None:
    # Let one whole sealed chunk sit in the transport while the next is sealed.
    writer.transport.set_write_buffer_limits(high=2 * MAX_SEALED, low=MAX_SEALED // 2)


class BulkListener:
    """The receiver's bulk TCP listener; attaches each connection to a registered attempt."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._port = port
        self._expected: dict[bytes, tuple[bytes, BulkHandler]] = {}
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.refused = 0

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._server is None:
            raise UsageError("bulk listener not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Bind and listen."""
        self._server = await asyncio.start_server(
            self._on_connect, self.host, self._port, limit=_STREAM_LIMIT
        )

    def expect(self, tid: bytes, token: bytes, handler: BulkHandler) -> None:
        """Accept one connection proving ``token`` for ``tid`` and hand it to ``handler``."""
        if len(token) != TOKEN_LEN:
            raise UsageError("bulk token must be 32 bytes")
        self._expected[tid] = (token, handler)

    def forget(self, tid: bytes) -> None:
        """Withdraw the token of ``tid`` (attempt over or replaced)."""
        self._expected.pop(tid, None)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            stream = await asyncio.wait_for(self._authenticate(reader, writer), HANDSHAKE_TIMEOUT)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ProtocolError):
            self.refused += 1
            writer.close()
            return
        finally:
            if task is not None:
                self._tasks.discard(task)
        token_handler = self._expected.pop(stream.tid, None)
        if token_handler is None:  # raced with forget()
            await stream.close()
            return
        await token_handler[1](stream)

    async def _authenticate(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> BulkStream:
        magic, tid, client_nonce = BULK_HELLO.unpack(await reader.readexactly(BULK_HELLO.size))
        entry = self._expected.get(tid)
        if magic != BULK_MAGIC or entry is None:
            raise HandshakeError("unknown bulk transfer")
        token = entry[0]
        server_nonce = os.urandom(NONCE_LEN)
        proof = bulk_server_proof(token, tid, client_nonce, server_nonce)
        writer.write(BULK_REPLY.pack(server_nonce, proof))
        (client_proof,) = BULK_PROOF.unpack(await reader.readexactly(BULK_PROOF.size))
        expected = bulk_client_proof(token, tid, client_nonce, server_nonce)
        if not hmac.compare_digest(client_proof, expected):
            raise HandshakeError("bad bulk token proof")
        _tune(writer)
        return BulkStream(tid, reader, writer)

    async def close(self) -> None:
        """Stop listening; connections already handed to handlers are theirs to close."""
        self._expected.clear()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks):
            task.cancel()


async def connect_bulk(
    host: str, port: int, tid: bytes, token: bytes, timeout: float = HANDSHAKE_TIMEOUT
) -> BulkStream:
    """Dial the receiver's bulk listener and run the token handshake.

    :class:`HandshakeError` if the listener refuses or proves the wrong token;
    ``OSError`` / ``TimeoutError`` if it cannot be reached (caller falls back).
    """

    async def dial() -> BulkStream:
        reader, writer = await asyncio.open_connection(host, port, limit=_STREAM_LIMIT)
        try:
            client_nonce = os.urandom(NONCE_LEN)
            writer.write(BULK_HELLO.pack(BULK_MAGIC, tid, client_nonce))
            try:
                reply = await reader.readexactly(BULK_REPLY.size)
            except asyncio.IncompleteReadError:
                raise HandshakeError("bulk listener refused the transfer") from None
            server_nonce, proof = BULK_REPLY.unpack(reply)
            if not hmac.compare_digest(
                proof, bulk_server_proof(token, tid, client_nonce, server_nonce)
            ):
                raise HandshakeError("bulk listener did not prove the transfer token")
            writer.write(BULK_PROOF.pack(bulk_client_proof(token, tid, client_nonce, server_nonce)))
            _tune(writer)
            return BulkStream(tid, reader, writer)
        except BaseException:
            writer.close()
            raise

    return await asyncio.wait_for(dial(), timeout)


async def send_chunks(
    stream: BulkStream,
    next_sealed: Callable[[], bytes],
    window: int,
    on_sent: Callable[[int], None] | None = None,
) -> bool:
    """Send sealed chunks until the final one, honouring credits; True if the receiver verified.

    ``next_sealed`` runs in a worker thread (read + seal), one chunk ahead of
    the socket. Returns False if the receiver reported failure; raises
    ``ConnectionError`` if the stream ends without a verdict.
    """
    loop = asyncio.get_running_loop()
    credit = window
    verdict: asyncio.Future[bool] = loop.create_future()
    more_credit = asyncio.Event()

    async def read_credits() -> None:
        nonlocal credit
        try:
            while True:
                (value,) = BULK_CREDIT.unpack(await stream.reader.readexactly(BULK_CREDIT.size))
                if value in (BULK_VERIFIED, BULK_FAILED):
                    verdict.set_result(value == BULK_VERIFIED)
                    return
                credit = max(credit, value)
                more_credit.set()
        except (asyncio.IncompleteReadError, OSError):
            if not verdict.done():
                verdict.set_exception(ConnectionError("bulk stream closed before the verdict"))
        finally:
            more_credit.set()

    credits_task = asyncio.create_task(read_credits())
    job: asyncio.Future[bytes] | None = loop.run_in_executor(None, next_sealed)
    index = 0
    try:
        while job is not None:
            sealed = await job
            final = bool(sealed[_FINAL_FLAG_AT] & 1)
            job = None if final else loop.run_in_executor(None, next_sealed)
            while index >= credit and not verdict.done():
                more_credit.clear()
                await more_credit.wait()
            if verdict.done():
                break
            stream.writer.write(BULK_FRAME.pack(len(sealed)))
            stream.writer.write(sealed)
            await stream.writer.drain()
            index += 1
            if on_sent is not None:
                on_sent(len(sealed))
        return await verdict
    finally:
        if job is not None:  # never leave a worker reading a file we are about to close
            with contextlib.suppress(Exception):
                await job
        credits_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await credits_task


async def receive_chunks(
    stream: BulkStream,
    process: Callable[[bytes], bool],
    window: int,
    after_chunk: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Receive sealed chunks up to the final one, granting credits as they are processed.

    ``process`` (open + check + write) runs in a worker thread while the next
    chunk is read from the socket; its errors (``DecryptionError``, protocol
    errors, disk full) propagate. ``after_chunk`` runs on the loop after each
    chunk, in order (checkpointing). Returns once the final chunk is written;
    the caller then verifies and calls :func:`send_verdict`.
    """
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[bool] | None = None
    processed = 0
    granted = window
    step = max(1, window // 4)

    async def settle() -> None:
        nonlocal pending, processed, granted
        assert pending is not None
        job, pending = pending, None
        await job
        processed += 1
        if after_chunk is not None:
            await after_chunk()
        if processed + window - granted >= step:
            granted = processed + window
            stream.writer.write(BULK_CREDIT.pack(granted))

    try:
        while True:
            (length,) = BULK_FRAME.unpack(await stream.reader.readexactly(BULK_FRAME.size))
            if length > MAX_SEALED:
                raise OversizeError(f"sealed chunk of {length} bytes exceeds {MAX_SEALED}")
            body = await stream.reader.readexactly(length)
            if pending is not None:
                await settle()
            pending = loop.run_in_executor(None, process, body)
            # The flag is only a hint for when to stop reading; the AEAD authenticates it.
            if length > _FINAL_FLAG_AT and body[_FINAL_FLAG_AT] & 1:
                await settle()
                return
    finally:
        if pending is not None:
            with contextlib.suppress(Exception):
                await pending


async def send_verdict(stream: BulkStream, verified: bool) -> None:
    """Tell the sender over the bulk stream whether the file verified."""
    with contextlib.suppress(OSError):
        stream.writer.write(BULK_CREDIT.pack(BULK_VERIFIED if verified else BULK_FAILED))
        await stream.writer.drain()
