"""Nodes as `talosd run` composes them (talos/daemon.py), for the local-socket tests."""

from __future__ import annotations

import asyncio
from pathlib import Path

from talos.config import NodeConfig
from talos.daemon import Daemon
from talos.local.conn import ClientConn
from talos.local.server import SOCKET_NAME
from talos.node import Node
from tests.talos.nodes import make_home, until


class Running:
    """A node as `talosd run` composes it (talos/daemon.py): the socket comes with it."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.node: Node = daemon.node

    def __getattr__(self, name: str) -> object:
        return getattr(self.node, name)

    async def stop(self) -> None:
        await self.daemon.stop()


async def started(home: Path, config: NodeConfig) -> Running:
    daemon = Daemon(home, config)
    await daemon.start()
    return Running(daemon)


async def pair(tmp_path: Path) -> tuple[Running, Running]:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    b.allow(a.did)
    return a, b


async def raw_client(
    node: Running, data: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, ClientConn]:
    """A client on ``node``'s socket that writes ``data`` and reads nothing yet, with the
    node's connection object for it (the node's only client)."""
    reader, writer = await asyncio.open_unix_connection(str(node.home.path / SOCKET_NAME))
    writer.write(data)
    local = node.daemon.local
    assert local is not None
    await until(lambda: len(local.conns) == 1, 10, "the client connected")
    (conn,) = local.conns
    return reader, writer, conn
