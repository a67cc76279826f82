"""The ``talos-proxy serve`` side: tunnel sessions onto local stdio tool processes (docs/DESIGN.md).

For each client session a peer opens, the policy picks a server, a fresh tool
process is started (MCP servers are stateful), and JSON-RPC messages move
between the tunnel and the process. This side judges, so both ways it forwards
the compact re-encoding of the object it parsed (:func:`mcp_proxy.jsonrpc.encode`),
never the bytes it received: the tool parses exactly what the policy judged, the
caller exactly what was audited (docs/PROTOCOL.md "MCP tunnel"; ADR 0003). A
denied ``tools/call`` is answered here (-32001); a ``tools/call`` notification is
refused and audited, whatever the tool. One request, one response: a tool's reply
for an id not pending is dropped; a dead tool's session is reported failed once,
with the real reason. Every event is audited (:mod:`mcp_proxy.audit`), and while
the audit log cannot be written nothing runs or is answered unrecorded (-32006).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Coroutine, Mapping
from typing import Any
from urllib.parse import urlsplit

from mcp_proxy.audit import AuditMode, Auditor, Event, failing
from mcp_proxy.http_upstream import HttpUpstream
from mcp_proxy.jsonrpc import (
    INTERNAL_ERROR,
    TOO_MANY_IN_FLIGHT,
    TOOL_DENIED,
    JsonRpcError,
    Kind,
    RequestId,
    audit_unavailable,
    encode,
    error_reply,
    sniff,
)
from mcp_proxy.peer_pause import PeerPause
from mcp_proxy.policy import Policy, PolicyDenied
from mcp_proxy.session_audit import InFlight, SessionAudit, refused_outside_a_session
from mcp_proxy.strict_replies import StrictReplies
from mcp_proxy.toolenv import tool_environment
from mcp_proxy.toolproc import ToolProcess
from mcp_proxy.transport import FrameSender, TunnelTransport
from mcp_proxy.tunnel_wire import (
    MAX_MESSAGE_BYTES,
    FrameKind,
    Joiner,
    TunnelFrame,
    decode_frame,
)
from talos.logging import event
from talos_sdk.errors import OversizeError, ProtocolError

__all__ = [
    "INBOX_FRAMES",
    "MAX_PEER_BACKLOG",
    "MAX_SESSIONS_PER_PEER",
    "MAX_TOOL_BACKLOG",
    "TunnelServer",
]

log = logging.getLogger(__name__)
WARN = logging.WARNING

# Tool processes one peer may hold at once (each session is one process).
MAX_SESSIONS_PER_PEER = 16
_UNKNOWN_SESSION = b"unknown session"
# Frames of a peer waiting for its worker; beyond it the link stops reading (backpressure).
INBOX_FRAMES = 8
#: Bytes a session's tool may leave unread before the session fails. A slower tool
#: pauses its caller (PAUSE) past the pipe's high water; what still arrives then was on
#: the way, so only a caller that ignores PAUSE gets this far.
MAX_TOOL_BACKLOG = 3 * MAX_MESSAGE_BYTES
#: The same bound over all sessions of one peer (so 16 sessions cannot hold 16 times it).
MAX_PEER_BACKLOG = 2 * MAX_TOOL_BACKLOG
#: Requests (and bytes) a session keeps in flight each way; past it: TOO_MANY_IN_FLIGHT.
MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES = 1024, 2 * MAX_MESSAGE_BYTES


class _Session:
    """One remote client session and its tool process."""

    def __init__(
        self, server: TunnelServer, peer: str, sid: int, name: str, proc_label: str
    ) -> None:
        self.server, self.peer, self.sid, self.name = server, peer, sid, name
        self.label = proc_label
        self.log_fields: dict[str, object] = {"peer": peer, "session": sid, "server": name}
        self.calls = InFlight(MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES)
        self.asks = InFlight(MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES)  # the tool's, to the caller
        self.proc: ToolProcess | HttpUpstream | None = None
        self.audit = SessionAudit(server.auditor, peer, name, sid, self._pid)
        self.closing = False
        self.caller_paused = False  # the caller's agent is not reading (PAUSE .. RESUME)
        self._output_paused = False
        self.joiner = Joiner()
        auditor = server.auditor
        self._strict = (
            StrictReplies(auditor, lambda: self.sender, sid, self._refuse_ask, self.log_fields)
            if auditor is not None and auditor.mode is AuditMode.STRICT
            else None
        )
        self.pause = PeerPause(
            lambda: self.sender,
            lambda _sid: not self.closing and server.sessions.get((peer, sid)) is self,
        )

    @property
    def sender(self) -> FrameSender:
        return self.server.sender_for(self.peer)

    def update_output(self) -> None:
        """Read the tool's output only while its caller reads and the peer's link takes it."""
        proc = self.proc
        paused = not self.closing and (self.caller_paused or self.sender.pressed)
        if proc is None or paused == self._output_paused:
            return
        self._output_paused = paused
        proc.pause_output() if paused else proc.resume_output()

    async def start(self, proc: ToolProcess | HttpUpstream) -> None:
        self.proc = proc
        await proc.start()

    def _pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # --- client -> tool -----------------------------------------------------------------------

    def check_input(self) -> None:
        """After the caller's lines were handed to the tool: pause the caller while the
        tool's input is full (PAUSE; RESUME once it drained), fail the session past
        :data:`MAX_TOOL_BACKLOG`, or once its peer's sessions hold :data:`MAX_PEER_BACKLOG`.

        Per session, not by holding the link's reading: a tool slower than its caller
        then costs its own session only, and the link goes on carrying the peer's other
        sessions (and, through an attached node, everything else of that link).
        """
        proc = self.proc
        if proc is None or proc.writable or self.closing:
            return
        backlog = proc.backlog
        if backlog > MAX_TOOL_BACKLOG or self.server.backlog_of(self.peer) > MAX_PEER_BACKLOG:
            reason = f"the tool left {backlog} bytes of input unread"
            event(log, "tool_input_overrun", WARN, **self.log_fields, backlog=backlog)
            self.audit.refusal(None, "overrun", reason)
            proc.discard_input()  # freed now, not once the tool has exited
            self.server.session_failed(self, reason)
            return
        self.pause.pause(self.sid, proc.drain)

    def from_client(self, line: bytes) -> None:
        proc = self.proc
        assert proc is not None
        try:
            msg = sniff(line)
            wire = encode(msg)
        except JsonRpcError as exc:
            self._answer(error_reply(exc.request_id, exc.code, str(exc)))
            self.audit.refusal(exc.request_id, "invalid", str(exc))
            return
        kind = msg.kind
        if kind is Kind.REQUEST:
            assert msg.id is not None and msg.method is not None
            call = self.audit.new_call(msg, wire)
            if (why := failing(self.server.auditor)) is not None:
                # Fail closed: a call run now would leave no record (docs/security.md).
                self._answer(audit_unavailable(msg.id, why))
                self.audit.call(msg.id, call, "audit-failed")
                return
            if msg.tool is not None and not self.server.policy.tool_allowed(self.peer, msg.tool):
                reply = error_reply(
                    msg.id, TOOL_DENIED, f"tool {msg.tool!r} not allowed for {self.peer}"
                )
                self.audit.call(msg.id, call, "denied")
                self._answer(reply)
                return
            if self.calls.taken(msg.id):
                # Its answer could not be told from the first one's: refused, not forwarded.
                self._answer(error_reply(msg.id, -32600, "Invalid Request: id already in use"))
                self.audit.refusal(msg.id, "invalid", "request id already in use")
                return
            if not self.calls.room(len(wire)):
                self._answer(error_reply(msg.id, TOO_MANY_IN_FLIGHT, "too many requests in flight"))
                self.audit.call(msg.id, call, "too-many")
                return
            self.calls.add(msg.id, call)
            proc.send(wire, msg.id)
            return
        if kind is Kind.RESPONSE or kind is Kind.ERROR:
            if msg.id is not None and (why := failing(self.server.auditor)) is not None:
                # The tool would act on an answer that leaves no record: it hears -32006.
                self._refuse_ask(msg.id, audit_unavailable(msg.id, why))
                return
            ask = self.asks.pop(msg.id)
            if ask is None:
                event(log, "unmatched_response_dropped", WARN, **self.log_fields, source="caller")
                self.audit.refusal(msg.id, "unmatched-response", "answers no pending tool request")
                return
            outcome = "ok" if kind is Kind.RESPONSE else "error"
            self.audit.call(msg.id, ask, outcome, msg.result, wire, event=Event.REQUEST)
            proc.send(wire)
            return
        if msg.method == "tools/call":
            # Not a request, so nothing could answer a denial: refuse whatever the policy says,
            # so no kind of message runs a tool unchecked.
            event(log, "notification_call_refused", WARN, **self.log_fields)
            self.audit.call(None, self.audit.new_call(msg, wire), "refused-notification")
            return
        if msg.method == "notifications/cancelled":
            params = msg.params if isinstance(msg.params, dict) else {}
            cancelled = params.get("requestId")
            if isinstance(cancelled, int | str) and (gone := self.calls.retire(cancelled)):
                # The tool may rightly never answer a cancelled request (MCP "Cancellation").
                proc.settle(cancelled)
                self.audit.call(cancelled, gone, "cancelled")
        proc.send(wire)

    # --- tool -> client -----------------------------------------------------------------------

    def flush(self) -> None:
        """The tool's output of one read is handed on: send it now, as one frame."""
        self.sender.flush_now()

    def from_tool(self, line: bytes) -> None:
        try:
            msg = sniff(line)
            wire = encode(msg)
        except JsonRpcError as exc:
            event(log, "tool_output_malformed", WARN, **self.log_fields, error=str(exc))
            call = self.calls.pop(exc.request_id)
            if call is not None and exc.request_id is not None:
                assert self.proc is not None
                self.proc.settle(exc.request_id)
                reply = error_reply(
                    exc.request_id, INTERNAL_ERROR, f"tool sent a malformed response: {exc}"
                )
                self.audit.call(exc.request_id, call, "malformed")
                self._emit(reply)
            return
        kind = msg.kind
        if kind is Kind.RESPONSE or kind is Kind.ERROR:
            call = self.calls.pop(msg.id)
            if call is None:
                # Unasked, a duplicate, or answering a cancelled call: one request, one response.
                event(log, "unmatched_response_dropped", WARN, **self.log_fields, source="tool")
                return
            assert self.proc is not None and msg.id is not None
            self.proc.settle(msg.id)
            ok = kind is Kind.RESPONSE
            policy = self.server.policy
            if ok and call.method == "tools/list" and policy.restricts_tools(self.peer):
                wire = policy.filter_tools_list(self.peer, wire)
            outcome = "ok" if ok else "error"
            if ok and isinstance(msg.result, dict) and msg.result.get("isError") is True:
                outcome = "tool-error"
            self.audit.call(msg.id, call, outcome, msg.result, wire)
        elif kind is Kind.REQUEST and msg.id is not None:
            # Sampling, elicitation, roots: audited when the caller answers.
            ask = self.audit.new_call(msg, wire)
            if (why := failing(self.server.auditor)) is not None:
                assert self.proc is not None
                self.proc.send(audit_unavailable(msg.id, why))
                self.audit.call(msg.id, ask, "audit-failed", event=Event.REQUEST)
                return
            if not self.asks.room(len(wire)):  # the caller leaves them unanswered
                assert self.proc is not None
                self.proc.send(error_reply(msg.id, TOO_MANY_IN_FLIGHT, "too many unanswered"))
                self.audit.call(msg.id, ask, "too-many", event=Event.REQUEST)
                return
            self.asks.add(msg.id, ask)
        self._emit(wire)

    def _answer(self, line: bytes) -> None:
        """A reply of the proxy's own to the caller (TunnelServer.own_sender may drop it)."""
        if self.server.own_sender(self.peer, len(line)) is not None:
            self._emit(line)

    def _emit(self, line: bytes) -> None:
        if self._strict is not None:
            self._strict.add(line)  # replies wait for their records (--audit strict)
            return
        self.sender.message(self.sid, line)

    def _refuse_ask(self, request_id: RequestId, reply: bytes) -> None:
        """The tool's own request is answered here instead of by the caller."""
        ask = self.asks.pop(request_id)
        if ask is not None and self.proc is not None:
            self.audit.call(request_id, ask, "audit-failed", event=Event.REQUEST)
            self.proc.send(reply)

    # --- end ----------------------------------------------------------------------------------

    def on_exit(self, code: int) -> None:
        proc = self.proc
        reason = proc.exit_reason if proc is not None else f"tool process exited (code {code})"
        self.audit.event(Event.SESSION, "exit", "stopped" if self.closing else "exited", reason)
        if self.closing:
            return
        # One report with the real reason; the client answers each pending request from it,
        # so the process's own per-request errors are not sent as well.
        calls, asks = self.calls.drain(), self.asks.drain()
        self.audit.ended(calls, asks, "tool-exited", reason)
        if proc is not None:
            proc.pending.clear()
        self.server.session_failed(self, reason)

    async def close(self, reason: str) -> None:
        """End the session (caller closed, link lost, proxy stopping) and stop its tool."""
        if not self.closing:
            self.closing = True
            calls, asks = self.calls.drain(), self.asks.drain()
            self.audit.ended(calls, asks, "closed", reason)
            self.audit.event(Event.SESSION, "close", "ok", reason)
        if self.proc is not None:
            await self.proc.terminate()
        self.pause.cancel()
        if self._strict is not None:
            await self._strict.stop()


class TunnelServer:
    """Serves tunnel sessions from authorised peers; one tool process per session."""

    def __init__(
        self,
        transport: TunnelTransport,
        policy: Policy,
        auditor: Auditor | None = None,
        *,
        grace: float = 2.0,
        max_sessions: int = MAX_SESSIONS_PER_PEER,
        env: Mapping[str, str] | None = None,
        pass_environment: bool = False,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.transport = transport
        self.policy = policy
        self.auditor = auditor
        self.grace = grace
        self.max_sessions = max_sessions
        # Tool environments (mcp_proxy.toolenv): --env, --pass-environment, serve's own.
        self.env = dict(env or {})
        self.pass_environment = pass_environment
        self.environ = dict(os.environ if environ is None else environ)
        self.sessions: dict[tuple[str, int], _Session] = {}
        self._senders: dict[str, FrameSender] = {}
        self._inbox: dict[str, asyncio.Queue[TunnelFrame | None]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self.started_processes = 0
        self.own_replies_dropped = 0  # replies of its own dropped for peers that read nothing
        self._closing: set[asyncio.Task[Any]] = set()
        self._stopping_of: Counter[str] = Counter()  # per peer: sessions stopping a tool
        transport.set_receiver(self._on_payload)
        transport.add_link_listener(self._on_link)

    def sender_for(self, peer: str) -> FrameSender:
        sender = self._senders.get(peer)
        if sender is None:
            sender = self._senders[peer] = FrameSender(self.transport, peer)
            sender.on_pressure(functools.partial(self._pressure, peer))
        return sender

    def backlog_of(self, peer: str) -> int:
        """Bytes the tools of ``peer``'s sessions have not read."""
        return sum(s.proc.backlog for (p, _), s in self.sessions.items() if p == peer and s.proc)

    def own_sender(self, peer: str, size: int) -> FrameSender | None:
        """The peer's sender for a reply of ``size`` bytes the proxy makes itself, or None:
        drop that reply, the peer sends such requests faster than it reads their answers
        (FrameSender.admit_own_reply): they must not queue answers without bound.
        """
        sender = self.sender_for(peer)
        if sender.admit_own_reply(size):
            return sender
        self.own_replies_dropped += 1
        if self.own_replies_dropped & (self.own_replies_dropped - 1) == 0:  # 1, 2, 4, ...
            event(log, "tunnel_own_replies_dropped", WARN, peer=peer,
                  dropped=self.own_replies_dropped)  # fmt: skip
        return None

    def _pressure(self, peer: str, pressed: bool) -> None:
        """The peer's link is not taking what its tools write: stop reading them, or resume."""
        event(log, "tunnel_output_paused" if pressed else "tunnel_output_resumed", peer=peer)
        for (who, _), session in self.sessions.items():
            if who == peer:
                session.update_output()

    async def stop(self) -> None:
        """Terminate every tool process and stop the workers."""
        for task in self._workers.values():
            task.cancel()
        for task in self._workers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await asyncio.gather(*(s.close("proxy stopping") for s in self.sessions.values()))
        self.sessions.clear()
        for sender in self._senders.values():
            await sender.close()

    # --- inbound ------------------------------------------------------------------------------

    def _on_payload(self, peer: str, payload: bytes) -> Awaitable[None] | None:
        """Take one frame; an awaitable returned means: read no more until it is done
        (only while the peer's worker has :data:`INBOX_FRAMES` frames queued)."""
        try:
            frame = decode_frame(payload)
        except ProtocolError as exc:
            event(log, "tunnel_frame_bad", WARN, peer=peer, error=str(exc))
            return None
        queue = self._inbox.get(peer)
        if queue is None:
            queue = self._inbox[peer] = asyncio.Queue(INBOX_FRAMES)
        kind = frame.kind
        if kind is FrameKind.MESSAGES or kind is FrameKind.PART:
            session = self.sessions.get((peer, frame.session))
            if (
                session is not None
                and session.proc is not None
                and session.proc.alive
                and queue.empty()
            ):
                # Hot path: no task hop when nothing is queued ahead of this frame.
                self._take(session, frame)
                self.sender_for(peer).flush_now()  # replies answered here (denied, malformed)
                session.check_input()
                return None
        worker = self._workers.get(peer)
        if worker is None or worker.done():
            self._workers[peer] = asyncio.create_task(self._work(peer, queue))
        if queue.full():
            return queue.put(frame)
        queue.put_nowait(frame)
        return None

    async def _work(self, peer: str, queue: asyncio.Queue[TunnelFrame | None]) -> None:
        while True:
            frame = await queue.get()
            if frame is None:
                return
            try:
                await self._handle(peer, frame)
            except Exception as exc:  # one bad frame must not stop the peer's worker
                event(log, "tunnel_frame_failed", logging.ERROR, peer=peer, error=repr(exc))

    async def _handle(self, peer: str, frame: TunnelFrame) -> None:
        key = (peer, frame.session)
        if frame.kind is FrameKind.OPEN:
            old = self.sessions.pop(key, None)
            if old is not None:
                self._close_later(old.close("reopened by the caller"), peer)
            name = frame.messages[0].decode("utf-8", "replace") if frame.messages else ""
            await self._open(peer, frame.session, name)
        elif frame.kind is FrameKind.MESSAGES or frame.kind is FrameKind.PART:
            session = self.sessions.get(key)
            if session is None:
                # Sessions are keyed by (peer, id): a frame never reaches another peer's tool.
                if (sender := self.own_sender(peer, len(_UNKNOWN_SESSION))) is not None:
                    sender.control(FrameKind.ERROR, frame.session, _UNKNOWN_SESSION)
                self._refuse(peer, frame.session, "unknown-session", "no such session of this peer")
                return
            self._take(session, frame)
            session.check_input()
        elif frame.kind is FrameKind.PAUSE or frame.kind is FrameKind.RESUME:
            session = self.sessions.get(key)
            if session is not None:
                session.caller_paused = frame.kind is FrameKind.PAUSE
                session.update_output()
        else:
            session = self.sessions.pop(key, None)
            if session is not None:
                reason = "closed by the caller"
                if frame.kind is FrameKind.ERROR and frame.messages:
                    reason = "failed at the caller: " + frame.messages[0].decode("utf-8", "replace")
                self._close_later(session.close(reason), peer)

    def _refuse(
        self, peer: str, sid: int, outcome: str, detail: str, event: Event = Event.REFUSAL
    ) -> None:
        refused_outside_a_session(self.auditor, peer, sid, outcome, detail, event)

    def _take(self, session: _Session, frame: TunnelFrame) -> None:
        """Hand a MESSAGES frame's lines to the session, rejoining split messages (PART)."""
        try:
            if frame.kind is FrameKind.PART:
                session.joiner.add_part(frame.messages[0])
                return
            lines = session.joiner.messages(frame.messages)
        except OversizeError as exc:
            # No id is known for a message never seen whole: the session fails, naming the bound.
            event(log, "tunnel_message_oversize", WARN, **session.log_fields, error=str(exc))
            session.audit.refusal(None, "oversize", str(exc))
            self.session_failed(session, str(exc))
            return
        proc = session.proc
        assert proc is not None  # set before the session is reachable by frames
        proc.hold()  # the frame's lines reach the tool in one write
        try:
            for line in lines:
                session.from_client(line)
        finally:
            proc.release()

    async def _open(self, peer: str, sid: int, name: str) -> None:
        try:
            name, spec = self.policy.server_for(peer, name)
        except PolicyDenied as exc:
            event(log, "session_refused", WARN, peer=peer, session=sid, reason=str(exc))
            said = str(exc).encode()
            if (sender := self.own_sender(peer, len(said))) is not None:
                sender.control(FrameKind.ERROR, sid, said)
            self._refuse(peer, sid, "refused", str(exc), Event.SESSION)
            return
        # Sessions still stopping their tools count: an OPEN or CLOSE storm kept 116 alive.
        held = sum(p == peer for p, _ in self.sessions) + self._stopping_of.get(peer, 0)
        if held >= self.max_sessions:
            reason = f"too many sessions: {peer} holds {held} (limit {self.max_sessions})"
            event(log, "session_refused", WARN, peer=peer, session=sid, reason=reason)
            if (sender := self.own_sender(peer, len(reason))) is not None:
                sender.control(FrameKind.ERROR, sid, reason.encode())
            self._refuse(peer, sid, "refused", reason, Event.SESSION)
            return
        session = _Session(self, peer, sid, name, f"tool[{name}:{peer[-6:]}:{sid}]")
        proc: ToolProcess | HttpUpstream
        if spec.url:
            proc = HttpUpstream(
                spec.url,
                spec.headers,
                session.from_tool,
                session.on_exit,
                label=session.label,
                log_fields=session.log_fields,
                on_batch=session.flush,
            )
        else:
            env = tool_environment(
                spec, self.environ, extra=self.env, pass_all=self.pass_environment
            )
            proc = ToolProcess(
                spec,
                session.from_tool,
                session.on_exit,
                label=session.label,
                log_fields=session.log_fields,
                grace=self.grace,
                on_batch=session.flush,
                env=env,
            )
        self.sessions[(peer, sid)] = session
        self.started_processes += 1
        await session.start(proc)
        session.update_output()  # a new session of a peer that is not reading waits too
        if proc.pid is not None or spec.url:
            # Which tool process serves whom: command only (its arguments are the operator's).
            detail = os.path.basename(spec.command) or urlsplit(spec.url).netloc
            session.audit.event(Event.SESSION, "open", "ok", detail)

    def session_failed(self, session: _Session, reason: str) -> None:
        """Report the session failed to its peer (once) and stop its tool."""
        key = (session.peer, session.sid)
        if self.sessions.get(key) is session:
            del self.sessions[key]
        self.sender_for(session.peer).control(FrameKind.ERROR, session.sid, reason.encode())
        self._close_later(session.close(reason), session.peer)

    def _on_link(self, peer: str, up: bool) -> None:
        if up:
            return
        # The link is gone: every session of that peer ends with its tool process.
        doomed = [s for (p, _), s in self.sessions.items() if p == peer]
        for s in doomed:
            del self.sessions[(s.peer, s.sid)]
        queue = self._inbox.pop(peer, None)
        if queue is not None:
            while not queue.empty():  # its sessions are gone: nothing queued matters
                queue.get_nowait()
            queue.put_nowait(None)
        self._workers.pop(peer, None)
        sender = self._senders.pop(peer, None)
        for s in doomed:
            self._close_later(s.close("link down"))
        if sender is not None:
            self._close_later(sender.close())

    def _close_later(self, closer: Coroutine[Any, Any, Any], peer: str = "") -> None:
        """Run a close in its own task (``stop`` waits for it); a session of ``peer`` counts
        against its limit until its tool has stopped."""
        task = asyncio.get_running_loop().create_task(closer)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        if peer:
            self._stopping_of[peer] += 1
            task.add_done_callback(lambda _: self._stopping_of.subtract((peer,)))
