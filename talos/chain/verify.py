"""Re-validate a whole block log and report every defect with its place (``talosd chain verify``).

Checks (docs/PROTOCOL.md "Block log"): heights are 0..n-1 with no gap and
match their keys; every block links to the stored bytes of the one before;
author, record count, Merkle root and node signature of every block; the
sender signature of every record; the record index (``records``) names exactly
the sealed records, each at its place.

The parent reads raw bytes in one LMDB read snapshot and computes each
block's expected ``prev_hash`` (so links across range boundaries are its job);
the CPU work — decoding, hashing, Ed25519 — goes to worker *processes* for
large logs. Processes, not threads: per-record Python work (decode, leaf
hashing) holds the GIL, so threads do not scale it. Workers never open the
store (no pages a live writer may be recycling, no second snapshot): the job
list reaches them once, at pool start — inherited by ``fork`` without
pickling, pickled once per worker under ``forkserver`` — and each task names only
a contiguous height range of it, so no block bytes are pickled per task.

Hybrid nodes (ADR 0005): the caller passes the node's ML-DSA-65 public key,
taken from its wallet (or a pin), never from the store being audited; blocks
from the height kept under ``meta`` ``chain:hybrid_since`` on (0 if the row is
missing) must be version 2 blocks under that key, blocks below it version 1.
"""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from talos.chain.block import (
    GENESIS_PREV,
    Block,
    BlockLinkError,
    ChainDefect,
    Record,
    check_record_signature,
    collect_block_defects,
)
from talos.chain.log import HYBRID_SINCE_KEY
from talos.store import Store
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import MalformedFrameError, StorageError
from talos_sdk.hybrid import HybridPublicKey

__all__ = ["Defect", "RecordIndexError", "VerifyReport", "verify_chain"]

_LOC = struct.Struct(">QI")
#: Below this many records one process is faster than starting workers.
PARALLEL_THRESHOLD = 4096
_CHUNKS_PER_WORKER = 4


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

    @property
    def ok(self) -> bool:
        return not self.defects


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
    if auth is not None:  # parsed once per range (the key object does not pickle)
        parsed = (HybridPublicKey(public_key_from_did(node_did), auth[0]), auth[1])
    return [_check_block(job, node_did, parsed) for job in jobs]


def _read_jobs(
    store: Store,
) -> tuple[list[_Job], dict[bytes, bytes], list[Defect], bytes | None, int]:
    """Everything needed, from one snapshot: jobs per height, the index, layout defects."""
    import hashlib

    defects: list[Defect] = []
    with store.read() as txn:
        blocks: dict[int, bytes] = {}
        for key, value in txn.items("blocks"):
            if len(key) != 8:
                defects.append(Defect("malformed", None, None, f"bad block key {key.hex()}"))
                continue
            blocks[int.from_bytes(key, "big")] = value
        recs: dict[int, list[tuple[int, bytes]]] = {}
        for key, value in txn.items("block_records"):
            if len(key) != _LOC.size:
                defects.append(Defect("malformed", None, None, f"bad record key {key.hex()}"))
                continue
            h, i = _LOC.unpack(key)
            recs.setdefault(h, []).append((i, value))
        index = dict(txn.items("records"))
        since_raw = txn.get("meta", HYBRID_SINCE_KEY)
    since = int.from_bytes(since_raw, "big") if since_raw is not None and len(since_raw) == 8 else 0
    top = max([*blocks, *recs], default=-1)
    jobs: list[_Job] = []
    prev: bytes | None = GENESIS_PREV
    for h in range(top + 1):
        raw = blocks.get(h)
        jobs.append((h, raw, recs.get(h, []), prev))
        prev = None if raw is None else hashlib.sha256(raw).digest()
    head = None if top < 0 or blocks.get(top) is None else hashlib.sha256(blocks[top]).digest()
    return jobs, index, defects, head, since


def verify_chain(
    store: Store | Path | str,
    node_did: str,
    *,
    workers: int | None = None,
    parallel_threshold: int = PARALLEL_THRESHOLD,
    mldsa65_public_key: bytes | None = None,
) -> VerifyReport:
    """Re-validate the whole log in ``store`` (a :class:`Store` or a home's store path).

    ``workers=None`` uses every core when the log has at least
    ``parallel_threshold`` records; ``workers=1`` forces one process.
    ``mldsa65_public_key``: the node's own ML-DSA-65 key when it is a hybrid node
    (``Wallet.mldsa_public_key``); without it, hybrid blocks are reported.
    """
    if mldsa65_public_key is not None:  # a bad key is the caller's mistake: fail now
        HybridPublicKey(public_key_from_did(node_did), mldsa65_public_key)
    if isinstance(store, Store):
        jobs, index, defects, head, since = _read_jobs(store)
    else:
        if not (Path(store) / "data.mdb").is_file():
            raise StorageError(f"no Talos store at {store} (expected {Path(store) / 'data.mdb'})")
        with Store(Path(store)) as opened:
            jobs, index, defects, head, since = _read_jobs(opened)

    total = sum(len(j[2]) for j in jobs)
    n = workers if workers is not None else (os.cpu_count() or 1)
    auth: _Auth = None if mldsa65_public_key is None else (bytes(mldsa65_public_key), since)
    if total < parallel_threshold or n <= 1 or len(jobs) < 2:
        n = 1
        results = _check_range(jobs, node_did, auth)
    else:
        results = _parallel(jobs, node_did, n, auth)

    located: dict[bytes, tuple[int, int]] = {}
    for found, ids, _ in results:
        defects.extend(found)
        for record_id, h, i in ids:
            if record_id in located:
                h0, i0 = located[record_id]
                defects.append(
                    Defect(
                        "record_index", h, i, f"record id also sealed at block {h0}, record {i0}"
                    )
                )
            else:
                located[record_id] = (h, i)
    for record_id, (h, i) in located.items():
        loc = index.get(record_id)
        if loc is None:
            defects.append(Defect("record_index", h, i, "sealed record missing from the index"))
        elif loc != _LOC.pack(h, i):
            defects.append(Defect("record_index", h, i, "index points elsewhere"))
    for record_id, loc in index.items():
        if record_id not in located:
            where = _LOC.unpack(loc) if len(loc) == _LOC.size else (None, None)
            defects.append(
                Defect(
                    "record_index",
                    where[0],
                    where[1],
                    f"index names unknown record {record_id.hex()}",
                )
            )
    defects.sort(key=lambda d: (d.height if d.height is not None else -1, d.index or -1, d.code))
    return VerifyReport(
        blocks=len(jobs),
        records=total,
        head_height=len(jobs) - 1,
        head_hash=head,
        defects=tuple(defects),
        workers=n,
    )


def _chunks(jobs: Sequence[_Job], n: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` job ranges of about equal record count.

    A few per worker rather than one: on a shared machine one core may be
    slower, and whoever finishes first takes the next range.
    """
    target = max(1, sum(len(j[2]) or 1 for j in jobs) // (n * _CHUNKS_PER_WORKER))
    out: list[tuple[int, int]] = []
    start = size = 0
    for i, job in enumerate(jobs):
        size += len(job[2]) or 1
        if size >= target:
            out.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(jobs):
        out.append((start, len(jobs)))
    return out


# Set in each worker by _install (the pool initializer), read by _run_range.
_WORK: tuple[Sequence[_Job], str, _Auth] | None = None


def _install(jobs: Sequence[_Job], node_did: str, auth: _Auth) -> None:
    global _WORK
    _WORK = (jobs, node_did, auth)


def _run_range(start: int, stop: int) -> list[_Result]:
    if _WORK is None:  # only reachable if the initializer did not run
        raise RuntimeError("chain verify worker started without its jobs")
    jobs, node_did, auth = _WORK
    return _check_range(jobs[start:stop], node_did, auth)


def _parallel(jobs: list[_Job], node_did: str, n: int, auth: _Auth) -> list[_Result]:
    ranges = _chunks(jobs, n)
    # fork is cheapest: workers inherit the jobs and do not re-import the
    # caller's __main__; with other threads alive (a running node) forking is
    # unsafe, so use a forkserver then (the jobs are pickled once per worker).
    method = "fork" if threading.active_count() == 1 else "forkserver"
    ctx = multiprocessing.get_context(method)
    with ProcessPoolExecutor(
        max_workers=min(n, len(ranges)),
        mp_context=ctx,
        initializer=_install,
        initargs=(jobs, node_did, auth),
    ) as pool:
        parts = pool.map(_run_range, [r[0] for r in ranges], [r[1] for r in ranges])
        return [r for part in parts for r in part]
