"""Two in-process app-channel endpoints with real LMDB stores and real block logs.

A *transport* for the manager tests (ordered delivery of app payloads, link
up/down callbacks): a second implementation of the app-host contract the
manager needs from talos.node.Node, with the node's real store writer; the
bytes themselves move over the real bulk TCP path on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from talos.chain.log import BlockLog
from talos.node_apps import NotConnectedError
from talos.store import Store
from talos.writer import StoreWriter
from talos_sdk.wallet import Wallet


class NotConnected(NotConnectedError):
    """The other endpoint is down (what talos.node.Node raises, a TalosError too)."""


class Endpoint:
    """One side: did, store, log, app handlers, link callbacks."""

    def __init__(self, home: Path, wallet: Wallet) -> None:
        self.home = home
        self.wallet = wallet
        self.did = wallet.did
        self.store = Store(home / "store")
        self.writer = StoreWriter(self.store)
        self.log = BlockLog(self.store, wallet, writes=self.writer)
        self.apps: dict[str, Callable[[str, bytes], Awaitable[None] | None]] = {}
        self.link_callbacks: list[Callable[[str, bool], None]] = []
        self.other: Endpoint | None = None
        self.up = False
        self.binding = b""  # stands in for the link's handshake hash
        self.host: str | None = "127.0.0.1"  # the link's peer address (None: a relay)
        self.queue: asyncio.Queue[tuple[str, str, bytes]] = asyncio.Queue()
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        while True:
            sender, name, payload = await self.queue.get()
            handler = self.apps.get(name)
            if handler is not None:
                result = handler(sender, payload)
                if inspect.isawaitable(result):
                    await result

    def register_app(
        self, name: str, handler: Callable[[str, bytes], Awaitable[None] | None]
    ) -> None:
        self.apps[name] = handler

    async def send_app(self, did: str, name: str, payload: bytes) -> None:
        other = self.other
        if other is None or not self.up or other.did != did:
            raise NotConnected(did)
        other.queue.put_nowait((self.did, name, payload))

    def on_link_change(self, callback: Callable[[str, bool], None]) -> None:
        self.link_callbacks.append(callback)

    def is_connected(self, did: str) -> bool:
        return self.up and self.other is not None and self.other.did == did

    def channel_binding(self, did: str) -> bytes:
        return self.binding if self.is_connected(did) else b""

    def peer_host(self, did: str) -> str | None:
        return self.host if self.is_connected(did) else None

    async def close(self) -> None:
        self.pump.cancel()
        await asyncio.gather(self.pump, return_exceptions=True)
        await asyncio.to_thread(self.writer.close)
        self.store.close()


def link(a: Endpoint, b: Endpoint, up: bool) -> None:
    """Bring the link between ``a`` and ``b`` up or down, telling both sides."""
    a.other, b.other = b, a
    a.up = b.up = up
    a.binding = b.binding = os.urandom(32) if up else b""
    for x, y in ((a, b), (b, a)):
        for cb in x.link_callbacks:
            cb(y.did, up)
