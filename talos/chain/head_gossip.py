"""Head gossip: an app-channel service that trades signed log heads with peers
(docs/DESIGN.md "Block log"; docs/PROTOCOL.md "Block log").

It sends this node's latest signed head on :data:`~talos.chain.heads.HEAD_CHANNEL`
when a peer's session comes up and whenever the log has grown (checked every
``interval``), and judges each head a peer presents against the one kept for
it (:func:`~talos.chain.heads.judge_and_store`) on the node's writer thread,
off the link's read loop, so a slow write never holds up the frames behind
it. Not synced: a head lost in a crash is sent again by the peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from talos.apphost import AppHost
from talos.chain import heads as hd
from talos.logging import event
from talos.metrics import Metrics
from talos_sdk.errors import TalosError

__all__ = ["HeadGossip"]

_log = logging.getLogger("talos.node")


class HeadGossip:
    """Sends our head to ready peers, keeps theirs, records equivocations."""

    def __init__(
        self,
        host: AppHost,
        metrics: Metrics,
        pinned: Callable[[str], bytes | None],
        interval: float,
    ) -> None:
        self.host = host
        self.metrics = metrics
        self.interval = interval
        self._pinned = pinned
        self._sent: dict[str, int] = {}  # peer -> height last sent on its current link
        self._ready: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        host.register_app(hd.HEAD_CHANNEL, self.on_head)
        host.on_link_change(self._on_link)

    async def run(self) -> None:
        """Announce our head to every ready peer when the log has grown (until cancelled)."""
        try:
            while True:
                await asyncio.sleep(self.interval)
                for did in list(self._ready):
                    self._send(did)
        finally:
            for task in list(self._tasks):
                task.cancel()

    def _on_link(self, did: str, up: bool) -> None:
        self._sent.pop(did, None)  # a new link hears the head again
        if up:
            self._ready.add(did)
            self._send(did)
        else:
            self._ready.discard(did)

    def _send(self, did: str) -> None:
        head = self.host.log.heads()
        if head is None or head.height <= self._sent.get(did, -1):
            return
        self._sent[did] = head.height
        task = asyncio.ensure_future(self._send_quiet(did, hd.encode_head(head.statement)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_quiet(self, did: str, payload: bytes) -> None:
        with contextlib.suppress(TalosError):  # the link went away: it hears it next time
            await self.host.send_app(did, hd.HEAD_CHANNEL, payload)

    def on_head(self, did: str, payload: bytes) -> None:
        """A peer's head: verify it now, judge and store it on the writer thread."""
        presented = hd.decode_head(payload, did, self._pinned(did))
        self.metrics.inc("heads_in")
        self.host.writer.submit(
            functools.partial(hd.judge_and_store, did=did, presented=presented),
            durable=False,
            then=functools.partial(self._judged, did),
            kind="head",
        )

    def _judged(self, did: str, fut: asyncio.Future[hd.Equivocation | None]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            event(_log, "head_store_failed", level=logging.ERROR, peer=did, error=repr(exc))
            return
        verdict = fut.result()
        if verdict is not None:
            self.metrics.inc("head_equivocations")
            event(
                _log,
                "head_equivocation",
                level=logging.WARNING,
                peer=did,
                reason=verdict.reason,
                kept_height=verdict.kept.height,
                presented_height=verdict.presented.height,
            )

    # --- what the status and API show ----------------------------------------------------------

    def peer_heads(self) -> dict[str, dict[str, Any]]:
        """The latest verified head statement kept for each peer."""
        with self.host.store.read() as txn:
            return hd.stored_heads(txn)

    def equivocation_counts(self) -> dict[str, int]:
        """Alerts seen per peer, including those past the stored ones."""
        with self.host.store.read() as txn:
            return hd.stored_equivocation_counts(txn)

    def equivocations(self) -> list[dict[str, Any]]:
        """Every equivocation alert recorded, oldest first per peer."""
        with self.host.store.read() as txn:
            return hd.stored_equivocations(txn)
