"""Peer discovery resolvers and their use by a real node (talos/discovery.py).

docs/DESIGN.md "Discovery and scale": one ``resolve(DID) -> addresses`` interface.
The node test runs two real nodes on 127.0.0.1 with ephemeral ports.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from talos.discovery import (
    SOURCE_ANNOUNCED,
    SOURCE_DIALLED,
    SOURCE_STATIC,
    BadAddressError,
    ChainResolver,
    LearnedResolver,
    Resolver,
    StaticResolver,
    normalize_address,
)
from talos.node import Node
from talos_sdk.errors import DIDError, UsageError
from talos_sdk.wallet import Wallet
from tests.talos.nodes import make_home, until

DIDS = [Wallet.from_seed(bytes([i]) * 32).did for i in range(1, 6)]
A, B, C = DIDS[0], DIDS[1], DIDS[2]


# --- addresses ------------------------------------------------------------------------------------


def test_normalize_drops_fragment_and_trailing_slash() -> None:
    assert normalize_address(f"ws://127.0.0.1:7000#{A}") == "ws://127.0.0.1:7000"
    assert normalize_address("wss://example.org:443/") == "wss://example.org:443"
    assert normalize_address("ws://[::1]:9") == "ws://[::1]:9"


@pytest.mark.parametrize(
    "bad",
    ["http://h:1", "ws://:1", "ws://h", "ws://h:99999", "ws://h:1/path", "ws://h:1?q=1", "h:1"],
)
def test_normalize_rejects_undialable(bad: str) -> None:
    with pytest.raises(BadAddressError):
        normalize_address(bad)


def test_normalize_rejects_non_string() -> None:
    with pytest.raises(BadAddressError, match="string"):
        normalize_address(7)  # type: ignore[arg-type]


def test_bad_address_error_is_a_usage_error() -> None:
    assert issubclass(BadAddressError, UsageError)


# --- StaticResolver -------------------------------------------------------------------------------


def test_static_reads_peers_table_without_fragment() -> None:
    table = {A: f"ws://127.0.0.1:7001#{A}", B: ""}
    r = StaticResolver(table)
    assert r.resolve(A) == ["ws://127.0.0.1:7001"]
    assert r.resolve(B) == []  # allowed only, no address
    assert r.resolve(C) == []


def test_static_follows_a_table_replaced_later() -> None:
    holder: dict[str, dict[str, str]] = {"t": {}}
    r = StaticResolver(lambda: holder["t"])
    assert r.resolve(A) == []
    holder["t"] = {A: f"ws://127.0.0.1:7002#{A}"}
    assert r.resolve(A) == ["ws://127.0.0.1:7002"]


def test_static_skips_bad_row_and_keeps_learned_static() -> None:
    r = StaticResolver({A: "not an address"})
    r.learn(A, "ws://127.0.0.1:7003", SOURCE_STATIC)
    r.learn(A, "ws://127.0.0.1:7003", SOURCE_STATIC)  # no repeat
    r.learn(A, "ws://127.0.0.1:7004", SOURCE_DIALLED)  # not the static source's business
    assert r.resolve(A) == ["ws://127.0.0.1:7003"]


def test_static_learn_rejects_bad_input() -> None:
    r = StaticResolver()
    with pytest.raises(DIDError):
        r.learn("did:key:nope", "ws://127.0.0.1:1", SOURCE_STATIC)
    with pytest.raises(BadAddressError):
        r.learn(A, "tcp://127.0.0.1:1", SOURCE_STATIC)


# --- LearnedResolver ------------------------------------------------------------------------------


def test_learned_newest_first_without_repeats() -> None:
    r = LearnedResolver()
    r.learn(A, "ws://127.0.0.1:1", SOURCE_DIALLED)
    r.learn(A, "ws://127.0.0.1:2", SOURCE_ANNOUNCED)
    r.learn(A, f"ws://127.0.0.1:1#{A}", SOURCE_DIALLED)  # seen again: moves to the front
    assert r.resolve(A) == ["ws://127.0.0.1:1", "ws://127.0.0.1:2"]
    assert r.resolve(B) == []


def test_learned_bounds_addresses_per_peer() -> None:
    r = LearnedResolver(max_per_peer=2)
    for port in (1, 2, 3):
        r.learn(A, f"ws://127.0.0.1:{port}", SOURCE_DIALLED)
    assert r.resolve(A) == ["ws://127.0.0.1:3", "ws://127.0.0.1:2"]


def test_learned_bounds_peers_dropping_least_recent() -> None:
    r = LearnedResolver(max_peers=2)
    r.learn(A, "ws://127.0.0.1:1", SOURCE_DIALLED)
    r.learn(B, "ws://127.0.0.1:2", SOURCE_DIALLED)
    r.learn(A, "ws://127.0.0.1:3", SOURCE_DIALLED)  # A is now the most recent
    r.learn(C, "ws://127.0.0.1:4", SOURCE_DIALLED)  # evicts B
    assert len(r) == 2
    assert r.resolve(B) == []
    assert r.resolve(A) == ["ws://127.0.0.1:3", "ws://127.0.0.1:1"]
    assert r.resolve(C) == ["ws://127.0.0.1:4"]
    r.forget(A)
    assert r.resolve(A) == [] and len(r) == 1


def test_learned_ignores_static_and_rejects_bad_input() -> None:
    r = LearnedResolver()
    r.learn(A, "ws://127.0.0.1:1", SOURCE_STATIC)
    assert r.resolve(A) == []
    with pytest.raises(BadAddressError, match="source"):
        r.learn(A, "ws://127.0.0.1:1", "gossip")
    with pytest.raises(DIDError):
        r.learn("did:web:example.org", "ws://127.0.0.1:1", SOURCE_DIALLED)
    with pytest.raises(BadAddressError):
        r.learn(A, "ws://127.0.0.1", SOURCE_DIALLED)
    assert len(r) == 0  # nothing half-stored by a refused call
    with pytest.raises(UsageError):
        LearnedResolver(max_peers=0)
    with pytest.raises(UsageError):
        LearnedResolver(max_per_peer=0)


# --- ChainResolver --------------------------------------------------------------------------------


def test_chain_concatenates_in_order_and_dedups() -> None:
    static = StaticResolver({A: f"ws://127.0.0.1:1#{A}"})
    learned = LearnedResolver()
    chain = ChainResolver(static, learned)
    chain.learn(A, "ws://127.0.0.1:2", SOURCE_DIALLED)
    chain.learn(A, "ws://127.0.0.1:1", SOURCE_DIALLED)  # same as the static one
    assert chain.resolve(A) == ["ws://127.0.0.1:1", "ws://127.0.0.1:2"]
    assert learned.resolve(A) == ["ws://127.0.0.1:1", "ws://127.0.0.1:2"]
    assert ChainResolver().resolve(A) == []
    for r in (static, learned, chain):
        assert isinstance(r, Resolver)


# --- the node -------------------------------------------------------------------------------------


class _Directory:
    """A custom discovery source: answers from a dict the test fills in."""

    def __init__(self) -> None:
        self.where: dict[str, str] = {}
        self.learned: list[tuple[str, str, str]] = []

    def resolve(self, did: str) -> list[str]:
        return [self.where[did]] if did in self.where else []

    def learn(self, did: str, addr: str, source: str) -> None:
        self.learned.append((did, addr, source))


async def test_node_dials_a_did_through_a_custom_resolver(tmp_path: Path) -> None:
    home_a, cfg_a = make_home(tmp_path, "a")
    home_b, cfg_b = make_home(tmp_path, "b")
    directory = _Directory()
    async with asyncio.timeout(30):
        b = Node(home_b, cfg_b)
        await b.start()
        a = Node(home_a, cfg_a, resolver=directory)
        await a.start()
        try:
            assert b.listen_url is not None
            b.allow(a.did)
            a.allow(b.did)  # A knows only B's DID: nothing in its peers table
            assert a.known_peers() == {}
            directory.where[b.did] = b.listen_url
            msg_id = await a.send_message(b.did, "found you", wait=True)
            (entry,) = b.inbox()
            assert (entry.sender, entry.text, entry.to_json()["id"]) == (
                a.did,
                "found you",
                msg_id,
            )
            assert (b.did, b.listen_url, SOURCE_DIALLED) in directory.learned
            assert a.known_peers() == {}  # discovery did not write the static table
        finally:
            await a.stop()
            await b.stop()


async def test_default_resolver_learns_the_dialled_address(tmp_path: Path) -> None:
    home_a, cfg_a = make_home(tmp_path, "a")
    home_b, cfg_b = make_home(tmp_path, "b")
    async with asyncio.timeout(30):
        b = Node(home_b, cfg_b)
        await b.start()
        a = Node(home_a, cfg_a)
        await a.start()
        try:
            assert b.listen_url is not None
            b.allow(a.did)
            await a.add_peer(f"{b.listen_url}#{b.did}")
            await a.wait_connected(b.did, 10)
            assert isinstance(a.resolver, ChainResolver)
            static, learned = a.resolver.resolvers
            assert static.resolve(b.did) == [b.listen_url]
            await until(lambda: learned.resolve(b.did) == [b.listen_url], what="learned")
            assert a.resolver.resolve(b.did) == [b.listen_url]
        finally:
            await a.stop()
            await b.stop()
