"""Where each sealed record is: record id -> (height, index), ADR 0013.

The ids are random (SHA-256 prefixes, sender-chosen message ids), so writing
each block's ids straight into the ``records`` B-tree dirtied about one leaf
page per record once the tree was large: at a million records 41.9 KB was
written per 376-byte record, 18x the first ten thousand. Here the ids of the
newest blocks live in a dict (:attr:`RecordIndex.recent`) and go into the
index in one batch when the dict holds a quarter of what the index holds (at
least :data:`MIN_BATCH`, at most :data:`MAX_BATCH`).

A batch *rewrites* the index: the old tree and the sorted dict are merged in
key order into the other of two databases (:data:`INDEX_DBS`, ``records`` and
``records_b``) with LMDB's append mode, so its pages are written once, full
and contiguous; ``meta`` :data:`INDEX_DB_KEY` names the one in use. Merging in
place was tried first: a batch of n/8 random ids touched every leaf anyway,
and the leaves it frees lie all over the file; the small transactions that
follow reuse those pages, each dirtying a different large page-cache folio.
Measured at 1M records (bench_chain): in place, write(2) bytes per record
grew 1.3x but device bytes (``write_bytes``) 7.4x; rewritten, both stay
flat (re-measured in place with a quarter: 1.27x write(2) bytes and no less
CPU, LMDB's page splits). The price is CPU and memory: each id is copied about
four times over the life of the log (~0.5 us each; a rewrite every ~n/4
records), and up to :data:`MAX_BATCH` ids are held in memory. A quarter, not
an eighth: a rewrite costs 38 bytes per entry of the tree, so 152 rather than
304 bytes per record; write(2) bytes per record at 100k-1M records were 1.15x
the first 10k with a quarter, 1.29x with an eighth.

A rewrite runs in steps, one per seal, each in the seal's transaction: the
next :data:`STEP` entries of the old tree and the dict's ids among them. At
1M records a whole rewrite held the node's one writer thread ~0.5 s (every
message commit waited); a step holds it ~10-25 ms. The dict being merged is
kept aside (:attr:`RecordIndex.frozen`) and newer ids collect in a new one;
the old tree is not touched until the last step names the new one in ``meta``
and moves the watermark, in one transaction. A rewrite lasts ~n/STEP seals
(~60 at 1M records), so memory holds the ids sealed meanwhile too.

Nothing durable depends on the dicts. ``meta`` :data:`WATERMARK_KEY` holds the
height below which every sealed record is in the index database; it is
written in the same transaction as the last step, and on open the dict is
rebuilt from the blocks at and above it (read in sequence). A crash at any
point leaves the index database, its name and the watermark consistent: LMDB
commits are atomic, and the rows a rewrite cut short left in the other
database are cleared by the next one.

Threads: the dicts are only changed by the sealer (under the log's seal lock);
readers on other threads look in the dicts first (:meth:`RecordIndex.in_memory`)
and then open a new read snapshot, which names its own index database
(:func:`index_db`); a rewrite's ids leave memory only after its last commit,
so a record is always in one place or the other.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from talos.store import Store, Txn

__all__ = [
    "INDEX_DBS",
    "INDEX_DB_KEY",
    "MAX_BATCH",
    "MIN_BATCH",
    "STEP",
    "WATERMARK_KEY",
    "RecordIndex",
    "Step",
    "index_db",
    "record_id_of",
]

#: ``meta`` key: u64 height; every sealed record below it is in the index database.
WATERMARK_KEY = b"chain:indexed_below"
#: ``meta`` key: the name of the database holding the index; absent = ``records``.
INDEX_DB_KEY = b"chain:index_db"
#: The two databases a rewrite alternates between: it builds the other one.
INDEX_DBS = ("records", "records_b")
#: Fewest ids merged at once (a small log keeps its ids in memory until then).
MIN_BATCH = 4096
#: Most ids held in memory: 134 B each in CPython (measured), so ~35 MB. Up to
#: 4x this many records (1M) a batch is a quarter of the tree and the bytes
#: written per record stay flat; beyond, rewrites come more often per record.
MAX_BATCH = 1 << 18
#: A batch is written when it holds 1/BATCH_FRACTION of the ids in the index.
BATCH_FRACTION = 4
#: Old entries a seal copies into the new tree (with the ids in memory that fall
#: among them): ~10-25 ms of the writer, where one rewrite of a 1M-record log in
#: a single seal held it ~0.5-1 s.
STEP = 16384

_U64 = struct.Struct(">Q")


def record_id_of(encoded: bytes) -> bytes:
    """The id of an encoded record without decoding the rest (docs/PROTOCOL.md "Block log")."""
    kind_len = encoded[1]
    at = 3 + kind_len
    return encoded[at : at + encoded[2 + kind_len]]


def index_db(txn: Txn) -> str:
    """The database holding the index in the snapshot ``txn``."""
    name = txn.get("meta", INDEX_DB_KEY)
    return INDEX_DBS[1] if name == INDEX_DBS[1].encode() else INDEX_DBS[0]


@dataclass
class _Pass:
    """A rewrite under way: ``frozen`` (ids of heights [watermark, below)) merged
    with the current tree into the other database, ``STEP`` old entries a seal."""

    frozen: dict[bytes, bytes]
    keys: list[bytes] = field(init=False)
    below: int = 0  # set by the seal that starts it: the height of its block
    done: int = 0  # frozen keys already copied
    resume: bytes | None = b""  # first old key not copied yet; b"" = from the start

    def __post_init__(self) -> None:
        self.keys = sorted(self.frozen)


@dataclass
class Step:
    """What a seal's transaction did to the index, applied by :meth:`RecordIndex.committed`."""

    started: _Pass | None = None
    done: int = 0
    resume: bytes | None = b""
    finished: bool = False


class RecordIndex:
    """Lookups by record id over the newest ids in memory and the rest in the index database."""

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
        #: Ids sealed since the watermark and not in a rewrite under way.
        self.recent: dict[bytes, bytes] = {}
        for key, value in txn.items("block_records", _U64.pack(self.watermark)):
            self.recent[record_id_of(value)] = key
        #: Ids being merged by the rewrite under way (empty when none is).
        self.frozen: dict[bytes, bytes] = {}
        self.current = index_db(txn)
        self._pass: _Pass | None = None  # a rewrite cut short by a crash starts again
        self._indexed = txn.count(self.current)

    @property
    def other(self) -> str:
        """The database the next rewrite builds."""
        return INDEX_DBS[1] if self.current == INDEX_DBS[0] else INDEX_DBS[0]

    @property
    def busy(self) -> bool:
        """Whether a rewrite is under way or ids wait in memory."""
        return self._pass is not None or bool(self.recent)

    def watermark_row(self, txn: Txn) -> None:
        """Write the watermark (the caller commits it, and only then may count it written).

        Written by the first seal after open when the row is missing or was
        lowered, in that seal's transaction: no block can be sealed above an
        unwritten watermark, and opening a log writes nothing (it may run on
        the event loop thread, where the node's writer cannot be waited for).
        """
        txn.put("meta", WATERMARK_KEY, _U64.pack(self.watermark))

    def in_memory(self, record_id: bytes) -> bytes | None:
        """Location of a sealed record held in memory; look here *before* opening
        the snapshot to search with :meth:`stored` (see the module docstring)."""
        return self.recent.get(record_id) or self.frozen.get(record_id)

    @staticmethod
    def stored(txn: Txn, record_id: bytes) -> bytes | None:
        """Location of a sealed record in the index database of the snapshot ``txn``."""
        return txn.get(index_db(txn), record_id)

    def get(self, txn: Txn, record_id: bytes) -> bytes | None:
        """Location (``record_key``) of a sealed record, or None, in the sealer's
        write transaction ``txn`` (where :attr:`current` is exact: only the
        sealer changes it; other threads use :meth:`in_memory` and :meth:`stored`)."""
        return self.in_memory(record_id) or txn.get(self.current, record_id)

    def plan(self, *, adding: int = 0, force: bool = False) -> _Pass | None:
        """Before a seal's transaction, off the writer: the rewrite to start in it
        if one is due once ``adding`` ids are sealed (or ``force``), else None.

        The ids in memory are sorted here, so the transaction does not hold the
        node's writer for it (262,144 ids: ~0.1 s on an idle core). Only the
        sealer changes the index, so ``recent`` cannot change before the seal.
        """
        if self._pass is not None:
            return None
        size = len(self.recent) + adding
        due = size >= MAX_BATCH or (size >= MIN_BATCH and size * BATCH_FRACTION >= self._indexed)
        if not (due or force) or not self.recent:
            return None
        return _Pass(self.recent)

    def step(self, txn: Txn, below: int, start: _Pass | None = None) -> Step:
        """In a seal's transaction: start the rewrite ``start`` (from :meth:`plan`),
        and copy the next ``STEP`` old entries of the one under way. ``below`` is
        the first height whose ids are not in memory yet (the block this
        transaction writes, or the next one). Nothing here changes until
        :meth:`committed` gets the result after the commit."""
        run = self._pass
        if run is None:
            if start is None:
                return Step()
            run = start
            run.below = below
            txn.clear(self.other)  # a rewrite cut short by a crash left rows there
        out = Step(started=start if self._pass is None else None)
        old = txn.items(self.current, run.resume or None)
        try:
            txn.put_many(self.other, _merge_step(old, run, out), append=True)
        finally:
            old.close()
        if out.resume is None:
            out.finished = True
            txn.put("meta", INDEX_DB_KEY, self.other.encode())
            txn.put("meta", WATERMARK_KEY, _U64.pack(run.below))
        return out

    def committed(self, new: dict[bytes, bytes], step: Step) -> None:
        """Account for a committed seal: its ids join memory, the rewrite moves on."""
        self.stale = False
        if step.started is not None:
            # frozen first: a reader that finds ``recent`` emptied finds them there.
            self.frozen = step.started.frozen
            self.recent = new
            self._pass = step.started
        else:
            self.recent.update(new)
        run = self._pass
        if run is None:
            return
        run.done, run.resume = step.done, step.resume
        if step.finished:
            self.current = self.other
            self.watermark = run.below
            self._indexed += len(run.frozen)
            self._pass = None
            self.frozen = {}  # after the commit: the ids are in the new current database


def _merge_step(
    old: Iterable[tuple[bytes, bytes]], run: _Pass, out: Step
) -> Iterator[tuple[bytes, bytes]]:
    """Up to ``STEP`` old pairs and the frozen ids below the next old key, in key
    order (a frozen id equal to an old one wins); where it stopped goes to ``out``.
    When the old tree ends, the frozen ids left follow and ``out.resume`` is None."""
    keys, frozen, done, n = run.keys, run.frozen, run.done, len(run.keys)
    count = 0
    for item in old:
        key = item[0]
        if count == STEP:
            out.done, out.resume = done, key
            return
        while done < n and keys[done] < key:
            k = keys[done]
            yield k, frozen[k]
            done += 1
        count += 1
        if done < n and keys[done] == key:
            k = keys[done]
            yield k, frozen[k]
            done += 1
            continue
        yield item
    while done < n:
        k = keys[done]
        yield k, frozen[k]
        done += 1
    out.done, out.resume = done, None
