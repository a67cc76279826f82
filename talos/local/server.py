"""The running node's local socket: one node, many local clients (DESIGN.md "Agents on a node").

``<home>/talosd.sock`` is a Unix domain socket, mode 0600 inside the 0700
home, and every connection's peer credentials (``SO_PEERCRED``) must name the
node's own uid: another user is refused even if the modes were loosened. The
frames are those of :mod:`talos.local.wire`; the ops of :mod:`talos.local.ops`.

App channels: a client claims a channel (``app.claim``) to receive a peer
link's app frames on it and sends APP frames to put its own on a link. Several
clients may share a channel: a *keyed* claim gets a range of 32-bit keys read
at a fixed offset of each payload (a channel that multiplexes sessions puts the
session id there, as the MCP tunnel does) and receives only frames whose key
falls in its range; an unkeyed claim receives the rest (ADR 0012). A keyed
claim names its peer, and its range lies in the half of the key space that
the order of the two DIDs gives this end (:func:`key_half`): the peer's node
hands its own keyed clients ranges from the other half, so the sessions each
end opens can never be mistaken for the other's; the node links to that peer
while the claim lives. A claim may also lend ``allow`` DIDs the right to link
while it lives (an attached serve's callers).

Stopping: every client hears ``stopping``; those holding app channels keep the
connection (calls still answered, links still up) until they leave or
:data:`DRAIN_SECONDS` pass, so an attached serve ends its sessions and writes
their audit through the node before it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from talos.local import wire
from talos.local.call import SOCKET_NAME, socket_path
from talos.local.conn import ClientConn
from talos.local.ops import LocalHost, resolve, run_op
from talos_sdk.errors import UsageError

if TYPE_CHECKING:
    from talos.node import Node

__all__ = ["SOCKET_NAME", "LocalServer", "socket_path"]

#: A keyed claim's share of the 32-bit key space; keys below the first range stay unkeyed.
KEY_RANGE = 1 << 20
_KEY = struct.Struct(">I")
#: How long a stopping node waits for clients holding app channels to leave.
DRAIN_SECONDS = 5.0
_RANGES_PER_HALF = (1 << 31) // KEY_RANGE


def key_half(own_did: str, peer_did: str) -> tuple[int, int]:
    """Range numbers ``[first, end)`` this end hands keyed claims toward ``peer_did``.

    The lower DID's end takes the lower half (less the unkeyed range 0), the
    other end the upper half: both ends compute the same split, no message needed.
    """
    if own_did < peer_did:
        return 1, _RANGES_PER_HALF
    return _RANGES_PER_HALF, 2 * _RANGES_PER_HALF


@dataclass(slots=True)
class _Claim:
    conn: ClientConn
    channel: str
    peer: str | None
    lo: int = 0
    hi: int = 0

    def takes(self, peer: str, key: int | None) -> bool:
        if self.peer is not None and self.peer != peer:
            return False
        if self.hi:
            return key is not None and self.lo <= key < self.hi
        return True


#: Connections the kernel queues before the node accepts them (asyncio's default is 100:
#: a few hundred agents starting at once got EAGAIN); the kernel caps it at somaxconn.
LISTEN_BACKLOG = 1024


class LocalServer:
    """Serves ``<home>/talosd.sock`` for one running node."""

    def __init__(self, node: Node, transfers: Any = None) -> None:
        self.node = node
        self.host = LocalHost(node, transfers)
        self.path = socket_path(node.home.path)
        self.conns: set[ClientConn] = set()
        self.claims: dict[str, list[_Claim]] = {}
        self._key_offsets: dict[str, int] = {}
        self._server: asyncio.AbstractServer | None = None
        self._next_range: dict[tuple[str, int], int] = {}
        self._registered: set[str] = set()
        self._lent: Counter[str] = Counter()
        self._draining: asyncio.Event | None = None

    async def start(self) -> None:
        if len(os.fsencode(self.path)) > 107:
            raise UsageError(f"home path too long for a Unix socket: {self.path}")
        # The home lock (talos/store.py) proves no other node runs here: a socket left
        # by a crashed node is stale.
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        old = os.umask(0o177)
        try:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(
                lambda: ClientConn(self), str(self.path), backlog=LISTEN_BACKLOG
            )
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self.node.on_link_change(self._on_link)
        self.node.on_link_problem(self._on_problem)
        own = self.node.authorizer
        self.node.authorizer = lambda did: own(did) or self._lent[did] > 0

    def _holders(self) -> set[ClientConn]:
        return {c.conn for claims in self.claims.values() for c in claims}

    async def close(self, *, handover: bool = False) -> None:
        """Tell every client the node stops; let app channel holders drain; close them.

        ``handover``: the node ran inside a ``talosd mcp`` whose agent left, and an
        attached ``talosd mcp`` may run the node in its stead (docs/PROTOCOL.md
        "Local clients").
        """
        if self._server is None:
            return
        self._server.close()
        holders = self._holders()
        stopping: dict[str, object] = {"event": "stopping", "reason": "the node is shutting down"}
        if handover:
            stopping |= {"reason": "the agent that ran the node left", "handover": True}
        for conn in list(self.conns):
            conn.event(stopping)
            if conn not in holders:
                conn.close()
        if holders:
            self._draining = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_SECONDS):
                    await self._draining.wait()
        for conn in list(self.conns):
            conn.close()
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def forget(self, conn: ClientConn) -> None:
        self.conns.discard(conn)
        for channel, claims in self.claims.items():
            claims[:] = [c for c in claims if c.conn is not conn]
            if not any(c.hi for c in claims):
                # The key offset is the keyed claims' layout: the next keyed client sets it.
                self._key_offsets.pop(channel, None)
        self._lent.subtract(conn.lent)
        conn.lent = []
        if self._draining is not None and not self._holders():
            self._draining.set()

    def _on_link(self, did: str, up: bool) -> None:
        obj: dict[str, Any] = {"event": "link", "did": did, "up": up}
        if up:
            obj["max_payload"] = self.host.node.max_app_payload(did)
        frame = wire.encode_json(wire.Kind.EVENT, obj)
        for conn in list(self.conns):
            if conn.watch:
                conn.notify(("link", did), frame)

    def _on_problem(self, did: str, problem: Any) -> None:
        body = {
            "event": "link_problem",
            "did": did,
            **problem.to_json(),
            "message": problem.message(did),
            "decisive": problem.decisive,
        }
        frame = wire.encode_json(wire.Kind.EVENT, body)
        for conn in list(self.conns):
            if conn.watch:
                conn.notify(("link_problem", did), frame)

    async def call(self, conn: ClientConn, op: str, args: dict[str, Any]) -> Any:
        if op == "hello":
            conn.watch = bool(args.get("watch", False))
        elif op == "app.claim":
            return self._claim(conn, args)
        return await run_op(self.host, op, args)

    # --- app channels ------------------------------------------------------------------------

    def _claim(self, conn: ClientConn, args: dict[str, Any]) -> dict[str, Any]:
        channel = args.get("channel")
        if not isinstance(channel, str) or not 0 < len(channel.encode()) < 256:
            raise UsageError("'channel' must be 1..255 bytes")
        peer_ref = args.get("peer")
        peer = resolve(self.node, peer_ref) if isinstance(peer_ref, str) else None
        offset = args.get("key_offset")
        allow = args.get("allow", [])
        if not isinstance(allow, list) or not all(isinstance(a, str) for a in allow):
            raise UsageError("'allow' must be a list of DIDs or peer names")
        lent = [resolve(self.node, ref) for ref in allow]
        claims = self.claims.setdefault(channel, [])
        if channel not in self._registered and channel in getattr(self.node, "_apps", {}):
            raise UsageError(f"app channel {channel!r} belongs to the node itself")
        claim = _Claim(conn, channel, peer)
        if offset is not None:
            if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 64:
                raise UsageError("'key_offset' must be an integer 0..63")
            if peer is None:
                raise UsageError("a keyed claim names its 'peer'")
            known = self._key_offsets.setdefault(channel, offset)
            if known != offset:
                raise UsageError(f"channel {channel!r} is keyed at offset {known}")
            n = self._free_range(channel, *key_half(self.node.did, peer))
            claim.lo, claim.hi = n * KEY_RANGE, (n + 1) * KEY_RANGE
        else:
            for other in claims:
                if not other.hi and other.peer == peer:
                    raise UsageError(
                        f"app channel {channel!r} is already claimed by another local client"
                        + (f" for {peer}" if peer else "")
                    )
        if channel not in self._registered:
            self.node.register_app(channel, self._deliverer(channel))
            self._registered.add(channel)
        if peer is not None:
            # The peer a client's sessions go to is linked to while the claim lives, as an
            # embedded proxy does: also one known by DID alone, reached through the relay.
            lent.append(peer)
        claims.append(claim)
        conn.lent.extend(lent)
        self._lent.update(lent)
        if peer is not None:
            self.node.reach(peer)
        return {"channel": channel, "peer": peer, "lo": claim.lo, "hi": claim.hi}

    def _free_range(self, channel: str, first: int, end: int) -> int:
        """The next range number in ``[first, end)`` no live claim holds, round robin.

        Round robin rather than lowest-free: a range comes back to a new client as
        late as possible, after frames of its previous holder's sessions are long gone.
        """
        held = {c.lo // KEY_RANGE for c in self.claims.get(channel, ()) if c.hi}
        start = self._next_range.get((channel, first), first)
        for i in range(end - first):
            n = first + (start - first + i) % (end - first)
            if n not in held:
                self._next_range[(channel, first)] = n + 1 if n + 1 < end else first
                return n
        raise UsageError(f"no key range left on channel {channel!r}")

    def _deliverer(self, channel: str) -> Any:
        def deliver(peer: str, payload: bytes) -> Awaitable[None] | None:
            claims = self.claims.get(channel, ())
            offset = self._key_offsets.get(channel, -1)
            key: int | None = None
            if offset >= 0 and len(payload) >= offset + 4:
                key = _KEY.unpack_from(payload, offset)[0]
            best: _Claim | None = None
            for claim in claims:
                if claim.takes(peer, key):
                    # Keyed first, then a claim naming the peer, then a catch-all.
                    rank = 0 if claim.hi else (1 if claim.peer else 2)
                    if best is None or rank < (0 if best.hi else (1 if best.peer else 2)):
                        best = claim
            if best is None:
                self.node.metrics.inc("local_app_unclaimed")
                return None
            drained = best.conn.write(wire.encode_app(channel, peer, payload))
            return None if drained is None else best.conn.wait_drained(drained)

        return deliver
