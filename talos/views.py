"""JSON views of the node's state, shared by the control API and the offline CLI.

Plain dicts, no I/O: the API (talos/api.py) serialises them, ``talosd``
prints them. Field names are the API's (docs/ARCHITECTURE.md "Module map and contracts").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from talos.chain.block import Block
from talos.chain.log import Quarantined
from talos.chain.verify import VerifyReport

__all__ = ["block_json", "quarantined_json", "report_json"]


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


def report_json(report: VerifyReport, quarantined: Iterable[Quarantined] = ()) -> dict[str, Any]:
    """A chain verify report; ``quarantined`` lists the records the sealer refused."""
    return {
        "ok": report.ok,
        "blocks": report.blocks,
        "records": report.records,
        "head_height": report.head_height,
        "head_hash": report.head_hash.hex() if report.head_hash else None,
        "defects": [
            {"code": d.code, "height": d.height, "index": d.index, "message": d.message}
            for d in report.defects
        ],
        "quarantined": [quarantined_json(q) for q in quarantined],
    }


def quarantined_json(q: Quarantined) -> dict[str, Any]:
    """A quarantined record: why, and whose (never its content)."""
    record = q.record
    return {
        "reason": q.reason,
        "record_id": record.record_id.hex() if record is not None else None,
        "sender": record.sender if record is not None else None,
    }
