"""Say loudly when the sealer quarantines a record (docs/DESIGN.md "Block validation").

Nothing else reads the ``quarantine`` database while a node runs, so this
watcher turns each new row into a ``record_quarantined`` warning (reason,
record id, sender; never content) and the ``records_quarantined`` counter
(test_a_quarantined_record_is_counted_and_shown).
"""

from __future__ import annotations

import asyncio
import logging

from talos.chain.log import BlockLog
from talos.logging import event
from talos.metrics import Metrics

__all__ = ["quarantined_count", "watch_quarantine"]

_log = logging.getLogger("talos.node")


def quarantined_count(log: BlockLog) -> int:
    """Records the sealer refused (bad signature, malformed, duplicate id)."""
    with log.store.read() as txn:
        return txn.count("quarantine")


async def watch_quarantine(log: BlockLog, metrics: Metrics, interval: float) -> None:
    """Check every ``interval`` seconds until cancelled."""
    seen = quarantined_count(log)
    if seen:
        event(_log, "records_quarantined", level=logging.WARNING, total=seen, new=0)
    while True:
        await asyncio.sleep(interval)
        now = quarantined_count(log)
        if now <= seen:
            continue
        fresh = log.quarantined()[seen:]
        metrics.inc("records_quarantined", now - seen)
        for q in fresh:
            record = q.record
            event(
                _log,
                "record_quarantined",
                level=logging.WARNING,
                reason=q.reason,
                record_id=record.record_id.hex() if record is not None else None,
                sender=record.sender if record is not None else None,
            )
        seen = now
