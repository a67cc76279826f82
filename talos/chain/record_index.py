"""Where each sealed record is: record id -> (height, index), ADR 0013.

The ids are random (SHA-256 prefixes, sender-chosen message ids), so writing
each block's ids straight into the ``records`` B-tree dirtied about one leaf
page per record once the tree was large: at a million records 41.9 KB was
written per 376-byte record, 18x the first ten thousand. Here the ids of the
newest blocks live in a dict (:attr:`RecordIndex.recent`) and go into
``records`` in one batch when the dict holds a quarter of what ``records``
does (at least :data:`MIN_BATCH`, at most :data:`MAX_BATCH`).

A batch *rewrites* ``records``: the old tree, read from a snapshot, and the
sorted dict are merged into the emptied database in key order with LMDB's
append mode, so its pages are written once, full and contiguous. Merging in
place was tried first: a batch of n/8 random ids touched every leaf anyway,
and the leaves it frees lie all over the file; the small transactions that
follow reuse those pages, each dirtying a different large page-cache folio.
Measured at 1M records (bench_chain): in place, write(2) bytes per record
grew 1.3x but device bytes (``write_bytes``) 7.4x; rewritten, both stay
flat. The price is CPU and memory: each id is copied about four times over
the life of the log (~0.5 us each; a rewrite every ~n/4 records, in the
seal's transaction), and up to :data:`MAX_BATCH` ids are held in memory.
A quarter, not an eighth: a rewrite costs 38 bytes per entry of the tree,
so 152 rather than 304 bytes per record; write(2) bytes per record at
100k-1M records were 1.15x the first 10k with a quarter, 1.29x with an eighth.

Nothing durable depends on the dict. ``meta`` :data:`WATERMARK_KEY` holds the
height below which every sealed record is in ``records``; it is written in the
same transaction as the batch, and on open the dict is rebuilt from the blocks
at and above it (at most :data:`MAX_BATCH` records, read in sequence). A crash
at any point leaves ``records`` and the watermark consistent: LMDB commits are
atomic.

Threads: the dict is only changed by the sealer (under the log's seal lock);
readers on other threads look in the dict first and then open a new read
snapshot, and a batch swaps in an empty dict only after its commit, so a
record is always in one place or the other.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

from talos.store import Store, Txn

__all__ = ["MAX_BATCH", "MIN_BATCH", "WATERMARK_KEY", "RecordIndex", "record_id_of"]

#: ``meta`` key: u64 height; every sealed record below it is in ``records``.
WATERMARK_KEY = b"chain:indexed_below"
#: Fewest ids merged at once (a small log keeps its ids in memory until then).
MIN_BATCH = 4096
#: Most ids held in memory: 134 B each in CPython (measured), so ~35 MB. Up to
#: 4x this many records (1M) a batch is a quarter of the tree and the bytes
#: written per record stay flat; beyond, rewrites come more often per record.
MAX_BATCH = 1 << 18
#: A batch is written when it holds 1/BATCH_FRACTION of the ids in ``records``.
BATCH_FRACTION = 4

_U64 = struct.Struct(">Q")


def record_id_of(encoded: bytes) -> bytes:
    """The id of an encoded record without decoding the rest (docs/PROTOCOL.md "Block log")."""
    kind_len = encoded[1]
    at = 3 + kind_len
    return encoded[at : at + encoded[2 + kind_len]]


class RecordIndex:
    """Lookups by record id over the newest ids in memory and the rest in ``records``."""

    def __init__(self, store: Store, txn: Txn, next_height: int) -> None:
        """Load from a read snapshot; ``next_height`` is the height the next block gets."""
        self._store = store
        raw = txn.get("meta", WATERMARK_KEY)
        if raw is None:
            # A store from before the watermark indexed every block as it sealed it.
            self.watermark = next_height
            self.stale = True
        else:
            # Above the tip only if the log was cut short by hand: clamp it, or
            # blocks sealed next would count as indexed without being so.
            self.watermark = min(_U64.unpack(raw)[0], next_height)
            self.stale = self.watermark != _U64.unpack(raw)[0]
        self.recent: dict[bytes, bytes] = {}
        for key, value in txn.items("block_records", _U64.pack(self.watermark)):
            self.recent[record_id_of(value)] = key
        self._indexed = txn.count("records")

    def watermark_row(self, txn: Txn) -> None:
        """Write the watermark (the caller commits it, and only then may count it written).

        Written by the first seal after open when the row is missing or was
        lowered, in that seal's transaction: no block can be sealed above an
        unwritten watermark, and opening a log writes nothing (it may run on
        the event loop thread, where the node's writer cannot be waited for).
        """
        txn.put("meta", WATERMARK_KEY, _U64.pack(self.watermark))

    def get(self, txn: Txn, record_id: bytes) -> bytes | None:
        """Location (``record_key``) of a sealed record in the snapshot ``txn``, or None."""
        loc = self.recent.get(record_id)
        return loc if loc is not None else txn.get("records", record_id)

    def batch_due(self, adding: int) -> bool:
        """Whether the dict, after ``adding`` more ids, should go into ``records``."""
        size = len(self.recent) + adding
        if size >= MAX_BATCH:
            return True
        return size >= MIN_BATCH and size * BATCH_FRACTION >= self._indexed

    def write_batch(self, txn: Txn, new: dict[bytes, bytes], below: int) -> None:
        """Rewrite ``records`` with the dict and ``new`` merged in, and move the
        watermark to ``below``; call :meth:`committed` with True after the commit."""
        batch = dict(self.recent)
        batch.update(new)
        # The snapshot is the state this write transaction started from (LMDB
        # has one writer), and it keeps the old pages readable after the drop.
        with self._store.read() as old:
            txn.clear("records")
            txn.put_many(
                "records", _merge(old.items("records"), sorted(batch.items())), append=True
            )
        txn.put("meta", WATERMARK_KEY, _U64.pack(below))

    def committed(self, new: dict[bytes, bytes], *, batched: bool, below: int) -> None:
        """Account for a committed seal: its ids join the dict, or the batch is on disk."""
        self.stale = False
        if batched:
            self._indexed += len(self.recent) + len(new)
            self.watermark = below
            self.recent = {}  # a new dict: readers holding the old one still find the ids
        else:
            self.recent.update(new)


def _merge(
    old: Iterable[tuple[bytes, bytes]], new: list[tuple[bytes, bytes]]
) -> Iterator[tuple[bytes, bytes]]:
    """Two key-ordered streams as one; on an equal key the new entry wins."""
    rest = iter(new)
    nxt = next(rest, None)
    for item in old:
        key = item[0]
        while nxt is not None and nxt[0] < key:
            yield nxt
            nxt = next(rest, None)
        if nxt is not None and nxt[0] == key:
            continue
        yield item
    if nxt is not None:
        yield nxt
        yield from rest
