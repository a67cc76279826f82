"""``talosd status`` and ``talosd outbox`` for people (docs/operations.md "Health and metrics").

Pure formatting of the JSON views of :mod:`talos.views`; standard library
only, so a client command prints without importing the node. Sequence
numbers are shown as ``epoch.n`` (docs/adr/0007-epoch-sequence-numbers.md:
the u64 seq is ``epoch << 32 | n``), times as local clock times.
"""

from __future__ import annotations

import time
from typing import Any

from talos.logging import escape

__all__ = ["outbox_lines", "seq_text", "status_lines"]

#: talos.pipeline.EPOCH_SHIFT (tests/talos/test_status_text.py keeps them equal).
EPOCH_SHIFT = 32
_PREVIEW = 40


def seq_text(seq: int) -> str:
    """A u64 sequence number as ``epoch.n`` (``0.0`` before anything was numbered)."""
    return f"{seq >> EPOCH_SHIFT}.{seq & ((1 << EPOCH_SHIFT) - 1)}"


def _when(ms: int | None) -> str:
    if not ms:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


def _who(row: dict[str, Any]) -> str:
    name = row.get("name")
    return f"{row['did']} ({name})" if name else str(row["did"])


def _state(row: dict[str, Any]) -> str:
    state = str(row.get("state") or "-")
    if state == "ready":
        via = row.get("via") or "direct"
        suite = row.get("session_suite") or "-"
        return f"ready ({row.get('role') or '-'}, {via}, {row.get('auth_suite')}, {suite})"
    return state.replace("_", " ")


def status_lines(status: dict[str, Any]) -> list[str]:
    """The readable summary: this node, then one block per peer."""
    queues = status.get("queues", {})
    pq = "required" if status.get("require_pq") else ("offered" if status.get("pq") else "off")
    height = status.get("chain_height")
    # Height -1 is the log's "no block yet" (the first block is 0): words for a person.
    chain = "no block sealed yet" if height == -1 else f"height {height}"
    lines = [
        f"node      {status['did']}",
        f"listen    {status.get('listen') or '-'}",
        f"identity  {status.get('auth_suite')}  post-quantum links: {pq}",
        f"chain     {chain},"
        f" {queues.get('log_pending', 0)} record(s) pending,"
        f" {status.get('quarantined_records', 0)} quarantined",
        f"queues    outbox {queues.get('outbox', 0)}, inbox {queues.get('inbox', 0)}",
        f"sessions  {len(status.get('sessions', []))}",
    ]
    if status.get("storage_error"):
        # Received messages are not stored (so not acknowledged) until this clears.
        lines.append(f"STORAGE   failing: {status['storage_error']}")
    relay = status.get("relay")
    if relay:
        state = "connected" if relay.get("connected") else "not connected"
        counters = ", ".join(
            f"{k} {relay.get(k, 0)}"
            for k in ("relay_packets_rejected", "relay_packets_dropped", "relay_packets_forged")
        )
        lines.append(
            f"relay     {state} to {', '.join(relay.get('servers', []))},"
            f" {relay.get('streams', 0)} stream(s), {counters}"
        )
    links = status.get("links", [])
    lines.append(f"peers     {len(links)}")
    for row in links:
        lines.append(f"  {_who(row)}")
        lines.append(f"    link      {_state(row)}")
        refusal = row.get("last_refusal")
        if refusal:
            when = _when(refusal.get("at_ms"))
            lines.append(f"    last      {when}  {escape(refusal.get('message'))}")
        elif row.get("why"):
            lines.append(f"    why       {escape(row['why'])}")
        # Numbers are epoch.n (docs/PROTOCOL.md "Link protocol"); 0 (nothing yet) and
        # None (no pipeline) say nothing.
        seqs = ", ".join(f"{key} {seq_text(row[key])}" for key in ("sent", "acked") if row.get(key))
        lines.append(f"    outbox    {row.get('outbox', 0)}" + (f"  ({seqs})" if seqs else ""))
        if row.get("delivered"):
            lines.append(f"    received  up to {seq_text(row['delivered'])} from it, in order")
    return lines


def outbox_lines(peers: list[dict[str, Any]]) -> list[str]:
    """Queued messages per peer, their state and why they do not move."""
    if not peers:
        return ["outbox empty"]
    lines: list[str] = []
    for peer in peers:
        count = int(peer.get("count", 0))
        lines.append(f"{_who(peer)}: {count} queued, link {_state(peer)}")
        if peer.get("why"):
            lines.append(f"  not moving: {escape(peer['why'])}")
        for m in peer.get("messages", []):
            text = str(m.get("text", ""))
            preview = text if len(text) <= _PREVIEW else text[: _PREVIEW - 1] + "…"
            lines.append(
                f"  {m['seq_text']:>10}  {_when(m.get('ts'))}  {m['id']}  {m['state']}  {preview!r}"
            )
        listed = len(peer.get("messages", []))
        if count > listed:
            lines.append(f"  ... and {count - listed} more")
    return lines
