"""Fixtures for relay tests: a real nats-server and node homes its users are made for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from talos.config import NodeConfig
from talos.relay.names import RelayNames, nkey_seed
from talos_sdk.wallet import Wallet
from tests.talos.nodes import make_home
from tests.talos.relay.natsd import NatsServer, nats_server_binary


class RelayNet:
    """Node homes (no --listen) and one nats-server whose users are those nodes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.homes: dict[str, tuple[Path, NodeConfig]] = {}
        self.server: NatsServer | None = None

    def home(self, name: str, **overrides: object) -> tuple[Path, NodeConfig]:
        from talos_sdk.keyfile import load_wallet

        assert self.server is not None
        settings: dict[str, object] = {"listen": None, "relays": (self.server.url,)}
        settings.update(overrides)
        home, config = make_home(self.root, name, **settings)
        did = load_wallet(home / "identity.key").did
        self.server.reload([did])
        self.homes[name] = (home, config)
        return home, config


def _relay_net(root: Path, *, shared: bool) -> Iterator[RelayNet]:
    nats_server_binary()  # skips with the reason when the binary is missing
    net = RelayNet(root)
    server_dir = root / "relay"
    server_dir.mkdir()
    net.server = NatsServer(server_dir, [], shared=shared)
    net.server.start()
    try:
        yield net
    finally:
        net.server.stop()


@pytest.fixture
def relay_net(tmp_path: Path) -> Iterator[RelayNet]:
    yield from _relay_net(tmp_path, shared=False)


@pytest.fixture
def shared_relay_net(tmp_path: Path) -> Iterator[RelayNet]:
    """A relay whose nodes share one NATS account (how relays were first set up)."""
    yield from _relay_net(tmp_path, shared=True)


async def rogue_connection(net: RelayNet, rogue: Wallet | None = None) -> Any:
    """A NATS connection as a node the relay knows (``rogue``, a new one if not given):
    another account on the same relay, with its own permissions."""
    import nats

    server = net.server
    assert server is not None
    rogue = rogue or Wallet.generate()
    server.reload([rogue.did])
    return await nats.connect(
        servers=[server.url],
        nkeys_seed_str=nkey_seed(rogue.seed),
        inbox_prefix=RelayNames.for_did(rogue.did).inbox_prefix,
        allow_reconnect=False,
    )
