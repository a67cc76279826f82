"""Tests for talos/chain/verify.py: tamper with raw LMDB bytes, expect the right defect there."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from talos.chain import verify
from talos.chain.block import Block, Record
from talos.chain.log import BlockLog, block_key, record_key
from talos.chain.record_index import index_db
from talos.chain.verify import CHUNK_RECORDS, Defect, _LogWalk, _run_chunk, verify_chain
from talos.store import Store
from talos_sdk.errors import StorageError
from talos_sdk.merkle import merkle_root
from tests.talos.chain import BOB, NODE, audit_record, make_record

PER_BLOCK = 4
BLOCKS = 5


@pytest.fixture
def chain(tmp_path: Path) -> Iterator[tuple[Store, BlockLog]]:
    store = Store(tmp_path / "store")
    log = BlockLog(store, NODE, max_records=PER_BLOCK, clock=lambda: 1_700_000_000.0)
    for i in range(PER_BLOCK * BLOCKS - 1):
        log.append(make_record(i))
    log.append(audit_record(99))
    log.seal()
    log.flush_index()  # every id in `records`, where these tests tamper with it
    yield store, log
    store.close()


def where(store: Store) -> list[tuple[str, int | None, int | None]]:
    report = verify_chain(store, NODE.did, workers=1)
    return [(d.code, d.height, d.index) for d in report.defects]


def test_clean_chain_verifies(chain: tuple[Store, BlockLog]) -> None:
    store, log = chain
    report = verify_chain(store, NODE.did, workers=1)
    assert report.ok, report.defects
    assert (report.blocks, report.records, report.head_height) == (BLOCKS, PER_BLOCK * BLOCKS, 4)
    assert report.head_hash == log.heads().hash  # type: ignore[union-attr]


def test_verify_by_path_opens_the_store_itself(
    chain: tuple[Store, BlockLog], tmp_path: Path
) -> None:
    store, _ = chain
    store.close()
    report = verify_chain(tmp_path / "store", NODE.did)
    assert report.ok
    assert report.records == PER_BLOCK * BLOCKS


def test_verify_by_missing_path_is_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="no Talos store"):
        verify_chain(tmp_path / "nowhere", NODE.did)
    assert not (tmp_path / "nowhere").exists()


def test_empty_log_is_ok(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        report = verify_chain(store, NODE.did)
    assert report.ok
    assert (report.blocks, report.head_height, report.head_hash) == (0, -1, None)


def test_flipped_byte_in_a_record(chain: tuple[Store, BlockLog]) -> None:
    store, _ = chain
    with store.write() as txn:
        raw = bytearray(txn.get("block_records", record_key(1, 2)) or b"")
        record = Record.from_bytes(bytes(raw))
        at = bytes(raw).index(record.commitment) + 5
        raw[at] ^= 0x01
        txn.put("block_records", record_key(1, 2), bytes(raw))
    assert where(store) == [("merkle_root", 1, None), ("sender_signature", 1, 2)]


def test_flipped_byte_in_a_block_header(chain: tuple[Store, BlockLog]) -> None:
    store, _ = chain
    with store.write() as txn:
        raw = bytearray(txn.get("blocks", block_key(2)) or b"")
        raw[16] ^= 0x40  # inside the timestamp
        txn.put("blocks", block_key(2), bytes(raw))
    assert where(store) == [("block_signature", 2, None), ("prev_link", 3, None)]


def test_reordered_blocks(chain: tuple[Store, BlockLog]) -> None:
    store, _ = chain
    with store.write() as txn:
        b1, b2 = txn.get("blocks", block_key(1)), txn.get("blocks", block_key(2))
        assert b1 is not None and b2 is not None
        txn.put("blocks", block_key(1), b2)
        txn.put("blocks", block_key(2), b1)
    found = where(store)
    assert ("height", 1, None) in found
    assert ("height", 2, None) in found
    assert ("prev_link", 1, None) in found
    assert ("merkle_root", 2, None) in found
    assert all(h in (1, 2, 3) for _, h, _ in found)


def test_deleted_block(chain: tuple[Store, BlockLog]) -> None:
    store, _ = chain
    with store.write() as txn:
        txn.delete("blocks", block_key(2))
    assert where(store) == [("missing_block", 2, None)]


def test_record_swapped_between_blocks(chain: tuple[Store, BlockLog]) -> None:
    store, _ = chain
    with store.write() as txn:
        a, b = (
            txn.get("block_records", record_key(1, 0)),
            txn.get("block_records", record_key(3, 1)),
        )
        assert a is not None and b is not None
        txn.put("block_records", record_key(1, 0), b)
        txn.put("block_records", record_key(3, 1), a)
    assert where(store) == [
        ("merkle_root", 1, None),
        ("record_index", 1, 0),
        ("merkle_root", 3, None),
        ("record_index", 3, 1),
    ]


def test_forged_sender_signature_in_a_node_signed_block(chain: tuple[Store, BlockLog]) -> None:
    """A node that signs a block over a forged record is caught by the sender check alone."""
    store, log = chain
    forged = dataclasses.replace(make_record(500), signature=BOB.sign(make_record(500).commitment))
    records = [make_record(501), forged]
    tip = log.get_block(log.height)
    assert tip is not None
    unsigned = Block(
        tip.height + 1,
        tip.hash(),
        tip.timestamp_ms,
        merkle_root([r.encoded for r in records]),
        len(records),
        NODE.did,
    )
    block = dataclasses.replace(unsigned, signature=NODE.sign(unsigned.header_bytes()))
    with store.write() as txn:
        txn.put("blocks", block_key(block.height), block.to_bytes())
        for i, r in enumerate(records):
            txn.put("block_records", record_key(block.height, i), r.encoded)
            txn.put(index_db(txn), r.record_id, record_key(block.height, i))
    assert where(store) == [("sender_signature", BLOCKS, 1)]


def test_record_index_tampering(chain: tuple[Store, BlockLog]) -> None:
    store, _ = chain
    with store.write() as txn:
        txn.delete(index_db(txn), make_record(5).record_id)  # block 1, record 1
        txn.put(index_db(txn), make_record(6).record_id, record_key(0, 0))  # block 1, record 2
        txn.put(index_db(txn), b"\x07" * 16, record_key(4, 0))
    assert where(store) == [
        ("record_index", 1, 1),
        ("record_index", 1, 2),
        ("record_index", 4, 0),
    ]


def test_malformed_block_and_record_bytes(chain: tuple[Store, BlockLog]) -> None:
    store, _ = chain
    with store.write() as txn:
        txn.put("blocks", block_key(1), b"TLBK\x01garbage")
        txn.put("block_records", record_key(3, 0), b"\x01\x00")
    found = where(store)
    assert ("malformed", 1, None) in found
    assert ("malformed", 3, 0) in found
    assert ("prev_link", 2, None) in found
    assert ("record_index", None, None) not in found


def test_missing_record_slot(chain: tuple[Store, BlockLog]) -> None:
    store, _ = chain
    with store.write() as txn:
        txn.delete("block_records", record_key(2, 1))
    found = where(store)
    assert ("record_count", 2, 1) in found
    assert ("record_index", 2, 1) in found


def test_parallel_report_equals_serial(tmp_path: Path) -> None:
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=8, clock=lambda: 1_700_000_000.0)
    for i in range(8 * 30):
        log.append(make_record(i))
    log.seal()
    with store.write() as txn:
        raw = bytearray(txn.get("blocks", block_key(7)) or b"")
        raw[-1] ^= 1
        txn.put("blocks", block_key(7), bytes(raw))
        txn.delete("blocks", block_key(20))
        txn.put("block_records", record_key(25, 3), make_record(9999).encoded)
    serial = verify_chain(store, NODE.did, workers=1)
    parallel = verify_chain(store, NODE.did, workers=2, parallel_threshold=0)
    assert parallel.workers == 2 and serial.workers == 1
    assert serial.defects
    assert parallel.defects == serial.defects
    assert (parallel.blocks, parallel.records, parallel.head_hash) == (
        serial.blocks,
        serial.records,
        serial.head_hash,
    )
    store.close()


def test_parallel_with_threads_alive_uses_forkserver_and_agrees(
    chain: tuple[Store, BlockLog],
) -> None:
    """A running node has helper threads: the pool must not fork them, and still agree."""
    store, _ = chain
    with store.write() as txn:
        txn.delete(index_db(txn), make_record(3).record_id)
    release = threading.Event()
    helper = threading.Thread(target=release.wait, args=(30,))
    helper.start()
    try:
        parallel = verify_chain(store, NODE.did, workers=2, parallel_threshold=0)
    finally:
        release.set()
        helper.join(timeout=30)
    serial = verify_chain(store, NODE.did, workers=1)
    assert parallel.workers == 2
    assert (
        parallel.defects
        == serial.defects
        == (Defect("record_index", 0, 3, "sealed record missing from the index"),)
    )


def test_walk_streams_contiguous_chunks_covering_every_height(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent streams the log in chunks; together they must tile it exactly."""
    import talos.chain.verify as verify_mod

    monkeypatch.setattr(verify_mod, "CHUNK_RECORDS", 7)
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=3, clock=lambda: 1_700_000_000.0)
    for i in range(3 * 41):
        log.append(make_record(i))
    log.seal()
    defects: list[Defect] = []
    with store.read() as txn:
        n_blocks = txn.count("blocks")
        walk = _LogWalk(txn, defects)
        chunks = list(walk.chunks())
    heights = [job[0] for chunk in chunks for job in chunk]
    assert heights == list(range(n_blocks)) and not defects
    # Bounded: a chunk closes as soon as it reaches the record count.
    assert all(sum(len(j[2]) for j in chunk) < 7 + 3 for chunk in chunks)
    assert (walk.heights, walk.records) == (n_blocks, 3 * 41)
    assert all(job[3] is not None for chunk in chunks for job in chunk)  # every prev link known
    parallel = verify_chain(store, NODE.did, workers=3, parallel_threshold=0)
    assert parallel.ok and parallel.workers == 3
    assert (parallel.blocks, parallel.records) == (n_blocks, 3 * 41)
    assert parallel.head_hash == log.heads().hash  # type: ignore[union-attr]
    store.close()


def test_default_chunk_is_a_bounded_slice_of_the_log() -> None:
    assert 256 <= CHUNK_RECORDS <= 65536


def test_duplicate_record_id_is_reported_once_at_the_copy_the_index_does_not_name(
    chain: tuple[Store, BlockLog],
) -> None:
    store, _ = chain
    with store.write() as txn:
        copy = txn.get("block_records", record_key(0, 1))
        assert copy is not None
        txn.put("block_records", record_key(3, 2), copy)  # r1 sealed again in block 3
    found = verify_chain(store, NODE.did, workers=1).defects
    assert [(d.code, d.height, d.index, d.message) for d in found] == [
        ("merkle_root", 3, None, "records do not hash to the header's Merkle root"),
        ("record_index", 3, 2, "record id also sealed at block 0, record 1"),
        ("record_index", 3, 2, f"index names unknown record {make_record(14).record_id.hex()}"),
    ]
    # The index names the later copy: the earlier one is the duplicate, and
    # the index entry of the record that was overwritten is unknown now.
    with store.write() as txn:
        txn.put(index_db(txn), make_record(1).record_id, record_key(3, 2))
    found = verify_chain(store, NODE.did, workers=1).defects
    assert [(d.code, d.height, d.index, d.message) for d in found if d.code == "record_index"] == [
        ("record_index", 0, 1, "record id also sealed at block 3, record 2"),
        (
            "record_index",
            3,
            2,
            f"index names unknown record {make_record(14).record_id.hex()}",
        ),
    ]


def test_block_far_beyond_the_tip_is_one_gap_defect(chain: tuple[Store, BlockLog]) -> None:
    """A stray key at height 2**40 must not make the walk visit every height."""
    store, log = chain
    tip = log.get_block(log.height)
    assert tip is not None
    with store.write() as txn:
        txn.put("blocks", block_key(2**40), tip.to_bytes())
    report = verify_chain(store, NODE.did, workers=1)
    gap = [(d.code, d.height, d.message) for d in report.defects if d.code == "missing_block"]
    assert gap == [("missing_block", BLOCKS, f"no block stored at heights {BLOCKS}..{2**40 - 1}")]
    # The copied block is judged where it is stored, not where its header says.
    assert {(d.code, d.height) for d in report.defects} - {("missing_block", BLOCKS)} == {
        ("height", 2**40),
        ("merkle_root", 2**40),
        ("record_count", 2**40),
    }  # no prev_link: the block before it is missing, there is no link to check
    assert report.blocks == 2**40 + 1


def test_junk_keys_a_few_heights_apart_cost_one_defect_each(
    chain: tuple[Store, BlockLog], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every run of missing heights is one defect, short or long, and the report lists
    at most MAX_DEFECTS: 1,000 junk keys 4,096 heights apart made 4 million defects."""
    store, log = chain
    tip = log.get_block(log.height)
    assert tip is not None
    with store.write() as txn:
        for i in range(1, 41):
            txn.put("blocks", block_key(BLOCKS + i * 100), tip.to_bytes())
    report = verify_chain(store, NODE.did, workers=1)
    gaps = [d for d in report.defects if d.code == "missing_block"]
    assert len(gaps) == 40 and report.omitted == 0
    assert gaps[0].message == f"no block stored at heights {BLOCKS}..{BLOCKS + 99}"
    assert report.blocks == BLOCKS + 4001
    monkeypatch.setattr(verify, "MAX_DEFECTS", 50)
    capped = verify_chain(store, NODE.did, workers=1)
    assert len(capped.defects) == 50 and capped.omitted == len(report.defects) - 50
    assert not capped.ok


def test_chunk_runner_outside_a_pool_refuses() -> None:
    """The worker entry point has no settings unless the pool initializer installed them."""
    with pytest.raises(RuntimeError, match="without its settings"):
        _run_chunk([])


def test_a_height_holding_more_records_than_a_block_can_is_not_read_whole(
    chain: tuple[Store, BlockLog], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crafted store with a huge run of records under one height: the walk holds at
    most MAX_BLOCK_RECORDS of them (a legitimate block has at most that many), counts
    the rest and says so, instead of reading them all into memory."""
    store, _ = chain
    cap = 6
    monkeypatch.setattr(verify, "MAX_BLOCK_RECORDS", cap)
    extra = make_record(1000).to_bytes()
    with store.write() as txn:
        for i in range(PER_BLOCK, PER_BLOCK + 50):
            txn.put("block_records", record_key(1, i), extra)
    with store.read() as txn:
        walk = _LogWalk(txn, defects := [])
        held = {job[0]: len(job[2]) for job in walk.jobs()}
    assert held[1] == cap and walk.records == PER_BLOCK * BLOCKS + 50
    assert [(d.code, d.height) for d in defects] == [("record_count", 1)]
    assert defects[0].message == (
        f"{PER_BLOCK + 50} records stored at this height; a block holds at most {cap}"
        f" of 64 MiB (only {cap} were checked)"
    )
    report = verify_chain(store, NODE.did, workers=1)
    assert not report.ok and ("record_count", 1, None) in where(store)


def test_seal_count_is_bounded_by_what_a_block_holds() -> None:
    from talos.chain.block import MAX_BLOCK_RECORDS
    from talos.config import NodeConfig
    from talos_sdk.errors import UsageError

    NodeConfig(seal_count=MAX_BLOCK_RECORDS)
    with pytest.raises(ValueError, match="less than or equal to 4096"):
        NodeConfig(seal_count=MAX_BLOCK_RECORDS + 1)
    with pytest.raises(UsageError, match=r"max_records must be 1\.\.4096"):
        BlockLog(Store.__new__(Store), NODE, max_records=MAX_BLOCK_RECORDS + 1)


def test_a_height_holding_more_bytes_than_a_block_can_is_not_read_whole(
    chain: tuple[Store, BlockLog], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Few records, each far larger than a record can be: held up to MAX_HEIGHT_BYTES."""
    store, _ = chain
    monkeypatch.setattr(verify, "MAX_HEIGHT_BYTES", 3 << 20)
    with store.write() as txn:
        for i in range(PER_BLOCK, PER_BLOCK + 8):
            txn.put("block_records", record_key(1, i), bytes(1 << 20))
    with store.read() as txn:
        walk = _LogWalk(txn, defects := [])
        held = {job[0]: sum(len(r) for _, r in job[2]) for job in walk.jobs()}
    assert held[1] <= 3 << 20 and walk.records == PER_BLOCK * BLOCKS + 8
    assert [(d.code, d.height) for d in defects] == [("record_count", 1)]


def test_chunks_are_cut_by_bytes_too(
    chain: tuple[Store, BlockLog], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Few but huge records: a chunk of CHUNK_RECORDS of them would be gigabytes."""
    store, _ = chain
    monkeypatch.setattr(verify, "CHUNK_BYTES", 2 << 20)
    with store.write() as txn:
        for height in range(BLOCKS):
            txn.put("block_records", record_key(height, PER_BLOCK), bytes(1 << 20))
    with store.read() as txn:
        chunks = list(_LogWalk(txn, []).chunks())
    assert len(chunks) >= BLOCKS // 2
    assert all(sum(len(r) for job in c for _, r in job[2]) <= 3 << 20 for c in chunks)
