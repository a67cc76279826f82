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
import logging
import os
import struct
from collections import Counter, deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from talos.local import wire
from talos.local.call import SOCKET_NAME, socket_path
from talos.local.flow import HIGH_WATER, FlowControlled
from talos.local.ops import LocalHost, error_json, resolve, run_op, start_op_send
from talos.local.peercred import peer_allowed, peer_uid
from talos.logging import event
from talos_sdk.errors import MalformedFrameError, OversizeError, TalosError, UsageError

if TYPE_CHECKING:
    from talos.node import Node
    from talos.node_send import Sending

__all__ = ["SOCKET_NAME", "LocalServer", "socket_path"]

_log = logging.getLogger("talos.local")
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
    conn: _Conn
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
#: A frame begun and not continued for this long ends the connection: an idle client
#: holds nothing, one stopped mid-frame holds what it sent of it (up to MAX_FRAME).
PARTIAL_FRAME_TIMEOUT = 30.0
#: Longest the node waits for a client that claimed an app channel to read what it was
#: handed: the link's read loop waits with it (frames of one link stay in order), so a
#: client stuck longer is disconnected rather than let stall every message of the link.
#: Claimers flow-control their own sessions (the tunnel's PAUSE/RESUME) and keep reading.
APP_STALL_LIMIT = 10.0
#: Calls one client may have in progress (long-polls and waiting sends included); past
#: it the node reads no more of its frames until some are answered.
MAX_PENDING_CALLS = 1024
#: Bytes of a watching client's buffer, beyond which a new event disconnects it.
MAX_UNREAD_EVENTS = 4 * HIGH_WATER


class _Conn(FlowControlled):
    """One local client.

    Its frames are not read while any *hold* is on: its replies pile up unread
    (above the write buffer's high water), it has :data:`MAX_PENDING_CALLS` calls in
    progress, or its APP frames wait for a busy link. So a client that stops
    reading, or floods calls, costs the node a bounded amount of memory.
    """

    def __init__(self, server: LocalServer) -> None:
        super().__init__()
        self.server = server
        self.reader = wire.FrameReader()
        self.tasks: set[asyncio.Task[None]] = set()
        self.sends: set[Sending] = set()  # sends not answered yet (no task each)
        self.watch = False
        self.closed = False
        self.lent: list[str] = []  # DIDs this client lets link while it is attached
        self._app_out: deque[wire.AppFrame] = deque()
        self._app_task: asyncio.Task[None] | None = None
        self._replies: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._holds: set[str] = set()
        self._queued = 0  # bytes in _replies
        self._partial: asyncio.TimerHandle | None = None  # PARTIAL_FRAME_TIMEOUT's timer

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # Kept: asyncio.get_running_loop() is a getpid() syscall per call on 3.11.
        self._loop = asyncio.get_running_loop()
        uid = peer_uid(transport.get_extra_info("socket"))
        if not peer_allowed(uid, os.getuid()):
            self.server.node.metrics.inc("local_clients_refused")
            event(_log, "local_client_refused", level=logging.WARNING, uid=uid)
            self.event({"event": "refused", "reason": "this node belongs to another user"})
            transport.close()
            self.closed = True
            return
        self.server.conns.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except (MalformedFrameError, OversizeError) as exc:
            event(_log, "local_frame_rejected", level=logging.WARNING, error=str(exc))
            self.event({"event": "refused", "reason": f"malformed local frame: {exc}"})
            self.close()
            return
        self._time_partial()
        for frame in frames:
            if frame.kind is wire.Kind.APP:
                assert isinstance(frame.body, wire.AppFrame)
                self._app(frame.body)
            elif frame.kind is wire.Kind.CALL:
                assert isinstance(frame.body, dict)
                if frame.body.get("op") == "send" and isinstance(frame.body.get("args"), dict):
                    self._send(frame.body)
                    continue
                assert self._loop is not None
                task = self._loop.create_task(self._call(frame.body))
                self.tasks.add(task)
                task.add_done_callback(self._call_done)
            # REPLY / EVENT from a client mean nothing to the node: ignored.
        if len(self.tasks) + len(self.sends) >= MAX_PENDING_CALLS:
            self._hold("calls")

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._settled()

    def _settled(self) -> None:
        if "calls" in self._holds and len(self.tasks) + len(self.sends) < MAX_PENDING_CALLS:
            self._release("calls")

    def pause_writing(self) -> None:
        super().pause_writing()
        self._hold("replies")  # it does not read its replies: read none of its calls

    def resume_writing(self) -> None:
        super().resume_writing()
        self._release("replies")

    async def wait_drained(self, drained: asyncio.Future[None]) -> None:
        """Wait for the client to read its buffer; past APP_STALL_LIMIT, disconnect it."""
        try:
            async with asyncio.timeout(APP_STALL_LIMIT):
                await asyncio.shield(drained)
        except TimeoutError:
            self.server.node.metrics.inc("local_clients_too_slow")
            event(_log, "local_client_too_slow", level=logging.WARNING, waited=APP_STALL_LIMIT)
            if self.transport is not None:
                self.transport.abort()  # it reads nothing: close() would wait for it

    def _time_partial(self) -> None:
        """Time the frame the client has begun, while this node reads (none while held)."""
        if self._partial is not None:
            self._partial.cancel()
            self._partial = None
        if self.reader.pending and not self._holds and self._loop is not None:
            self._partial = self._loop.call_later(PARTIAL_FRAME_TIMEOUT, self._partial_stale)

    def _hold(self, why: str) -> None:
        """Stop reading this client's frames until every hold is released."""
        if not self._holds and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self._holds.add(why)
        # The rest of a frame cut by the pause waits unread in the kernel: not the
        # client's delay, so its timer stops (and starts again on release).
        self._time_partial()

    def _release(self, why: str) -> None:
        if why not in self._holds:
            return
        self._holds.discard(why)
        if not self._holds and self.transport is not None and not self.closed:
            self.transport.resume_reading()
            self._time_partial()

    def _partial_stale(self) -> None:
        self._partial = None
        reason = f"a local frame begun {PARTIAL_FRAME_TIMEOUT:g} s ago is still incomplete"
        event(_log, "local_frame_rejected", level=logging.WARNING, error=reason)
        if self.transport is not None:
            self.transport.abort()  # it may read nothing either: close() would wait for it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._partial is not None:
            self._partial.cancel()
        self.server.forget(self)
        for task in list(self.tasks):
            task.cancel()  # a client gone mid-long-poll: its call ends, nothing was consumed
        for sending in list(self.sends):
            sending.abandon()
        self.sends.clear()
        if self._app_task is not None:
            self._app_task.cancel()
        self.wake_writers()

    # --- writing -----------------------------------------------------------------------------

    def write(self, data: bytes) -> asyncio.Future[None] | None:
        """Write a frame; a future to await when the client reads slower than we write."""
        if self._replies:  # queued replies leave first: frames keep their order
            self._replies.append(data)
            data = b"".join(self._replies)
            self._replies = []
            self._queued = 0
        if self.closed or self.transport is None:
            return None
        self.transport.write(data)
        return self.drained

    def reply(self, data: bytes) -> None:
        """Write a REPLY together with the others of this loop pass, in one write.

        An ack settles many waiting sends in one pass: one write per reply was 9 % of
        a sending node's GIL time at 64 sends in flight on one connection.
        """
        if not self._replies:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._flush_replies)
        self._replies.append(data)
        self._queued += len(data)
        if self._queued > HIGH_WATER:
            # Out now: the transport then says whether the client keeps up (pause_writing),
            # before the next call of this pass runs (see _call).
            self._flush_replies()

    def _flush_replies(self) -> None:
        if self._replies:  # not already written ahead of another frame
            self.write(b"")  # write() sends the queued replies first

    def event(self, obj: dict[str, Any]) -> None:
        self.write(wire.encode_json(wire.Kind.EVENT, obj))

    def notify(self, frame: bytes) -> None:
        """A watched event (link up/down, a link problem), which anyone who dials the node
        can cause: a client that leaves MAX_UNREAD_EVENTS unread is disconnected rather
        than have its buffer grow with every refused dial."""
        transport = self.transport
        if self.closed or transport is None:
            return
        if transport.get_write_buffer_size() > MAX_UNREAD_EVENTS:
            self.server.node.metrics.inc("local_clients_too_slow")
            event(_log, "local_client_too_slow", level=logging.WARNING, unread="events")
            self.closed = True
            transport.abort()  # it reads nothing: close() would wait for it
            return
        self.write(frame)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    # --- calls -------------------------------------------------------------------------------

    async def _call(self, msg: dict[str, Any]) -> None:
        call_id = msg.get("id")
        op = msg.get("op")
        args = msg.get("args") or {}
        try:
            # Calls read before the client stopped reading its replies run only as it reads
            # them: each reply can be up to a frame (32 MiB), so running them all at once
            # would buffer up to MAX_PENDING_CALLS of them.
            while self.drained is not None:
                await self.drained
            if not isinstance(op, str) or not isinstance(args, dict):
                raise UsageError("a CALL needs 'op' (string) and 'args' (object)")
            result = await self.server.call(self, op, args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._answer(call_id, op, None, exc)
        else:
            self._answer(call_id, op, result, None)

    def _send(self, msg: dict[str, Any]) -> None:
        """The ``send`` op driven by callbacks: no task per call (talos/node_send.py)."""
        call_id = msg.get("id")
        started: list[Sending] = []

        def done(result: Any, exc: BaseException | None) -> None:
            if started:
                self.sends.discard(started[0])
                self._settled()
            self._answer(call_id, "send", result, exc)

        try:
            sending = start_op_send(self.server.host, msg["args"], done)
        except Exception as exc:
            self._answer(call_id, "send", None, exc)
            return
        started.append(sending)
        self.sends.add(sending)

    def _answer(self, call_id: Any, op: Any, result: Any, exc: BaseException | None) -> None:
        if exc is None:
            reply: dict[str, Any] = {"id": call_id, "result": result}
        else:
            if not isinstance(exc, TalosError | TimeoutError):
                event(_log, "local_op_failed", level=logging.ERROR, op=op, error=repr(exc))
            reply = {"id": call_id, "error": error_json(exc)}
        try:
            frame = wire.encode_json(wire.Kind.REPLY, reply)
        except (UsageError, OversizeError) as bad:  # text that is not UTF-8, a reply too big
            event(_log, "local_reply_unencodable", level=logging.ERROR, op=op, error=str(bad))
            frame = wire.encode_json(wire.Kind.REPLY, {"id": call_id, "error": error_json(bad)})
        self.reply(frame)

    # --- app frames to the node's links ----------------------------------------------------

    def _app(self, frame: wire.AppFrame) -> None:
        if self._app_task is not None:
            self._app_out.append(frame)
            return
        try:
            if self.server.node.try_send_app(frame.peer, frame.channel, frame.payload):
                return
        except (TalosError, ConnectionError) as exc:
            self._app_lost(frame, exc)
            return
        # The link is busy: keep order, stop reading this client until it drained.
        self._app_out.append(frame)
        self._hold("app")
        self._app_task = asyncio.ensure_future(self._drain_app())

    async def _drain_app(self) -> None:
        node = self.server.node
        while self._app_out:
            frame = self._app_out.popleft()
            try:
                await node.send_app(frame.peer, frame.channel, frame.payload)
            except (TalosError, ConnectionError) as exc:
                self._app_lost(frame, exc)
        self._app_task = None
        self._release("app")

    def _app_lost(self, frame: wire.AppFrame, exc: BaseException) -> None:
        # As for an in-process sender: the link listener fails what depended on it.
        self.server.node.metrics.inc("local_app_dropped")
        event(_log, "local_app_dropped", level=logging.DEBUG, peer=frame.peer, error=str(exc))


class LocalServer:
    """Serves ``<home>/talosd.sock`` for one running node."""

    def __init__(self, node: Node, transfers: Any = None) -> None:
        self.node = node
        self.host = LocalHost(node, transfers)
        self.path = socket_path(node.home.path)
        self.conns: set[_Conn] = set()
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
                lambda: _Conn(self), str(self.path), backlog=LISTEN_BACKLOG
            )
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self.node.on_link_change(self._on_link)
        self.node.on_link_problem(self._on_problem)
        own = self.node.authorizer
        self.node.authorizer = lambda did: own(did) or self._lent[did] > 0

    def _holders(self) -> set[_Conn]:
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

    def forget(self, conn: _Conn) -> None:
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
                conn.notify(frame)

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
                conn.notify(frame)

    async def call(self, conn: _Conn, op: str, args: dict[str, Any]) -> Any:
        if op == "hello":
            conn.watch = bool(args.get("watch", False))
        elif op == "app.claim":
            return self._claim(conn, args)
        return await run_op(self.host, op, args)

    # --- app channels ------------------------------------------------------------------------

    def _claim(self, conn: _Conn, args: dict[str, Any]) -> dict[str, Any]:
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
