"""The ``talos-proxy connect`` side: be the MCP server an agent launches (MCP "Transports: stdio").

Every message of the agent goes to the remote tool as bytes: requests,
responses to the tool's own requests (sampling, elicitation, roots),
notifications (progress, cancellation, initialized). Every message of the tool
comes back the same way. Locally the client only checks that a line is
JSON-RPC (-32700 / -32600 replies otherwise) and remembers which request ids
are unanswered, so that a dropped link answers them (-32002) instead of
leaving the agent waiting. A request waiting for a link the serving peer
refuses (it does not allow this DID, a pin or post-quantum policy) is answered
at the refusal with -32004 and the reason, not after ``link_wait``.

Every message crosses as one line (:func:`mcp_proxy.jsonrpc.one_line`): bytes
with a raw CR or LF, from the agent or from the tunnel, are re-encoded from
their parsed object, so neither the serving peer's tool nor this agent's stdio
reader or SSE stream can split one message into two. Each agent request gets
exactly one response: a reply for an id that is not pending (a stale or
duplicate one) is dropped.

When the link comes back, or the remote session failed, the session is opened
again on the next need, and -- once the agent's ``initialize`` has been
answered -- its cached ``initialize`` request and ``initialized`` notification
are replayed to the fresh tool process (that reply swallowed), so the agent
keeps one MCP session across reconnects. An ``initialize`` still unanswered
is never replayed: it is answered (with the link error) or forwarded once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from mcp_proxy.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    LINK_DOWN,
    LINK_REFUSED,
    JsonRpcError,
    Kind,
    RequestId,
    Sniffed,
    error_reply,
    one_line,
    sniff,
)
from mcp_proxy.peer_pause import PeerPause
from mcp_proxy.transport import FrameSender, TunnelTransport
from mcp_proxy.tunnel_wire import MAX_MESSAGE_BYTES, FrameKind, Joiner, decode_frame
from talos.logging import Throttle, event
from talos_sdk.errors import OversizeError, ProtocolError, UsageError

__all__ = [
    "EMBEDDED_SID_END",
    "MAX_AGENT_BACKLOG",
    "MAX_REMOTE_REASON",
    "ClientSession",
    "TunnelClient",
]

log = logging.getLogger(__name__)
WARN = logging.WARNING

Deliver = Callable[[bytes], None]
#: Several lines at once (those of one tunnel frame), for a sink that can write them together.
DeliverMany = Callable[[list[bytes]], None]
#: An awaitable while the session's sink holds more than it should (the agent is not reading).
Backpressure = Callable[[], Awaitable[None] | None]
#: Bytes the session's sink holds in this process, not yet taken by the agent.
Backlog = Callable[[], int]
#: Bytes an agent may leave unread before its session fails. Past the sink's high water
#: the serving side is asked to pause (PAUSE); what still arrives was on the way, so
#: only a serving side that ignores PAUSE gets this far (as serve's MAX_TOOL_BACKLOG).
MAX_AGENT_BACKLOG = 3 * MAX_MESSAGE_BYTES
#: Characters of a serving side's ERROR/CLOSE reason kept: it is logged, and copied into
#: the error reply of every request the session had pending.
MAX_REMOTE_REASON = 1024
#: An embedded connect's session ids stay below the first range a node hands attached
#: clients (talos/local/server.py KEY_RANGE), so an attached serve's node routes them to it.
EMBEDDED_SID_END = 1 << 20


class ClientSession:
    """One agent-side MCP session carried by the tunnel."""

    def __init__(
        self,
        client: TunnelClient,
        deliver: Deliver,
        deliver_many: DeliverMany | None = None,
        backpressure: Backpressure | None = None,
        backlog: Backlog | None = None,
    ) -> None:
        self.client = client
        self.backlog = backlog
        # Asked after each delivery: an awaitable means the agent is not reading, and the
        # serving side is asked to pause this session's tool until it is done (PAUSE).
        self.backpressure = backpressure
        self.pause = PeerPause(
            lambda: client.sender,
            lambda sid: sid == self.sid and not self.closed and client.link_up,
        )
        # The serving side's tool is not reading (a PAUSE from it, until RESUME): the
        # agent's lines wait, and ``on_hold`` (the stdin reader) stops reading meanwhile.
        self.held = False
        self._unheld = asyncio.Event()
        self._unheld.set()
        self.on_hold: Callable[[bool], None] | None = None
        # A fresh tunnel session id per attach: late frames of an earlier attach
        # (a stale ERROR, replies of a dead tool) then match nothing and are ignored.
        self.sid = 0
        self.deliver = deliver
        self.deliver_many = deliver_many
        self.attached = False
        self.closed = False
        self.pending: dict[RequestId, str] = {}
        self._init_line: bytes | None = None
        self._init_id: RequestId | None = None
        self._initialized_line: bytes | None = None
        # The agent's initialize was answered: a fresh tool process needs the replay.
        self._initialized = False
        self._swallow: set[RequestId] = set()
        self.joiner = Joiner()

    def try_forward(self, line: bytes) -> bool:
        """Handle one line at once if the link is up and the tool takes input (the hot path);
        False means use from_agent."""
        return not self.held and self.forward_now(line)

    def forward_now(self, line: bytes) -> bool:
        """:meth:`try_forward`, even while the serving side holds this session: for a
        small message that must not wait behind what is held (a cancellation)."""
        if not self.client.link_up:
            return False
        msg = self._note(line)
        if msg is not None:
            self._forward(msg, line)
        return True

    async def from_agent(self, line: bytes) -> None:
        """Forward one line of the agent, waiting for the link and for the serving side to
        take input; answers locally what it must."""
        msg = self._note(line)
        if msg is None:
            return
        try:
            while not self.closed:
                if not await self.client.wait_link():
                    if msg.kind is Kind.REQUEST:
                        assert msg.id is not None
                        self.pending.pop(msg.id, None)
                        code, text = self.client.down_error()
                        self.deliver(error_reply(msg.id, code, text))
                    return
                if not self.held:
                    self._forward(msg, line)
                    return
                await self._unheld.wait()  # RESUME, or the session's end (detach, close)
        except asyncio.CancelledError:
            self._unsent(msg)  # its caller is gone (an HTTP client hung up): never sent
            raise
        self._unsent(msg)  # the session closed while the line waited: never sent

    def _unsent(self, msg: Sniffed) -> None:
        """Forget a request that will never be sent: its id may be used again."""
        if msg.kind is Kind.REQUEST and msg.id is not None:
            self.pending.pop(msg.id, None)

    def hold(self, held: bool) -> None:
        """The serving side asks this session to stop (PAUSE) or go on (RESUME) sending."""
        if held == self.held:
            return
        self.held = held
        self._unheld.clear() if held else self._unheld.set()
        if self.on_hold is not None:
            self.on_hold(held)

    def _note(self, line: bytes) -> Sniffed | None:
        """Check the line and remember what a reconnect or a link loss needs; None if answered."""
        try:
            msg = sniff(line)
        except JsonRpcError as exc:
            self.deliver(error_reply(exc.request_id, exc.code, str(exc)))
            return None
        if msg.kind is Kind.REQUEST:
            assert msg.id is not None and msg.method is not None
            if msg.id in self.pending:
                # A second request with a pending id could never get its own response.
                self.deliver(
                    error_reply(msg.id, INVALID_REQUEST, "Invalid Request: id already in use")
                )
                return None
            if msg.method == "initialize":
                self._init_id = msg.id
                self._init_line = self._initialized_line = None
                self._initialized = False
            self.pending[msg.id] = msg.method
        elif msg.method == "notifications/cancelled" and isinstance(msg.params, dict):
            # The agent gave up: a late reply to that id is not delivered.
            cancelled = msg.params.get("requestId")
            if isinstance(cancelled, int | str):
                self.pending.pop(cancelled, None)
        return msg

    def _forward(self, msg: Sniffed, line: bytes) -> None:
        try:
            line = one_line(line, msg)
        except JsonRpcError as exc:
            if msg.kind is Kind.REQUEST and msg.id is not None:
                self.pending.pop(msg.id, None)
                self.deliver(error_reply(msg.id, exc.code, str(exc)))
            return
        # Cached as forwarded (one line), for the replay to a fresh tool process.
        if msg.method == "initialize" and msg.id == self._init_id:
            self._init_line = line
        elif msg.method == "notifications/initialized":
            self._initialized_line = line
        if not self.attached:
            self.attach()
        self.client.sender.message(self.sid, line)

    def attach(self) -> None:
        """Open the remote session (again), replaying the agent's handshake if it completed."""
        sender = self.client.sender
        self.client.rebind(self)
        self.joiner = Joiner()
        sender.control(FrameKind.OPEN, self.sid, self.client.server_name.encode())
        self.attached = True
        if self._initialized and self._init_line is not None and self._init_id is not None:
            self._swallow.add(self._init_id)
            sender.message(self.sid, self._init_line)
            if self._initialized_line is not None:
                sender.message(self.sid, self._initialized_line)

    @property
    def resumable(self) -> bool:
        """Whether a new link should reopen this session at once (its handshake completed)."""
        return not self.attached and not self.closed and self._initialized

    def from_remote(self, line: bytes) -> None:
        line_out = self._accept_remote(line)
        if line_out is not None:
            self.deliver(line_out)

    def from_remote_many(self, lines: Sequence[bytes]) -> None:
        """The messages of one tunnel frame: those kept reach the agent together."""
        if self.deliver_many is None:
            for line in lines:
                self.from_remote(line)
            return
        kept = [out for line in lines if (out := self._accept_remote(line)) is not None]
        if kept:
            self.deliver_many(kept)

    def _accept_remote(self, line: bytes) -> bytes | None:
        """The line to hand the agent (re-encoded if it must be), or None if it is dropped."""
        try:
            msg = sniff(line)
            line = one_line(line, msg)
        except JsonRpcError as exc:
            self.client.warn("tunnel_message_malformed", session=self.sid, error=str(exc))
            return None
        if msg.kind is Kind.RESPONSE or msg.kind is Kind.ERROR:
            rid = msg.id
            if rid is not None and rid in self._swallow:
                self._swallow.discard(rid)
                return None  # the replayed initialize's reply: the agent had its own
            if rid is None or self.pending.pop(rid, None) is None:
                # Not (or no longer) awaited: one request gets exactly one response.
                self.client.warn("unmatched_response_dropped", session=self.sid)
                return None
            if rid == self._init_id and msg.kind is Kind.RESPONSE:
                self._initialized = True
        return line

    def detach(self, code: int, reason: str) -> None:
        """The remote session is gone: answer every pending request with an error."""
        self.attached = False
        self.hold(False)  # a PAUSE held the session that ended, not the next one
        # Late frames of the dead session (a tool's last words) then match nothing.
        self.client.forget_sid(self)
        self._swallow.clear()
        pending, self.pending = self.pending, {}
        for request_id in pending:
            self.deliver(error_reply(request_id, code, reason))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.attached and self.client.link_up:
            self.client.sender.control(FrameKind.CLOSE, self.sid)
        self.attached = False
        self.hold(False)
        self.client.forget(self)


class TunnelClient:
    """The agent side of the tunnel to one serving peer."""

    def __init__(
        self,
        transport: TunnelTransport,
        server_did: str,
        server_name: str = "",
        *,
        link_wait: float = 10.0,
        first_sid: int = 1,
        sid_end: int = EMBEDDED_SID_END,
    ) -> None:
        self.transport = transport
        self.server_did = server_did
        self.server_name = server_name
        self.link_wait = link_wait
        self.sender = FrameSender(transport, server_did)
        self.sessions: set[ClientSession] = set()
        self._by_sid: dict[int, ClientSession] = {}
        # An attached proxy shares its node's "mcp" channel: its ids come from its range
        # [first_sid, sid_end) and wrap inside it (docs/adr/0012-local-clients.md).
        if not 0 < first_sid < sid_end <= 1 << 32:
            raise UsageError(f"bad tunnel session id range [{first_sid}, {sid_end})")
        self._first_sid = first_sid
        self._sid_end = sid_end
        self._next_sid = first_sid
        self._up = asyncio.Event()
        if transport.is_up(server_did):
            self._up.set()
        # Why the serving peer refused the link (its allow list, pins, PQ policy), if it did.
        self._refused: str | None = transport.refusal(server_did)
        self._refusal = asyncio.Event()
        transport.set_receiver(self._on_payload)
        transport.add_link_listener(self._on_link)
        transport.add_refusal_listener(self._on_refused)
        self._closing = False
        # What a faulty serving side can repeat at will is logged a few times a minute.
        self._throttle = Throttle()

    @property
    def link_up(self) -> bool:
        return self._up.is_set()

    def down_message(self) -> str:
        """What an agent's request hears while there is no link, with the latest reason."""
        problem = self.transport.problem(self.server_did)
        return f"tunnel link to {self.server_did} is down" + (f": {problem}" if problem else "")

    def down_error(self) -> tuple[int, str]:
        """The JSON-RPC error for a request the link cannot carry: refused, or down."""
        if self._refused is not None:
            return LINK_REFUSED, f"tunnel link refused: {self._refused}"
        return LINK_DOWN, self.down_message()

    def open_session(
        self,
        deliver: Deliver,
        deliver_many: DeliverMany | None = None,
        backpressure: Backpressure | None = None,
        backlog: Backlog | None = None,
    ) -> ClientSession:
        session = ClientSession(self, deliver, deliver_many, backpressure, backlog)
        self.sessions.add(session)
        return session

    def rebind(self, session: ClientSession) -> None:
        """Give ``session`` a new tunnel session id (on every attach)."""
        self._by_sid.pop(session.sid, None)
        session.sid = self._next_sid
        following = self._next_sid + 1
        self._next_sid = following if following < self._sid_end else self._first_sid
        self._by_sid[session.sid] = session

    def forget_sid(self, session: ClientSession) -> None:
        if self._by_sid.get(session.sid) is session:
            del self._by_sid[session.sid]

    def forget(self, session: ClientSession) -> None:
        self.sessions.discard(session)
        self._by_sid.pop(session.sid, None)

    async def wait_link(self) -> bool:
        """True once the link is up; False after ``link_wait`` or at a refusal of it.

        A refusal heard earlier may be stale (the peer's allow list changes): the
        peer is dialled again at once and this waits for that attempt's answer.
        """
        if self._up.is_set():
            return True
        if self._refused is not None:
            self._refused = None
            self._refusal.clear()
            self.transport.redial(self.server_did)
        up = asyncio.ensure_future(self._up.wait())
        refused = asyncio.ensure_future(self._refusal.wait())
        try:
            first = asyncio.FIRST_COMPLETED
            await asyncio.wait((up, refused), timeout=self.link_wait, return_when=first)
        finally:
            for waiter in (up, refused):
                waiter.cancel()
        return self._up.is_set()

    async def close(self) -> None:
        self._closing = True  # the link going down from here on is our own doing
        for session in list(self.sessions):
            session.close()
        await self.sender.flush()
        await self.sender.close()

    def warn(self, name: str, **fields: object) -> None:
        """A WARNING the serving side can cause at will, throttled (the rest counted)."""
        dropped = self._throttle.admit(name, time.monotonic())
        if dropped is not None:
            event(log, name, WARN, **fields, **({"suppressed": dropped} if dropped else {}))

    def _on_payload(self, peer: str, payload: bytes) -> None:
        session = self._take(peer, payload)
        if session is None or session.backpressure is None:
            return
        wait = session.backpressure()
        if wait is None:
            return
        # The agent is not reading. Past the bound, the serving side went on past PAUSE:
        # fail the session, as serve fails a caller (checked only here, off the hot path).
        if session.backlog is not None and (backlog := session.backlog()) > MAX_AGENT_BACKLOG:
            reason = f"the agent left {backlog} bytes of the tool's output unread"
            self.warn("agent_output_overrun", session=session.sid, backlog=backlog)
            self.sender.control(FrameKind.CLOSE, session.sid)
            session.detach(INTERNAL_ERROR, reason)
            return
        # Else the serving side pauses this session's tool.
        session.pause.pause(session.sid, lambda: wait)

    def _take(self, peer: str, payload: bytes) -> ClientSession | None:
        """Handle one tunnel frame; the session it delivered messages to, if any."""
        if peer != self.server_did:
            self.warn("tunnel_frame_unexpected_peer", peer=peer)
            return None
        try:
            frame = decode_frame(payload)
        except ProtocolError as exc:
            self.warn("tunnel_frame_bad", peer=peer, error=str(exc))
            return None
        session = self._by_sid.get(frame.session)
        if session is None:
            return None
        if frame.kind is FrameKind.MESSAGES:
            try:
                lines = session.joiner.messages(frame.messages)
            except OversizeError as exc:
                self._oversize(session, exc)
                return None
            session.from_remote_many(lines)
            return session
        elif frame.kind is FrameKind.PART:
            try:
                session.joiner.add_part(frame.messages[0])
            except OversizeError as exc:
                self._oversize(session, exc)
        elif frame.kind is FrameKind.PAUSE or frame.kind is FrameKind.RESUME:
            session.hold(frame.kind is FrameKind.PAUSE)
        elif frame.kind in (FrameKind.ERROR, FrameKind.CLOSE):
            reason = "closed"
            if frame.messages:
                reason = frame.messages[0][: 4 * MAX_REMOTE_REASON].decode("utf-8", "replace")
                if len(reason) > MAX_REMOTE_REASON:
                    reason = reason[:MAX_REMOTE_REASON] + "… (cut)"
            event(
                log,
                "remote_session_ended",
                WARN,
                peer=peer,
                session=frame.session,
                kind=frame.kind.name.lower(),
                reason=reason,
            )
            session.detach(INTERNAL_ERROR, reason)
        return None

    def _oversize(self, session: ClientSession, exc: OversizeError) -> None:
        # Only a faulty server sends this (its tool lines are bounded the same way).
        event(log, "tunnel_message_oversize", WARN, session=session.sid, error=str(exc))
        self.sender.control(FrameKind.CLOSE, session.sid)
        session.detach(INTERNAL_ERROR, str(exc))

    def _on_refused(self, peer: str, message: str) -> None:
        """The serving peer (or this node) refused the link: answer waiting requests now."""
        if peer != self.server_did or self._up.is_set():
            return
        level = logging.INFO if self._closing else WARN
        event(log, "tunnel_link_refused", level, peer=peer, reason=message)
        self._refused = message
        self._refusal.set()

    def _on_link(self, peer: str, up: bool) -> None:
        if peer != self.server_did:
            return
        if up:
            event(log, "tunnel_link_up", peer=peer)
            self._refused = None
            self._refusal.clear()
            self._up.set()
            for session in list(self.sessions):
                # Reopen at once so the tool can talk first (list_changed, logging).
                if session.resumable:
                    session.attach()
            return
        # Down during our own close is the shutdown itself, not a fault.
        event(log, "tunnel_link_down", logging.INFO if self._closing else WARN, peer=peer)
        self._up.clear()
        self.sender.discard()
        for session in list(self.sessions):
            session.detach(LINK_DOWN, f"tunnel link to {peer} lost")
