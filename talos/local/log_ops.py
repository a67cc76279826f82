"""Block-log ops for local clients: append app records, read them back (docs/PROTOCOL.md
"Local clients", docs/adr/0012-local-clients.md).

An attached ``talos-proxy serve`` has no store of its own: its audit records
are appended here, through the node's one store writer (talos/writer.py), as
unsigned records authored by the node, sealed into its blocks like any other.
``log.records`` reads the records of one kind back (sealed and pending) for
``talos-proxy audit`` while the node holds the store.

The node treats an app record as opaque bytes: it checks only the kind (never
one of the node's own kinds) and the block format's bounds.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
from typing import TYPE_CHECKING, Any

from talos.chain.block import Record
from talos.chain.pending import pending_record
from talos_sdk.errors import MalformedFrameError, UsageError

if TYPE_CHECKING:
    from talos.local.ops import LocalHost
    from talos.store import Txn

__all__ = ["NODE_RECORD_KINDS", "op_log_append", "op_log_records"]

#: Kinds the node itself writes (talos/sessions.py, talos/transfer/manager.py): a local
#: client may not append records that would pass for the node's own.
NODE_RECORD_KINDS = frozenset({"msg", "file"})
#: Records per ``log.append`` call and per ``log.records`` page.
MAX_BATCH = 1000
MAX_PAGE = 2000
#: Records one ``log.records`` call looks at, of any kind: the scan runs on the event
#: loop, and a kind absent from 300k records held it 1.7 s. Past it the page ends,
#: perhaps empty, and ``next`` says where to go on.
MAX_SCAN = 20_000


def _kind(args: dict[str, Any]) -> str:
    kind = args.get("kind")
    if not isinstance(kind, str) or not 0 < len(kind.encode()) <= 32:
        raise UsageError("'kind' must be 1..32 bytes")
    if kind in NODE_RECORD_KINDS:
        raise UsageError(f"record kind {kind!r} is the node's own")
    return kind


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise UsageError(f"{what!r} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise UsageError(f"{what!r} is not valid base64") from None


def _record(node_did: str, kind: str, item: Any) -> Record:
    if not isinstance(item, dict):
        raise UsageError("each record is an object")
    recipient, ts = item.get("recipient"), item.get("timestamp_ms")
    if not isinstance(recipient, str) or not recipient:
        raise UsageError("'recipient' must be a non-empty string")
    if isinstance(ts, bool) or not isinstance(ts, int) or not 0 <= ts < 1 << 63:
        raise UsageError("'timestamp_ms' must be a non-negative integer")
    return Record(  # the block format's bounds raise UsageError here
        kind=kind,
        record_id=os.urandom(16),
        sender=node_did,
        recipient=recipient,
        commitment=_b64(item.get("commitment"), "commitment"),
        signature=b"",
        timestamp_ms=ts,
        extra=_b64(item.get("extra", ""), "extra"),
    )


def _append_all(txn: Txn, *, log: Any, records: list[Record]) -> None:
    for record in records:
        log.append(record, txn)


async def op_log_append(host: LocalHost, args: dict[str, Any]) -> Any:
    """``{kind, records: [{recipient, commitment, timestamp_ms, extra}], durable}``."""
    node = host.node
    kind = _kind(args)
    items = args.get("records")
    if not isinstance(items, list) or len(items) > MAX_BATCH:
        raise UsageError(f"'records' must be a list of at most {MAX_BATCH}")
    records = [_record(node.did, kind, item) for item in items]
    durable = bool(args.get("durable", False))
    if records:
        job = functools.partial(_append_all, log=node.log, records=records)
        await node.writer.write(job, durable=durable, kind="log")
    elif durable:
        await node.writer.sync()
    return {"appended": len(records)}


def _entry(record: Record, height: int | None) -> dict[str, Any]:
    return {
        "height": height,
        "record_id": record.record_id.hex(),
        "recipient": record.recipient,
        "commitment": base64.b64encode(record.commitment).decode(),
        "timestamp_ms": record.timestamp_ms,
        "extra": base64.b64encode(record.extra).decode(),
    }


async def op_log_records(host: LocalHost, args: dict[str, Any]) -> Any:
    """Records of ``kind``, a page at a time: pending ones first, then sealed ones.

    ``after`` is the ``next`` of the previous page. Pending first: a record
    sealed while a reader pages through is then met again among the sealed
    ones (readers drop a record id seen twice) instead of being missed.
    """
    node = host.node
    kind = _kind(args)
    after = args.get("after") or "p:"
    if not isinstance(after, str) or after[:2] not in ("p:", "s:"):
        raise UsageError("'after' must be the 'next' of a previous page")
    try:
        phase, start = after[0], bytes.fromhex(after[2:])
    except ValueError:
        raise UsageError("'after' must be the 'next' of a previous page") from None
    out: list[dict[str, Any]] = []
    # Records that do not decode (a damaged or edited store): said, not fatal, so a
    # reader still gets every record that does (talosd chain verify names the damage).
    unreadable: list[dict[str, Any]] = []
    last = start
    scanned = 0
    with node.store.read() as txn:
        db = "pending" if phase == "p" else "block_records"
        for key, value in txn.items(db, start):
            if key == start:
                continue
            last = key
            scanned += 1
            height = None if phase == "p" else int.from_bytes(key[:8], "big")
            try:
                record = Record.from_bytes(pending_record(value) if phase == "p" else value)
            except MalformedFrameError as exc:
                unreadable.append({"height": height, "key": key.hex(), "error": str(exc)})
                continue
            if record.kind == kind:
                out.append(_entry(record, height))
            if len(out) >= MAX_PAGE or scanned >= MAX_SCAN:
                return _page(out, unreadable, f"{phase}:{last.hex()}")
    return _page(out, unreadable, "s:" if phase == "p" else None)


def _page(records: list[dict[str, Any]], bad: list[dict[str, Any]], after: str | None) -> Any:
    page: dict[str, Any] = {"records": records, "next": after}
    if bad:
        page["unreadable"] = bad
    return page
