"""Re-validate a whole block log and report its defects with their places (``talosd chain verify``;
at most MAX_DEFECTS are listed, the rest counted).

Checks (docs/PROTOCOL.md "Block log"): heights are 0..n-1 with no gap and
match their keys; every block links to the stored bytes of the one before;
author, record count, Merkle root and node signature of every block; the
sender signature of every record; the record index (``records``, or
``records_b`` when ``meta`` ``chain:index_db`` names it, ADR 0013) names
exactly the sealed records, each at its place.

Memory does not grow with the log (nor with one height's records: a height
holding more than a block can, ``MAX_BLOCK_RECORDS`` records or
:data:`MAX_HEIGHT_BYTES`, is a defect and only that much is checked): the
parent walks ``blocks`` and ``block_records`` with two cursors of one LMDB read
snapshot, cuts the stream into chunks of about :data:`CHUNK_RECORDS` records
(computing each block's expected ``prev_hash`` on the way, so links across
chunks are its job) and
hands them to worker *processes*, at most two per worker in flight. Processes,
not threads: per-record Python work (decode, leaf hashing, Ed25519) holds the
GIL. Workers never open the store (no pages a live writer may be recycling, no
second snapshot): a chunk's bytes are pickled to them, about 0.5 MB per chunk.
At a million records this keeps the verifier's own memory at a few MB where
reading the log into dicts first took 1.24 GB.

The record index is checked without a table of all record ids: each sealed
record looks up its id in the index database (and, when the index names
another place, reads the record there to tell a duplicate id from a wrong
entry). The index entries that matched are counted; only if the index holds
more entries than that is it walked to name the extra ones. Records at and
above the index watermark (``meta`` ``chain:indexed_below``, ADR 0013) may be
missing from it: the node keeps their ids in memory until a batch. Their ids
are kept here to catch a duplicate among them (about ``record_index.MAX_BATCH``
of them in a log the node wrote, ~35 MB, plus those sealed while a rewrite
ran); a store without the watermark row must have every record indexed. The
other index database (a rewrite under way, or the previous tree) is not read.

Hybrid nodes (ADR 0005): the caller passes the node's ML-DSA-65 public key,
taken from its wallet (or a pin), never from the store being audited; blocks
from the first hybrid height on must be version 2 blocks under that key, blocks
below it version 1. That height comes from the caller too when its key file
keeps it (``hybrid_since``, docs/PROTOCOL.md "Block log"), and a store whose
``meta`` ``chain:hybrid_since`` row says otherwise is a defect: a forger of
Ed25519 rewriting hybrid blocks classically would move the row past them.
Otherwise the row decides (0 if it is missing).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import struct
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from talos.chain.block import (
    GENESIS_PREV,
    MAX_BLOCK_RECORDS,
    Block,
    BlockLinkError,
    ChainDefect,
    Record,
    check_record_signature,
    collect_block_defects,
)
from talos.chain.log import HYBRID_SINCE_KEY
from talos.chain.record_index import WATERMARK_KEY, index_db
from talos.store import Store, Txn
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import MalformedFrameError, StorageError
from talos_sdk.hybrid import HybridPublicKey

__all__ = ["Defect", "RecordIndexError", "VerifyReport", "verify_chain"]

_LOC = struct.Struct(">QI")
#: Below this many records one process is faster than starting workers.
PARALLEL_THRESHOLD = 4096
#: Records per chunk handed to a worker: ~0.1 s of Ed25519 on one core, so a
#: slow (shared) core holds up little and the pickling (~0.5 MB) is amortised.
CHUNK_RECORDS = 2048
#: Record bytes per chunk at most (a legitimate chunk of CHUNK_RECORDS is ~1 MB).
CHUNK_BYTES = 16 << 20
#: Bytes of one height's records held at most: a legitimate block of MAX_BLOCK_RECORDS
#: records, each with a commitment and an extra at their bounds, stays below it.
MAX_HEIGHT_BYTES = 64 << 20
#: Defects listed in a report; more are counted (``VerifyReport.omitted``): a store
#: damaged throughout must not make the report as large as the log.
MAX_DEFECTS = 10_000


class RecordIndexError(ChainDefect):
    """The ``records`` index disagrees with the sealed records."""

    code = "record_index"


@dataclass(frozen=True, slots=True)
class Defect:
    """One problem found: what (``code``, ``message``) and where (``height``, ``index``)."""

    code: str
    height: int | None
    index: int | None
    message: str

    @classmethod
    def of(cls, err: ChainDefect) -> Defect:
        return cls(err.code, err.height, err.index, err.detail)


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Result of :func:`verify_chain`; ``ok`` when no defect was found."""

    blocks: int
    records: int
    head_height: int
    head_hash: bytes | None
    defects: tuple[Defect, ...] = field(default=())
    workers: int = 1
    omitted: int = 0  # defects found beyond MAX_DEFECTS, not listed

    @property
    def ok(self) -> bool:
        return not self.defects


class _Found(list[Defect]):
    """The defects found: the first :data:`MAX_DEFECTS` kept, the others counted."""

    omitted = 0

    def append(self, defect: Defect) -> None:
        if len(self) < MAX_DEFECTS:
            super().append(defect)
        else:
            self.omitted += 1

    def extend(self, defects: Iterable[Defect]) -> None:
        for defect in defects:
            self.append(defect)


# The node's ML-DSA-65 key and the first height it must sign (bytes: picklable).
_Auth = tuple[bytes, int] | None
# (height, block bytes or None, [(index, record bytes)], expected prev_hash or None)
_Job = tuple[int, bytes | None, list[tuple[int, bytes]], bytes | None]
# defects, [(record_id, height, index)], record count
_Result = tuple[list[Defect], list[tuple[bytes, int, int]], int]


def _check_block(job: _Job, node_did: str, auth: tuple[HybridPublicKey, int] | None) -> _Result:
    height, raw, raw_records, prev = job
    defects: list[Defect] = []
    ids: list[tuple[bytes, int, int]] = []
    records: list[Record] = []
    for expect, (index, data) in enumerate(raw_records):
        if index != expect:
            defects.append(Defect("record_count", height, expect, f"record slot {expect} missing"))
            break
        try:
            record = Record.from_bytes(data)
        except MalformedFrameError as exc:
            defects.append(Defect("malformed", height, index, f"record does not decode: {exc}"))
            continue
        records.append(record)
        ids.append((record.record_id, height, index))
    if raw is None:
        defects.append(Defect("missing_block", height, None, "no block stored at this height"))
        return defects, ids, len(raw_records)
    try:
        block = Block.from_bytes(raw)
    except MalformedFrameError as exc:
        defects.append(Defect("malformed", height, None, f"block does not decode: {exc}"))
        return defects, ids, len(raw_records)
    if defects:  # a record is missing or unreadable: root and count cannot match
        for i, record in enumerate(records):
            why = check_record_signature(record, node_did)
            if why is not None:
                defects.append(Defect("sender_signature", height, i, why))
        return defects, ids, len(raw_records)
    auth_key = auth[0] if auth is not None and height >= auth[1] else None
    found = collect_block_defects(
        block,
        records,
        GENESIS_PREV if prev is None else prev,
        node_did,
        expected_height=height,
        auth_key=auth_key,
    )
    if prev is None and height > 0:  # the previous block is missing: no link to check
        found = [d for d in found if not isinstance(d, BlockLinkError)]
    defects.extend(Defect.of(d) for d in found)
    return defects, ids, len(raw_records)


def _check_range(jobs: Sequence[_Job], node_did: str, auth: _Auth = None) -> list[_Result]:
    parsed = None
    if auth is not None:  # parsed once per chunk (the key object does not pickle)
        parsed = (HybridPublicKey(public_key_from_did(node_did), auth[0]), auth[1])
    return [_check_block(job, node_did, parsed) for job in jobs]


class _LogWalk:
    """The log as a stream of jobs in height order, from one read snapshot.

    ``blocks`` and ``block_records`` are both keyed by height first, so two
    cursors advancing together give each height its block and records.
    """

    def __init__(self, txn: Txn, defects: list[Defect]) -> None:
        self._blocks = self._keyed(txn.items("blocks"), 8, "block", defects)
        self._records = self._keyed(txn.items("block_records"), _LOC.size, "record", defects)
        self._defects = defects
        self.heights = 0
        self.records = 0
        self.head_hash: bytes | None = None

    @staticmethod
    def _keyed(
        items: Iterator[tuple[bytes, bytes]], size: int, what: str, defects: list[Defect]
    ) -> Iterator[tuple[int, int, bytes]]:
        for key, value in items:
            if len(key) != size:
                defects.append(Defect("malformed", None, None, f"bad {what} key {key.hex()}"))
                continue
            height, index = (int.from_bytes(key, "big"), 0) if size == 8 else _LOC.unpack(key)
            yield height, index, value

    def jobs(self) -> Iterator[_Job]:
        """One job per height from 0 to the highest block or record."""
        block = next(self._blocks, None)
        record = next(self._records, None)
        height = 0
        prev: bytes | None = GENESIS_PREV
        while block is not None or record is not None:
            present = min(x[0] for x in (block, record) if x is not None)
            if present > height:
                # A run of heights with nothing stored is one defect, however long:
                # junk keys far apart must not cost a job and a defect per height.
                where = (
                    "this height" if present == height + 1 else f"heights {height}..{present - 1}"
                )
                self._defects.append(
                    Defect("missing_block", height, None, f"no block stored at {where}")
                )
                height, prev = present, None
            raw = None
            if block is not None and block[0] == height:
                raw = block[2]
                block = next(self._blocks, None)
            records: list[tuple[int, bytes]] = []
            stored = held = 0
            while record is not None and record[0] == height:
                # No block holds more: past that, a height's records are counted, not held.
                if stored < MAX_BLOCK_RECORDS and held + len(record[2]) <= MAX_HEIGHT_BYTES:
                    records.append((record[1], record[2]))
                    held += len(record[2])
                stored += 1
                record = next(self._records, None)
            if stored > len(records):
                self._defects.append(
                    Defect(
                        "record_count",
                        height,
                        None,
                        f"{stored} records stored at this height; a block holds at most"
                        f" {MAX_BLOCK_RECORDS} of {MAX_HEIGHT_BYTES >> 20} MiB"
                        f" (only {len(records)} were checked)",
                    )
                )
            yield height, raw, records, prev
            self.records += stored
            prev = None if raw is None else hashlib.sha256(raw).digest()
            self.head_hash = prev
            height += 1
        self.heights = height

    def chunks(self) -> Iterator[list[_Job]]:
        """Consecutive jobs of about :data:`CHUNK_RECORDS` records, or :data:`CHUNK_BYTES`
        of them (records far larger than a record can be made few records a lot)."""
        chunk: list[_Job] = []
        size = held = 0
        for job in self.jobs():
            chunk.append(job)
            size += len(job[2]) or 1
            held += len(job[1] or b"") + sum(len(data) for _, data in job[2])
            if size >= CHUNK_RECORDS or held >= CHUNK_BYTES:
                yield chunk
                chunk, size, held = [], 0, 0
        if chunk:
            yield chunk


class _IndexCheck:
    """Checks ``records`` against the sealed records as their ids stream past."""

    def __init__(self, txn: Txn, defects: list[Defect]) -> None:
        self._txn = txn
        self._db = index_db(txn)
        self._defects = defects
        self._matched = 0
        mark = txn.get("meta", WATERMARK_KEY)
        # No row: a store that indexed every record as it sealed it.
        self._below = int.from_bytes(mark, "big") if mark and len(mark) == 8 else None
        # id -> height << 32 | index: an int, not a tuple, keeps ~134 B per id.
        self._unindexed: dict[bytes, int] = {}
        # Ids whose index entry was already reported wrong (bounded by the defects).
        self._reported: set[bytes] = set()

    def check(self, ids: Sequence[tuple[bytes, int, int]]) -> None:
        """Each sealed record must be indexed at its own place."""
        get, db = self._txn.get, self._db
        for record_id, h, i in ids:
            loc = get(db, record_id)
            if loc == _LOC.pack(h, i):
                self._matched += 1
                continue
            if loc is None:
                if self._below is not None and h >= self._below:
                    self._unindexed_seen(record_id, h, i)
                    continue
                self._report(record_id, h, i, "sealed record missing from the index")
            elif self._id_at(loc) == record_id:
                at = _LOC.unpack(loc)
                self._report(
                    record_id, h, i, f"record id also sealed at block {at[0]}, record {at[1]}"
                )
            else:
                self._report(record_id, h, i, "index points elsewhere")

    def _unindexed_seen(self, record_id: bytes, h: int, i: int) -> None:
        here = h << 32 | i
        first = self._unindexed.setdefault(record_id, here)
        if first != here:
            self._report(
                record_id,
                h,
                i,
                f"record id also sealed at block {first >> 32}, record {first & 0xFFFFFFFF}",
            )

    def finish(self) -> None:
        """Name index entries that no sealed record matched, if there are any."""
        if self._txn.count(self._db) == self._matched:
            return
        for record_id, loc in self._txn.items(self._db):
            if record_id in self._reported or self._id_at(loc) == record_id:
                continue
            where = _LOC.unpack(loc) if len(loc) == _LOC.size else (None, None)
            self._defects.append(
                Defect(
                    "record_index",
                    where[0],
                    where[1],
                    f"index names unknown record {record_id.hex()}",
                )
            )

    def _report(self, record_id: bytes, h: int, i: int, message: str) -> None:
        self._reported.add(record_id)
        self._defects.append(Defect("record_index", h, i, message))

    def _id_at(self, loc: bytes) -> bytes | None:
        data = self._txn.get("block_records", loc) if len(loc) == _LOC.size else None
        if data is None:
            return None
        try:
            return Record.from_bytes(data).record_id
        except MalformedFrameError:
            return None


def verify_chain(
    store: Store | Path | str,
    node_did: str,
    *,
    workers: int | None = None,
    parallel_threshold: int = PARALLEL_THRESHOLD,
    mldsa65_public_key: bytes | None = None,
    hybrid_since: int | None = None,
) -> VerifyReport:
    """Re-validate the whole log in ``store`` (a :class:`Store` or a home's store path).

    ``workers=None`` uses every core when the log has at least
    ``parallel_threshold`` records; ``workers=1`` forces one process.
    ``mldsa65_public_key``: the node's own ML-DSA-65 key when it is a hybrid node
    (``Wallet.mldsa_public_key``); without it, hybrid blocks are reported.
    ``hybrid_since``: the first hybrid height as the node's key file keeps it.
    """
    if mldsa65_public_key is not None:  # a bad key is the caller's mistake: fail now
        HybridPublicKey(public_key_from_did(node_did), mldsa65_public_key)
    auth = (mldsa65_public_key, hybrid_since)
    if isinstance(store, Store):
        return _verify(store, node_did, workers, parallel_threshold, auth)
    if not (Path(store) / "data.mdb").is_file():
        raise StorageError(f"no Talos store at {store} (expected {Path(store) / 'data.mdb'})")
    with Store(Path(store)) as opened:
        return _verify(opened, node_did, workers, parallel_threshold, auth)


def _verify(
    store: Store,
    node_did: str,
    workers: int | None,
    parallel_threshold: int,
    hybrid: tuple[bytes | None, int | None],
) -> VerifyReport:
    defects = _Found()
    n = workers if workers is not None else (os.cpu_count() or 1)
    mldsa65_public_key, kept = hybrid
    with store.read() as txn:
        since_raw = txn.get("meta", HYBRID_SINCE_KEY)
        since = int.from_bytes(since_raw, "big") if since_raw and len(since_raw) == 8 else 0
        if kept is not None and since_raw is not None and since != kept:
            defects.append(
                Defect(
                    "hybrid_since",
                    None,
                    None,
                    f"the store says hybrid blocks begin at height {since}, the node's key"
                    f" file at {kept}: blocks from {kept} on are held to the key file",
                )
            )
        since = since if kept is None else kept
        auth: _Auth = None if mldsa65_public_key is None else (bytes(mldsa65_public_key), since)
        if txn.count("block_records") < parallel_threshold or txn.count("blocks") < 2:
            n = 1
        walk = _LogWalk(txn, defects)
        index = _IndexCheck(txn, defects)
        chunks = walk.chunks()
        results = (
            _serial(chunks, node_did, auth) if n <= 1 else _parallel(chunks, node_did, n, auth)
        )
        for found, ids in results:
            defects.extend(found)
            index.check(ids)
        index.finish()
    defects.sort(key=lambda d: (d.height if d.height is not None else -1, d.index or -1, d.code))
    return VerifyReport(
        blocks=walk.heights,
        records=walk.records,
        head_height=walk.heights - 1,
        head_hash=walk.head_hash,
        defects=tuple(defects),
        workers=max(n, 1),
        omitted=defects.omitted,
    )


def _serial(
    chunks: Iterator[list[_Job]], node_did: str, auth: _Auth
) -> Iterator[tuple[list[Defect], list[tuple[bytes, int, int]]]]:
    for chunk in chunks:
        for found, ids, _ in _check_range(chunk, node_did, auth):
            yield found, ids


# Set in each worker by _install (the pool initializer), read by _run_chunk.
_WORK: tuple[str, _Auth] | None = None


def _install(node_did: str, auth: _Auth) -> None:
    global _WORK
    _WORK = (node_did, auth)


def _run_chunk(jobs: Sequence[_Job]) -> list[_Result]:
    if _WORK is None:  # only reachable if the initializer did not run
        raise RuntimeError("chain verify worker started without its settings")
    node_did, auth = _WORK
    return _check_range(jobs, node_did, auth)


def _parallel(
    chunks: Iterator[list[_Job]], node_did: str, n: int, auth: _Auth
) -> Iterator[tuple[list[Defect], list[tuple[bytes, int, int]]]]:
    # fork is cheapest (workers do not re-import the caller's __main__); with
    # other threads alive (a running node) forking is unsafe, so use a
    # forkserver then.
    method = "fork" if threading.active_count() == 1 else "forkserver"
    ctx = multiprocessing.get_context(method)
    with ProcessPoolExecutor(
        max_workers=n, mp_context=ctx, initializer=_install, initargs=(node_did, auth)
    ) as pool:
        # Two chunks per worker in flight: one being checked, one waiting, so no
        # worker idles while the parent reads; results are taken in order.
        pending: deque[Future[list[_Result]]] = deque()
        for chunk in chunks:
            pending.append(pool.submit(_run_chunk, chunk))
            while len(pending) >= 2 * n:
                for found, ids, _ in pending.popleft().result():
                    yield found, ids
        while pending:
            for found, ids, _ in pending.popleft().result():
                yield found, ids
