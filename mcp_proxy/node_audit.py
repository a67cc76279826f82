"""Audit records of an attached ``talos-proxy serve``, kept by the running node
(docs/PROTOCOL.md "MCP tunnel", Audit record, docs/adr/0012-local-clients.md).

An attached serve opens no store: :class:`NodeAuditSink` hands its record
batches to the node over the local socket (``log.append``), which appends them
to its block log through its one store writer, as :class:`~mcp_proxy.audit.BlockLogSink`
does in an embedded serve; the records are the same bytes either way, and
``talos-proxy audit`` reads them back alike (mcp_proxy/audit_log.py).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

from mcp_proxy.audit import RECORD_KIND, AuditRecord
from mcp_proxy.audit_record import pack
from talos.local.client import LocalClient

__all__ = ["NodeAuditSink"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class NodeAuditSink:
    """An async :class:`~mcp_proxy.audit.Auditor` sink writing through the attached node."""

    commits_from_loop = True

    def __init__(self, client: LocalClient) -> None:
        self.client = client

    async def commit(self, records: Sequence[AuditRecord], sync: bool) -> None:
        """Append ``records`` in one write transaction; ``sync`` makes them durable."""
        await self.client.call(
            "log.append",
            kind=RECORD_KIND,
            durable=sync,
            records=[
                {
                    "recipient": p.recipient,
                    "commitment": _b64(p.commitment),
                    "timestamp_ms": p.timestamp_ms,
                    "extra": _b64(p.extra),
                }
                for p in pack(records)
            ],
        )
