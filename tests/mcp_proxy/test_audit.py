"""Tests for mcp_proxy.audit: group commit and strict mode into a real BlockLog on LMDB."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_proxy.audit import (
    AUDIT_KEY_FILE,
    MAX_COMMITMENT,
    AuditKey,
    AuditMode,
    Auditor,
    AuditRecord,
    BlockLogSink,
    Event,
    Facts,
)
from mcp_proxy.audit_log import record_entries
from mcp_proxy.audit_record import INLINE_SLOW_LIMIT
from talos.chain.block import MAX_COMMITMENT as BLOCK_MAX_COMMITMENT
from talos.chain.block import MAX_EXTRA as BLOCK_MAX_EXTRA
from talos.chain.log import BlockLog
from talos.store import Store
from talos_sdk.wallet import Wallet

CALLER = "did:key:z6MkCaller"
KEY = AuditKey(bytes(range(32)))
digest = KEY.digest


def rec(i: int, *, tool: str = "echo", plaintext: bytes = b"") -> AuditRecord:
    return AuditRecord(
        caller=CALLER,
        server="default",
        method="tools/call",
        tool=tool,
        request_id=i,
        params_hmac=digest({"i": i}),
        result_hmac=digest({"ok": True}),
        latency_us=123,
        outcome="ok",
        timestamp_ms=1_700_000_000_000 + i,
        plaintext=plaintext,
    )


@pytest.fixture
def block_log(tmp_path: Path) -> BlockLog:
    store = Store(tmp_path / "store")
    return BlockLog(store, Wallet.generate(), max_records=1000)


def sealed_commitments(block_log: BlockLog) -> list[dict[str, object]]:
    """Every audited event of the sealed log, batch records expanded, in order."""
    block_log.seal()
    out = []
    for height in range(block_log.height + 1):
        for r in block_log.block_records(height):
            assert r.kind == "mcp"
            out += [e.body for e in record_entries(r, height)]
    return out


def test_bounds_match_the_block_format() -> None:
    assert MAX_COMMITMENT == BLOCK_MAX_COMMITMENT
    from mcp_proxy.audit import MAX_EXTRA

    assert MAX_EXTRA == BLOCK_MAX_EXTRA


def test_digest_is_a_keyed_hmac_over_the_canonical_form() -> None:
    import hmac

    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    assert digest({"a": 1}) == hmac.new(bytes(range(32)), b'{"a":1}', hashlib.sha256).digest()
    # Without the key the plain hash of a guess does not match (no dictionary attack).
    assert digest({"a": 1}) != hashlib.sha256(b'{"a":1}').digest()
    assert AuditKey(bytes(32)).digest({"a": 1}) != digest({"a": 1})
    assert digest(None) == b""


def test_audit_key_is_created_0600_and_reloaded(tmp_path: Path) -> None:
    import os

    key = AuditKey.load(tmp_path)
    path = tmp_path / AUDIT_KEY_FILE
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert AuditKey.load(tmp_path).digest({"x": 1}) == key.digest({"x": 1})
    path.write_text("not hex\n")
    from talos_sdk.errors import UsageError

    with pytest.raises(UsageError, match="audit key"):
        AuditKey.load(tmp_path)


async def test_group_commit_batches_into_the_block_log(block_log: BlockLog) -> None:
    sink = BlockLogSink(block_log, block_log.node_did)
    auditor = Auditor(sink, sync_interval=0.05)
    async with asyncio.timeout(10):
        await auditor.start()
        for i in range(100):
            auditor.submit(rec(i))
        await auditor.stop()
    assert auditor.written == 100
    commitments = sealed_commitments(block_log)
    assert [c["id"] for c in commitments] == list(range(100))
    first = commitments[0]
    assert first["caller"] == CALLER and first["tool"] == "echo" and first["outcome"] == "ok"
    assert first["params_hmac"] == digest({"i": 0}).hex()
    assert first["event"] == "call" and first["v"] == 3
    block_log.store.close()


async def test_strict_barrier_waits_for_durable_write(block_log: BlockLog) -> None:
    sink = BlockLogSink(block_log, block_log.node_did)
    auditor = Auditor(sink, mode=AuditMode.STRICT, sync_interval=60)
    async with asyncio.timeout(10):
        await auditor.start()
        auditor.submit(rec(1))
        await auditor.record_barrier()
        # Durable means it is in LMDB already, before any seal or stop.
        assert block_log.pending_count == 1
        await auditor.stop()
    block_log.store.close()


async def test_plaintext_goes_to_extra_and_is_bounded(block_log: BlockLog) -> None:
    sink = BlockLogSink(block_log, block_log.node_did)
    auditor = Auditor(sink, plaintext=True)
    async with asyncio.timeout(10):
        await auditor.start()
        auditor.submit(rec(1, plaintext=b"x" * 10_000))
        await auditor.stop()
    block_log.seal()
    (record,) = block_log.block_records(0)
    assert record.extra == b"x" * BLOCK_MAX_EXTRA
    assert record.recipient == CALLER and record.sender == block_log.node_did
    block_log.store.close()


def test_huge_tool_name_still_fits_the_commitment() -> None:
    commitment = rec(1, tool="t" * 10_000).commitment()
    assert len(commitment) <= MAX_COMMITMENT
    assert orjson.loads(commitment)["tool"] == "t" * 256


async def test_failed_write_fails_strict_waiters(tmp_path: Path) -> None:
    class Broken:
        def write(self, records: object) -> None:
            raise OSError("disk gone")

        def sync(self) -> None:
            raise OSError("disk gone")

    auditor = Auditor(Broken(), mode=AuditMode.STRICT)
    async with asyncio.timeout(10):
        await auditor.start()
        auditor.submit(rec(1))
        with pytest.raises(OSError, match="disk gone"):
            await auditor.record_barrier()
        auditor._queue.clear()
        await auditor.stop()


def test_digests_are_rfc8785_so_any_jcs_library_recomputes_them() -> None:
    import hmac

    from talos_sdk.canonical import canonical_json_bytes

    params = {"name": "add", "arguments": {"b": 1.5, "a": 1e21, "é": "x"}}
    expected = hmac.new(bytes(range(32)), canonical_json_bytes(params), hashlib.sha256).digest()
    assert digest(params) == expected
    # A value JCS cannot represent still gets a digest rather than losing the record.
    assert len(digest({"n": 2**60 + 1})) == 32
    assert len(digest({"n": 2**70 + 1})) == 32


VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "hmac" / "rfc4231.json"


def test_hmac256_matches_rfc4231_and_the_stdlib() -> None:
    import hmac
    import os

    from mcp_proxy.audit_record import Hmac256

    for v in orjson.loads(VECTORS.read_bytes())["vectors"]:
        mac = Hmac256(bytes.fromhex(v["key"])).mac(bytes.fromhex(v["data"]))
        assert mac.hex() == v["mac"], v["case"]
    for size in (0, 1, 32, 63, 64, 65, 1000):
        key, data = os.urandom(32), os.urandom(size)
        assert Hmac256(key).mac(data) == hmac.new(key, data, hashlib.sha256).digest()


def _reference_commitment(r: AuditRecord) -> bytes:
    """The record body through the general RFC 8785 path, as every earlier version wrote it."""
    from mcp_proxy.audit_record import _stable_json

    return _stable_json(
        {
            "v": 2,
            "event": str(r.event),
            "caller": r.caller,
            "server": r.server,
            "session": r.session,
            "pid": r.pid,
            "method": r.method,
            "tool": r.tool,
            "id": r.request_id,
            "params_hmac": r.params_hmac.hex(),
            "result_hmac": r.result_hmac.hex(),
            "latency_us": r.latency_us,
            "outcome": r.outcome,
            "detail": r.detail,
        }
    )


@given(
    text=st.text(max_size=40),
    rid=st.one_of(st.none(), st.text(max_size=20), st.integers(-(2**70), 2**70)),
    pid=st.one_of(st.none(), st.integers(0, 2**22)),
    event=st.sampled_from(list(Event)),
)
@settings(max_examples=300, deadline=None)
def test_commitment_is_the_rfc8785_body_whatever_the_fields(
    text: str, rid: int | str | None, pid: int | None, event: Event
) -> None:
    r = AuditRecord(
        caller=f"did:key:z6Mk{text}",
        server=text,
        method="tools/call",
        tool=text or None,
        request_id=rid,
        params_hmac=digest({"t": text}),
        result_hmac=b"",
        latency_us=len(text) * 1000,
        outcome="ok",
        timestamp_ms=1_700_000_000_000,
        event=event,
        session=7,
        pid=pid,
        detail=text[::-1],
    )
    assert r.commitment() == _reference_commitment(r)


class CountingSink:
    """Records each write (one per commit) and each sync."""

    def __init__(self) -> None:
        self.writes: list[list[AuditRecord]] = []
        self.syncs = 0

    def write(self, records: Sequence[AuditRecord]) -> None:
        self.writes.append(list(records))

    def sync(self) -> None:
        self.syncs += 1


def facts(i: int, params: object, result: object) -> Facts:
    return (CALLER, "default", "tools/call", "echo", i, params, result, 5, "ok",
            1_700_000_000_000 + i, b"", Event.CALL, 3, 99, "")  # fmt: skip


async def test_noted_calls_are_built_and_written_in_one_batch() -> None:
    sink = CountingSink()
    auditor = Auditor(sink, key=KEY, commit_interval=0.01, sync_interval=60)
    async with asyncio.timeout(10):
        await auditor.start()
        for i in range(200):  # one loop pass: one batch, one write
            auditor.note(facts(i, {"i": i}, {"ok": i} if i % 2 else None))
        auditor.submit(rec(200))
        await auditor.record_barrier()
        assert [len(w) for w in sink.writes] == [201] and sink.syncs == 1
        await auditor.stop()
    records = sink.writes[0]
    assert [r.request_id for r in records] == list(range(201))
    assert records[1].params_hmac == digest({"i": 1})
    assert records[1].result_hmac == digest({"ok": 1})
    assert records[2].result_hmac == b""  # no result: no digest
    assert records[7].session == 3 and records[7].pid == 99 and records[7].latency_us == 5
    assert records[200] == rec(200)


async def test_a_full_batch_is_written_without_waiting_for_the_linger() -> None:
    sink = CountingSink()
    auditor = Auditor(sink, key=KEY, commit_interval=60, batch_limit=8, sync_interval=60)
    async with asyncio.timeout(10):
        await auditor.start()
        for i in range(7):
            auditor.note(facts(i, None, None))
        await asyncio.sleep(0.05)
        assert sink.writes == []  # below the limit: the records linger
        auditor.note(facts(7, None, None))
        while not sink.writes:
            await asyncio.sleep(0.005)
        assert [len(w) for w in sink.writes] == [8]
        await auditor.stop()
    assert [len(w) for w in sink.writes] == [8] and sink.syncs == 1


async def test_unsynced_writes_are_synced_within_the_interval() -> None:
    sink = CountingSink()
    auditor = Auditor(sink, commit_interval=0.001, sync_interval=0.05)
    async with asyncio.timeout(30):
        await auditor.start()
        auditor.note(facts(1, None, None))
        while not (sink.writes and sink.syncs):
            await asyncio.sleep(0.01)
        writes, syncs = len(sink.writes), sink.syncs
        await asyncio.sleep(0.2)  # clean: no more writes or syncs while nothing happens
        assert (len(sink.writes), sink.syncs) == (writes, syncs)
        await auditor.stop()


async def test_a_batch_long_to_digest_is_built_off_the_event_loop() -> None:
    # A params or result of floats takes the pure-Python RFC 8785 encoder (~2.5 s for
    # 8 MB): built on the loop, it stalled every session of every peer of a serve. Such a
    # batch goes to a thread; the others stay on the loop (a thread hop per batch cost
    # 20 % of the tunnel's throughput at 256 in flight).
    sink = CountingSink()
    auditor = Auditor(sink, key=KEY, commit_interval=0.01, sync_interval=60)
    built: list[tuple[bool, threading.Thread]] = []
    real_build = auditor._build

    def recording(queued: list[Any], inline: bool = False) -> list[AuditRecord]:
        built.append((inline, threading.current_thread()))
        return real_build(queued, inline)

    auditor._build = recording  # type: ignore[method-assign]
    heavy = {"x": [0.1] * (INLINE_SLOW_LIMIT // 3)}
    async with asyncio.timeout(10):
        await auditor.start()
        auditor.note(facts(1, {"small": 0.5}, {"y": 1}))
        await auditor.record_barrier()
        auditor.note(facts(2, heavy, None))
        await auditor.record_barrier()
        await auditor.stop()
    loop_thread = threading.current_thread()
    assert built[0] == (True, loop_thread)  # small: on the loop
    assert built[1] == (True, loop_thread) and built[2][0] is False  # heavy: tried, then...
    assert built[2][1] is not loop_thread  # ...built in a thread
    assert sink.writes[1][0].params_hmac == digest(heavy)
