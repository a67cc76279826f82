"""Tests for the in-order thread pipeline under the bulk path (talos.transfer.pipeline)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from talos.transfer.pipeline import Pipeline, Slot

CHUNKS = 50


def _source(count: int) -> tuple[list[int], Callable[[Slot], None]]:
    produced: list[int] = []

    def fill(slot: Slot) -> None:
        slot.offset = len(produced)
        slot.plain[0] = slot.offset % 256
        produced.append(slot.offset)
        slot.last = len(produced) == count

    return produced, fill


def test_every_stage_sees_every_chunk_in_order_on_a_small_ring() -> None:
    ring = Slot.ring(3, 16, 32)
    seen: list[list[int]] = [[], [], []]
    in_flight: set[int] = set()
    most = 0
    lock = threading.Lock()

    def stage(i: int) -> Callable[[Slot], None]:
        def run(slot: Slot) -> None:
            nonlocal most
            assert slot.plain[0] == slot.offset % 256  # the buffer still holds its chunk
            seen[i].append(slot.offset)
            with lock:
                in_flight.add(id(slot))
                most = max(most, len(in_flight))
                if i == 2:
                    in_flight.discard(id(slot))

        return run

    produced, fill = _source(CHUNKS)
    Pipeline(ring, [stage(0), stage(1), stage(2)], lambda: None).run(fill, "test")
    assert produced == list(range(CHUNKS))
    assert seen == [list(range(CHUNKS))] * 3
    assert most <= len(ring)  # the ring bounds the chunks in flight, so the memory


def test_no_stages_runs_the_source_alone() -> None:
    produced, fill = _source(5)
    Pipeline(Slot.ring(2, 4, 4), [], lambda: None).run(fill, "test")
    assert produced == [0, 1, 2, 3, 4]


def test_first_error_wins_and_nothing_after_it_reaches_later_stages() -> None:
    woken = threading.Event()
    written: list[int] = []

    def opener(slot: Slot) -> None:
        if slot.offset == 7:
            raise ValueError("chunk 7 is bad")

    def writer(slot: Slot) -> None:
        written.append(slot.offset)

    def late_failure(slot: Slot) -> None:
        # A thread woken by the first failure fails too; its error must not mask the first.
        if woken.is_set():
            raise ConnectionError("woken")

    _, fill = _source(CHUNKS)
    pipeline = Pipeline(Slot.ring(4, 8, 8), [opener, late_failure, writer], woken.set)
    with pytest.raises(ValueError, match="chunk 7"):
        pipeline.run(fill, "test")
    assert woken.is_set()
    assert 7 not in written and all(o < 7 for o in written)


def test_a_failing_source_stops_the_stages() -> None:
    def fill(slot: Slot) -> None:
        raise OSError("source gone")

    calls: list[Slot] = []
    with pytest.raises(OSError, match="source gone"):
        Pipeline(Slot.ring(2, 8, 8), [calls.append], lambda: None).run(fill, "test")
    assert calls == []


def test_aligned_plaintext_buffers() -> None:
    import ctypes

    for slot in Slot.ring(2, 1 << 20, 16):
        assert ctypes.addressof(ctypes.c_char.from_buffer(slot.plain)) % 4096 == 0
        assert len(slot.plain) == 1 << 20 and len(slot.sealed) == 16


def test_a_parallel_last_stage_overlaps_and_still_sees_every_chunk_once() -> None:
    """Two threads in the last stage: both work at once, every chunk passes once,
    and run() returns only after the slower thread finished its chunk."""
    both_in = threading.Barrier(2, timeout=30)
    finished: list[int] = []
    lock = threading.Lock()

    def write(slot: Slot) -> None:
        if slot.offset < 2:
            both_in.wait()  # only returns if the two threads are in here together
        with lock:
            finished.append(slot.offset)

    produced, fill = _source(CHUNKS)
    pipeline = Pipeline(Slot.ring(4, 16, 32), [lambda slot: None, write], lambda: None, 2)
    pipeline.run(fill, "test")
    assert sorted(finished) == produced == list(range(CHUNKS))
    assert len(pipeline.busy) == 3 and all(t >= 0 for t in pipeline.busy)
    assert pipeline.busy[2] > 0


def test_an_error_in_a_parallel_last_stage_stops_both_threads() -> None:
    def write(slot: Slot) -> None:
        if slot.offset == 7:
            raise OSError("disk gone")

    _, fill = _source(CHUNKS)
    with pytest.raises(OSError, match="disk gone"):
        Pipeline(Slot.ring(4, 16, 32), [write], lambda: None, 2).run(fill, "test")
    with pytest.raises(ValueError):
        Pipeline(Slot.ring(1, 4, 4), [write], lambda: None, 0)


def test_a_ring_costs_memory_only_where_chunks_land() -> None:
    # Each authenticated bulk stream gets a ring; an idle one must not hold memory: 16
    # rings of zero-filled bytearrays were +96 MB resident before a byte arrived.
    from talos.transfer.bulk_data import PIPELINE_SLOTS
    from talos.transfer.protocol import BULK_CHUNK

    def resident() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    before = resident()
    rings = [Slot.ring(PIPELINE_SLOTS, BULK_CHUNK, BULK_CHUNK + 25) for _ in range(16)]
    assert resident() - before < 8 << 20
    rings[0][0].sealed[:5] = b"12345"  # written where a chunk lands, like any buffer
    assert bytes(rings[0][0].sealed[:5]) == b"12345"
