"""The ``net`` fixture: a sender and a receiver that auto-accepts it, linked."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from talos.transfer.manager import TransferConfig

from .net import Net, make_net


@pytest.fixture
async def net(tmp_path: Path) -> AsyncIterator[Net]:
    n = await make_net(tmp_path, TransferConfig())
    n.receiver.config = TransferConfig(auto_accept=(n.a.did,))
    yield n
    await n.sender.stop()
    await n.receiver.stop()
    await n.a.close()
    await n.b.close()
