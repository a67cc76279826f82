"""Two real nodes linked through a man-in-the-middle relay on 127.0.0.1 (tests/talos/mitm.py).

Every frame after the handshake is sealed (docs/PROTOCOL.md "Link protocol", Sealed frames):
whatever the relay forges, flips, cuts, reorders, replays or injects, the
link closes, nothing the frame carried takes effect, no message is reported
delivered before the receiver committed it, and once the path is honest
every queued message arrives exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from talos.link.handshake import CLOSE_BAD_PROOF
from talos.node import CLOSE_TRY_AGAIN, Node
from talos.node_delivery import HEARTBEAT_IDLE
from talos_sdk.did import public_key_from_did
from tests.talos.mitm import Delayer, Tamper, relay_to
from tests.talos.nodes import make_home, started, until

#: Sealed frames start at index 2 in each direction (after the handshake messages).
FIRST_SEALED = 2


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[Node, Node]]:
    a = await started(*make_home(tmp_path, "a"))
    b = await started(*make_home(tmp_path, "b"))
    b.allow(a.did)
    yield a, b
    await a.stop()
    await b.stop()


def once(direction: str, at: int, attack: Callable[[bytes, list[bytes]], list[bytes]]) -> Tamper:
    """Apply ``attack`` to one frame of the first relayed connection only."""
    state = {"conn": 0, "seen": [], "done": False}
    history: list[bytes] = []

    def tamper(d: str, index: int, data: bytes) -> list[bytes]:
        if d != direction:
            return [data]
        if index == 0:
            state["conn"] += 1  # type: ignore[operator]
            history.clear()
        if state["conn"] == 1 and index == at and not state["done"]:
            state["done"] = True
            return attack(data, list(history))
        history.append(data)
        return [data]

    return tamper


def _flip(data: bytes, history: list[bytes]) -> list[bytes]:
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x01
    return [bytes(bad)]


ATTACKS: dict[str, Callable[[bytes, list[bytes]], list[bytes]]] = {
    "forged": lambda data, h: [os.urandom(len(data))],
    "bit_flipped": _flip,
    "truncated": lambda data, h: [data[: len(data) - 5]],
    "replayed": lambda data, h: [data, h[-1]],
    "reordered": lambda data, h: [h[-1], data],
    "injected": lambda data, h: [os.urandom(48), data],
    "dropped_then_forged": lambda data, h: [os.urandom(25)],
}


async def _deliver_all(a: Node, b: Node, texts: list[str]) -> None:
    """Send with wait=True; at each acknowledgement the text must be in B's inbox."""

    async def one(text: str) -> None:
        await a.send_message(b.did, text, wait=True)
        assert text in [m.text for m in b.inbox()], "reported delivered before B committed it"

    await asyncio.gather(*(one(t) for t in texts))


def _exactly_once(b: Node, texts: list[str]) -> None:
    got = [m.text for m in b.inbox()]
    assert sorted(got) == sorted(texts), got


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize(("direction", "at"), [("a2b", FIRST_SEALED + 1), ("b2a", FIRST_SEALED)])
async def test_tampered_sealed_frames_close_the_link_and_lose_nothing(
    pair: tuple[Node, Node], attack: str, direction: str, at: int
) -> None:
    a, b = pair
    async with asyncio.timeout(60), relay_to(b.listen_url or "") as relay:
        relay.tamper = once(direction, at, ATTACKS[attack])
        await a.add_peer(f"{relay.url}#{b.did}")
        texts = [f"{attack}-{direction}-{i}" for i in range(5)]
        await _deliver_all(a, b, texts)
        await a.wait_connected(b.did, 30)
        _exactly_once(b, texts)
        unauthentic = a.metrics.counters.get("frames_unauthentic", 0) + b.metrics.counters.get(
            "frames_unauthentic", 0
        )
        assert unauthentic >= 1, "the tampered frame closed a link"
        assert relay.connections >= 2, "a fresh link came up through the honest relay"
        # Both nodes keep serving: another round goes through.
        more = [f"{attack}-after-{i}" for i in range(3)]
        await _deliver_all(a, b, more)
        _exactly_once(b, texts + more)


async def test_injected_ack_for_unsent_messages_deletes_nothing(
    pair: tuple[Node, Node],
) -> None:
    """The old forged-ACK attack: now it does not even open, and the queue is intact."""
    a, b = pair

    def forge_ack(data: bytes, h: list[bytes]) -> list[bytes]:
        return [b"\x21" + (2**63).to_bytes(8, "big"), data]  # a plaintext ACK

    async with asyncio.timeout(60), relay_to(b.listen_url or "") as relay:
        relay.tamper = once("b2a", FIRST_SEALED, forge_ack)
        await a.add_peer(f"{relay.url}#{b.did}")
        texts = [f"ack-{i}" for i in range(4)]
        await _deliver_all(a, b, texts)
        _exactly_once(b, texts)


async def test_passive_observer_sees_no_identities_or_text(pair: tuple[Node, Node]) -> None:
    a, b = pair
    async with asyncio.timeout(30), relay_to(b.listen_url or "") as relay:
        await a.add_peer(f"{relay.url}#{b.did}")
        await _deliver_all(a, b, ["a secret only b may read"])
    captured = b"".join(data for _, data in relay.captured)
    assert captured
    for node in (a, b):
        assert node.did.encode() not in captured
        assert public_key_from_did(node.did) not in captured
    assert b"a secret only b may read" not in captured


async def test_replayed_handshake_is_refused_and_the_node_keeps_running(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    async with asyncio.timeout(30):
        async with relay_to(b.listen_url or "") as relay:
            await a.add_peer(f"{relay.url}#{b.did}")
            await a.wait_connected(b.did, 20)
        recorded = [data for d, data in relay.captured if d == "a2b"][:2]
        async with connect(b.listen_url or "", compression=None) as ws:
            await ws.send(recorded[0])
            await ws.recv()  # B's fresh message 2
            await ws.send(recorded[1])  # message 3 of another handshake
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            assert ws.close_code == CLOSE_BAD_PROOF
        await until(lambda: b.metrics.counters.get("links_refused", 0) >= 1, what="refusal")
        assert b.started
        await a.add_peer(f"{b.listen_url}#{b.did}")
        await a.send_message(b.did, "still linked", wait=True)


async def test_handshake_flood_from_one_address_is_capped(pair: tuple[Node, Node]) -> None:
    a, b = pair
    url = b.listen_url or ""
    per_address = b.settings.max_handshakes_per_address
    async with asyncio.timeout(30):
        silent = [await connect(url) for _ in range(per_address)]
        await until(lambda: b.links.admission.total == per_address, what="slots held")
        async with connect(url) as extra:
            with pytest.raises(ConnectionClosed):
                await extra.recv()
        assert extra.close_code == CLOSE_TRY_AGAIN
        # The first-message deadline frees the slots without anyone's help.
        for ws in silent:
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        await until(lambda: b.links.admission.total == 0, what="slots freed")
        await a.add_peer(f"{url}#{b.did}")
        await a.send_message(b.did, "after the flood", wait=True)
        assert [m.text for m in b.inbox()] == ["after the flood"]


async def test_a_dropped_app_frame_is_caught_by_the_idle_links_heartbeat(
    pair: tuple[Node, Node],
) -> None:
    """Nothing retries an APP frame (an MCP call): the heartbeat's failed open does."""
    a, b = pair
    drop = {"next": False}

    def tamper(direction: str, index: int, data: bytes) -> list[bytes]:
        if direction == "a2b" and drop["next"] and index >= FIRST_SEALED:
            drop["next"] = False
            return []
        return [data]

    got: list[bytes] = []
    b.register_app("probe", lambda did, payload: got.append(payload))
    async with asyncio.timeout(60), relay_to(b.listen_url or "") as relay:
        relay.tamper = tamper
        await a.add_peer(f"{relay.url}#{b.did}")
        await a.wait_connected(b.did, 30)
        drop["next"] = True
        await a.send_app(b.did, "probe", b"lost on the way")
        # A sends nothing more; within a heartbeat B fails to open A's next frame.
        await until(
            lambda: b.metrics.counters.get("frames_unauthentic", 0) >= 1,
            timeout=HEARTBEAT_IDLE * 4,
            what="the gap to be caught",
        )
        await until(lambda: relay.connections >= 2, what="a fresh link")
        await a.wait_connected(b.did, 30)
        await a.send_app(b.did, "probe", b"after")
        await until(lambda: got == [b"after"], what="the next frame")


async def test_a_stranger_cannot_flood_the_log_with_failed_handshakes(
    pair: tuple[Node, Node], caplog: pytest.LogCaptureFixture
) -> None:
    """Every failure is counted; only a burst of them per address is logged per minute."""
    _, b = pair
    caplog.set_level(logging.WARNING, logger="talos.node")
    async with asyncio.timeout(60):
        for _ in range(30):
            async with connect(b.listen_url or "") as ws:
                await ws.send(b"\x00" * 40)  # not a Noise message 1
                with pytest.raises(ConnectionClosed):
                    await ws.recv()
        await until(lambda: b.metrics.counters.get("links_refused", 0) >= 30, what="counted")
    lines = [r for r in caplog.records if r.getMessage() == "link_refused"]
    assert 1 <= len(lines) <= 10, len(lines)


async def test_a_tampered_handshake_on_every_dial_does_not_end_a_wait_as_a_refusal(
    pair: tuple[Node, Node],
) -> None:
    """4001 on each dial is an attacker's doing, not B's answer: the wait runs its course."""
    a, b = pair
    tampering = {"on": True}

    def flip_message_2(direction: str, index: int, data: bytes) -> list[bytes]:
        if tampering["on"] and direction == "b2a" and index == 0:
            return _flip(data, [])
        return [data]

    async with asyncio.timeout(60), relay_to(b.listen_url or "") as relay:
        relay.tamper = flip_message_2
        await a.add_peer(f"{relay.url}#{b.did}")
        with pytest.raises(TimeoutError):
            await a.send_message(b.did, "kept", wait=True, timeout=2)
        assert relay.connections >= 2  # it kept dialling, refused each time
        tampering["on"] = False
        await until(lambda: [m.text for m in b.inbox()] == ["kept"], 30, "delivered")


async def test_a_delayed_frame_of_a_replaced_link_changes_nothing(tmp_path: Path) -> None:
    # The attacker only delays: it holds the dialler's SESSION_OFFER on the first link,
    # loses that connection (the dialler redials, a new session comes up on link 2),
    # then hands the held offer, authentic and in order, to the listener's end of the
    # first link, which the listener is still closing. It was once taken as current:
    # the listener dropped the live session and the ready link carried nothing again.
    x = await started(*make_home(tmp_path, "x"))
    y = await started(*make_home(tmp_path, "y"))
    a, b = (x, y) if x.did < y.did else (y, x)  # a opens the session (X3DH initiator)
    try:
        async with asyncio.timeout(60):
            assert b.listen_url is not None
            delayer = Delayer(int(b.listen_url.rsplit(":", 1)[1]))
            proxy = await asyncio.start_server(delayer.handle, "127.0.0.1", 0)
            port = proxy.sockets[0].getsockname()[1]
            b.allow(a.did)
            await a.add_peer(f"ws://127.0.0.1:{port}#{b.did}")
            await until(lambda: len(delayer.held) >= 1, 20, "a's offer held")
            delayer.cut_dialler()
            await until(lambda: a.is_connected(b.did) and b.is_connected(a.did), 20, "link 2")
            delayer.release(0)
            # The late offer reaches b's end of link 1 after b's close frame: dropped unread
            # (frames_dropped_closing); had it come before, it is read and ignored (stale).
            late = ("frames_stale", "frames_dropped_closing")
            await until(
                lambda: (
                    any(b.metrics.counters.get(k, 0) for k in late) or not b.sessions.has(a.did)
                ),
                20,
                "the late offer read or dropped",
            )
            assert b.sessions.has(a.did), "a late frame of the replaced link dropped the session"
            await a.send_message(b.did, "after the late offer", wait=True, timeout=20)
            await b.send_message(a.did, "and back", wait=True, timeout=20)
            proxy.close()
            delayer.close()
    finally:
        await a.stop()
        await b.stop()
