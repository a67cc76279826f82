"""Tests for talos/chain/log.py: append, seal, reopen, proofs, quarantine on real LMDB."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from talos.chain.block import GENESIS_PREV, Block, Record, validate_block, verify_head_statement
from talos.chain.log import (
    BlockLog,
    UnknownRecordError,
    record_key,
    run_sealer,
    verify_inclusion_proof,
)
from talos.chain.pending import pending_key, pending_row
from talos.chain.record_index import index_db
from talos.store import Store
from talos_sdk.errors import UsageError
from talos_sdk.wallet import Wallet
from tests.talos.chain import ALICE, BOB, NODE, audit_record, make_record


class FakeClock:
    """Injectable clock (seconds), moved by hand."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def open_log(path: Path, clock: FakeClock | None = None, **kw: int) -> tuple[Store, BlockLog]:
    store = Store(path)
    return store, BlockLog(store, NODE, clock=clock or FakeClock(), **kw)


def test_append_then_seal_builds_a_valid_chain(tmp_path: Path) -> None:
    store, log = open_log(tmp_path, max_records=4)
    for i in range(10):
        log.append(make_record(i))
    assert log.pending_count == 10
    blocks = log.seal()
    assert [b.record_count for b in blocks] == [4, 4, 2]
    assert log.pending_count == 0
    prev = GENESIS_PREV
    for h, block in enumerate(log.iter_blocks()):
        validate_block(block, log.block_records(h), prev, NODE.did, expected_height=h)
        prev = block.hash()
    assert log.height == 2
    assert log.get_block(2) == blocks[2]
    assert log.get_block(3) is None
    assert list(log.iter_blocks(1)) == blocks[1:]
    assert log.seal() == []
    store.close()


def test_append_joins_the_callers_transaction(tmp_path: Path) -> None:
    store, log = open_log(tmp_path)
    with pytest.raises(RuntimeError), store.write() as txn:
        txn.put("inbox", b"m0", b"hello")
        log.append(make_record(0), txn)
        raise RuntimeError("crash before commit")
    with store.write() as txn:
        txn.put("inbox", b"m1", b"hello")
        log.append(make_record(1), txn)
    blocks = log.seal()  # the aborted record never reached the log
    assert len(blocks) == 1
    assert log.block_records(0) == [make_record(1)]
    assert log.find_record(make_record(0).record_id) is None
    store.close()


def test_seal_by_count_and_by_time(tmp_path: Path) -> None:
    clock = FakeClock()
    store, log = open_log(tmp_path, clock, max_records=3, max_delay_ms=50)
    log.append(make_record(0))
    assert not log.seal_due()
    assert log.seal_if_due() == []
    clock.now += 0.049
    assert log.seal_if_due() == []
    clock.now += 0.002
    assert len(log.seal_if_due()) == 1
    for i in range(1, 4):
        log.append(make_record(i))
    assert log.seal_due()  # full, no time passed
    assert [b.record_count for b in log.seal_if_due()] == [3]
    assert not log.seal_due()
    store.close()


def test_pending_records_survive_reopen(tmp_path: Path) -> None:
    store, log = open_log(tmp_path)
    log.append(make_record(0), durable=True)
    log.seal()
    log.append(make_record(1))
    log.append(make_record(2))
    store.close()  # "crash": records are pending in LMDB, not sealed

    clock = FakeClock()
    store, log = open_log(tmp_path, clock, max_delay_ms=50)
    assert log.pending_count == 2
    assert log.height == 0
    assert not log.seal_due()
    clock.now += 0.05
    blocks = log.seal_if_due()
    assert len(blocks) == 1
    assert blocks[0].height == 1
    assert blocks[0].prev_hash == log.get_block(0).hash()  # type: ignore[union-attr]
    assert log.block_records(1) == [make_record(1), make_record(2)]
    log.append(make_record(3))
    log.seal()
    assert log.height == 2
    store.close()


def test_bad_sender_signature_is_quarantined_not_sealed(tmp_path: Path) -> None:
    store, log = open_log(tmp_path)
    forged = dataclasses.replace(make_record(1), signature=BOB.sign(make_record(1).commitment))
    unsigned_foreign = dataclasses.replace(make_record(2), signature=b"")
    log.append(make_record(0))
    log.append(forged)
    log.append(unsigned_foreign)
    log.append(audit_record(3))
    log.append(make_record(0))  # same id twice in one batch
    blocks = log.seal()
    assert len(blocks) == 1
    assert log.block_records(0) == [make_record(0), audit_record(3)]
    q = log.quarantined()
    assert [e.reason for e in q] == [
        "sender signature does not verify",
        "unsigned record not authored by the node",
        "duplicate record id in block",
    ]
    assert q[0].record == forged
    log.append(make_record(0))  # already sealed in block 0
    assert log.seal() == []
    assert log.quarantined()[-1].reason == "record id already sealed"
    assert log.pending_count == 0
    store.close()


def test_a_record_the_appender_verified_skips_the_seals_check_until_a_restart(
    tmp_path: Path,
) -> None:
    """``verified=True`` takes the appender's word (the node's own records, messages
    its session opened); the mark is memory only, so a reopened log checks again,
    and verify_chain re-checks every sealed record whatever the seal skipped."""
    from talos.chain.verify import verify_chain

    forged = dataclasses.replace(make_record(1), signature=BOB.sign(make_record(1).commitment))
    store, log = open_log(tmp_path)
    log.append(make_record(0), verified=True)
    log.append(forged, verified=True)  # a lying appender: sealed as vouched for
    assert [b.record_count for b in log.seal()] == [2]
    assert log.quarantined() == []
    assert log._verified == set()  # marks go with their records
    defects = verify_chain(store, NODE.did, workers=1).defects
    assert [(d.code, d.height, d.index) for d in defects] == [("sender_signature", 0, 1)]

    forged2 = dataclasses.replace(make_record(2), signature=BOB.sign(make_record(2).commitment))
    log.append(forged2, verified=True, durable=True)
    store.close()  # "crash" before the seal: the mark is gone with the process
    store, log = open_log(tmp_path)
    assert log.seal() == []
    assert [e.reason for e in log.quarantined()] == ["sender signature does not verify"]
    store.close()


def test_undecodable_pending_bytes_are_quarantined(tmp_path: Path) -> None:
    store, log = open_log(tmp_path)
    with store.write() as txn:
        txn.put("pending", (7).to_bytes(8, "big"), b"\x01garbage")
    log.append(make_record(0))
    log.seal()
    q = log.quarantined()
    assert len(q) == 1
    assert q[0].reason.startswith("malformed")
    assert q[0].record is None
    assert log.block_records(0) == [make_record(0)]
    store.close()


def test_find_record_and_inclusion_proofs(tmp_path: Path) -> None:
    store, log = open_log(tmp_path, max_records=5)
    records = [make_record(i) for i in range(12)]
    for r in records:
        log.append(r)
    log.seal()
    found = log.find_record(records[7].record_id)
    assert found is not None
    block, index, record = found
    assert (block.height, index, record) == (1, 2, records[7])
    for r in records:
        proof = log.inclusion_proof(r.record_id)
        assert verify_inclusion_proof(proof, NODE.did)
        assert not verify_inclusion_proof(proof, ALICE.did)
    proof = log.inclusion_proof(records[3].record_id)
    other = log.inclusion_proof(records[4].record_id)
    assert not verify_inclusion_proof({**proof, "leaf": other["leaf"]}, NODE.did)
    assert not verify_inclusion_proof({**proof, "index": 2}, NODE.did)
    assert not verify_inclusion_proof({**proof, "height": 1}, NODE.did)
    assert not verify_inclusion_proof({**proof, "proof": proof["proof"][::-1]}, NODE.did)
    assert not verify_inclusion_proof({**proof, "block": "00"}, NODE.did)
    assert not verify_inclusion_proof({"leaf": "zz"}, NODE.did)
    with pytest.raises(UnknownRecordError, match="recorded once its peer acknowledged"):
        log.inclusion_proof(b"\x00" * 16)
    assert log.find_record(b"\x00" * 16) is None
    # A record appended and not sealed yet: said so, for whoever asks right after a send.
    waiting = make_record(99)
    log.append(waiting)
    with pytest.raises(UnknownRecordError, match="yet: it is recorded and waits"):
        log.inclusion_proof(waiting.record_id)
    store.close()


def test_a_forged_or_damaged_index_row_answers_for_no_record(tmp_path: Path) -> None:
    # The index is data on disk like any other: a row naming another record's place
    # must not make a proof of that record pass for the one asked about, and a row of
    # the wrong length is "no sealed record", not a struct error.
    store, log = open_log(tmp_path, max_records=4)
    records = [make_record(i) for i in range(8)]
    for r in records:
        log.append(r)
    log.seal()
    log.flush_index()
    never_sealed = bytes.fromhex("00112233445566778899aabbccddeeff")
    with store.write() as txn:
        txn.put(index_db(txn), never_sealed, record_key(1, 2))
        txn.put(index_db(txn), records[1].record_id, b"\x00\x00\x01")
    for rid in (never_sealed, records[1].record_id):
        with pytest.raises(UnknownRecordError):
            log.inclusion_proof(rid)
        assert log.find_record(rid) is None
    assert verify_inclusion_proof(log.inclusion_proof(records[6].record_id), NODE.did)
    store.close()


def test_heads_are_signed_statements(tmp_path: Path) -> None:
    store, log = open_log(tmp_path)
    assert log.heads() is None
    log.append(make_record(0))
    log.seal()
    head = log.heads()
    assert head is not None
    assert (head.height, head.hash) == (0, log.get_block(0).hash())  # type: ignore[union-attr]
    assert verify_head_statement(head.statement, NODE.did)
    assert log.heads() is head  # cached until the next block
    log.append(make_record(1))
    log.seal()
    assert log.heads().height == 1  # type: ignore[union-attr]
    store.close()


def test_bad_parameters(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        with pytest.raises(UsageError):
            BlockLog(store, NODE, max_records=0)
        with pytest.raises(UsageError):
            BlockLog(store, NODE, max_delay_ms=-1)


@contextlib.asynccontextmanager
async def sealing(log: BlockLog, interval: float | None = None) -> AsyncIterator[None]:
    """``run_sealer`` on ``log`` while the block runs; then cancelled and the store closed."""
    task = asyncio.create_task(run_sealer(log, interval=interval))
    try:
        yield
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        log.store.close()


async def test_run_sealer_seals_on_time(tmp_path: Path) -> None:
    log = BlockLog(Store(tmp_path), NODE, max_delay_ms=5)
    async with sealing(log, interval=0.002):
        log.append(make_record(0))
        async with asyncio.timeout(5):
            while log.height < 0:
                await asyncio.sleep(0.002)
        assert log.block_records(0) == [make_record(0)]


async def test_an_idle_sealer_sleeps_a_whole_delay_and_half_one_while_records_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sleeps asked for, not timed: the schedule is what is tested.
    asked: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        asked.append(delay)
        await real_sleep(0.001)

    log = BlockLog(Store(tmp_path), NODE, max_delay_ms=200)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    async with sealing(log):
        async with asyncio.timeout(10):
            while len(asked) < 3:
                await real_sleep(0.001)
            assert set(asked) == {0.2}  # nothing pending: one wake-up per delay
            log.append(make_record(0))
            while log.height < 0:
                await real_sleep(0.001)
        assert 0.1 in asked  # a record waits: half a delay
        assert log.block_records(0) == [make_record(0)]


# --- fixed vector: tests/vectors/chain/small_chain.json -----------------------------------------

VECTOR = Path(__file__).resolve().parents[2] / "vectors" / "chain" / "small_chain.json"
VECTOR_CLOCK_S = 1_732_000_000.25
VECTOR_MAX_RECORDS = 3


def vector_records() -> list[Record]:
    return [make_record(i) for i in range(6)] + [audit_record(6)]


def build_vector_chain(path: Path) -> dict[str, Any]:
    """Seal the vector's records with fixed seeds and a fixed clock; return the JSON body."""
    with Store(path) as store:
        log = BlockLog(store, NODE, max_records=VECTOR_MAX_RECORDS, clock=lambda: VECTOR_CLOCK_S)
        for record in vector_records():
            log.append(record)
        blocks = log.seal()
        return {
            "source": "generated by `python -m tests.talos.chain.test_log` (Talos itself)",
            "note": (
                "Fixed chain: node seed 00..1f, senders Wallet.from_seed(01*32) and "
                "(02*32) from tests/talos/chain/__init__.py, clock fixed at "
                f"{VECTOR_CLOCK_S} s, max_records={VECTOR_MAX_RECORDS}. Ed25519 is "
                "deterministic, so the same inputs must give the same bytes and hashes; "
                "regenerate only on a deliberate format change."
            ),
            "node_did": NODE.did,
            "records": [r.encoded.hex() for r in vector_records()],
            "blocks": [
                {"height": b.height, "encoded": b.to_bytes().hex(), "hash": b.hash().hex()}
                for b in blocks
            ],
        }


def test_vector_chain_reproduces(tmp_path: Path) -> None:
    expected = json.loads(VECTOR.read_text())
    assert build_vector_chain(tmp_path) == expected


def test_vector_chain_validates_from_its_bytes_alone() -> None:
    vector = json.loads(VECTOR.read_text())
    records = [Record.from_bytes(bytes.fromhex(r)) for r in vector["records"]]
    assert records == vector_records()
    prev = GENESIS_PREV
    for n, entry in enumerate(vector["blocks"]):
        block = Block.from_bytes(bytes.fromhex(entry["encoded"]))
        assert block.hash().hex() == entry["hash"]
        chunk = records[n * VECTOR_MAX_RECORDS : (n + 1) * VECTOR_MAX_RECORDS]
        validate_block(block, chunk, prev, vector["node_did"], expected_height=n)
        prev = block.hash()


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        body = build_vector_chain(Path(tmp))
    VECTOR.parent.mkdir(parents=True, exist_ok=True)
    VECTOR.write_text(json.dumps(body, indent=2) + "\n")
    print(f"wrote {VECTOR}")


def test_sealed_records_fill_their_pages(tmp_path: Path) -> None:
    # MDB_APPEND for keys that only grow: every leaf page full (1.05x the
    # payload here; plain in-order puts leave 1.11x).
    store, log = open_log(tmp_path, max_records=64)
    for start in range(0, 2048, 64):
        with store.write() as txn:
            for i in range(start, start + 64):
                log.append(audit_record(i), txn)
        log.seal()
    with store.read() as txn:
        stat = txn.raw.stat(txn._db("block_records"))
        payload = sum(len(k) + len(v) for k, v in txn.items("block_records"))
    assert stat["entries"] == 2048
    assert stat["leaf_pages"] * stat["psize"] < 1.08 * payload
    store.close()


def test_seal_over_stray_records_at_the_next_height_overwrites_them(tmp_path: Path) -> None:
    store, log = open_log(tmp_path, max_records=4)
    log.append(make_record(0))
    log.seal()
    with store.write() as txn:  # damage: a record at height 1 with no block
        txn.put("block_records", record_key(1, 2), b"stray")
    for i in range(1, 5):
        log.append(make_record(i))
    [block] = log.seal()
    assert block.height == 1
    assert log.block_records(1) == [make_record(i) for i in range(1, 5)]
    store.close()


def test_a_pending_row_the_node_did_not_write_is_not_sealed_as_its_own(tmp_path: Path) -> None:
    # The node's own records carry no signature: the block's vouches for them. A row
    # written into the store by someone else (the disk, not the passphrase) would be
    # signed as the node's at the next seal: untagged, tagged under another key or
    # moved to another place, it is quarantined.
    store, log = open_log(tmp_path)
    forged = audit_record(1).encoded
    other = Wallet.from_seed(b"\x09" * 32)
    with store.write() as txn:
        txn.put("pending", (7).to_bytes(8, "big"), forged)
        txn.put("pending", (8).to_bytes(8, "big"), pending_row(pending_key(other.seed), 8, forged))
        txn.put("pending", (9).to_bytes(8, "big"), pending_row(pending_key(NODE.seed), 3, forged))
        # Untagged, as a version before the tags wrote it: a peer's signature vouches.
        txn.put("pending", (10).to_bytes(8, "big"), make_record(5).encoded)
    log.append(make_record(0))
    [block] = log.seal()
    assert log.block_records(block.height) == [make_record(0), make_record(5)]
    quarantined = log.quarantined()
    reasons = [q.reason for q in quarantined]
    assert [q.record for q in quarantined] == 3 * [audit_record(1)]  # each names its record
    assert reasons[0].startswith("an untagged unsigned record")
    assert reasons[1:] == 2 * [
        "malformed: pending row not written by this node (its tag does not verify)"
    ]
    store.close()


def test_append_below_a_higher_pending_key_still_queues_the_record(tmp_path: Path) -> None:
    store, log = open_log(tmp_path)
    with store.write() as txn:  # a pending key above the log's next sequence number
        row = pending_row(pending_key(NODE.seed), 10**9, make_record(7).encoded)
        txn.put("pending", (10**9).to_bytes(8, "big"), row)
    log.append(make_record(0))
    [block] = log.seal()
    assert sorted(r.record_id for r in log.block_records(block.height)) == sorted(
        make_record(i).record_id for i in (0, 7)
    )
    assert log.pending_count == 0
    store.close()
