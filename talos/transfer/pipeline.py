"""Chunks through threads in order: the bulk path's read/hash/seal/send and
recv/open/hash/write pipelines (docs/adr/0004-bulk-transfer-path.md, "Pipeline").

A fixed ring of :class:`Slot` buffers circulates: the *source* (run in the
calling thread) fills a free slot, every stage takes the slots in order from
the stage before it, and the last stage hands them back to the ring. Each stage
is one thread, so reading, hashing, sealing and the socket (or opening,
hashing and the disk) overlap: SHA-256, ChaCha20-Poly1305 and the syscalls
release the GIL on 1 MiB buffers. On this 2-core VM that hides the O_DIRECT
write latency and lets each process use the core the other leaves idle
(numbers in the ADR).

The first error in any thread wins: every thread stops taking slots, ``wake``
is called to unblock a thread parked in a socket call, and :meth:`Pipeline.run`
re-raises that error once all threads have ended. A stage therefore never
sees a slot after a failure upstream (a chunk that failed to open is never
written).
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Pipeline", "Slot", "aligned_buffer"]


def aligned_buffer(size: int) -> memoryview:
    """A page-aligned writable buffer (anonymous mmap), usable for ``O_DIRECT`` writes."""
    return memoryview(mmap.mmap(-1, max(size, 1)))


@dataclass(slots=True, eq=False)
class Slot:
    """One chunk in flight; its buffers are allocated once and reused round the ring."""

    #: plaintext (page-aligned, so the receiver can write it with O_DIRECT)
    plain: memoryview
    #: the sealed chunk (talos_sdk.aead layout)
    sealed: memoryview
    #: bytes of plaintext in ``plain``
    size: int = 0
    #: bytes of ``sealed`` in use
    sealed_size: int = 0
    #: where the plaintext goes in the file
    offset: int = 0
    #: the stream's final (commit) chunk: every stage stops after it
    last: bool = False

    @classmethod
    def ring(cls, count: int, plain_size: int, sealed_size: int) -> list[Slot]:
        """``count`` slots with buffers of the given sizes."""
        return [
            cls(aligned_buffer(plain_size), memoryview(bytearray(sealed_size)))
            for _ in range(count)
        ]


Stage = Callable[[Slot], None]
_STOP = None


class Pipeline:
    """``source`` then ``stages``, each in its own thread, over a ring of ``slots``."""

    def __init__(self, slots: Sequence[Slot], stages: Sequence[Stage], wake: Callable[[], None]):
        self._free: queue.SimpleQueue[Slot | None] = queue.SimpleQueue()
        for slot in slots:
            self._free.put(slot)
        self._stages = list(stages)
        self._queues: list[queue.SimpleQueue[Slot | None]] = [
            queue.SimpleQueue() for _ in self._stages
        ]
        self._wake = wake
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = exc
        for q in (self._free, *self._queues):
            q.put(_STOP)
        with contextlib.suppress(Exception):
            self._wake()

    def _stage(self, index: int) -> None:
        inbox = self._queues[index]
        outbox = self._queues[index + 1] if index + 1 < len(self._queues) else self._free
        work = self._stages[index]
        try:
            while (slot := inbox.get()) is not _STOP and self._error is None:
                work(slot)
                outbox.put(slot)
                if slot.last:
                    return
        except BaseException as exc:
            self._fail(exc)

    def run(self, source: Stage, name: str) -> None:
        """Fill slots with ``source`` until it marks one ``last``; returns once that slot
        passed every stage, or raises the first error of any thread."""
        threads = [
            threading.Thread(target=self._stage, args=(i,), name=f"{name}-{i + 1}", daemon=True)
            for i in range(len(self._stages))
        ]
        for thread in threads:
            thread.start()
        first = self._queues[0] if self._queues else self._free
        try:
            while (slot := self._free.get()) is not _STOP and self._error is None:
                slot.last = False
                source(slot)
                first.put(slot)
                if slot.last:
                    break
        except BaseException as exc:
            self._fail(exc)
        for thread in threads:
            thread.join()
        if self._error is not None:
            raise self._error
