"""Asking the other end of the tunnel to hold one session (PAUSE .. RESUME).

Both ends use it when their side of a session stops reading: ``connect`` when
the agent does not read its replies, ``serve`` when the tool does not read its
input. The ask is per session, never by holding the link's reading, so the
link's keepalives and other sessions (and, through an attached node, all the
link's other traffic) go on (docs/PROTOCOL.md "MCP tunnel", kinds PAUSE and RESUME).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from mcp_proxy.transport import FrameSender
from mcp_proxy.tunnel_wire import FrameKind

__all__ = ["PeerPause"]


class PeerPause:
    """PAUSE once for a session, then RESUME when what was full has drained.

    ``sender_of()`` is the sender of the session's peer at the time of each frame;
    ``current(sid)`` says whether ``sid`` still names the session when it drained
    (not closed, not replaced by a new attach), else no RESUME is sent.
    """

    def __init__(self, sender_of: Callable[[], FrameSender], current: Callable[[int], bool]):
        self._sender_of = sender_of
        self._current = current
        self.sid: int | None = None  # the session id a PAUSE went out for
        self._task: asyncio.Task[None] | None = None

    def pause(self, sid: int, drained: Callable[[], Awaitable[None]]) -> None:
        """Ask the peer to hold ``sid`` (once) until ``drained()`` is done."""
        if self.sid != sid:
            # A new attach (a new sid) is asked again; the running wait resumes it.
            self.sid = sid
            self._send(FrameKind.PAUSE, sid)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._resume(drained()))

    def cancel(self) -> None:
        """The session is over: no RESUME will be sent."""
        if self._task is not None:
            self._task.cancel()

    async def _resume(self, drained: Awaitable[None]) -> None:
        await drained
        sid, self.sid = self.sid, None
        if sid is not None and self._current(sid):
            self._send(FrameKind.RESUME, sid)

    def _send(self, kind: FrameKind, sid: int) -> None:
        sender = self._sender_of()
        sender.control(kind, sid)
        sender.flush_now()  # the other end acts on it at once, not after a loop pass
