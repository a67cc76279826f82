"""The sealed link channel and its handshake (docs/adr/0011-noise-link-channel.md).

Run ``python bench/bench_link.py`` (any pyperf option works; ``--fast`` for a
smoke run). Rows: a link frame sealed and opened by :class:`LinkChannel`
(35 B, an ACK-sized frame, and 64 KiB) beside one raw ChaCha20-Poly1305
encrypt + decrypt of the same bytes in the same run (targets 0.5x and 0.9x);
complete in-memory link handshakes per second, classical Noise XX and hybrid
XXhfs with ML-KEM-768, both with Ed25519 identities, beside the X25519
exchange floor. Over a real WebSocket on 127.0.0.1: a batch of 400 B link
frames written with ``Link.send_nowait`` (seal + write, no wait) and read by
the peer link, beside plain websockets ``send`` / ``recv`` of the same frames
on the same loop.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from talos import runtime
from talos.link.channel import LinkChannel
from talos.link.handshake import LinkHandshake, Role
from talos.link.peer import Link, LinkSettings, accept_link, dial_link, listen_links
from talos_sdk.noise import CipherState
from talos_sdk.wallet import Wallet

SIZES = {"35 B": 35, "64 KiB": 64 * 1024}
_NONCE = struct.Struct("<4xQ")


def bench_seal_open(suite: Suite) -> None:
    """Seal on one channel and open on its peer, beside raw AEAD encrypt + decrypt."""
    key_ab, key_ba = os.urandom(32), os.urandom(32)
    a = LinkChannel(CipherState(key_ab), CipherState(key_ba))
    b = LinkChannel(CipherState(key_ba), CipherState(key_ab))
    aead = ChaCha20Poly1305(key_ab)
    for label, size in SIZES.items():
        frame = os.urandom(size)
        tag = label.replace(" ", "")
        counter = [0]

        def raw(frame: bytes = frame, counter: list[int] = counter) -> bytes:
            nonce = _NONCE.pack(counter[0])
            counter[0] += 1
            return aead.decrypt(nonce, aead.encrypt(nonce, frame, None), None)

        def ours(frame: bytes = frame) -> bytes:
            return b.open(a.seal(frame))

        suite.pair(
            f"link.seal_open.{tag}",
            f"LinkChannel seal + open {label}",
            raw,
            ours,
            raw_label=f"ChaCha20-Poly1305 encrypt + decrypt {label}",
        )


def _handshake(ini_wallet: Wallet, res_wallet: Wallet, pq: bool) -> None:
    ini = LinkHandshake(ini_wallet, Role.INITIATOR, pq=pq)
    res = LinkHandshake(res_wallet, Role.RESPONDER)
    data = ini.start()
    sides = (res, ini)
    turn = 0
    while data is not None:
        data = sides[turn].receive(data)
        turn = 1 - turn
    assert ini.done and res.done


def bench_handshakes(suite: Suite) -> None:
    """Both sides of one complete link handshake per call (in memory, no sockets)."""
    a, b = Wallet.from_seed(b"\x01" * 32), Wallet.from_seed(b"\x02" * 32)
    suite.single(
        "link.handshake.classical",
        "link handshake, Noise XX + Ed25519 identities (both sides)",
        lambda: _handshake(a, b, False),
    )
    suite.single(
        "link.handshake.hybrid",
        "link handshake, Noise XXhfs ML-KEM-768 + Ed25519 identities (both sides)",
        lambda: _handshake(a, b, True),
    )
    x, y = x25519.X25519PrivateKey.generate(), x25519.X25519PrivateKey.generate()
    y_pub = y.public_key()
    suite.floor("link.x25519.exchange", "OpenSSL X25519 exchange", lambda: x.exchange(y_pub))


#: Frames per timed call over the socket: enough to amortise one loop pass per batch.
SOCKET_BATCH = 64
SOCKET_FRAME = 400


class _SocketPair:
    """Two links (and, for the floor, two plain websockets) over 127.0.0.1 on one loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop() if (f := runtime.loop_factory()) is None else f()
        self.frame = os.urandom(SOCKET_FRAME)
        self.link, self.peer_link, self.ws, self.peer_ws = self.loop.run_until_complete(
            self._open()
        )

    async def _open(self) -> tuple[Link, Link, Any, Any]:
        from websockets.asyncio.client import connect
        from websockets.asyncio.server import serve

        a, b = Wallet.generate(), Wallet.generate()
        settings = LinkSettings()
        accepted: asyncio.Queue[Any] = asyncio.Queue()

        async def on_link(ws: Any) -> None:
            await accepted.put(await accept_link(ws, b, lambda did: True, settings))
            await asyncio.Future()  # the handler holds the connection open

        async def on_plain(ws: Any) -> None:
            await accepted.put(ws)
            await asyncio.Future()

        links_server = await listen_links(on_link, "127.0.0.1", 0, settings)
        url = f"ws://127.0.0.1:{next(iter(links_server.sockets)).getsockname()[1]}"
        link = await dial_link(url, b.did, a, lambda did: True, settings)
        peer_link = await accepted.get()
        plain_server = await serve(on_plain, "127.0.0.1", 0, compression=None)
        port = next(iter(plain_server.sockets)).getsockname()[1]
        ws = await connect(f"ws://127.0.0.1:{port}", compression=None)
        peer_ws = await accepted.get()
        self._servers = (links_server, plain_server)
        return link, peer_link, ws, peer_ws

    async def _ours(self) -> None:
        link, frame = self.link, self.frame
        for _ in range(SOCKET_BATCH):
            if not link.send_nowait(frame):
                await link.send(frame)
        for _ in range(SOCKET_BATCH):
            await self.peer_link.recv()

    async def _raw(self) -> None:
        ws, frame = self.ws, self.frame
        for _ in range(SOCKET_BATCH):
            await ws.send(frame)
        for _ in range(SOCKET_BATCH):
            await self.peer_ws.recv()

    def ours(self) -> None:
        self.loop.run_until_complete(self._ours())

    def raw(self) -> None:
        self.loop.run_until_complete(self._raw())


def bench_socket(suite: Suite) -> None:
    """Link.send_nowait + the peer's recv over 127.0.0.1, beside plain websockets."""
    pair = _SocketPair()  # in every pyperf process, so no timed call pays the setup
    suite.pair(
        "link.socket.send_nowait.400B",
        f"Link.send_nowait + peer recv, {SOCKET_FRAME} B frames over 127.0.0.1",
        pair.raw,
        pair.ours,
        raw_label=f"websockets send + recv, {SOCKET_FRAME} B frames over 127.0.0.1",
        per_call=SOCKET_BATCH,
    )


def main() -> None:
    """Register every row, run them, print the table, write the results JSON."""
    suite = Suite.create(__file__)
    bench_seal_open(suite)
    bench_handshakes(suite)
    bench_socket(suite)
    suite.finish()


if __name__ == "__main__":
    main()
