"""Two real nodes in one event loop over 127.0.0.1 (talos/node.py).

Real LMDB in tmp dirs, real websockets on ephemeral ports; every test is
bounded by ``asyncio.timeout`` and polls with deadlines instead of sleeping.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from talos.node import ConnectTimeoutError, Node, NotConnectedError
from talos.pipeline import make_seq
from talos.status_text import status_lines
from talos_sdk.errors import BundleError, DIDError, LinkRefusedError, UsageError
from talos_sdk.keyfile import load_wallet
from talos_sdk.ratchet import Session
from talos_sdk.wallet import Wallet
from tests.talos.nodes import addr, link, make_home, started, until


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[Node, Node]]:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    yield a, b
    await a.stop()
    await b.stop()


async def test_message_is_committed_then_acked(pair: tuple[Node, Node]) -> None:
    a, b = pair
    async with asyncio.timeout(20):
        await link(a, b)
        assert a.sessions.suite(b.did) == "x25519-mlkem768"
        msg_id = await a.send_message(b.did, "hello B", wait=True)
        (entry,) = b.inbox()
        assert entry.to_json()["id"] == msg_id
        # First message to B in A's first boot epoch (ADR 0007).
        assert (entry.sender, entry.text, entry.seq) == (a.did, "hello B", make_seq(1, 1))
        await until(lambda: a.status()["queues"]["outbox"] == 0, what="outbox drained")
        # The receiver's audit record is sealed with A's signature over the commitment.
        await until(lambda: b.log.find_record(bytes.fromhex(msg_id)) is not None, what="seal")
        _, _, record = b.log.find_record(bytes.fromhex(msg_id))  # type: ignore[misc]
        assert record.sender == a.did and record.recipient == b.did
        assert b.log.quarantined() == []


async def test_many_messages_pipelined_keep_order_exactly_once(pair: tuple[Node, Node]) -> None:
    a, b = pair
    async with asyncio.timeout(30):
        await link(a, b)
        ids = [await a.send_message(b.did, f"m{i}") for i in range(200)]
        await a.send_message(b.did, "last", wait=True)
        texts = [e.text for e in b.inbox(limit=10_000)]
        assert texts == [f"m{i}" for i in range(200)] + ["last"]
        assert [e.to_json()["id"] for e in b.inbox(limit=10_000)][:200] == ids
        # Both directions at once.
        await asyncio.gather(
            *(b.send_message(a.did, f"r{i}") for i in range(20)),
        )
        await b.send_message(a.did, "done", wait=True)
        assert [e.text for e in a.inbox()] == [f"r{i}" for i in range(20)] + ["done"]


async def test_frames_arriving_during_a_commit_share_the_next_one(
    pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit, made deterministic by holding A's first receive commit."""
    a, b = pair
    gate = threading.Event()
    sizes: list[int] = []

    def first_held(kind: str, size: int) -> None:
        sizes.append(size)
        if len(sizes) == 1:
            assert gate.wait(20), "held commit never released"

    try:
        async with asyncio.timeout(30):
            await link(a, b)
            a.writer.before("receive", first_held)
            sends = [asyncio.create_task(b.send_message(a.did, f"r{i}")) for i in range(20)]
            await until(
                lambda: a.status()["queues"]["incoming_batch"] == 19,
                what="r1..r19 behind the held commit",
            )
            gate.set()
            await asyncio.gather(*sends)
            await until(lambda: len(a.inbox()) == 20, what="the second commit")
            await b.send_message(a.did, "done", wait=True)
            assert [e.text for e in a.inbox()] == [f"r{i}" for i in range(20)] + ["done"]
            assert sizes == [1, 19, 1]
            assert a.metrics.counters["commits"] == 3
    finally:
        gate.set()


async def test_offline_peer_gets_messages_when_it_comes_back(tmp_path: Path) -> None:
    home_a, cfg_a = make_home(tmp_path, "a")
    home_b, cfg_b = make_home(tmp_path, "b")
    async with asyncio.timeout(30):
        b = await started(home_b, cfg_b)
        b_addr, b_did = addr(b), b.did
        port = b.listen_url.rsplit(":", 1)[1]  # type: ignore[union-attr]
        a = await started(home_a, cfg_a)
        b.allow(a.did)
        await a.add_peer(b_addr)
        await link(a, b)
        await b.stop()
        await until(lambda: not a.is_connected(b_did), what="link down")
        for i in range(5):
            await a.send_message(b_did, f"while offline {i}")
        assert a.status()["queues"]["outbox"] == 5
        # B comes back on the same port (A keeps redialling with backoff).
        b = await started(home_b, cfg_b.model_copy(update={"listen": f"127.0.0.1:{port}"}))
        b.allow(a.did)
        await until(lambda: len(b.inbox()) == 5, timeout=20, what="redelivery")
        await until(lambda: a.status()["queues"]["outbox"] == 0, what="acks")
        assert [e.text for e in b.inbox()] == [f"while offline {i}" for i in range(5)]
        await a.stop()
        await b.stop()


async def test_clean_restart_resumes_sessions(tmp_path: Path) -> None:
    home_a, cfg_a = make_home(tmp_path, "a")
    home_b, cfg_b = make_home(tmp_path, "b", allow=())
    async with asyncio.timeout(30):
        a, b = await started(home_a, cfg_a), await started(home_b, cfg_b)
        await link(a, b)
        await a.send_message(b.did, "one", wait=True)
        sid = {s["did"]: s["id"] for s in a.sessions.info()}[b.did]
        b_port = b.listen_url.rsplit(":", 1)[1]  # type: ignore[union-attr]
        a_did = a.did
        await a.stop()
        await b.stop()
        b = await started(home_b, cfg_b.model_copy(update={"listen": f"127.0.0.1:{b_port}"}))
        b.allow(a_did)
        a = await started(home_a, cfg_a)
        assert not a.unclean_start and not b.unclean_start
        await a.wait_connected(b.did, 10)
        await b.wait_connected(a.did, 10)
        assert {s["did"]: s["id"] for s in a.sessions.info()}[b.did] == sid
        await a.send_message(b.did, "two", wait=True)
        assert [e.text for e in b.inbox()] == ["one", "two"]
        await a.stop()
        await b.stop()


async def test_unclean_start_discards_sessions_and_rekeys(tmp_path: Path) -> None:
    home_a, cfg_a = make_home(tmp_path, "a")
    home_b, cfg_b = make_home(tmp_path, "b")
    async with asyncio.timeout(30):
        a, b = await started(home_a, cfg_a), await started(home_b, cfg_b)
        await link(a, b)
        await a.send_message(b.did, "before", wait=True)
        old = {s["did"]: s["id"] for s in b.sessions.info()}[a.did]
        b_port = b.listen_url.rsplit(":", 1)[1]  # type: ignore[union-attr]
        a_did = a.did
        await b.stop()
        # What a crash leaves behind: the running marker is still in the store.
        from talos.store import Store

        with Store(home_b / "store") as store, store.write() as txn:
            txn.put("meta", b"running", b"\0" * 8)
        b = await started(home_b, cfg_b.model_copy(update={"listen": f"127.0.0.1:{b_port}"}))
        b.allow(a_did)
        assert b.unclean_start
        await b.wait_connected(a_did, 10)
        new = {s["did"]: s["id"] for s in b.sessions.info()}[a_did]
        assert new != old
        await a.send_message(b.did, "after", wait=True)
        await b.send_message(a.did, "back", wait=True)
        assert [e.text for e in b.inbox()] == ["before", "after"]
        assert [e.text for e in a.inbox()] == ["back"]
        await a.stop()
        await b.stop()


async def test_app_channels_are_ordered_and_link_changes_reported(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    got: list[tuple[str, bytes]] = []
    changes: list[tuple[str, bool]] = []
    done = asyncio.Event()

    async def handler(peer: str, payload: bytes) -> None:
        got.append((peer, payload))
        if len(got) == 100:
            done.set()

    b.register_app("echo", handler)
    a.on_link_change(lambda did, up: changes.append((did, up)))
    async with asyncio.timeout(20):
        with pytest.raises(NotConnectedError):
            await a.send_app(b.did, "echo", b"too early")
        with pytest.raises(ConnectTimeoutError):
            await a.wait_connected(b.did, 0.05)
        await link(a, b)
        assert a.is_connected(b.did) and changes == [(b.did, True)]
        for i in range(100):
            await a.send_app(b.did, "echo", i.to_bytes(4, "big"))
        await done.wait()
        assert got == [(a.did, i.to_bytes(4, "big")) for i in range(100)]
        # An unknown channel costs the frame, not the link.
        await a.send_app(b.did, "nobody", b"x")
        await until(lambda: b.metrics.counters.get("frames_rejected", 0) == 1, what="reject")
        assert a.is_connected(b.did)
        await b.stop()
        await until(lambda: (b.did, False) in changes, what="link down callback")
        assert not a.is_connected(b.did)


async def test_try_send_app_sends_inline_in_order_with_send_app(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    got: list[bytes] = []
    b.register_app("echo", lambda peer, payload: got.append(payload))
    async with asyncio.timeout(20):
        with pytest.raises(NotConnectedError):
            a.try_send_app(b.did, "echo", b"too early")
        await link(a, b)
        for i in range(50):
            if i % 2:
                await a.send_app(b.did, "echo", bytes([i]))
            else:
                assert a.try_send_app(b.did, "echo", bytes([i]))
        await until(lambda: len(got) == 50, what="50 app frames")
        assert got == [bytes([i]) for i in range(50)]
        with pytest.raises(UsageError, match="frame bound"):
            a.try_send_app(b.did, "echo", b"x" * (a.config.max_frame + 1))
        # A paused socket: nothing is sealed or sent, the caller falls back to send_app.
        peer_link = a.peer_state(b.did).link
        assert peer_link is not None
        peer_link.ws.pause_writing()
        assert not a.try_send_app(b.did, "echo", b"held")
        peer_link.ws.resume_writing()
        await a.send_app(b.did, "echo", b"after")
        await until(lambda: got[-1:] == [b"after"], what="frame after the pause")
        assert b"held" not in got


def _ratchet_state(node: Node, peer: str) -> dict[str, Any]:
    blob = node.sessions.snapshot([peer])[peer]
    (n,) = struct.unpack_from(">H", blob)
    return Session.from_bytes(blob[2 + n :]).to_dict()


async def test_the_owed_ratchet_step_is_taken_once_an_app_frame_is_handed_on(
    pair: tuple[Node, Node],
) -> None:
    """ADR 0002 point 5: the key pair + DH of a turn is made before the reply is sealed."""
    a, b = pair
    got: list[tuple[str, bytes]] = []
    for node in pair:
        node.register_app("echo", lambda peer, payload: got.append((peer, payload)))
    async with asyncio.timeout(20):
        await link(a, b)
        keys_of_b = set()
        for turn in range(5):
            await a.send_app(b.did, "echo", b"ping %d" % turn)
            await until(lambda n=2 * turn + 1: len(got) == n, what="ping delivered")
            # B heard A's new ratchet key and has handed the frame on: its new key
            # pair exists already, and sealing the reply makes no other.
            held = _ratchet_state(b, a.did)["dhs_pub"]
            keys_of_b.add(held)
            await b.send_app(a.did, "echo", b"pong %d" % turn)
            await until(lambda n=2 * turn + 2: len(got) == n, what="pong delivered")
            assert _ratchet_state(a, b.did)["dhr"] == held
        # One new key per turn (Signal's schedule with the node's default of 1).
        assert len(keys_of_b) == 5
        assert [p for _, p in got] == [
            m for t in range(5) for m in (b"ping %d" % t, b"pong %d" % t)
        ]


async def test_unknown_peer_is_refused(pair: tuple[Node, Node]) -> None:
    a, b = pair  # B does not know A
    async with asyncio.timeout(10):
        await a.add_peer(addr(b))
        await until(lambda: b.metrics.counters.get("links_refused", 0) >= 1, what="refusal")
        assert not a.is_connected(b.did)
        assert not b.is_connected(a.did)


async def test_send_rejects_bad_input(pair: tuple[Node, Node]) -> None:
    a, _ = pair
    with pytest.raises(DIDError):
        await a.send_message("did:key:nonsense", "x")
    with pytest.raises(UsageError, match="itself"):
        await a.send_message(a.did, "x")
    with pytest.raises(UsageError, match="above"):
        await a.send_message(Wallet.generate().did, "x" * (2 << 20))
    with pytest.raises(UsageError, match="own DID"):
        await a.add_peer(f"ws://127.0.0.1:1#{a.did}")
    assert a.status()["queues"]["outbox"] == 0


async def test_classical_suite_when_one_side_has_no_pq(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a", pq=False))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(10):
            await link(a, b)
            assert a.sessions.suite(b.did) == b.sessions.suite(a.did) == "x25519"
            await b.send_message(a.did, "classic", wait=True)
    finally:
        await a.stop()
        await b.stop()


async def test_full_disk_refuses_to_ack_and_loses_nothing(tmp_path: Path) -> None:
    home_a, cfg_a = make_home(tmp_path, "a")
    # Past the map, not past A's inbox share (an eighth of the map unless set).
    home_b, cfg_b = make_home(tmp_path, "b", map_size=1 << 20, inbox_share=1 << 30)
    async with asyncio.timeout(30):
        a, b = await started(home_a, cfg_a), await started(home_b, cfg_b)
        await link(a, b)
        await a.send_message(b.did, "small", wait=True)
        big = "x" * 300_000
        ids = [await a.send_message(b.did, f"{i}{big}") for i in range(4)]
        await until(lambda: b.metrics.counters.get("commit_failures", 0) >= 1, what="map full")
        assert a.status()["queues"]["outbox"] >= 1  # not acknowledged, still queued at A
        assert b.is_connected(a.did)  # the node keeps running and linked
        # ... and says why nothing moves: status (and the API's /healthz) name the failure.
        status = b.status()
        assert status["storage_error"] is not None and "map_size" in status["storage_error"]
        assert any(line.startswith("STORAGE   failing") for line in status_lines(status))
        b_port = b.listen_url.rsplit(":", 1)[1]  # type: ignore[union-attr]
        a_did = a.did
        await b.stop()
        # More room: everything arrives exactly once, in order, after the stored rows.
        bigger = cfg_b.model_copy(update={"map_size": 64 << 20, "listen": f"127.0.0.1:{b_port}"})
        b = await started(home_b, bigger)
        b.allow(a_did)
        await until(lambda: a.status()["queues"]["outbox"] == 0, timeout=20, what="redelivery")
        got = [e.to_json()["id"] for e in b.inbox()]
        assert got[1:] == ids and b.inbox()[0].text == "small"
        assert b.status()["storage_error"] is None
        await a.stop()
        await b.stop()


async def test_both_sides_dialling_keep_exactly_one_link(pair: tuple[Node, Node]) -> None:
    a, b = pair
    async with asyncio.timeout(20):
        await asyncio.gather(a.add_peer(addr(b)), b.add_peer(addr(a)))
        await a.wait_connected(b.did, 10)
        await b.wait_connected(a.did, 10)
        for i in range(20):
            await a.send_message(b.did, f"a{i}")
            await b.send_message(a.did, f"b{i}")
        await a.send_message(b.did, "end", wait=True)
        await b.send_message(a.did, "end", wait=True)
        assert [e.text for e in b.inbox()] == [f"a{i}" for i in range(20)] + ["end"]
        assert [e.text for e in a.inbox()] == [f"b{i}" for i in range(20)] + ["end"]
        # Both sides hold the same single WebSocket (when both links came up, the
        # one dialled by the smaller DID survived on both sides).
        la, lb = a.peer_state(b.did).link, b.peer_state(a.did).link
        assert la is not None and lb is not None
        assert la.role != lb.role
        assert la.ws.local_address == lb.ws.remote_address


async def test_failed_start_is_clear_and_leaves_the_home_usable(
    pair: tuple[Node, Node], tmp_path: Path
) -> None:
    a, _ = pair
    port = a.listen_url.rsplit(":", 1)[1]  # type: ignore[union-attr]
    home, cfg = make_home(tmp_path, "c", listen=f"127.0.0.1:{port}")
    async with asyncio.timeout(10):
        c = Node(home, cfg)
        with pytest.raises(UsageError, match="cannot listen"):
            await c.start()
        assert not c.started
        c = await started(home, cfg.model_copy(update={"listen": "127.0.0.1:0"}))
        assert not c.unclean_start  # the failed start cleaned up after itself
        await c.stop()


async def test_offline_send_is_delivered_on_the_next_run(tmp_path: Path) -> None:
    from talos.config import Home
    from talos.home import offline_add_peer, offline_inbox, offline_peers, offline_send

    home_a, cfg_a = make_home(tmp_path, "a")
    home_b, cfg_b = make_home(tmp_path, "b")
    async with asyncio.timeout(20):
        b = await started(home_b, cfg_b)
        a_did = load_wallet(home_a / "identity.key").did
        b.allow(a_did)
        offline_add_peer(Home(home_a), addr(b))
        assert offline_peers(Home(home_a))[0]["did"] == b.did
        msg_id = offline_send(Home(home_a), b.did, "queued while stopped")
        a = await started(home_a, cfg_a)  # dials B from its peers table
        await until(lambda: len(b.inbox()) == 1, what="delivery")
        assert b.inbox()[0].to_json()["id"] == msg_id
        await a.stop()
        await b.stop()
        assert [m["text"] for m in offline_inbox(Home(home_b))] == ["queued while stopped"]


async def _three_by_did(root: Path) -> tuple[Node, Node, Node]:
    """Three nodes, the hub last: it has the largest DID, so it responds to both."""
    nodes = [await started(*make_home(root, name)) for name in ("x", "y", "z")]
    lo, mid, hub = sorted(nodes, key=lambda n: n.did)
    return lo, mid, hub


async def test_two_peers_set_up_sessions_with_one_node_at_once(tmp_path: Path) -> None:
    """Both initiators answer the hub's offers at once; both sessions come up."""
    b, c, hub = await _three_by_did(tmp_path)
    try:
        async with asyncio.timeout(20):
            hub.allow(b.did)
            hub.allow(c.did)
            await asyncio.gather(b.add_peer(addr(hub)), c.add_peer(addr(hub)))
            for node, other in ((b, hub), (c, hub), (hub, b), (hub, c)):
                await node.wait_connected(other.did, 10)
            await b.send_message(hub.did, "from b", wait=True)
            await c.send_message(hub.did, "from c", wait=True)
            await hub.send_message(b.did, "to b", wait=True)
            await hub.send_message(c.did, "to c", wait=True)
            assert sorted(e.text for e in hub.inbox()) == ["from b", "from c"]
            assert hub.metrics.counters.get("session_setup_failures", 0) == 0
            assert hub.metrics.counters.get("frames_rejected", 0) == 0
    finally:
        for node in (b, c, hub):
            await node.stop()


async def test_failed_session_init_closes_the_link_and_sets_up_again(
    pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused SESSION_INIT must not leave the initiator on a dead session."""
    a, b = sorted(pair, key=lambda n: n.did)  # b responds
    real = b.sessions.on_init
    refused: list[str] = []

    def refuse_once(peer: str, init: Any, *binding: Any) -> Any:
        if not refused:
            refused.append(peer)
            raise BundleError("injected: one-time prekey 0 was already used")
        return real(peer, init, *binding)

    monkeypatch.setattr(b.sessions, "on_init", refuse_once)
    async with asyncio.timeout(20):
        b.allow(a.did)
        await a.add_peer(addr(b))
        await a.wait_connected(b.did, 10)
        await b.wait_connected(a.did, 10)
        assert refused == [a.did]
        assert b.metrics.counters["session_setup_failures"] == 1
        assert a.metrics.counters["links_up"] >= 2  # the refused link was closed and redialled
        await a.send_message(b.did, "after the retry", wait=True)
        assert [e.text for e in b.inbox()] == ["after the retry"]


async def test_message_above_the_receivers_frame_bound(tmp_path: Path) -> None:
    """The sender learns B's bound from its offer and refuses what cannot fit."""
    from talos.config import Home
    from talos.home import offline_send
    from talos.pipeline import MessageTooLargeError, text_limit

    home_a, cfg_a = make_home(tmp_path, "a")
    b = await started(*make_home(tmp_path, "b", max_frame=64 * 1024))
    a_did = load_wallet(home_a / "identity.key").did
    b.allow(a_did)
    big = "x" * (text_limit(64 * 1024) + 1)
    # Queued while A is stopped, so nobody knew B's bound: A must fail it, not retry forever.
    offline_send(Home(home_a), b.did, big)
    offline_send(Home(home_a), b.did, "after the big one")
    with pytest.raises(MessageTooLargeError, match="limit of this node"):
        offline_send(Home(home_a), b.did, "x" * (1 << 20))
    a = await started(home_a, cfg_a)
    try:
        async with asyncio.timeout(20):
            await a.add_peer(addr(b))
            await until(lambda: len(b.inbox()) == 1, what="the small message")
            assert [e.text for e in b.inbox()] == ["after the big one"]
            await until(lambda: a.status()["queues"]["outbox"] == 0, what="acks")
            assert a.metrics.counters["messages_failed"] == 1
            with pytest.raises(MessageTooLargeError, match="above the 62464-byte limit"):
                await a.send_message(b.did, big)
            # The bound is exact: the largest text that is allowed does arrive.
            await a.send_message(b.did, big[:-1], wait=True)
            assert len(b.inbox()[-1].text) == len(big) - 1
            assert b.metrics.counters.get("frames_rejected", 0) == 0
            assert a.peer_state(b.did).link is not None and a.metrics.counters["links_up"] == 1
    finally:
        await a.stop()
        await b.stop()


async def test_a_caller_whose_report_raises_does_not_strand_the_other_waiters(
    pair: tuple[Node, Node], caplog: pytest.LogCaptureFixture
) -> None:
    """One ack tells every send waiting on it from inside one loop (talos/node_send.py):
    a caller whose ``done`` raises is logged, and the sends after it still hear back."""
    a, b = pair
    async with asyncio.timeout(30):
        await link(a, b)
        told: list[str | None] = []

        def raising(msg_id: str | None, exc: BaseException | None) -> None:
            told.append(msg_id)
            raise RuntimeError("this caller's reply path broke")

        # Queued behind an unsent backlog so a single ack covers all three.
        first = a.start_send(b.did, "first", raising, wait=True, timeout=20)
        rest = [a.send_message(b.did, f"m{i}", wait=True, timeout=20) for i in range(2)]
        ids = await asyncio.gather(*rest)
        await until(lambda: told == [first.msg_id], what="the raising caller was told")
        assert [e.text for e in b.inbox()] == ["first", "m0", "m1"]
        assert [e.to_json()["id"] for e in b.inbox()][1:] == ids
        assert "send_report_failed" in caplog.text
        assert "frame_handling_failed" not in caplog.text  # the ack's frame was handled whole


async def test_a_listen_port_in_use_is_a_usage_error_that_says_what_to_do(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = Node(*make_home(tmp_path, "a", listen=f"127.0.0.1:{port}"))
        with pytest.raises(UsageError, match="another process listens there: give another port"):
            await node.start()
        await node.stop()


async def test_wait_connected_ends_at_a_refusal_for_good(tmp_path: Path) -> None:
    """A peer that does not allow us: the wait ends at its refusal, saying why, not
    after the timeout."""
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    try:
        async with asyncio.timeout(20):  # well under the wait's own 60 s
            await a.add_peer(addr(b))  # b does not allow a
            with pytest.raises(LinkRefusedError, match="not on its allow list"):
                await a.wait_connected(b.did, 60)
    finally:
        await a.stop()
        await b.stop()


async def test_a_refusal_for_good_is_redialled_at_the_backoff_cap(tmp_path: Path) -> None:
    """Only the refusing operator changes a refusal for good: the dialler waits the
    backoff cap before each new try, not the exponential steps from its first delay."""
    fast = {"reconnect_initial": 0.05, "reconnect_max": 1.0}
    a = await started(*make_home(tmp_path, "a", **fast))
    b = await started(*make_home(tmp_path, "b"))
    refusals: list[str] = []
    a.on_link_problem(lambda did, problem: refusals.append(did) if problem.decisive else None)
    try:
        await a.add_peer(addr(b))  # b does not allow a
        await until(lambda: refusals != [], 10, "the first refusal")
        await asyncio.sleep(1.4)
        # At the cap (0.5-1.0 s each, jittered): at most two more; the exponential steps
        # from 0.05 s made five or six here. A slow machine only makes fewer.
        assert len(refusals) <= 3, refusals
    finally:
        await a.stop()
        await b.stop()


async def test_a_node_told_not_to_dials_none_of_the_peers_its_store_knows(tmp_path: Path) -> None:
    """``dial_known = False`` (an embedded talos-proxy connect): the peers the store has
    addresses for are not dialled at start; by default they are."""
    home, config = make_home(tmp_path, "a")
    other = Wallet.generate().did
    async with asyncio.timeout(30):
        node = await started(home, config)
        await node.add_peer(f"ws://127.0.0.1:9#{other}")  # kept in the store; nobody there
        await node.stop()
        for dial_known in (False, True):
            node = Node(home, config)
            node.dial_known = dial_known
            await node.start()
            try:
                assert node.links.dialling(other) is dial_known
                assert other in node.known_peers()  # known either way
            finally:
                await node.stop()
