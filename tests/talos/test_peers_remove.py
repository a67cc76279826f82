"""Forgetting a peer (``talosd peers remove``, talos/node_links.py remove_peer): real nodes,
sockets on 127.0.0.1 and LMDB; and the same on a stopped home through the CLI."""

from __future__ import annotations

import asyncio
from pathlib import Path

from talos.local.client import LocalClient
from talos.peer_names import names
from talos.store import Store
from tests.talos.daemons import talosd
from tests.talos.local.running import started as started_daemon
from tests.talos.nodes import addr, link, make_home, started, until


async def test_a_removed_peer_is_no_longer_dialled_or_accepted(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(60):
            await b.add_peer(addr(a))  # b dials a and allows it
            await link(a, b)
            await b.send_message(a.did, "before", wait=True)
            with b.store.read() as txn:
                assert b.sessions.has(a.did) and txn.get("sessions", a.did.encode())
            await a.stop()  # so that a message waits in b's outbox
            await b.send_message(a.did, "waits")
            assert await b.remove_peer(a.did) == 1  # the queued one stays
            assert a.did not in b.known_peers() and not b.authorizer(a.did)
            assert not b.sessions.has(a.did) and not b.links.dialling(a.did)
            with b.store.read() as txn:
                assert txn.get("sessions", a.did.encode()) is None
            a = await started(a.home.path, a.config)  # a dials b, which no longer allows it
            await a.add_peer(addr(b))
            await until(lambda: "allow list" in a.link_state(b.did)[1], 20, "refused")
            assert not b.is_connected(a.did)
            await b.add_peer(addr(a))  # added again: the queued message goes
            await until(lambda: [m.text for m in a.inbox()] == ["before", "waits"], 30, "sent")
    finally:
        await a.stop()
        await b.stop()


async def test_removing_the_peer_of_a_live_link_closes_it(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(60):
            await link(a, b)  # a dials b; b allows a
            assert await a.remove_peer(b.did) == 0
            await until(lambda: not a.is_connected(b.did) and not b.is_connected(a.did), 20)
            await asyncio.sleep(0.5)  # a does not dial again
            assert not a.links.dialling(b.did) and not a.is_connected(b.did)
    finally:
        await a.stop()
        await b.stop()


def test_peers_remove_on_a_stopped_home_by_name(tmp_path: Path) -> None:
    home = tmp_path / "a"
    assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
    other = talosd("init", "--home", str(tmp_path / "b"), "--no-passphrase").stdout.strip()
    address = f"ws://127.0.0.1:9#{other}"
    added = talosd("peers", "add", address, "--name", "bob", "--home", str(home))
    assert added.returncode == 0, added.stderr
    assert talosd("send", "--home", str(home), "bob", "queued").returncode == 0
    res = talosd("peers", "remove", "bob", "--home", str(home))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (
        f"removed {other}; 1 message(s) stay queued for it"
        f" (talosd outbox {other} --drop drops them)"
    )
    assert other not in talosd("peers", "list", "--home", str(home)).stdout
    unknown = talosd("peers", "remove", "bob", "--home", str(home))
    assert unknown.returncode == 2 and "unknown peer name 'bob'" in unknown.stderr
    with Store(home / "store") as store, store.read() as txn:
        assert names(txn) == {}


async def test_what_removal_cannot_undo_is_said(tmp_path: Path) -> None:
    # Two things keep or bring back a removed peer: the node's configuration (an
    # --allow or --peer of this run, config.json), which applies at every start; and a
    # local client's claim naming it (an attached talos-proxy connect), which lends it
    # the right to link while it lasts. The removal says both instead of claiming more.
    x = await started_daemon(*make_home(tmp_path, "x"))
    y = await started(*make_home(tmp_path, "y"))
    client = None
    try:
        async with asyncio.timeout(60):
            await y.add_peer(addr(x.node))
            await x.node.add_peer(addr(y))
            await until(lambda: x.is_connected(y.did), 20, "linked")
            client = await LocalClient.connect(x.home.path)
            await client.call("app.claim", channel="t", peer=y.did)
            res = await client.call("peers.remove", peer=y.did)
            assert (res["configured"], res["still_allowed"]) == (False, True)
            await until(lambda: x.is_connected(y.did), 20, "linked again: the claim lends it")
            await client.close()
            client = None
            await until(lambda: not x.node.authorizer(y.did), 10, "the claim gone, the right")
    finally:
        if client is not None:
            await client.close()
        await x.stop()
        await y.stop()
    home, _ = make_home(tmp_path, "z", allow=(y.did,))
    res = talosd("peers", "remove", y.did, "--home", str(home))
    assert res.returncode == 0 and "back at the next start" in res.stderr, res.stderr
