"""mcp_proxy.audit_log: reading audit records back from a real block log, filters, --since,
--verify."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from mcp_proxy.audit import Auditor, AuditRecord, BlockLogSink, Event
from mcp_proxy.audit_log import AuditFilter, format_entry, parse_since, read_entries, select
from mcp_proxy.nodehost import ensure_home
from talos.chain.log import BlockLog, record_key
from talos.config import Home
from talos.store import Store
from talos_sdk.errors import UsageError
from talos_sdk.keyfile import load_wallet
from tests.mcp_proxy.e2e import audit_verify

NOW = 1_800_000_000.0


def test_since_forms() -> None:
    assert parse_since("15m", NOW) == int((NOW - 900) * 1000)
    assert parse_since("2h", NOW) == int((NOW - 7200) * 1000)
    assert parse_since("1700000000000") == 1_700_000_000_000
    assert parse_since("2023-11-14T22:13:20Z") == 1_700_000_000_000
    for bad in ("yesterday", "2023-11-14T22:13:20", "5w"):
        with pytest.raises(UsageError, match="--since"):
            parse_since(bad, NOW)


def record(i: int, **kw: object) -> AuditRecord:
    base: dict[str, object] = {
        "caller": "did:key:z6MkA" if i % 2 else "did:key:z6MkB",
        "server": "default",
        "method": "tools/call",
        "tool": "echo" if i % 3 else "add",
        "request_id": i,
        "params_hmac": b"\x01" * 32,
        "result_hmac": b"\x02" * 32,
        "latency_us": 10,
        "outcome": "ok",
        "timestamp_ms": 1_700_000_000_000 + i * 1000,
    }
    base.update(kw)
    return AuditRecord(**base)  # type: ignore[arg-type]


async def _audited(home_path: Path) -> tuple[Store, BlockLog, Auditor]:
    """A proxy home's block log with a started auditor writing to it."""
    ensure_home(home_path)
    home = Home(home_path)
    store = Store(home.store_dir)
    log = BlockLog(store, load_wallet(home.identity))
    auditor = Auditor(BlockLogSink(log, log.node_did))
    await auditor.start()
    return store, log, auditor


async def test_sealed_and_pending_records_are_read_and_filtered(tmp_path: Path) -> None:
    store, log, auditor = await _audited(tmp_path)
    for i in range(6):
        auditor.submit(record(i))
    auditor.submit(
        record(6, event=Event.SESSION, method="exit", tool=None, outcome="exited", detail="x")
    )
    await auditor.stop()
    log.seal()
    auditor = Auditor(BlockLogSink(log, log.node_did))
    await auditor.start()
    auditor.submit(record(7, outcome="denied"))  # stays pending: not sealed
    await auditor.stop()
    store.close()

    entries = await asyncio.to_thread(read_entries, tmp_path)
    assert [e.body["id"] for e in entries] == list(range(8))
    assert entries[0].height == 0 and entries[-1].height is None
    pick = lambda f: [e.body["id"] for e in select(entries, f)]  # noqa: E731
    assert pick(AuditFilter(peer="did:key:z6MkA")) == [1, 3, 5, 7]
    assert pick(AuditFilter(tool="add")) == [0, 3]
    assert pick(AuditFilter(outcome="denied")) == [7]
    assert pick(AuditFilter(event="session")) == [6]
    assert pick(AuditFilter(since_ms=1_700_000_005_000)) == [5, 6, 7]
    line = format_entry(entries[6])
    assert "session" in line and "exited" in line and "(x)" in line and "block 0" in line
    assert "pending" in format_entry(entries[7])


async def test_a_record_that_does_not_decode_is_listed_as_unreadable(tmp_path: Path) -> None:
    # One damaged record ended the whole listing ("record truncated"), hiding every
    # audit entry: it is now an entry of its own, where it is stored.
    store, log, auditor = await _audited(tmp_path)
    for i in range(3):
        auditor.submit(record(i))
        await auditor.stop()  # one record each
        await auditor.start()
    await auditor.stop()
    log.seal()
    with store.write() as txn:
        txn.put("block_records", record_key(0, 1), b"\x00\x01")
    store.close()
    entries = await asyncio.to_thread(read_entries, tmp_path)
    assert [e.body.get("id") for e in entries] == [0, None, 2]
    bad = entries[1]
    assert (bad.height, bad.body["outcome"]) == (0, "unreadable")
    assert "talosd chain verify" in format_entry(bad)


def test_not_a_home(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a talos home"):
        read_entries(tmp_path / "nothing")


async def test_verify_vouches_for_entries_by_block_and_fails_on_a_forged_one(
    tmp_path: Path,
) -> None:
    """``talos-proxy audit --verify`` (a real subprocess on a real store): "[block N]"
    is checked against the signed chain, entry by entry."""
    store, log, auditor = await _audited(tmp_path)
    for i in range(3):  # one record each: 0 and 1 in block 0, 2 in block 1, 3 pending
        auditor.submit(record(i))
        await auditor.stop()
        if i == 1:
            log.seal()
        await auditor.start()
    log.seal()
    auditor.submit(record(3))
    await auditor.stop()
    store.close()

    done = await asyncio.to_thread(audit_verify, tmp_path, "--json")
    listed = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0, done.stderr
    assert [(e["id"], e["height"], e["verified"]) for e in listed] == [
        (0, 0, True), (1, 0, True), (2, 1, True), (3, None, None)
    ]  # fmt: skip
    assert "block log verified, up to block 1" in done.stderr

    # A forger puts a genuine, signed record of block 0 in place of block 1's.
    with Store(Home(tmp_path).store_dir) as forged, forged.write() as txn:
        genuine = txn.get("block_records", record_key(0, 0))
        assert genuine is not None
        txn.put("block_records", record_key(1, 0), genuine)
    done = await asyncio.to_thread(audit_verify, tmp_path)
    lines = done.stdout.splitlines()
    assert done.returncode == 1
    assert [line.rsplit("[", 1)[1] for line in lines] == [
        "block 0 verified]", "block 0 verified]", "block 1 DEFECT]", "pending]"
    ]  # fmt: skip
    assert "does NOT verify" in done.stderr and "talosd chain verify" in done.stderr


async def test_verify_vouches_for_no_entry_while_the_owner_is_unchecked(tmp_path: Path) -> None:
    """A sealed key and no passphrase: the DID comes from the key file's clear header,
    which a log rebuilt under another key would name too, so nothing is "verified"."""
    secret = tmp_path / "passphrase"
    secret.write_text("correct horse battery staple\n")
    home_path = tmp_path / "h"
    ensure_home(home_path, passphrase_file=str(secret))
    home = Home(home_path)
    store = Store(home.store_dir)
    log = BlockLog(store, load_wallet(home.identity, "correct horse battery staple"))
    auditor = Auditor(BlockLogSink(log, log.node_did))
    await auditor.start()
    auditor.submit(record(0))
    await auditor.stop()
    log.seal()
    store.close()

    unchecked = await asyncio.to_thread(audit_verify, home_path, "--json")
    assert unchecked.returncode == 0, unchecked.stderr
    assert [orjson.loads(line)["verified"] for line in unchecked.stdout.splitlines()] == [None]
    assert "NOTE" in unchecked.stderr and "--passphrase-file" in unchecked.stderr
    checked = await asyncio.to_thread(
        audit_verify, home_path, "--json", "--passphrase-file", str(secret)
    )
    assert checked.returncode == 0, checked.stderr
    assert [orjson.loads(line)["verified"] for line in checked.stdout.splitlines()] == [True]
