"""Tests for talos/chain/record_index.py (ADR 0013): the newest ids in memory, the
rest in ``records`` in sorted batches, on real LMDB, across reopen and a killed writer."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import talos.chain.record_index as record_index
from talos.chain.block import Record
from talos.chain.log import BlockLog, block_key, verify_inclusion_proof
from talos.chain.record_index import WATERMARK_KEY, index_db, record_id_of
from talos.chain.verify import verify_chain
from talos.store import Store
from tests.talos.chain import ALICE, NODE, audit_record, make_record

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of a few dozen ids, rewritten a few entries per seal, so a short test
    crosses many batches and seals in the middle of a rewrite."""
    monkeypatch.setattr(record_index, "MIN_BATCH", 24)
    monkeypatch.setattr(record_index, "MAX_BATCH", 64)
    monkeypatch.setattr(record_index, "STEP", 7)


def node_record(i: int) -> Record:
    return Record(
        kind="mcp",
        record_id=hashlib.sha256(b"rid" + i.to_bytes(8, "big")).digest()[:16],
        sender=NODE.did,
        recipient=ALICE.did,
        commitment=i.to_bytes(8, "big"),
        signature=b"",
        timestamp_ms=1_700_000_000_000 + i,
    )


def watermark(store: Store) -> int | None:
    with store.read() as txn:
        raw = txn.get("meta", WATERMARK_KEY)
    return None if raw is None else int.from_bytes(raw, "big")


def indexed(store: Store) -> int:
    with store.read() as txn:
        return txn.count(index_db(txn))


def fill(log: BlockLog, start: int, count: int, per_block: int = 5) -> None:
    for first in range(start, start + count, per_block):
        for i in range(first, min(first + per_block, start + count)):
            log.append(node_record(i))
        log.seal()


def assert_all_found(log: BlockLog, count: int) -> None:
    for i in range(count):
        found = log.find_record(node_record(i).record_id)
        assert found is not None, i
        assert found[2] == node_record(i)


def test_record_id_of_reads_the_id_of_both_id_sizes() -> None:
    for record in (make_record(1), audit_record(2), node_record(3)):
        assert record_id_of(record.encoded) == record.record_id


def test_ids_go_to_records_in_batches_and_stay_findable(tmp_path: Path) -> None:
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=5)
    assert watermark(store) is None  # opening writes nothing
    fill(log, 0, 20)  # the first seal writes the watermark with its block
    assert indexed(store) == 0 and watermark(store) == 0  # below MIN_BATCH: memory only
    assert_all_found(log, 20)
    fill(log, 20, 300)
    assert 0 < indexed(store) < 320
    mark = watermark(store)
    assert mark is not None and 0 < mark <= log.height + 1
    with store.read() as txn:  # exactly the records below the watermark are in `records`
        below = [k for k, _ in txn.items("block_records") if int.from_bytes(k[:8], "big") < mark]
        assert txn.count(index_db(txn)) == len(below)
    assert_all_found(log, 320)
    proof = log.inclusion_proof(node_record(319).record_id)  # in memory still
    assert verify_inclusion_proof(proof, NODE.did)
    report = verify_chain(store, NODE.did, workers=1)
    assert report.ok and report.records == 320
    store.close()


def test_reopen_rebuilds_the_memory_part(tmp_path: Path) -> None:
    store = Store(tmp_path)
    fill(BlockLog(store, NODE, max_records=5), 0, 137)
    mark = watermark(store)
    store.close()
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=5)
    assert watermark(store) == mark
    assert_all_found(log, 137)
    # An id sealed before the reopen, whether in `records` or not, is refused again.
    for i in (0, 136):
        log.append(node_record(i))
    log.seal()
    reasons = sorted(q.reason for q in log.quarantined())
    assert reasons == ["record id already sealed"] * 2
    fill(log, 137, 200)
    assert_all_found(log, 337)
    assert verify_chain(store, NODE.did, workers=1).ok
    store.close()


def _index_rows(store: Store) -> tuple[str, int, int]:
    """The index database in use, its rows, and the rows of the other one."""
    with store.read() as txn:
        current = index_db(txn)
        other = next(db for db in record_index.INDEX_DBS if db != current)
        return current, txn.count(current), txn.count(other)


def test_a_rewrite_copies_a_step_per_seal_and_every_id_stays_findable(tmp_path: Path) -> None:
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=5)
    fill(log, 0, 150)
    seen_mid_pass = reopened = False
    count = 150
    while count < 600:
        before = _index_rows(store)
        fill(log, count, 5)
        count += 5
        after = _index_rows(store)
        if after[0] == before[0] and after[2] > before[2]:
            # One step: at most STEP old rows plus the frozen ids (<= MAX_BATCH) among them.
            assert after[2] - before[2] <= record_index.STEP + record_index.MAX_BATCH
            if after[2] > record_index.STEP:
                seen_mid_pass = True
                assert_all_found(log, count)
                assert verify_chain(store, NODE.did, workers=1).ok
                if not reopened:  # stop mid-rewrite: the next one starts over
                    store.close()
                    store = Store(tmp_path)
                    log = BlockLog(store, NODE, max_records=5)
                    reopened = True
                    assert_all_found(log, count)
    assert seen_mid_pass and reopened
    assert_all_found(log, count)
    log.flush_index()
    _, rows, _ = _index_rows(store)
    assert rows == count and watermark(store) == log.height + 1
    assert verify_chain(store, NODE.did, workers=1).ok
    store.close()


def test_flush_index_puts_every_id_in_records(tmp_path: Path) -> None:
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=5)
    fill(log, 0, 17)
    log.flush_index()
    assert indexed(store) == 17 and watermark(store) == log.height + 1
    log.flush_index()  # nothing left: no write
    assert_all_found(log, 17)
    assert verify_chain(store, NODE.did, workers=1).ok
    store.close()


def test_store_without_the_watermark_row_was_fully_indexed(tmp_path: Path) -> None:
    """A log from before the watermark had every id in `records`: it counts as indexed."""
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=5)
    fill(log, 0, 30)
    log.flush_index()
    with store.write() as txn:
        txn.delete("meta", WATERMARK_KEY)
    assert verify_chain(store, NODE.did, workers=1).ok
    store.close()
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=5)
    below = log.height + 1
    fill(log, 30, 10)
    assert watermark(store) == below
    assert_all_found(log, 40)
    assert verify_chain(store, NODE.did, workers=1).ok
    store.close()


def test_watermark_above_a_cut_log_is_clamped(tmp_path: Path) -> None:
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=5)
    fill(log, 0, 100)
    log.flush_index()
    cut = 10  # keep blocks 0..9 (records 0..49), as a hand-cut log would
    with store.write() as txn:
        doomed = [("blocks", k) for k, _ in txn.items("blocks", block_key(cut))]
        doomed += [("block_records", k) for k, _ in txn.items("block_records", block_key(cut))]
        doomed += [
            (index_db(txn), k)
            for k, loc in txn.items(index_db(txn))
            if int.from_bytes(loc[:8], "big") >= cut
        ]
        for db, key in doomed:
            txn.delete(db, key)
    store.close()
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=5)
    assert log.height == cut - 1 and watermark(store) == 20  # lowered with the next seal
    fill(log, 1000, 15)
    assert watermark(store) == cut
    assert verify_chain(store, NODE.did, workers=1).ok
    store.close()


def test_verify_reports_a_duplicate_among_ids_not_yet_in_records(tmp_path: Path) -> None:
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=5)
    fill(log, 0, 10)  # two blocks, both above the watermark (below MIN_BATCH)
    assert indexed(store) == 0
    with store.write() as txn:  # record 0 written again over block 1's first record
        first = txn.get("block_records", block_key(0) + bytes(4))
        assert first is not None
        txn.put("block_records", block_key(1) + bytes(4), first)
    found = [(d.code, d.height, d.index) for d in verify_chain(store, NODE.did).defects]
    assert ("record_index", 1, 0) in found and ("merkle_root", 1, None) in found
    store.close()


_WRITER = textwrap.dedent(
    """
    import hashlib, sys
    from pathlib import Path
    import talos.chain.record_index as record_index
    from talos.chain.log import BlockLog
    from talos.store import Store
    from tests.talos.chain.test_record_index import node_record
    from tests.talos.chain import NODE

    record_index.MIN_BATCH, record_index.MAX_BATCH, record_index.STEP = 24, 64, 7
    store = Store(Path(sys.argv[1]))
    log = BlockLog(store, NODE, max_records=7)
    i = int(sys.argv[2])
    while True:  # until killed: every seal is durable before it is reported
        for j in range(i, i + 7):
            log.append(node_record(j))
        log.seal()
        i += 7
        print(i, flush=True)
    """
)


def _run_until_killed(home: Path, start: int, report_at: int) -> int:
    """Start a writer process, SIGKILL it once it reported ``report_at`` sealed records."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(home), str(start)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    acknowledged = start
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= report_at:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return acknowledged


def test_killed_writer_loses_no_acknowledged_record(tmp_path: Path) -> None:
    """SIGKILL mid-run, twice: every record acknowledged before it is found after reopen."""
    acknowledged = _run_until_killed(tmp_path, 0, 250)
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=7)
    assert_all_found(log, acknowledged)
    mark = watermark(store)
    assert mark is not None and indexed(store) > 0
    store.close()
    second = 10_000  # fresh ids: the first run may have left appended, unsealed ones
    again = _run_until_killed(tmp_path, second, second + 250)
    store = Store(tmp_path)
    log = BlockLog(store, NODE, max_records=7)
    log.seal()  # records appended but unsealed at a kill are sealed now
    assert_all_found(log, acknowledged)
    for i in range(second, again):
        assert log.find_record(node_record(i).record_id) is not None, i
    report = verify_chain(store, NODE.did, workers=1)
    assert report.ok, report.defects
    store.close()
