"""One local client's connection to the node's socket (docs/adr/0012-local-clients.md).

:class:`ClientConn` reads the client's frames and answers its calls
(:mod:`talos.local.ops`, ``send`` without a task per call), hands its APP frames
to the links and writes what the node has for it. The client costs the node
bounded memory: its frames are not read while it leaves replies unread, has
:data:`MAX_PENDING_CALLS` in progress, or its APP frames wait for a busy link;
a frame it leaves half sent, an app channel it does not read and events it
does not read end the connection. The socket and the app-channel claims are
:mod:`talos.local.server`'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections import deque
from typing import TYPE_CHECKING, Any, TypeGuard

from talos.local import wire
from talos.local.flow import HIGH_WATER, FlowControlled
from talos.local.ops import error_json, start_op_send
from talos.local.peercred import peer_allowed, peer_uid
from talos.logging import event
from talos_sdk.errors import MalformedFrameError, OversizeError, TalosError, UsageError

if TYPE_CHECKING:
    from talos.local.server import LocalServer
    from talos.node_send import Sending

__all__ = [
    "APP_STALL_LIMIT",
    "MAX_HELD_EVENTS",
    "MAX_PENDING_CALLS",
    "PARTIAL_FRAME_TIMEOUT",
    "ClientConn",
]

_log = logging.getLogger("talos.local")

#: A frame not complete this long after its first byte ends the connection (time the
#: node itself holds the client's reading not counted): an idle client holds nothing,
#: one stopped or trickling mid-frame holds what it sent of it (up to MAX_FRAME).
PARTIAL_FRAME_TIMEOUT = 30.0
#: Longest the node waits for a client that claimed an app channel to read what it was
#: handed: the link's read loop waits with it (frames of one link stay in order), so a
#: client stuck longer is disconnected rather than let stall every message of the link.
#: Claimers flow-control their own sessions (the tunnel's PAUSE/RESUME) and keep reading.
APP_STALL_LIMIT = 10.0
#: Calls one client may have in progress (long-polls and waiting sends included); past
#: it the node reads no more of its frames until some are answered.
MAX_PENDING_CALLS = 1024
#: Links whose latest event is held for a watching client that does not read.
MAX_HELD_EVENTS = 1024
#: Holds on a client's reading that are the node's doing (its calls in progress, a busy
#: link), not the client's (its replies unread): the partial-frame timer waits for them.
_NODE_HOLDS = frozenset({"calls", "app"})
#: Ops a ``cancel`` ends (besides ``send``): those that wait. The others are short and
#: write then update state (a peer stored, then kept): cut between, the two disagreed.
_CANCELLABLE = frozenset({"inbox"})


def _is_call_id(value: object) -> TypeGuard[int | str]:
    """A client's call id a ``cancel`` can name: a string or an integer (not a bool)."""
    return type(value) is int or type(value) is str


class ClientConn(FlowControlled):
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
        #: calls in progress by the client's id, for its ``cancel``
        self._by_id: dict[int | str, asyncio.Task[None] | Sending] = {}
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
        self._frame_left = PARTIAL_FRAME_TIMEOUT  # what the begun frame has left of it
        self._timed_since = 0.0  # loop time the running timer started
        #: (kind, DID) -> the latest watched event, held while the client does not read
        self._held_events: dict[tuple[str, str], bytes] = {}

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
        self._time_partial(new_frame=bool(frames))
        for frame in frames:
            if frame.kind is wire.Kind.APP:
                assert isinstance(frame.body, wire.AppFrame)
                self._app(frame.body)
            elif frame.kind is wire.Kind.CALL:
                body = frame.body
                assert isinstance(body, dict)
                op = body.get("op")
                if op == "cancel":
                    self._cancel(body.get("args"))
                    continue
                if op == "send" and isinstance(body.get("args"), dict):
                    self._send(body)
                    continue
                assert self._loop is not None
                task = self._loop.create_task(self._call(body))
                self.tasks.add(task)
                call_id = body.get("id")
                task.add_done_callback(functools.partial(self._call_done, call_id))
                if op in _CANCELLABLE:
                    self._track(call_id, task)
            # REPLY / EVENT from a client mean nothing to the node: ignored.
        if len(self.tasks) + len(self.sends) >= MAX_PENDING_CALLS:
            self._hold("calls")

    def _call_done(self, call_id: Any, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._untrack(call_id, task)
        self._settled()

    def _track(self, call_id: Any, call: asyncio.Task[None] | Sending) -> None:
        if _is_call_id(call_id):
            self._by_id[call_id] = call

    def _untrack(self, call_id: Any, call: asyncio.Task[None] | Sending) -> None:
        if _is_call_id(call_id) and self._by_id.get(call_id) is call:
            del self._by_id[call_id]

    def _cancel(self, args: Any) -> None:
        """The client gave up a call that waits (a long-poll, a send waiting for its ack):
        end it, answer nothing. Other calls run to their end, their reply ignored.

        Otherwise an agent's cancelled long-polls and waiting sends ran on, up to
        MAX_PENDING_CALLS of them, and the node stopped reading the connection.
        """
        call_id = args.get("id") if isinstance(args, dict) else None
        call = self._by_id.pop(call_id, None) if _is_call_id(call_id) else None
        if isinstance(call, asyncio.Task):
            call.cancel()  # _call raises CancelledError: no reply
        elif call is not None:
            call.abandon()  # the message itself stays queued
            self.sends.discard(call)
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
        held, self._held_events = self._held_events, {}
        for frame in held.values():
            self.write(frame)

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

    def _time_partial(self, *, new_frame: bool = False) -> None:
        """Time the frame the client has begun from its first byte (``new_frame``: the
        bytes pending began after a frame completed), except while the node itself holds
        its reading (calls in progress, a busy link): the rest of the frame then waits
        in the kernel, not by the client's doing. A client that does not read its own
        replies is timed on."""
        loop = self._loop
        if loop is None:
            return
        if self._partial is not None:
            self._partial.cancel()
            self._partial = None
            self._frame_left -= loop.time() - self._timed_since
        if new_frame or not self.reader.pending:
            self._frame_left = PARTIAL_FRAME_TIMEOUT
        if self.reader.pending and not (self._holds & _NODE_HOLDS):
            self._timed_since = loop.time()
            self._partial = loop.call_later(max(self._frame_left, 0.0), self._partial_stale)

    def _hold(self, why: str) -> None:
        """Stop reading this client's frames until every hold is released."""
        if not self._holds and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self._holds.add(why)
        if why in _NODE_HOLDS:
            self._time_partial()

    def _release(self, why: str) -> None:
        if why not in self._holds:
            return
        self._holds.discard(why)
        if not self._holds and self.transport is not None and not self.closed:
            self.transport.resume_reading()
        if why in _NODE_HOLDS:
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
        self._by_id.clear()
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

    def notify(self, key: tuple[str, str], frame: bytes) -> None:
        """A watched event (link up/down, a link problem: ``key`` is its kind and DID).

        Anyone who dials the node can cause one, so while the client leaves its buffer
        above high water (a paused attached proxy does, on purpose) only the latest
        event per key is held, for at most MAX_HELD_EVENTS keys, and written once it
        reads again: a later state of a link replaces an earlier one, and a refused
        dial no longer grows the buffer.
        """
        if self.closed or self.transport is None:
            return
        if self.drained is None and not self._held_events:
            self.write(frame)
            return
        self._held_events.pop(key, None)
        self._held_events[key] = frame
        if len(self._held_events) > MAX_HELD_EVENTS:
            del self._held_events[next(iter(self._held_events))]  # the oldest key's

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
                self._untrack(call_id, started[0])
                self._settled()
            self._answer(call_id, "send", result, exc)

        try:
            sending = start_op_send(self.server.host, msg["args"], done)
        except Exception as exc:
            self._answer(call_id, "send", None, exc)
            return
        started.append(sending)
        self.sends.add(sending)
        self._track(call_id, sending)

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
