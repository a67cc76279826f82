"""The ``talos-proxy serve`` side: tunnel sessions onto local stdio tool processes (DESIGN.md).

For each client session a peer opens, the policy picks a server, a fresh tool
process is started (MCP servers are stateful), and JSON-RPC lines are moved
between the tunnel and the process as bytes. The only parsing is the sniff
policy and audit need; the only rewrite is a ``tools/list`` result filtered to
what the caller may use. A denied ``tools/call`` is answered here (-32001) and
never reaches the tool; a ``tools/call`` without an id (a notification) is refused
and audited, whatever the tool. A tool that dies answers all its pending requests with
-32603 and its session is reported failed, so the client can start afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any

from mcp_proxy.audit import AuditMode, Auditor, AuditRecord, digest
from mcp_proxy.jsonrpc import (
    INTERNAL_ERROR,
    TOOL_DENIED,
    JsonRpcError,
    Kind,
    RequestId,
    error_reply,
    sniff,
)
from mcp_proxy.policy import Policy, PolicyDenied
from mcp_proxy.toolproc import ToolProcess
from mcp_proxy.transport import FrameSender, TunnelTransport
from mcp_proxy.tunnel_wire import FrameKind, Joiner, TunnelFrame, decode_frame
from talos_sdk.errors import OversizeError, ProtocolError

__all__ = ["INBOX_FRAMES", "MAX_SESSIONS_PER_PEER", "TunnelServer"]

log = logging.getLogger(__name__)

# Tool processes one peer may hold at once (each session is one process).
MAX_SESSIONS_PER_PEER = 16
# Frames of a peer waiting for its worker; beyond it the link stops reading (backpressure).
INBOX_FRAMES = 8


@dataclass(slots=True)
class _Call:
    method: str
    tool: str | None
    params_sha256: bytes
    started: float
    plaintext: bytes


class _Session:
    """One remote client session and its tool process."""

    def __init__(
        self, server: TunnelServer, peer: str, sid: int, name: str, proc_label: str
    ) -> None:
        self.server = server
        self.peer = peer
        self.sid = sid
        self.name = name
        self.label = proc_label
        self.calls: dict[RequestId, _Call] = {}
        self.proc: ToolProcess | None = None
        self.closing = False
        self.joiner = Joiner()
        self._strict_out: deque[bytes] = deque()
        self._strict_wake = asyncio.Event()
        self._strict_task: asyncio.Task[None] | None = None

    @property
    def sender(self) -> FrameSender:
        return self.server.sender_for(self.peer)

    async def start(self, proc: ToolProcess) -> None:
        self.proc = proc
        await proc.start()

    # --- client -> tool -----------------------------------------------------------------------

    def from_client(self, line: bytes) -> None:
        proc = self.proc
        assert proc is not None
        try:
            msg = sniff(line)
        except JsonRpcError as exc:
            self.sender.message(self.sid, error_reply(exc.request_id, exc.code, str(exc)))
            return
        if msg.kind is Kind.REQUEST:
            assert msg.id is not None and msg.method is not None
            policy = self.server.policy
            auditor = self.server.auditor
            keep = auditor is not None and auditor.plaintext
            call = _Call(
                msg.method,
                msg.tool,
                digest(msg.params),
                time.perf_counter(),
                line if keep else b"",
            )
            if msg.tool is not None and not policy.tool_allowed(self.peer, msg.tool):
                reply = error_reply(
                    msg.id, TOOL_DENIED, f"tool {msg.tool!r} not allowed for {self.peer}"
                )
                self._audit(msg.id, call, b"", "denied")
                self._emit(reply)
                return
            self.calls[msg.id] = call
            proc.send(line, msg.id)
            return
        if msg.method == "tools/call":
            # Not a request, so nothing could answer a denial: refuse whatever the policy says,
            # so no kind of message runs a tool unchecked (review #5).
            log.warning("%s: tools/call sent as a notification refused", self.label)
            auditor = self.server.auditor
            keep = auditor is not None and auditor.plaintext
            call = _Call(
                msg.method, msg.tool, digest(msg.params), time.perf_counter(), line if keep else b""
            )
            self._audit("", call, b"", "refused-notification")  # "": it carried no id
            return
        if msg.kind is Kind.NOTIFICATION and msg.method == "notifications/cancelled":
            params = msg.params if isinstance(msg.params, dict) else {}
            cancelled = params.get("requestId")
            if isinstance(cancelled, int | str) and cancelled in self.calls:
                # The tool may rightly never answer a cancelled request (MCP "Cancellation").
                call = self.calls.pop(cancelled)
                proc.settle(cancelled)
                self._audit(cancelled, call, b"", "cancelled")
        proc.send(line)

    # --- tool -> client -----------------------------------------------------------------------

    def flush(self) -> None:
        """The tool's output of one read is handed on: send it now, as one frame."""
        self.sender.flush_now()

    def from_tool(self, line: bytes) -> None:
        try:
            msg = sniff(line)
        except JsonRpcError as exc:
            log.warning("%s: malformed output from the tool: %s", self.label, exc)
            call = self.calls.pop(exc.request_id, None) if exc.request_id is not None else None
            if call is not None and exc.request_id is not None:
                assert self.proc is not None
                self.proc.settle(exc.request_id)
                reply = error_reply(
                    exc.request_id, INTERNAL_ERROR, f"tool sent a malformed response: {exc}"
                )
                self._audit(exc.request_id, call, b"", "malformed")
                self._emit(reply)
            return
        if msg.kind in (Kind.RESPONSE, Kind.ERROR) and msg.id is not None:
            call = self.calls.pop(msg.id, None)
            if call is not None:
                assert self.proc is not None
                self.proc.settle(msg.id)
                ok = msg.kind is Kind.RESPONSE
                policy = self.server.policy
                if ok and call.method == "tools/list" and policy.restricts_tools(self.peer):
                    line = policy.filter_tools_list(self.peer, line)
                outcome = "ok" if ok else "error"
                if ok and isinstance(msg.result, dict) and msg.result.get("isError") is True:
                    outcome = "tool-error"
                self._audit(msg.id, call, digest(msg.result), outcome, line)
        self._emit(line)

    def _emit(self, line: bytes) -> None:
        auditor = self.server.auditor
        if auditor is not None and auditor.mode is AuditMode.STRICT:
            # Replies wait for their records; order is kept by one task per session.
            self._strict_out.append(line)
            if self._strict_task is None or self._strict_task.done():
                self._strict_task = asyncio.create_task(self._drain_strict())
            self._strict_wake.set()
            return
        self.sender.message(self.sid, line)

    async def _drain_strict(self) -> None:
        auditor = self.server.auditor
        assert auditor is not None
        while True:
            if not self._strict_out:
                self._strict_wake.clear()
                await self._strict_wake.wait()
                continue
            batch = list(self._strict_out)
            self._strict_out.clear()
            # Every record queued so far commits in one fsync; then the replies leave in order.
            await auditor.record_barrier()
            sender = self.sender
            for line in batch:
                sender.message(self.sid, line)
            sender.flush_now()

    def _audit(
        self,
        request_id: RequestId,
        call: _Call,
        result_sha: bytes,
        outcome: str,
        reply: bytes = b"",
    ) -> None:
        auditor = self.server.auditor
        if auditor is None:
            return
        rec = AuditRecord(
            caller=self.peer,
            server=self.name,
            method=call.method,
            tool=call.tool,
            request_id=request_id,
            params_sha256=call.params_sha256,
            result_sha256=result_sha,
            latency_us=int((time.perf_counter() - call.started) * 1e6),
            outcome=outcome,
            timestamp_ms=int(time.time() * 1000),
            plaintext=(call.plaintext + b"\n" + reply) if auditor.plaintext else b"",
        )
        auditor.submit(rec)

    # --- end ----------------------------------------------------------------------------------

    def on_exit(self, code: int) -> None:
        if self.closing:
            return
        self.server.session_failed(self, f"tool process exited (code {code})")

    async def close(self) -> None:
        self.closing = True
        if self.proc is not None:
            await self.proc.terminate()
        if self._strict_task is not None:
            self._strict_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._strict_task


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
    ) -> None:
        self.transport = transport
        self.policy = policy
        self.auditor = auditor
        self.grace = grace
        self.max_sessions = max_sessions
        self.sessions: dict[tuple[str, int], _Session] = {}
        self._senders: dict[str, FrameSender] = {}
        self._inbox: dict[str, asyncio.Queue[TunnelFrame | None]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self.started_processes = 0
        self._closing: set[asyncio.Task[Any]] = set()
        transport.set_receiver(self._on_payload)
        transport.add_link_listener(self._on_link)

    def sender_for(self, peer: str) -> FrameSender:
        sender = self._senders.get(peer)
        if sender is None:
            sender = self._senders[peer] = FrameSender(self.transport, peer)
        return sender

    async def stop(self) -> None:
        """Terminate every tool process and stop the workers."""
        for task in self._workers.values():
            task.cancel()
        for task in self._workers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await asyncio.gather(*(s.close() for s in self.sessions.values()))
        self.sessions.clear()
        for sender in self._senders.values():
            await sender.close()

    # --- inbound ------------------------------------------------------------------------------

    def _on_payload(self, peer: str, payload: bytes) -> Awaitable[None] | None:
        """Take one frame; an awaitable returned means: read no more until it is done."""
        try:
            frame = decode_frame(payload)
        except ProtocolError as exc:
            log.warning("bad tunnel frame from %s: %s", peer, exc)
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
                proc = session.proc
                # Only a tool slower than its caller costs an await (stdin above high water).
                return None if proc.writable else proc.drain()
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
            except Exception:
                log.exception("handling a tunnel frame from %s failed", peer)

    async def _handle(self, peer: str, frame: TunnelFrame) -> None:
        key = (peer, frame.session)
        if frame.kind is FrameKind.OPEN:
            old = self.sessions.pop(key, None)
            if old is not None:
                self._close_later(old.close())
            await self._open(peer, frame.session, frame.messages[0].decode("utf-8", "replace"))
        elif frame.kind is FrameKind.MESSAGES or frame.kind is FrameKind.PART:
            session = self.sessions.get(key)
            if session is None:
                self.sender_for(peer).control(FrameKind.ERROR, frame.session, b"unknown session")
                return
            self._take(session, frame)
            if session.proc is not None:
                await session.proc.drain()
        else:
            session = self.sessions.pop(key, None)
            if session is not None:
                self._close_later(session.close())

    def _take(self, session: _Session, frame: TunnelFrame) -> None:
        """Hand a MESSAGES frame's lines to the session, rejoining split messages (PART)."""
        try:
            if frame.kind is FrameKind.PART:
                session.joiner.add_part(frame.messages[0])
                return
            lines = session.joiner.messages(frame.messages)
        except OversizeError as exc:
            # No id is known for a message never seen whole: the session fails, naming the bound.
            log.warning("%s: %s; session ended", session.label, exc)
            self.session_failed(session, str(exc))
            self._close_later(session.close())
            return
        for line in lines:
            session.from_client(line)

    async def _open(self, peer: str, sid: int, name: str) -> None:
        try:
            name, spec = self.policy.server_for(peer, name)
        except PolicyDenied as exc:
            log.warning("session %d from %s refused: %s", sid, peer, exc)
            self.sender_for(peer).control(FrameKind.ERROR, sid, str(exc).encode())
            return
        held = sum(1 for p, _ in self.sessions if p == peer)
        if held >= self.max_sessions:
            reason = f"too many sessions: {peer} holds {held} (limit {self.max_sessions})"
            log.warning("session %d refused: %s", sid, reason)
            self.sender_for(peer).control(FrameKind.ERROR, sid, reason.encode())
            return
        session = _Session(self, peer, sid, name, f"tool[{name}:{peer[-6:]}:{sid}]")
        proc = ToolProcess(
            spec,
            session.from_tool,
            session.on_exit,
            label=session.label,
            grace=self.grace,
            on_batch=session.flush,
        )
        self.sessions[(peer, sid)] = session
        self.started_processes += 1
        await session.start(proc)

    def session_failed(self, session: _Session, reason: str) -> None:
        key = (session.peer, session.sid)
        if self.sessions.get(key) is session:
            del self.sessions[key]
        self.sender_for(session.peer).control(FrameKind.ERROR, session.sid, reason.encode())

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
            self._close_later(s.close())
        if sender is not None:
            self._close_later(sender.close())

    def _close_later(self, closer: Coroutine[Any, Any, Any]) -> None:
        """Run a close in its own task (``stop`` waits for it): a worker may be cancelled."""
        task = asyncio.get_running_loop().create_task(closer)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
