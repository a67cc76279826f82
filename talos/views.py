"""JSON views of the node's state, shared by the control API and the offline CLI.

Plain dicts: the local ops (talos/local/ops.py) send them, ``talosd`` prints
them (talos/status_text.py for people). Field names are the API's
(docs/ARCHITECTURE.md "Module map and contracts"). Sequence numbers stay u64
here; ``*_text`` twins give ``epoch.n`` (docs/adr/0007-epoch-sequence-numbers.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from talos import pipeline as pl
from talos.chain.block import Block
from talos.chain.log import Quarantined
from talos.chain.verify import VerifyReport, verify_chain
from talos.peer_names import names as peer_names
from talos.status_text import seq_text

if TYPE_CHECKING:
    from talos.node import Node
    from talos.store import Txn

__all__ = [
    "block_json",
    "node_status",
    "outbox_json",
    "outbox_listing",
    "quarantined_json",
    "report_json",
]

#: Messages listed per peer by ``talosd outbox`` (the count covers them all).
OUTBOX_LIST_LIMIT = 100


def block_json(block: Block) -> dict[str, Any]:
    """One sealed block's header fields (``GET /v1/chain/show``)."""
    return {
        "height": block.height,
        "hash": block.hash().hex(),
        "prev_hash": block.prev_hash.hex(),
        "timestamp_ms": block.timestamp_ms,
        "merkle_root": block.merkle_root.hex(),
        "records": block.record_count,
    }


def report_json(
    report: VerifyReport, node: str, quarantined: Iterable[Quarantined], *, node_checked: bool
) -> dict[str, Any]:
    """A chain verify report of ``node``'s log; ``quarantined`` lists the records the sealer
    refused; ``node_checked``: the DID came from the unlocked key, not a clear header."""
    return {
        "ok": report.ok,
        "node": node,
        "node_checked": node_checked,
        "blocks": report.blocks,
        "records": report.records,
        "head_height": report.head_height,
        "head_hash": report.head_hash.hex() if report.head_hash else None,
        "defects": [
            {"code": d.code, "height": d.height, "index": d.index, "message": d.message}
            for d in report.defects
        ],
        "defects_omitted": report.omitted,
        "quarantined": [quarantined_json(q) for q in quarantined],
    }


def node_verify_json(node: Node) -> dict[str, Any]:
    """The node's own log sealed, then verified (one worker), as :func:`report_json`.

    Blocking (LMDB, signatures): the API and the local socket run it in a thread.
    """
    node.log.seal()
    report = verify_chain(
        node.store,
        node.did,
        workers=1,
        mldsa65_public_key=node.wallet.mldsa_public_key,
        hybrid_since=node.hybrid_since,
    )
    return report_json(report, node.did, node.log.quarantined(), node_checked=True)


def quarantined_json(q: Quarantined) -> dict[str, Any]:
    """A quarantined record: why, and whose (never its content)."""
    record = q.record
    return {
        "reason": q.reason,
        "record_id": record.record_id.hex() if record is not None else None,
        "sender": record.sender if record is not None else None,
    }


def _outbox_rows(txn: Txn, did: str | None = None) -> Iterator[pl.OutboxEntry]:
    """Every outbox row (of ``did`` only, when given), in peer then sequence order."""
    start = pl.outbox_prefix(did) if did is not None else None
    for key, value in txn.items("outbox", start):
        row = pl.decode_outbox(key, value)
        if did is not None and row.peer != did:
            return
        yield row


def _outbox_counts(txn: Txn) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key, _ in txn.items("outbox"):
        did = key[:-9].decode()
        counts[did] = counts.get(did, 0) + 1
    return counts


def _peer_row(node: Node, did: str, outbox: int, names: dict[str, str]) -> dict[str, Any]:
    peer = node._peers.get(did)
    link = peer.link if peer is not None else None
    state, why = node.link_state(did)
    problem = node.link_problem(did)
    row: dict[str, Any] = {
        "did": did,
        "name": names.get(did),
        "state": state,
        "why": why or None,
        "connected": link is not None,
        "ready": peer is not None and peer.ready.is_set(),
        "role": link.role.name.lower() if link is not None else None,
        "via": link.via if link is not None else None,
        "auth_suite": link.auth_suite if link is not None else None,
        "kem": link.kem if link is not None else None,
        "session_suite": node.sessions.suite(did) if node.sessions.has(did) else None,
        "outbox": outbox,
        "acked": peer.tx.acked if peer is not None else None,
        "sent": peer.tx.sent if peer is not None else None,
        "delivered": peer.rx.delivered if peer is not None else None,
        "last_refusal": None,
    }
    if problem is not None:
        row["last_refusal"] = {**problem.to_json(), "message": problem.message(did)}
    for key in ("acked", "sent", "delivered"):
        row[f"{key}_text"] = seq_text(row[key]) if row[key] is not None else None
    return row


def node_status(node: Node) -> dict[str, Any]:
    """``talosd status --json``: this node, every peer it knows of (link state, last
    refusal, outbox depth), sessions, queues, chain height, post-quantum state."""
    with node.store.read() as txn:
        outbox_by_peer = _outbox_counts(txn)
        inbox = txn.count("inbox")
        names = peer_names(txn)
    dids = set(node._peers) | set(node.known_peers()) | set(outbox_by_peer)
    dids |= {did for did, _ in node._problems.items()}
    dids.discard(node.did)
    return {
        "did": node.did,
        "listen": node.listen_url,
        "relay": node.relay.status() if node.relay is not None else None,
        "auth_suite": node.wallet.suite,
        "require_pq": node.config.require_pq,
        "pq": node.config.pq,
        "epoch": node.epoch,
        "links": [_peer_row(node, d, outbox_by_peer.get(d, 0), names) for d in sorted(dids)],
        "sessions": node.sessions.info(),
        "queues": {
            "outbox": sum(outbox_by_peer.values()),
            "inbox": inbox,
            "incoming_batch": len(node._incoming),
            "log_pending": node.log.pending_count,
        },
        "chain_height": node.log.height,
        "storage_error": node.storage_error,
        "quarantined_records": node.quarantined_count(),
        "equivocations": node.heads.equivocations(),
        "equivocation_counts": node.heads.equivocation_counts(),
    }


#: What :func:`outbox_listing` says of a peer's link: state, why, last refusal,
#: and the highest sequence number sent (rows at or below it await their ack).
LinkView = tuple[str, str | None, dict[str, Any] | None, int]
LinkFacts = Callable[[str], LinkView]


def outbox_json(node: Node, did: str | None = None) -> list[dict[str, Any]]:
    """``talosd outbox --json``: per peer with queued messages, the link's state, why
    they do not move, and the first :data:`OUTBOX_LIST_LIMIT` messages."""

    def link(peer_did: str) -> LinkView:
        state, why = node.link_state(peer_did)
        peer = node._peers.get(peer_did)
        problem = node.link_problem(peer_did)
        relay = node.relay
        posted = relay.mailboxed(peer_did) if relay is not None else 0
        return (
            state,
            why or None,
            problem.to_json() if problem is not None else None,
            max(peer.tx.sent if peer is not None else 0, posted),  # the mailbox's are sent
        )

    with node.store.read() as txn:
        return outbox_listing(txn, did, link)


def outbox_listing(txn: Txn, did: str | None, link: LinkFacts) -> list[dict[str, Any]]:
    """The rows of :func:`outbox_json`, from a read snapshot; ``link`` tells each
    peer's link (a running node's view, or "stopped" for ``talosd outbox`` offline)."""
    by_peer: dict[str, list[pl.OutboxEntry]] = {}
    counts = _outbox_counts(txn) if did is None else {}
    for row in _outbox_rows(txn, did):
        rows = by_peer.setdefault(row.peer, [])
        if len(rows) < OUTBOX_LIST_LIMIT:
            rows.append(row)
        if did is not None:
            counts[did] = counts.get(did, 0) + 1
    names = peer_names(txn)
    out = []
    for peer_did in sorted(by_peer):
        state, why, refusal, sent = link(peer_did)
        out.append(
            {
                "did": peer_did,
                "name": names.get(peer_did),
                "state": state,
                "why": why,
                "last_refusal": refusal,
                "count": counts.get(peer_did, 0),
                "messages": [
                    {
                        "id": row.msg_id.hex(),
                        "seq": row.seq,
                        "seq_text": seq_text(row.seq),
                        "ts": row.ts_ms,
                        "bytes": len(row.data),
                        "text": row.text,
                        "state": "sent, awaiting ack" if row.seq <= sent else "queued",
                    }
                    for row in by_peer[peer_did]
                ],
            }
        )
    return out
