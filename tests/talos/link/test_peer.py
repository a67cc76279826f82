"""Authenticated WebSocket links on 127.0.0.1 (talos/link/peer.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from websockets.exceptions import ConnectionClosed

from talos.link import handshake as hs
from talos.link import wire
from talos.link.peer import (
    CLOSE_UNAUTHENTIC,
    Link,
    LinkSettings,
    PeerRefused,
    accept_link,
    dial_link,
    listen_links,
)
from talos.link.wsconn import WsServer, WsStream
from talos_sdk.errors import HandshakeError
from talos_sdk.wallet import Wallet

SETTINGS = LinkSettings(max_frame=16384, handshake_timeout=5)


@dataclass
class Liar:
    """Signs with its own key but claims someone else's DID."""

    wallet: Wallet
    did: str

    def sign(self, data: bytes) -> bytes:
        return self.wallet.sign(data)


@dataclass
class Listener:
    wallet: Wallet
    authorizer: Callable[[str], bool]
    links: asyncio.Queue[Link] = field(default_factory=asyncio.Queue)
    errors: asyncio.Queue[Exception] = field(default_factory=asyncio.Queue)
    server: WsServer | None = None

    async def handler(self, ws: WsStream) -> None:
        try:
            link = await accept_link(ws, self.wallet, self.authorizer, SETTINGS)
        except HandshakeError as exc:
            await self.errors.put(exc)
            return
        await self.links.put(link)
        await ws.wait_closed()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = next(iter(self.server.sockets)).getsockname()[1]
        return f"ws://127.0.0.1:{port}"


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    lst = Listener(Wallet.generate(), lambda did: True)
    lst.server = await listen_links(lst.handler, "127.0.0.1", 0, SETTINGS)
    try:
        yield lst
    finally:
        lst.server.close()
        await lst.server.wait_closed()


async def test_link_authenticates_and_carries_frames(listener: Listener) -> None:
    me = Wallet.generate()
    async with asyncio.timeout(5):
        link = await dial_link(listener.url, listener.wallet.did, me, lambda d: True, SETTINGS)
        server_link = await listener.links.get()
        assert link.peer_did == listener.wallet.did
        assert server_link.peer_did == me.did
        assert link.suites == hs.SUITES
        await link.send(wire.encode(wire.Msg(1, b"hi")))
        assert wire.decode(await server_link.recv()) == wire.Msg(1, b"hi")
        await server_link.send(wire.encode(wire.Ack(1)))
        assert wire.decode(await link.recv()) == wire.Ack(1)
        await link.close()


async def test_unknown_peer_gets_a_clear_refusal(listener: Listener) -> None:
    listener.authorizer = lambda did: False
    async with asyncio.timeout(5):
        with pytest.raises(PeerRefused, match="not on the allow list") as exc:  # sealed REFUSE
            await dial_link(
                listener.url, listener.wallet.did, Wallet.generate(), lambda d: True, SETTINGS
            )
        assert exc.value.code == hs.CLOSE_UNAUTHORIZED
        assert isinstance(await listener.errors.get(), hs.Refusal)


async def test_impostor_claiming_a_did_is_refused(listener: Listener) -> None:
    victim = Wallet.generate()
    liar = Liar(Wallet.generate(), victim.did)
    async with asyncio.timeout(5):
        with pytest.raises(PeerRefused, match="does not verify") as exc:
            await dial_link(listener.url, listener.wallet.did, liar, lambda d: True, SETTINGS)
        assert exc.value.code == hs.CLOSE_BAD_PROOF
        err = await listener.errors.get()
        assert isinstance(err, hs.Refusal)
        assert err.code == hs.CLOSE_BAD_PROOF
        assert listener.links.empty()


async def test_dialer_refuses_a_server_that_is_not_the_pinned_did(listener: Listener) -> None:
    someone_else = Wallet.generate().did
    async with asyncio.timeout(5):
        with pytest.raises(hs.Refusal, match="pinned DID mismatch"):
            await dial_link(listener.url, someone_else, Wallet.generate(), lambda d: True, SETTINGS)
        err = await listener.errors.get()
        assert isinstance(err, PeerRefused)
        assert err.code == hs.CLOSE_PINNED_MISMATCH


async def test_garbage_during_handshake_is_refused(listener: Listener) -> None:
    from websockets.asyncio.client import connect

    async with asyncio.timeout(5), connect(listener.url, compression=None) as ws:
        await ws.send(b"\xffgarbage")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert ws.close_code == hs.CLOSE_PROTOCOL
        err = await listener.errors.get()
        assert "suite" in str(err)


async def test_silent_connection_is_dropped_at_the_first_message_deadline() -> None:
    from websockets.asyncio.client import connect

    lst = Listener(Wallet.generate(), lambda did: True)
    settings = LinkSettings(first_message_timeout=0.2, handshake_timeout=30)

    async def handler(ws: WsStream) -> None:
        try:
            await accept_link(ws, lst.wallet, lambda d: True, settings)
        except HandshakeError as exc:
            await lst.errors.put(exc)

    server = await listen_links(handler, "127.0.0.1", 0, settings)
    try:
        async with asyncio.timeout(20):
            port = server.sockets[0].getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}") as ws:
                with pytest.raises(ConnectionClosed):
                    await ws.recv()  # we never send message 1
                assert ws.close_code == hs.CLOSE_PROTOCOL
            assert "timed out" in str(await lst.errors.get())
    finally:
        server.close()
        await server.wait_closed()


async def test_tampered_sealed_frame_closes_the_link(listener: Listener) -> None:
    me = Wallet.generate()
    async with asyncio.timeout(5):
        link = await dial_link(listener.url, listener.wallet.did, me, lambda d: True, SETTINGS)
        server_link = await listener.links.get()
        await link.ws.send(b"\x00" * 40)  # raw, not sealed by the channel
        with pytest.raises(ConnectionClosed):
            await server_link.recv()
        assert server_link.unauthentic
        assert server_link.ws.close_code == CLOSE_UNAUTHENTIC


async def test_unreachable_address_is_a_connection_error() -> None:
    async with asyncio.timeout(5):
        # Bind then close a socket to get a port nobody listens on.
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectionError, match="cannot reach"):
            await dial_link(
                f"ws://127.0.0.1:{port}", "did:key:x", Wallet.generate(), lambda d: True, SETTINGS
            )


async def test_send_nowait_writes_in_call_order_with_send(listener: Listener) -> None:
    me = Wallet.generate()
    async with asyncio.timeout(5):
        link = await dial_link(listener.url, listener.wallet.did, me, lambda d: True, SETTINGS)
        server_link = await listener.links.get()
        assert link.send_nowait(wire.encode(wire.Msg(1, b"a")))
        await link.send(wire.encode(wire.Msg(2, b"b")))
        assert link.send_nowait(wire.encode(wire.Msg(3, b"c")))
        got = [wire.decode(await server_link.recv()) for _ in range(3)]
        assert got == [wire.Msg(1, b"a"), wire.Msg(2, b"b"), wire.Msg(3, b"c")]
        await link.close()


async def test_send_nowait_refuses_while_flow_control_pauses_writing(listener: Listener) -> None:
    me = Wallet.generate()
    async with asyncio.timeout(5):
        link = await dial_link(listener.url, listener.wallet.did, me, lambda d: True, SETTINGS)
        server_link = await listener.links.get()
        link.ws.pause_writing()  # what the transport calls above its high-water mark
        assert not link.writable
        assert not link.send_nowait(wire.encode(wire.Msg(1, b"held")))
        link.ws.resume_writing()
        assert link.writable
        assert link.send_nowait(wire.encode(wire.Msg(2, b"sent")))
        assert wire.decode(await server_link.recv()) == wire.Msg(2, b"sent")
        await link.close()


async def test_send_nowait_on_a_closed_link_sends_nothing(listener: Listener) -> None:
    me = Wallet.generate()
    async with asyncio.timeout(5):
        link = await dial_link(listener.url, listener.wallet.did, me, lambda d: True, SETTINGS)
        await listener.links.get()
        await link.close()
        assert not link.open
        assert not link.writable
        assert not link.send_nowait(wire.encode(wire.Msg(1, b"late")))


def test_send_nowait_both_ways_on_the_loop_talosd_runs() -> None:
    """Links made by listen_links / dial_link write without waiting on either end, on the
    loop ``talosd run`` uses (uvloop when installed: its transports are not asyncio's)."""
    from talos import runtime
    from talos.link.peer import listen_links

    async def main() -> None:
        a, b = Wallet.generate(), Wallet.generate()
        accepted: asyncio.Queue[Link] = asyncio.Queue()

        async def on_link(ws: WsStream) -> None:
            await accepted.put(await accept_link(ws, b, lambda did: True, SETTINGS))
            await ws.wait_closed()

        server = await listen_links(on_link, "127.0.0.1", 0, SETTINGS)
        try:
            async with asyncio.timeout(10):
                port = next(iter(server.sockets)).getsockname()[1]
                link = await dial_link(f"ws://127.0.0.1:{port}", b.did, a, lambda d: True, SETTINGS)
                peer = await accepted.get()
                for end in (link, peer):
                    assert end.writable and end.can_send_now
                assert link.send_nowait(wire.encode(wire.Msg(1, b"to b")))
                assert peer.send_nowait(wire.encode(wire.Msg(1, b"to a")))
                assert wire.decode(await peer.recv()) == wire.Msg(1, b"to b")
                assert wire.decode(await link.recv()) == wire.Msg(1, b"to a")
                peer.ws.pause_writing()  # what the transport calls above its high-water mark
                assert not peer.writable
                assert not peer.send_nowait(wire.encode(wire.Msg(2, b"held")))
                peer.ws.resume_writing()
                assert peer.send_nowait(wire.encode(wire.Msg(2, b"sent")))
                assert wire.decode(await link.recv()) == wire.Msg(2, b"sent")
                await link.close()
                await peer.ws.wait_closed()
                assert not peer.writable and not peer.send_nowait(b"\x21")
        finally:
            server.close()
            await server.wait_closed()

    runtime.run(main())
