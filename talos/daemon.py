"""The composition root of ``talosd run`` (docs/ARCHITECTURE.md "Module map and contracts").

Builds and wires the parts of a running node in one place: the
:class:`~talos.node.Node` (links, sessions, pipeline, block log), the
:class:`~talos.transfer.manager.TransferManager` on the node's app channel, and
the control API over both, and the local socket of attached clients
(talos/local/server.py). Transfer runs whether or not the API does; the API
only adds routes over the manager it is handed. Stop order is the reverse of
start: the local socket first (its clients hear ``stopping``), then the API
(long-polls woken), then transfers, then the node.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from talos.config import Home, NodeConfig, transfer_settings
from talos.local.server import LocalServer
from talos.node import Node
from talos.transfer.manager import TransferConfig, TransferManager
from talos_sdk.wallet import Wallet

if TYPE_CHECKING:
    from talos.http_serve import HttpServer

__all__ = ["Daemon"]


class Daemon:
    """A node with its transfer manager and (if configured) its control API."""

    def __init__(
        self,
        home: Path,
        config: NodeConfig | None = None,
        *,
        files_dir: Path | str | None = None,
        transfer: TransferConfig | None = None,
        wallet: Wallet | None = None,
    ) -> None:
        self.home = Home(Path(home))
        self.node = Node(self.home.path, config, wallet=wallet)
        self.transfer_config = transfer or transfer_settings(self.home.path, self.node.config)
        chosen = files_dir or self.transfer_config.files_dir or self.home.path / "files"
        self.files_dir = Path(chosen).expanduser().resolve()
        self.transfers: TransferManager | None = None
        self.api_url: str | None = None
        self._api: HttpServer | None = None
        self.local: LocalServer | None = None

    async def start(self) -> None:
        """Node, then transfers, then the API; a failure undoes what started."""
        await self.node.start()
        try:
            self.transfers = TransferManager(
                self.node, self.files_dir, self.transfer_config, private_dir=self.home.path
            )
            await self.transfers.start()
            config = self.node.config
            if config.api:
                from talos.api import start_api

                self._api, self.api_url = await start_api(
                    self.node, self.transfers, config.api_host, config.api_port
                )
            # Local clients attach last and hear "stopping" first (ADR 0012).
            self.local = LocalServer(self.node, self.transfers)
            await self.local.start()
        except BaseException:
            await self.stop()
            raise
        self.home.write_node_info(
            {
                "pid": os.getpid(),
                "did": self.node.did,
                "listen": self.node.listen_url,
                "api": self.api_url,
                "socket": str(self.local.path) if self.local is not None else None,
            }
        )

    async def stop(self, *, handover: bool = False) -> None:
        """Local clients, API, transfers, node; the node file goes last (clients read it).

        ``handover`` tells local clients that one of them may run the node now
        (LocalServer.close).
        """
        if self.local is not None:
            local, self.local = self.local, None
            await local.close(handover=handover)
        self.node.quiesce()  # long-polls return now, so the API can close promptly
        if self._api is not None:
            runner, self._api = self._api, None
            await runner.cleanup()
        if self.transfers is not None:
            transfers, self.transfers = self.transfers, None
            await transfers.stop()
        await self.node.stop()
        with contextlib.suppress(FileNotFoundError):
            self.home.node_file.unlink()

    async def __aenter__(self) -> Daemon:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
