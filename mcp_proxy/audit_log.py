"""Reading the audit back: ``talos-proxy audit`` (docs/PROTOCOL.md "MCP tunnel", Audit record).

The records are ``kind="mcp"`` records of the serve node's block log, one event each
(version 2) or several (a batch record, version 3,
docs/adr/0014-audit-batch-records.md): sealed
ones in their blocks (with the height that proves them) and those not sealed
yet. :func:`read_entries` collects both, oldest first; :class:`AuditFilter`
selects by peer, tool, outcome, event and time. While a node runs on the home
(``talosd run``, with or without an attached serve) the records come from it
over its local socket (``log.records``, docs/adr/0012-local-clients.md);
otherwise the store is opened read-only in spirit (nothing is written), which
an embedded ``talos-proxy serve`` still running on the home prevents. Where an
entry is stored is not proof that it is intact: :func:`check_chain` verifies
the signed chain (``--verify``) and :class:`ChainCheck` says what that vouches
for, entry by entry.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from mcp_proxy.audit import RECORD_KIND
from mcp_proxy.audit_record import BATCH_VERSION
from talos.logging import escape
from talos_sdk.errors import MalformedFrameError, UsageError

__all__ = [
    "AuditEntry",
    "AuditFilter",
    "ChainCheck",
    "check_chain",
    "entries_of",
    "format_entry",
    "parse_since",
    "read_entries",
    "record_entries",
]

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One audit record as stored: where (block height, None while unsealed) and what."""

    timestamp_ms: int
    height: int | None
    record_id: str
    body: dict[str, Any]
    plaintext: bytes
    #: Place in a batch record (version 3), None in a record of its own (version 2).
    index: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "timestamp_ms": self.timestamp_ms,
            "height": self.height,
            "record_id": self.record_id,
            **({} if self.index is None else {"index": self.index}),
            **self.body,
        }
        if self.plaintext:
            out["plaintext"] = self.plaintext.decode("utf-8", "replace")
        return out


def parse_since(text: str, now: float | None = None) -> int:
    """``--since``: ``30s``/``15m``/``2h``/``7d`` ago, an ISO 8601 time or epoch ms, as epoch ms."""
    now = time.time() if now is None else now
    match = _RELATIVE.match(text.strip())
    if match:
        return int((now - float(match.group(1)) * _UNIT_SECONDS[match.group(2)]) * 1000)
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(
            f"--since needs 15m, 2h, 7d, an ISO 8601 time or epoch ms: {text!r}"
        ) from None
    if moment.tzinfo is None:
        raise UsageError(f"--since needs a time zone (e.g. Z): {text!r}")
    return int(moment.timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """Which entries to show; None matches anything."""

    peer: str | None = None
    tool: str | None = None
    outcome: str | None = None
    event: str | None = None
    since_ms: int | None = None

    def __call__(self, entry: AuditEntry) -> bool:
        body = entry.body
        return (
            (self.peer is None or body.get("caller") == self.peer)
            and (self.tool is None or body.get("tool") == self.tool)
            and (self.outcome is None or body.get("outcome") == self.outcome)
            and (self.event is None or body.get("event", "call") == self.event)
            and (self.since_ms is None or entry.timestamp_ms >= self.since_ms)
        )


_SURROGATE = re.compile("[\ud800-\udfff]")


def _printable(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: _SURROGATE.sub("\ufffd", v) if type(v) is str else v for k, v in obj.items()}


def _loads(commitment: bytes) -> Any:
    """A commitment's JSON. A name a caller chose may hold a lone surrogate, which the
    writer escapes (RFC 8785 allows it) but orjson refuses to read: the stdlib reads
    it, shown as U+FFFD, so one such event does not hide the batch record it shares."""
    try:
        return orjson.loads(commitment)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(commitment, object_hook=_printable)
    except ValueError:
        return None


def entries_of(
    *,
    commitment: bytes,
    recipient: str,
    timestamp_ms: int,
    height: int | None,
    record_id: str,
    extra: bytes,
) -> list[AuditEntry]:
    """An audit record's stored fields as entries: one per event of a batch record
    (version 3, docs/adr/0014-audit-batch-records.md), else one (version 2)."""
    body = _loads(commitment)
    if not isinstance(body, dict):
        body = {"outcome": "unreadable"}
    calls = body.get("calls")
    if body.get("v") != BATCH_VERSION or not isinstance(calls, list):
        body.setdefault("caller", recipient)
        return [AuditEntry(timestamp_ms, height, record_id, body, extra)]
    out = []
    for index, call in enumerate(calls):
        if not isinstance(call, dict):
            call = {"outcome": "unreadable"}
        when = call.pop("timestamp_ms", timestamp_ms)
        # A batch entry has no caller of its own (ADR 0014): one that claims
        # another is not believed, the record's recipient is who called.
        call["caller"] = recipient
        call["v"] = BATCH_VERSION
        ms = when if type(when) is int else timestamp_ms
        out.append(AuditEntry(ms, height, record_id, call, b"", index))
    return out


def record_entries(record: Any, height: int | None) -> list[AuditEntry]:
    """The audit entries of a block-log ``record`` (none unless it is an audit record)."""
    if record.kind != RECORD_KIND:
        return []
    return entries_of(
        commitment=record.commitment,
        recipient=record.recipient,
        timestamp_ms=record.timestamp_ms,
        height=height,
        record_id=record.record_id.hex(),
        extra=record.extra,
    )


def unreadable_entry(height: int | None, key: str, error: str) -> AuditEntry:
    """A stored record that does not decode (a damaged or edited store), shown where
    it is instead of ending the listing; ``talosd chain verify`` says more."""
    detail = f"{error}; run talosd chain verify"
    return AuditEntry(
        0, height, key, {"event": "record", "outcome": "unreadable", "detail": detail}, b""
    )


def _read_from_node(home: Path) -> list[AuditEntry]:
    """The records as the running node of ``home`` reads them, a page at a time."""
    from talos.local.call import call

    pending: dict[str, list[AuditEntry]] = {}
    sealed: dict[str, list[AuditEntry]] = {}
    unreadable: list[AuditEntry] = []
    after: str | None = None
    while True:
        page = call(home, "log.records", {"kind": RECORD_KIND, "after": after})
        unreadable += (
            unreadable_entry(bad["height"], str(bad["key"]), str(bad["error"]))
            for bad in page.get("unreadable", ())
        )
        for row in page["records"]:
            entries = entries_of(
                commitment=base64.b64decode(row["commitment"]),
                recipient=str(row["recipient"]),
                timestamp_ms=int(row["timestamp_ms"]),
                height=row["height"],
                record_id=str(row["record_id"]),
                extra=base64.b64decode(row["extra"]),
            )
            rid = str(row["record_id"])
            (pending if row["height"] is None else sealed)[rid] = entries
        after = page["next"]
        if after is None:
            break
    # A record sealed while we paged was met twice: its sealed copy wins.
    return [
        *(e for entries in sealed.values() for e in entries),
        *(e for rid, entries in pending.items() if rid not in sealed for e in entries),
        *unreadable,
    ]


def read_entries(home: Path) -> list[AuditEntry]:
    """Every audit record of the proxy home ``home``: sealed blocks first, then pending ones."""
    from talos.chain.block import Record
    from talos.chain.pending import pending_record
    from talos.config import Home
    from talos.local.call import NoNodeError
    from talos.store import Store

    talos_home = Home(home)
    if not talos_home.exists():
        raise UsageError(f"{home} is not a talos home (no identity)")
    try:
        return _read_from_node(home)
    except NoNodeError:
        pass  # no node runs there: the store is ours to read
    store = Store(talos_home.store_dir, map_size=talos_home.load_config().map_size)
    out: list[AuditEntry] = []
    try:
        with store.read() as txn:
            for db in ("block_records", "pending"):
                for key, data in txn.items(db):
                    height = int.from_bytes(key[:8], "big") if db == "block_records" else None
                    try:
                        encoded = data if height is not None else pending_record(data)
                        record = Record.from_bytes(encoded)
                    except MalformedFrameError as exc:
                        out.append(unreadable_entry(height, key.hex(), str(exc)))
                        continue
                    out += record_entries(record, height)
    finally:
        store.close()
    return out


@dataclass(frozen=True, slots=True)
class ChainCheck:
    """What the block log's verification (``talosd chain verify``) says of audit entries.

    An entry is vouched for by its block: ``verified`` when the chain verified up
    to a head at or past its height with no defect in that block, ``DEFECT`` when
    a defect is in its block, and ``unverified`` when sealed after the check,
    when the log has a defect that no one block holds (or defects left unlisted),
    or when the log's owner was not checked (its DID read from a sealed key
    file's clear header: a log rebuilt under another key would verify too).
    A pending entry (not sealed yet) has nothing to check: no verdict.
    """

    ok: bool
    head_height: int | None
    bad_heights: frozenset[int]
    unplaced: bool
    defects: int
    node: str
    node_checked: bool

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> ChainCheck:
        """From the JSON report of ``chain.verify`` (talos/views.py ``report_json``)."""
        defects = report["defects"]
        omitted = int(report.get("defects_omitted", 0))
        head = report.get("head_height")
        return cls(
            ok=bool(report["ok"]),
            head_height=None if head is None or head < 0 else int(head),  # -1: no block
            bad_heights=frozenset(d["height"] for d in defects if d["height"] is not None),
            unplaced=omitted > 0 or any(d["height"] is None for d in defects),
            defects=len(defects) + omitted,
            node=str(report.get("node")),
            # Heads that peers signed vouch for the owner as the key would (talosd chain verify).
            node_checked=bool(report.get("node_checked", True))
            or report.get("witness", {}).get("checked", 0) > 0,
        )

    def vouches(self, entry: AuditEntry) -> bool | None:
        """The verdict as JSON: true when verified, false on a DEFECT, else null."""
        return {"verified": True, "DEFECT": False}.get(self.verdict(entry) or "")

    def verdict(self, entry: AuditEntry) -> str | None:
        height = entry.height
        if height is None:
            return None
        if height in self.bad_heights:
            return "DEFECT"
        if (
            self.unplaced
            or not self.node_checked
            or self.head_height is None
            or height > self.head_height
        ):
            return "unverified"
        return "verified"


def check_chain(
    home: Path, passphrase_file: str | None = None, heads: str | None = None
) -> ChainCheck:
    """Verify the block log of ``home``: by its running node, or from the store; with
    ``heads`` (a file of this node's signed heads that peers hold), against those too,
    which alone catches a log whose newest blocks were removed.

    Offline, ``passphrase_file`` (or the environment) unlocks the identity key, so
    the log is checked against its owner's DID from the key rather than from the
    key file's clear header (talos/home.py ``log_owner``). The listing reads the
    store again afterwards: an edit made in between, by someone who can write
    the store, is seen by the next check, not this one.
    """
    from talos.cli_chain import log_owner_of, verify_report

    return ChainCheck.from_report(verify_report(home, log_owner_of(home, passphrase_file), heads))


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def format_entry(entry: AuditEntry, verdict: str | None = None) -> str:
    """One line for a person: time, event, outcome, who, what; never arguments; where it
    is stored, with what :meth:`ChainCheck.verdict` said of it when given.

    Method and tool names are the caller's words: their control characters are
    shown as escapes, so a name cannot drive the terminal or forge a line.
    """
    b = entry.body
    what = " ".join(
        str(part)
        for part in (
            b.get("method") or "",
            b.get("tool") or "",
            "" if b.get("id") is None else f"id={b['id']}",
            "" if b.get("pid") is None else f"pid={b['pid']}",
            "" if b.get("latency_us") in (None, 0) else f"{b['latency_us']}us",
        )
        if part
    )
    detail = f" ({b['detail']})" if b.get("detail") else ""
    sealed = "pending" if entry.height is None else f"block {entry.height}"
    if verdict is not None:
        sealed += f" {verdict}"
    return escape(
        f"{_when(entry.timestamp_ms)} {b.get('event', 'call'):<8} {b.get('outcome', '?'):<12} "
        f"{b.get('caller', '?')} {b.get('server', '')}#{b.get('session', '')} {what}{detail}"
        f" [{sealed}]"
    )


def select(entries: Iterable[AuditEntry], keep: AuditFilter) -> Iterator[AuditEntry]:
    return (e for e in entries if keep(e))
