"""The node's append-only block log over :class:`~talos.store.Store` (docs/DESIGN.md "Block log").

Appending is O(1) and does no signing: the encoded record, tagged under the
node's pending key (talos/chain/pending.py), goes into the ``pending`` database,
inside the caller's write transaction when one is given, so an inbox row and its
log record commit (or roll back) together. Sealing is where the work happens, off
the hot path: the pending records are read back from LMDB, their sender
signatures verified as one batch (unless the appender vouched it checked them,
see :meth:`BlockLog.append`), the Merkle root computed, the block signed and
written with its record index in one durable transaction. A record that fails its
checks is moved to ``quarantine`` with the reason — never sealed, never silently dropped.

The Merkle root is computed at seal time from what LMDB holds rather than kept
in an in-memory accumulator during ``append``: an append made inside a caller's
transaction that later aborts would otherwise leave the accumulator ahead of
the store, and hashing at seal time keeps SHA-256 off the message hot path.
For the same reason, restart needs no rebuild: pending records are in LMDB.

The log is synchronous. :func:`run_sealer` is the asyncio helper a node runs as
a background task; it seals in a worker thread (``asyncio.to_thread``).
Sealing is durable (fsync) because a signed head may leave the node right
after: a block a peer has seen must never be lost and re-sealed differently.

A hybrid wallet (suite ``ed25519-mldsa65``, ADR 0005) signs blocks and heads
with ``sign_auth``: version 2 blocks carrying the key id, ~0.9 ms per *block*
(not per record). The height of the first hybrid block is kept in ``meta``
(:data:`HYBRID_SINCE_KEY`) and, for a hybrid identity made by ``talosd init``,
in its key file, which the audit holds the blocks to over the row.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from talos.chain.block import (
    GENESIS_PREV,
    MAX_BLOCK_RECORDS,
    Block,
    Record,
    check_record_signature,
    head_signing_bytes,
    head_statement,
    verify_inclusion_proof,
)
from talos.chain.pending import bare_record, is_tagged, pending_key, pending_row, tagged_record
from talos.chain.record_index import RecordIndex, Step, record_id_of
from talos.store import Store, Txn
from talos.writer import DirectWrites, Writes
from talos_sdk.errors import MalformedFrameError, TalosError, UsageError
from talos_sdk.hybrid import HybridPublicKey
from talos_sdk.merkle import inclusion_proof as merkle_inclusion_proof
from talos_sdk.merkle import merkle_root

__all__ = [
    "HYBRID_SINCE_KEY",
    "BlockLog",
    "Head",
    "Quarantined",
    "UnknownRecordError",
    "block_key",
    "read_quarantine",
    "record_key",
    "run_sealer",
    "verify_inclusion_proof",
]

_U64 = struct.Struct(">Q")
_LOC = struct.Struct(">QI")
_UNTAGGED = (
    "an untagged unsigned record (pending from a version before tagged rows, or"
    " written by something else): nothing vouches that the node wrote it"
)
#: ``meta`` key: u64 height from which every block is hybrid-signed.
HYBRID_SINCE_KEY = b"chain:hybrid_since"


class _Signer(Protocol):
    """What the log needs of a wallet."""

    @property
    def did(self) -> str: ...

    def sign(self, data: bytes) -> bytes: ...

    def sign_auth(self, data: bytes) -> bytes: ...

    @property
    def hybrid_public_key(self) -> HybridPublicKey | None: ...

    def private_bytes(self) -> bytes: ...


class UnknownRecordError(UsageError, KeyError):
    """No sealed record has this id."""


def block_key(height: int) -> bytes:
    """Key of block ``height`` in the ``blocks`` database."""
    return _U64.pack(height)


def record_key(height: int, index: int) -> bytes:
    """Key of record ``index`` of block ``height`` in ``block_records`` (also the index value)."""
    return _LOC.pack(height, index)


@dataclass(frozen=True, slots=True)
class Head:
    """The latest block and the node's signed statement about it."""

    height: int
    hash: bytes
    statement: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A pending record that was refused at sealing, with the reason."""

    reason: str
    data: bytes

    @property
    def record(self) -> Record | None:
        """The record, or ``None`` if its bytes do not even decode."""
        try:
            return Record.from_bytes(self.data)
        except MalformedFrameError:
            return None


class BlockLog:
    """Append records, seal them into signed blocks, and answer questions about the log."""

    def __init__(
        self,
        store: Store,
        wallet: _Signer,
        *,
        max_records: int = 256,
        max_delay_ms: int = 50,
        clock: Callable[[], float] = time.time,
        writes: Writes | None = None,
    ) -> None:
        if not 1 <= max_records <= MAX_BLOCK_RECORDS or max_delay_ms < 0:
            raise UsageError(f"max_records must be 1..{MAX_BLOCK_RECORDS}, max_delay_ms >= 0")
        self.store = store
        # A running node passes its StoreWriter: every write of the log then runs on
        # the node's one writer thread (talos/writer.py); offline tools write directly.
        self._writes: Writes = writes if writes is not None else DirectWrites(store)
        self.wallet = wallet
        self.node_did = wallet.did
        self.max_records = max_records
        self.max_delay_ms = max_delay_ms
        self._clock = clock
        self._lock = threading.Lock()  # append (loop thread) vs seal (worker thread)
        self._seal_lock = threading.Lock()
        # Pending seqs whose signature the appender checked (see append).
        self._verified: set[int] = set()
        self._head: Head | None = None
        self._row_key: bytes | None = None  # pending_key, made at the first append or seal
        with store.read() as txn:
            last_pending = txn.last("pending")
            self._next_seq = _U64.unpack(last_pending[0])[0] + 1 if last_pending else 0
            self._pending = txn.count("pending")
            last = txn.last("blocks")
            self._tip = Block.from_bytes(last[1]) if last else None
            since = txn.get("meta", HYBRID_SINCE_KEY)
            self._index = RecordIndex(store, txn, self.height + 1)
        self._key_id: bytes | None = None
        hybrid = wallet.hybrid_public_key
        if hybrid is not None:
            self._key_id = hybrid.key_id
            if since is None:
                # Recorded before the first hybrid block, so a later rewrite of
                # hybrid blocks as classical ones is a defect, not a silent downgrade.
                mark = _U64.pack(self.height + 1)
                self._writes.run(lambda t: t.put("meta", HYBRID_SINCE_KEY, mark), kind="log")
        # Records that survived a restart are due max_delay_ms after it.
        self._oldest_ms: int | None = self._now_ms() if self._pending else None

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    # --- writing ---------------------------------------------------------------------------------

    def append(
        self,
        record: Record,
        txn: Txn | None = None,
        *,
        durable: bool = False,
        verified: bool = False,
    ) -> None:
        """Queue ``record`` for the next block.

        With ``txn`` the record commits with the caller's transaction. Without,
        it is written in its own transaction, group-committed unless ``durable``.
        ``verified`` says the caller has already checked the sender signature
        (a message its session opened, or a record this node signed): the seal
        then skips that Ed25519 verify, ~65 us per message on each node. The
        mark lives in memory only, so after a restart every pending record is
        checked again.
        """
        if txn is None:
            self._writes.run(
                lambda own: self._append(record, own, verified), durable=durable, kind="log"
            )
        else:
            self._append(record, txn, verified)

    def _append(self, record: Record, txn: Txn, verified: bool = False) -> None:
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if verified:
                self._verified.add(seq)
            # Counted before commit: if the caller aborts, the count is high and
            # a seal merely happens early; seal() re-reads the truth.
            self._pending += 1
            if self._oldest_ms is None:
                self._oldest_ms = self._now_ms()
        row = pending_row(self._pending_key(), seq, record.encoded)
        _put_last(txn, "pending", _U64.pack(seq), row)  # sequence numbers only grow

    def _pending_key(self) -> bytes:
        if self._row_key is None:  # a log opened only to be read never asks
            self._row_key = pending_key(self.wallet.private_bytes())
        return self._row_key

    def write(self, fn: Callable[[Txn], None], *, durable: bool = False) -> None:
        """Run ``fn(txn)`` (e.g. several :meth:`append` calls) in one write transaction.

        Blocking: call from a worker thread when a node's writer is in use.
        """
        self._writes.run(fn, durable=durable, kind="log")

    def sync(self) -> None:
        """Make every earlier write durable (blocking, like :meth:`write`)."""
        self._writes.run(_no_write, durable=True, kind="sync")

    @property
    def pending_count(self) -> int:
        """Records appended and not yet sealed (an upper bound, see ``_append``)."""
        return self._pending

    def seal_due(self, now_ms: int | None = None) -> bool:
        """True if the open block is full or its oldest record has waited long enough."""
        if self._pending >= self.max_records:
            return True
        oldest = self._oldest_ms
        if not self._pending or oldest is None:
            return False
        now = self._now_ms() if now_ms is None else now_ms
        return now - oldest >= self.max_delay_ms

    def seal_if_due(self, now_ms: int | None = None) -> list[Block]:
        """Seal if :meth:`seal_due`; returns the blocks written."""
        return self.seal() if self.seal_due(now_ms) else []

    def seal(self) -> list[Block]:
        """Seal every pending record into blocks of at most ``max_records``."""
        sealed: list[Block] = []
        with self._seal_lock:
            while True:
                block, more = self._seal_one()
                if block is not None:
                    sealed.append(block)
                if not more:
                    break
        return sealed

    def _seal_one(self) -> tuple[Block | None, bool]:
        with self._lock:
            counted = self._pending
            verified = self._verified.copy()
        with self.store.read() as txn:
            batch: list[tuple[bytes, bytes]] = []
            for key, value in txn.items("pending"):
                batch.append((key, value))
                if len(batch) == self.max_records:
                    break
        more_after = len(batch) == self.max_records

        # The batch signature check: CPU only, no transaction held.
        good: list[tuple[bytes, Record]] = []
        refused: list[tuple[bytes, str, bytes]] = []
        seen: set[bytes] = set()
        row_key = self._pending_key()
        for key, row in batch:
            seq = _U64.unpack(key)[0]
            tagged = is_tagged(row)
            try:
                # A row the node did not write is quarantined, record and all: its own
                # records are unsigned, and sealing would sign them as the node's.
                data = tagged_record(row_key, seq, row) if tagged else row
                record = Record.from_bytes(data)
            except MalformedFrameError as exc:
                refused.append((key, f"malformed: {exc}", bare_record(row)))
                continue
            if not tagged and not record.signature:
                why: str | None = _UNTAGGED  # only a signature can vouch for such a row
            elif seq in verified:
                why = None
            else:
                why = check_record_signature(record, self.node_did)
            if why is None and record.record_id in seen:
                why = "duplicate record id in block"
            if why is not None:
                refused.append((key, why, data))
                continue
            seen.add(record.record_id)
            good.append((key, record))

        block: Block | None = None
        remaining = 0
        if batch:
            index = self._index
            new: dict[bytes, bytes] = {}
            start = index.plan(adding=len(good))

            def write(txn: Txn) -> tuple[Block | None, int, Step]:
                keep: list[Record] = []
                for key, record in good:
                    if index.get(txn, record.record_id) is not None:
                        refused.append((key, "record id already sealed", record.encoded))
                    else:
                        keep.append(record)
                for key, why, data in refused:
                    txn.put("quarantine", key, _quarantine_value(why, data))
                for key, _ in batch:
                    txn.delete("pending", key)
                written = self._write_block(txn, keep) if keep else None
                step = Step()
                if index.stale:  # with the first block sealed since open (ADR 0013)
                    index.watermark_row(txn)
                if written is not None:
                    new.update(
                        (r.record_id, record_key(written.height, i)) for i, r in enumerate(keep)
                    )
                    step = index.step(txn, written.height, start)
                return written, txn.count("pending"), step

            block, remaining, step = self._writes.run(write, durable=True, kind="seal")
            if block is not None:
                self._tip = block
                index.committed(new, step)
        with self._lock:
            if self._verified:
                self._verified.difference_update(_U64.unpack(key)[0] for key, _ in batch)
            # Appends counted since we started are kept; the store tells the rest.
            self._pending = remaining + max(0, self._pending - counted)
            self._oldest_ms = self._now_ms() if self._pending else None
        return block, more_after

    def _write_block(self, txn: Txn, records: list[Record]) -> Block:
        tip = self._tip
        height = 0 if tip is None else tip.height + 1
        leaves = [r.encoded for r in records]
        unsigned = Block(
            height=height,
            prev_hash=GENESIS_PREV if tip is None else tip.hash(),
            timestamp_ms=self._now_ms(),
            merkle_root=merkle_root(leaves),
            record_count=len(records),
            node_did=self.node_did,
            key_id=self._key_id,
        )
        block = Block(
            unsigned.height,
            unsigned.prev_hash,
            unsigned.timestamp_ms,
            unsigned.merkle_root,
            unsigned.record_count,
            unsigned.node_did,
            self.wallet.sign_auth(unsigned.header_bytes()),
            self._key_id,
        )
        _put_last(txn, "blocks", block_key(height), block.to_bytes())
        _put_in_order(txn, [(record_key(height, i), leaf) for i, leaf in enumerate(leaves)])
        # The ids go to the record index (talos/chain/record_index.py), not here.
        return block

    def flush_index(self) -> None:
        """Put every sealed id into the index database now (blocking, like :meth:`write`).

        Not needed for correctness (ADR 0013): tests call it to tamper with a
        complete index. A node does not at stop: it would rewrite the whole
        index (~0.5 s at 1M records) to save the next open ~0.1 s.
        """
        with self._seal_lock:
            index, tip = self._index, self._tip
            if tip is None:
                return
            below = tip.height + 1
            while index.busy:
                start = index.plan(force=True)
                step = self._writes.run(
                    partial(index.step, below=below, start=start), durable=False, kind="log"
                )
                index.committed({}, step)

    # --- reading ---------------------------------------------------------------------------------

    def heads(self) -> Head | None:
        """Latest block and a signed head statement peers can keep, or ``None`` if empty."""
        tip = self._tip
        if tip is None:
            return None
        head = self._head
        if head is None or head.height != tip.height:
            block_hash = tip.hash()
            ts = self._now_ms()
            sig = self.wallet.sign_auth(
                head_signing_bytes(self.node_did, tip.height, block_hash, ts)
            )
            head = Head(
                tip.height,
                block_hash,
                head_statement(self.node_did, tip.height, block_hash, ts, sig),
            )
            self._head = head
        return head

    @property
    def height(self) -> int:
        """Height of the latest block, -1 when nothing is sealed yet."""
        return -1 if self._tip is None else self._tip.height

    def get_block(self, height: int) -> Block | None:
        """The block at ``height`` (one LMDB get)."""
        with self.store.read() as txn:
            data = txn.get("blocks", block_key(height))
        return None if data is None else Block.from_bytes(data)

    def block_records(self, height: int) -> list[Record]:
        """The records of block ``height`` in leaf order."""
        with self.store.read() as txn:
            return [Record.from_bytes(v) for _, v in _records_of(txn, height)]

    def iter_blocks(self, start: int = 0) -> Iterator[Block]:
        """Blocks in height order from ``start``."""
        with self.store.read() as txn:
            for _, data in txn.items("blocks", block_key(start)):
                yield Block.from_bytes(data)

    def find_record(self, record_id: bytes) -> tuple[Block, int, Record] | None:
        """Where a sealed record is: its block, index, and the record itself."""
        in_memory = self._index.in_memory(record_id)  # before the snapshot, see RecordIndex
        with self.store.read() as txn:
            place = _sealed_at(txn, in_memory or RecordIndex.stored(txn, record_id), record_id)
            if place is None:
                return None
            height, index, data = place
            block = txn.get("blocks", block_key(height))
        if block is None:
            return None
        return Block.from_bytes(block), index, Record.from_bytes(data)

    def inclusion_proof(self, record_id: bytes) -> dict[str, Any]:
        """A JSON-able RFC 6962 inclusion proof for a sealed record, checked by
        :func:`verify_inclusion_proof` with nothing but the node's DID."""
        if len(record_id) not in (16, 32):  # as validate_record; LMDB refuses an empty key
            raise UnknownRecordError(f"no sealed record with id {record_id.hex()!r}")
        in_memory = self._index.in_memory(record_id)
        with self.store.read() as txn:
            place = _sealed_at(txn, in_memory or RecordIndex.stored(txn, record_id), record_id)
            if place is None:
                raise UnknownRecordError(_not_sealed(txn, record_id))
            height, index, _ = place
            block_bytes = txn.get("blocks", block_key(height))
            leaves = [v for _, v in _records_of(txn, height)]
        if block_bytes is None or index >= len(leaves):
            raise UnknownRecordError(f"record {record_id.hex()} indexed but not stored")
        block = Block.from_bytes(block_bytes)
        return {
            "height": height,
            "index": index,
            "size": len(leaves),
            "leaf": leaves[index].hex(),
            "proof": [p.hex() for p in merkle_inclusion_proof(leaves, index)],
            "root": block.merkle_root.hex(),
            "block": block_bytes.hex(),
            "block_signature": block.signature.hex(),
        }

    def quarantined(self) -> list[Quarantined]:
        """Records refused at sealing, oldest first."""
        return read_quarantine(self.store)


def read_quarantine(store: Store) -> list[Quarantined]:
    """Records refused at sealing, oldest first, read without opening the log (whose
    newest block may be the damage an audit is looking for)."""
    with store.read() as txn:
        return [_quarantine_entry(v) for _, v in txn.items("quarantine")]


def _no_write(txn: Txn) -> None:
    return None


def _put_last(txn: Txn, db: str, key: bytes, value: bytes) -> None:
    """Write ``key``, expected above every key of ``db``, with MDB_APPEND (see
    :func:`_put_in_order`); an out-of-order key (not expected) takes a plain put."""
    if not txn.put(db, key, value, append=True):
        txn.put(db, key, value)


def _put_in_order(txn: Txn, items: list[tuple[bytes, bytes]]) -> None:
    """Write a block's records, whose keys sort after every record already sealed.

    MDB_APPEND: the new key goes straight to the end of the last page, with
    no search and no split of a full page in two. LMDB's own split already
    favours in-order inserts, so the gain is modest: 4096 sealed records took
    241 leaf pages instead of 256, and 1M records (bench_chain
    sustained_append_seal, with ``pending`` appended the same way) a 517 MB
    file instead of 574 MB and 2.12-2.27 kB instead of 2.23-2.38 kB of
    write(2) per record. A store whose ``block_records`` already holds keys
    at this height (damaged: records without their block) takes the plain
    path, which overwrites them as before.
    """
    try:
        txn.put_many("block_records", items, append=True)
    except UsageError:
        txn.put_many("block_records", items)


def _records_of(txn: Txn, height: int) -> Iterator[tuple[bytes, bytes]]:
    prefix = block_key(height)
    for key, value in txn.items("block_records", prefix):
        if key[:8] != prefix:
            return
        yield key, value


def _not_sealed(txn: Txn, record_id: bytes) -> str:
    """Why there is no proof for ``record_id`` yet: the words for a person who just sent."""
    for _, row in txn.items("pending"):  # a block's worth at most
        with contextlib.suppress(TalosError):
            if Record.from_bytes(bare_record(row)).record_id == record_id:
                return (
                    f"no sealed record with id {record_id.hex()} yet: it is recorded and waits"
                    " for the next block (sealed within seal_interval): try again in a moment"
                )
    return (
        f"no sealed record with id {record_id.hex()} (a message sent is recorded once"
        " its peer acknowledged it, and sealed within seal_interval after that)"
    )


def _sealed_at(txn: Txn, loc: bytes | None, record_id: bytes) -> tuple[int, int, bytes] | None:
    """Height, index and bytes of the sealed record ``record_id`` at the index entry
    ``loc``; None unless a record with that id is stored there (a damaged or forged
    index row must not answer for another record, or raise)."""
    if loc is None or len(loc) != _LOC.size:
        return None
    data = txn.get("block_records", loc)
    try:
        if data is None or record_id_of(data) != record_id:
            return None
    except IndexError:  # too short to hold an id
        return None
    height, index = _LOC.unpack(loc)
    return height, index, data


def _quarantine_value(reason: str, data: bytes) -> bytes:
    why = reason.encode("utf-8")[:0xFFFF]
    return struct.pack(">H", len(why)) + why + data


def _quarantine_entry(value: bytes) -> Quarantined:
    (n,) = struct.unpack_from(">H", value)
    return Quarantined(value[2 : 2 + n].decode("utf-8", "replace"), value[2 + n :])


async def run_sealer(log: BlockLog, interval: float | None = None) -> None:
    """Seal ``log`` on time until cancelled; the CPU work runs in a worker thread.

    While records are pending it checks every ``interval`` (default: half of
    ``max_delay_ms``). With none pending it sleeps a whole delay: a record that
    arrives meanwhile is younger than the delay at the next check, so no record
    waits more than 1.5 delays either way (a block filled during that sleep
    waits for its end), and an idle node wakes once per delay instead of twice.
    """
    period = interval if interval is not None else max(log.max_delay_ms / 2000, 0.001)
    idle = max(period, log.max_delay_ms / 1000)
    while True:
        await asyncio.sleep(period if log.pending_count else idle)
        if log.seal_due():
            await asyncio.to_thread(log.seal)
