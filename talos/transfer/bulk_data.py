"""The data phase of the bulk TCP path (docs/adr/0004-bulk-transfer-path.md).

Once :mod:`talos.transfer.bulk` has authenticated a stream, it carries::

    sender   -> receiver: ( u32 length | sealed chunk )*      (talos_sdk.aead layout)
    receiver -> sender:   ( u64 credit )*  then u64 BULK_VERIFIED / BULK_FAILED

Credits are chunk indices: the sender may send chunk ``i`` only while
``i < credit``, so a slow receiver slows the sender and neither side holds
more than ``window`` chunks (the kernel's socket buffers are the queue).

The data phase runs in dedicated threads on the blocking socket, as a
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
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

from talos.aio import uncancelled
from talos.transfer.bulk import IDLE_TIMEOUT, MAX_SEALED, BulkStream
from talos.transfer.pipeline import Pipeline, Slot, Stage
from talos.transfer.protocol import (
    BULK_CREDIT,
    BULK_FAILED,
    BULK_FRAME,
    BULK_VERIFIED,
    MAX_CHUNK,
)
from talos_sdk.errors import UsageError

__all__ = ["PIPELINE_SLOTS", "WRITERS", "receive_chunks", "send_chunks", "send_verdict"]

#: Bytes per second a bulk frame must arrive at, beyond IDLE_TIMEOUT of grace (32 kbit/s,
#: below a 2G mobile link): a 1 MiB frame may take 60 + 256 s. A peer trickling a byte
#: now and then no longer holds a receive (and one of MAX_BULK_RECEIVES) for ever.
MIN_RATE: Final = 4096
#: Chunks in flight inside one process: one per pipeline stage plus slack for jitter.
PIPELINE_SLOTS: Final = 6
#: Receiver threads writing to disk at once: two positional writes in flight hide
#: the per-write latency of the disk (ADR 0004, "Pipeline").
WRITERS: Final = 2
log = logging.getLogger(__name__)
_FINAL_FLAG_AT: Final = 8  # flags byte of the aead chunk header
_T = TypeVar("_T")


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
    # Never leave a thread writing into a file the caller is about to close: a cancel
    # shuts the stream down (which wakes the thread) and waits for the thread's end.
    return await uncancelled(fut, on_cancel=stream.abort)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; with ``deadline`` (``time.monotonic``), fail once it has passed.

    The socket's timeout (IDLE_TIMEOUT) bounds each read that makes no progress;
    the deadline bounds the whole, so a peer trickling a byte now and then cannot
    hold the stream open. Checked between reads: a frame ends at most one
    IDLE_TIMEOUT after it.
    """
    got = 0
    while got < len(view):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("bulk frame not complete in time (below MIN_RATE)")
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
    on_sent: Callable[[Slot], None] | None = None,
) -> bool:
    """Send sealed chunks until the final one, honouring credits; True if the receiver verified.

    ``stages`` fill a slot's ``sealed`` buffer (read, hash, seal: the first is
    the pipeline's source and marks the final slot ``last``); each runs in its
    own thread over the ring ``slots``, and a last stage here frames and sends
    the chunk, then calls ``on_sent(slot)``. Returns False if the receiver reported failure; raises
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
            on_sent(slot)

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
        started = time.monotonic()
        _recv_into(sock, memoryview(head), started + IDLE_TIMEOUT)
        (length,) = BULK_FRAME.unpack(head)
        if length > min(len(slot.sealed), MAX_SEALED):
            # The length is not authenticated: damage in transit, worth another attempt,
            # not a verdict on the transfer.
            raise ConnectionError(f"sealed chunk of {length} bytes exceeds {MAX_SEALED}")
        _recv_into(sock, slot.sealed[:length], started + IDLE_TIMEOUT + length / MIN_RATE)
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
