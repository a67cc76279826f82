"""Audit batch records (docs/adr/0014-audit-batch-records.md): several events in one
block-log record, read back one entry per event, and tamper-evident through the chain."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_proxy.audit import Auditor, AuditRecord, BlockLogSink, Event
from mcp_proxy.audit_log import format_entry, read_entries, record_entries
from mcp_proxy.audit_record import BATCH_VERSION, MAX_COMMITMENT, AuditKey, _stable_json, pack
from mcp_proxy.nodehost import ensure_home
from talos.chain.block import Record
from talos.chain.log import BlockLog, record_key
from talos.chain.verify import verify_chain
from talos.config import Home
from talos.store import Store
from talos_sdk.canonical import canonical_json_bytes
from talos_sdk.errors import EncodingError, UsageError
from talos_sdk.keyfile import load_wallet

KEY = AuditKey(bytes(range(32)))
ALICE = "did:key:z6MkAlice"
BOB = "did:key:z6MkBob"


def call(i: int, caller: str = ALICE, **kw: object) -> AuditRecord:
    fields: dict[str, object] = {
        "caller": caller,
        "server": "default",
        "method": "tools/call",
        "tool": "echo",
        "request_id": i,
        "params_hmac": KEY.digest({"i": i}),
        "result_hmac": KEY.digest({"r": i}),
        "latency_us": 100 + i,
        "outcome": "ok",
        "timestamp_ms": 1_700_000_000_000 + i,
        "session": 7,
        "pid": 4242,
    }
    fields.update(kw)
    return AuditRecord(**fields)  # type: ignore[arg-type]


def test_a_batch_packs_many_calls_per_record_in_order_and_rfc8785() -> None:
    records = [call(i) for i in range(40)]
    packed = pack(records)
    assert 1 < len(packed) <= 5  # about ten calls a record, not one
    for p in packed:
        assert len(p.commitment) <= MAX_COMMITMENT
        assert canonical_json_bytes(orjson.loads(p.commitment)) == p.commitment
        assert p.recipient == ALICE and p.extra == b""
    node = "did:key:z6MkNode"
    stored = [Record("mcp", bytes(16), node, *p[:2], b"", p.timestamp_ms) for p in packed]
    bodies = [e.body for r in stored for e in record_entries(r, None)]
    assert [b["id"] for b in bodies] == list(range(40))
    one = bodies[3]
    assert one["caller"] == ALICE and one["v"] == 3 and one["latency_us"] == 103
    assert one["params_hmac"] == KEY.digest({"i": 3}).hex()
    # Each entry is the version 2 body's fields, plus its own time.
    v2 = orjson.loads(records[3].commitment())
    assert {k: v for k, v in one.items() if k != "v"} == {k: v for k, v in v2.items() if k != "v"}
    assert packed[0].timestamp_ms == records[0].timestamp_ms


def test_callers_do_not_share_a_record_and_plaintext_keeps_its_own() -> None:
    records = [call(0), call(1), call(2, BOB), call(3, plaintext=b"req\nrep"), call(4)]
    packed = pack(records)
    assert [p.recipient for p in packed] == [ALICE, BOB, ALICE, ALICE]
    assert [len(orjson.loads(p.commitment).get("calls", [None])) for p in packed] == [2, 1, 1, 1]
    assert orjson.loads(packed[2].commitment)["v"] == 2 and packed[2].extra == b"req\nrep"


def test_an_oversized_name_is_cut_so_the_entry_fits_a_batch_record() -> None:
    (packed,) = pack([call(1, tool="t" * 10_000, detail="d" * 10_000)])
    assert len(packed.commitment) <= MAX_COMMITMENT
    (entry,) = orjson.loads(packed.commitment)["calls"]
    assert entry["tool"] == "t" * 256 and entry["detail"] == "d" * 256


async def write_home(home: Path, records: list[AuditRecord], *, seal: bool) -> BlockLog:
    ensure_home(home)
    talos_home = Home(home)
    log = BlockLog(Store(talos_home.store_dir), load_wallet(talos_home.identity))
    auditor = Auditor(BlockLogSink(log, log.node_did), key=KEY)
    async with asyncio.timeout(30):
        await auditor.start()
        for rec in records:
            auditor.submit(rec)
        await auditor.stop()
    if seal:
        log.seal()
    return log


async def test_talos_proxy_audit_reads_every_call_of_batch_and_old_records(
    tmp_path: Path,
) -> None:
    log = await write_home(tmp_path, [call(i) for i in range(25)], seal=True)
    # A version 2 record as stores written before batch records hold them.
    old = call(25, event=Event.SESSION, method="exit", tool=None, outcome="exited", detail="x")
    stamp, commitment = old.timestamp_ms, old.commitment()
    log.append(Record("mcp", bytes(16), log.node_did, old.caller, commitment, b"", stamp))
    log.store.close()
    entries = await asyncio.to_thread(read_entries, tmp_path)
    assert [e.body["id"] for e in entries] == list(range(26))
    assert [e.timestamp_ms for e in entries] == [1_700_000_000_000 + i for i in range(26)]
    assert entries[-1].index is None and entries[-1].body["v"] == 2
    assert entries[-1].height is None and entries[0].height == 0
    assert {e.record_id for e in entries[:25]} < {e.record_id for e in entries}
    assert entries[12].to_json()["index"] == entries[12].index


async def test_tampering_with_one_call_of_a_sealed_batch_is_detected(tmp_path: Path) -> None:
    log = await write_home(tmp_path, [call(i) for i in range(25)], seal=True)
    store, node_did = log.store, log.node_did
    assert verify_chain(store, node_did, workers=1).ok
    # Rewrite one call's outcome inside the batch record, keeping it valid JSON.
    with store.write() as txn:
        raw = bytes(txn.get("block_records", record_key(0, 1)) or b"")
        record = Record.from_bytes(raw)
        body = orjson.loads(record.commitment)
        assert body["v"] == 3 and len(body["calls"]) > 1
        body["calls"][1]["outcome"] = "denied"
        forged = Record(
            record.kind, record.record_id, record.sender, record.recipient,
            canonical_json_bytes(body), b"", record.timestamp_ms,
        )  # fmt: skip
        txn.put("block_records", record_key(0, 1), forged.encoded)
    report = verify_chain(store, node_did, workers=1)
    assert [(d.code, d.height) for d in report.defects] == [("merkle_root", 0)]
    store.close()


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(value=JSON)
@settings(max_examples=400, deadline=None)
def test_the_digest_fast_path_gives_the_rfc8785_bytes(value: object) -> None:
    # orjson's output is taken only when it is JCS's; otherwise the general path decides.
    try:
        expected = canonical_json_bytes(value)
    except EncodingError:  # beyond 2**53: the sorted-key fallback, as before
        expected = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    assert _stable_json(value) == expected
    mac = hmac.new(bytes(range(32)), expected, hashlib.sha256).digest()
    assert KEY.digest(value) == (b"" if value is None else mac)  # absent: no digest


@given(
    text=st.text(max_size=30),
    rid=st.one_of(st.none(), st.text(max_size=9), st.integers(-(2**70), 2**70)),
)
@settings(max_examples=300, deadline=None)
def test_a_batch_entry_is_the_rfc8785_body(text: str, rid: int | str | None) -> None:
    rec = call(0, server=text, tool=text or None, request_id=rid, detail=text[::-1])
    # The v2 body's fields through the general path, without caller and v, with the time.
    reference = _stable_json(
        {
            "event": "call",
            "server": rec.server,
            "session": rec.session,
            "pid": rec.pid,
            "method": rec.method,
            "tool": rec.tool,
            "id": rec.request_id,
            "params_hmac": rec.params_hmac.hex(),
            "result_hmac": rec.result_hmac.hex(),
            "latency_us": rec.latency_us,
            "outcome": rec.outcome,
            "detail": rec.detail,
            "timestamp_ms": rec.timestamp_ms,
        }
    )
    assert rec.entry() == reference


async def test_noting_before_start_is_a_usage_error() -> None:
    auditor = Auditor(BlockLogSink.__new__(BlockLogSink), key=KEY)
    with pytest.raises(UsageError, match="start"):
        auditor.submit(call(1))


async def test_names_that_escape_long_cannot_make_a_batch_vanish(tmp_path: Path) -> None:
    # A caller chooses the method, tool and id: a control character takes 6 bytes
    # escaped, so cutting names to 256 characters alone left the record above the
    # block format's bound, and the block log refused the whole batch, the other
    # caller's events with it.
    hostile = {"method": "\x01" * 300, "tool": "\x02" * 300, "request_id": "\x1f" * 300}
    records = [
        call(0),
        call(1, BOB, **hostile),
        call(2, BOB, plaintext=b"req\nrep", **hostile),
        call(3),
    ]
    log = await write_home(tmp_path, records, seal=True)
    assert verify_chain(log.store, log.node_did, workers=1).ok
    log.store.close()
    entries = await asyncio.to_thread(read_entries, tmp_path)
    assert [e.body["caller"] for e in entries] == [ALICE, BOB, BOB, ALICE]
    assert [e.body["id"] for e in entries][::3] == [0, 3]
    cut = entries[1].body
    assert cut["method"].strip("\x01") == "" and 0 < len(cut["method"]) < 256
    assert cut["params_hmac"] == KEY.digest({"i": 1}).hex()
    assert entries[2].plaintext == b"req\nrep" and entries[2].body["v"] == 2


async def test_a_lone_surrogate_in_one_call_does_not_hide_its_batch_record(
    tmp_path: Path,
) -> None:
    # RFC 8785 writes a lone surrogate a caller put in a tool name as an escape
    # that orjson refuses to read: the whole batch record, the caller's other
    # calls with it, read back as one "unreadable" entry.
    records = [call(0, BOB), call(1, BOB, tool="\ud800x"), call(2, BOB)]
    assert len(pack(records)) == 1
    log = await write_home(tmp_path, records, seal=True)
    log.store.close()
    entries = await asyncio.to_thread(read_entries, tmp_path)
    assert [(e.body["id"], e.index) for e in entries] == [(0, 0), (1, 1), (2, 2)]
    assert [e.body["tool"] for e in entries] == ["echo", "\ufffdx", "echo"]
    assert all(e.body["caller"] == BOB for e in entries)
    assert format_entry(entries[1]).count("\ufffdx") == 1
    assert orjson.loads(orjson.dumps(entries[1].to_json()))["tool"] == "\ufffdx"


async def test_a_tool_name_with_control_characters_is_shown_not_obeyed(tmp_path: Path) -> None:
    log = await write_home(tmp_path, [call(0, BOB, tool="\x1b[2Jx\nforged")], seal=True)
    log.store.close()
    (entry,) = await asyncio.to_thread(read_entries, tmp_path)
    line = format_entry(entry)
    assert "\\x1b[2Jx\\x0aforged" in line and "\x1b" not in line and "\n" not in line


async def test_a_batch_entry_that_names_its_own_caller_reads_as_the_recipients(
    tmp_path: Path,
) -> None:
    # Version 3 entries carry no caller: the record's recipient is the caller.
    # An unsealed record whose entry claims another caller (written by anything
    # but the Auditor) must not make `talos-proxy audit` blame someone else.
    log = await write_home(tmp_path, [], seal=False)
    forged = {"calls": [{"caller": BOB, "id": 1, "tool": "echo"}], "v": BATCH_VERSION}
    commitment = canonical_json_bytes(forged)
    log.append(Record("mcp", bytes(16), log.node_did, ALICE, commitment, b"", 1_700_000_000_000))
    log.store.close()
    entries = await asyncio.to_thread(read_entries, tmp_path)
    assert [(e.body["caller"], e.body["id"], e.height) for e in entries] == [(ALICE, 1, None)]
    assert ALICE in format_entry(entries[0]) and BOB not in format_entry(entries[0])
