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

The last stage may run in several threads (``last_workers``): its slots then
finish out of order, so only a stage whose effect does not depend on order
(the receiver's positional ``pwrite``) may be run that way; two writes in
flight hide the disk's per-write latency (numbers in the ADR). :attr:`busy`
holds each step's time inside its work (source first), to find the slow one.

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
import time
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
        """``count`` slots with buffers of the given sizes.

        Both are anonymous maps, not zero-filled bytearrays: a page costs memory only
        once a chunk reaches it, and the whole ring goes back to the system when the
        stream ends (bytearrays touched every page when a connection authenticated, and
        the allocator kept them: 64 idle connections held +390 MB, for good).
        """
        return [cls(aligned_buffer(plain_size), aligned_buffer(sealed_size)) for _ in range(count)]


Stage = Callable[[Slot], None]
_STOP = None


class Pipeline:
    """``source`` then ``stages``, each in its own thread, over a ring of ``slots``."""

    def __init__(
        self,
        slots: Sequence[Slot],
        stages: Sequence[Stage],
        wake: Callable[[], None],
        last_workers: int = 1,
    ):
        if last_workers < 1:
            raise ValueError("last_workers must be at least 1")
        self._free: queue.SimpleQueue[Slot | None] = queue.SimpleQueue()
        for slot in slots:
            self._free.put(slot)
        self._stages = list(stages)
        self._queues: list[queue.SimpleQueue[Slot | None]] = [
            queue.SimpleQueue() for _ in self._stages
        ]
        self._last_workers = last_workers if self._stages else 1
        self._wake = wake
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        #: seconds each step spent in its work: ``busy[0]`` the source, then each stage
        #: (summed over the last stage's threads)
        self.busy = [0.0] * (len(self._stages) + 1)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = exc
        for q in (self._free, *self._queues):
            q.put(_STOP)
        for _ in range(self._last_workers - 1):
            self._queues[-1].put(_STOP)
        with contextlib.suppress(Exception):
            self._wake()

    def _step(
        self,
        index: int,
        inbox: queue.SimpleQueue[Slot | None],
        outbox: queue.SimpleQueue[Slot | None],
        work: Stage,
    ) -> bool:
        """Move slots from ``inbox`` through ``work`` to ``outbox`` up to the ``last``
        one (True) or until the pipeline fails (False); ``busy[index]`` adds up."""
        clock = time.perf_counter
        busy = 0.0
        try:
            while (slot := inbox.get()) is not _STOP and self._error is None:
                if index == 0:
                    slot.last = False
                start = clock()
                work(slot)
                busy += clock() - start
                outbox.put(slot)
                if slot.last:
                    return True
        except BaseException as exc:
            self._fail(exc)
        finally:
            with self._lock:
                self.busy[index] += busy
        return False

    def _stage(self, index: int) -> None:
        inbox = self._queues[index]
        outbox = self._queues[index + 1] if index + 1 < len(self._queues) else self._free
        if self._step(index + 1, inbox, outbox, self._stages[index]) and outbox is self._free:
            # The other threads of a parallel last stage wait for slots that never come.
            for _ in range(self._last_workers - 1):
                inbox.put(_STOP)

    def run(self, source: Stage, name: str) -> None:
        """Fill slots with ``source`` until it marks one ``last``; returns once that slot
        passed every stage, or raises the first error of any thread."""
        counts = [1] * len(self._stages)
        if counts:
            counts[-1] = self._last_workers
        threads = [
            threading.Thread(target=self._stage, args=(i,), name=f"{name}-{i + 1}.{k}", daemon=True)
            for i, count in enumerate(counts)
            for k in range(count)
        ]
        for thread in threads:
            thread.start()
        first = self._queues[0] if self._queues else self._free
        self._step(0, self._free, first, source)
        for thread in threads:
            thread.join()
        if self._error is not None:
            raise self._error
