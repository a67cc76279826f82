"""Helpers shared by node tests: homes, fast configs, polling with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from talos.config import NodeConfig
from talos.home import init_home
from talos.node import Node

FAST = {
    "listen": "127.0.0.1:0",
    "api": False,
    "seal_interval": 0.05,
    "retry_interval": 0.5,
    "reconnect_initial": 0.05,
    "reconnect_max": 0.5,
    "session_flush_interval": 0.2,
    "handshake_timeout": 5.0,
    "one_time_prekeys": 2,
}


def make_config(**overrides: object) -> NodeConfig:
    return NodeConfig.model_validate({**FAST, **overrides})


def make_home(root: Path, name: str, **overrides: object) -> tuple[Path, NodeConfig]:
    home = root / name
    config = make_config(**overrides)
    init_home(home, config)
    return home, config


async def started(home: Path, config: NodeConfig) -> Node:
    node = Node(home, config)
    await node.start()
    return node


def addr(node: Node) -> str:
    assert node.listen_url is not None
    return f"{node.listen_url}#{node.did}"


async def link(a: Node, b: Node, timeout: float = 10) -> None:
    """A dials B (B allows A) and both sessions come up."""
    b.allow(a.did)
    await a.add_peer(addr(b))
    await a.wait_connected(b.did, timeout)
    await b.wait_connected(a.did, timeout)


async def until(cond: Callable[[], bool], timeout: float = 10, what: str = "condition") -> None:
    """Poll ``cond`` until true or fail after ``timeout`` seconds (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
