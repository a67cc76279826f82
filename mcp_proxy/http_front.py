"""Streamable HTTP endpoint for ``connect --http`` (MCP 2025-11-25 "Transports: Streamable HTTP").

One endpoint, ``/mcp``: POST carries one JSON-RPC message (a request is
answered with an SSE stream that ends with its response; a notification or
response gets 202), GET opens the SSE stream for messages the server sends on
its own, DELETE ends the session. ``Mcp-Session-Id`` is issued on
``initialize`` and required after it (400 when missing, 404 when unknown).

Security (spec "Security Warning"): binds 127.0.0.1 unless told otherwise, a
request whose ``Origin`` is not a loopback origin gets 403, and every request
must carry ``Authorization: Bearer <token>`` (token stored 0600 in the home).

Server messages are routed as the spec asks: a response to the POST that
carries its request, a progress notification to the POST whose request holds
its ``progressToken``, anything else (sampling, elicitation, logging,
list_changed) to the GET stream, or to the newest open POST stream when there
is none, or kept until a stream opens.

A session no request has touched for ``idle_timeout`` seconds (30 min by
default; a POST waiting for its response counts as a touch, an open GET
stream does not) is ended like a DELETE: its tunnel session closes, which
stops the remote tool process, and later requests get 404 (spec "Session
Management": the client then starts a new session).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from mcp_proxy.client import ClientSession, TunnelClient
from mcp_proxy.jsonrpc import JsonRpcError, Kind, RequestId, error_reply, sniff

__all__ = ["ENDPOINT", "HttpFront"]

log = logging.getLogger(__name__)

ENDPOINT = "/mcp"
SESSION_HEADER = "Mcp-Session-Id"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
MAX_BACKLOG = 1000
MAX_BODY = 16 * 1024 * 1024
IDLE_TIMEOUT = 30 * 60.0


class _Stream:
    """One open SSE response: a queue of lines its handler writes out."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    def put(self, line: bytes | None) -> None:
        self.queue.put_nowait(line)


class _HttpSession:
    """One MCP session of an HTTP client, carried by one tunnel session."""

    def __init__(self, client: TunnelClient, session_id: str) -> None:
        self.id = session_id
        self.tunnel: ClientSession = client.open_session(self.deliver)
        self.waiters: dict[RequestId, _Stream] = {}
        self.tokens: dict[RequestId, _Stream] = {}
        self.posts: list[_Stream] = []
        self.get_stream: _Stream | None = None
        self.backlog: deque[bytes] = deque(maxlen=MAX_BACKLOG)
        self.last_used = asyncio.get_running_loop().time()

    def touch(self) -> None:
        self.last_used = asyncio.get_running_loop().time()

    def idle_since(self, now: float) -> float:
        """Seconds without a request; 0 while a POST still waits for its response."""
        return 0.0 if self.posts else now - self.last_used

    def deliver(self, line: bytes) -> None:
        try:
            msg = sniff(line)
        except JsonRpcError:
            log.warning("http session %s: dropping a malformed message", self.id[:8])
            return
        if msg.kind in (Kind.RESPONSE, Kind.ERROR) and msg.id is not None:
            stream = self.waiters.pop(msg.id, None)
            if stream is not None:
                stream.put(line)
                stream.put(None)
                return
        if msg.method == "notifications/progress" and isinstance(msg.params, dict):
            token = msg.params.get("progressToken")
            stream = self.tokens.get(token) if isinstance(token, int | str) else None
            if stream is not None:
                stream.put(line)
                return
        if self.get_stream is not None:
            self.get_stream.put(line)
        elif self.posts:
            self.posts[-1].put(line)
        else:
            self.backlog.append(line)

    def close(self) -> None:
        for stream in [*self.waiters.values(), *self.posts]:
            stream.put(None)
        if self.get_stream is not None:
            self.get_stream.put(None)
        self.waiters.clear()
        self.tunnel.close()


def _json_error(status: int, code: int, message: str, rid: Any = None) -> web.Response:
    return web.Response(
        status=status, body=error_reply(rid, code, message), content_type="application/json"
    )


def _origin_ok(origin: str | None) -> bool:
    if origin is None:
        return True  # not a browser: nothing to validate (DNS rebinding needs a browser)
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in LOOPBACK_HOSTS


def parse_bind(spec: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT``; the host defaults to 127.0.0.1."""
    host, sep, port = spec.rpartition(":")
    if not sep:
        host, port = "", spec
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--http needs HOST:PORT, got {spec!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port out of range in {spec!r}")
    return host, number


class HttpFront:
    """The aiohttp app serving MCP Streamable HTTP in front of a :class:`TunnelClient`."""

    def __init__(
        self,
        client: TunnelClient,
        token: str,
        bind: str = "127.0.0.1:0",
        *,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        if idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive")
        self.client = client
        self.token = token
        self.idle_timeout = idle_timeout
        self._reaper: asyncio.Task[None] | None = None
        self.host, self.port = parse_bind(bind)
        if self.host not in LOOPBACK_HOSTS:
            log.warning("Streamable HTTP bound to %s: reachable beyond this machine", self.host)
        self.sessions: dict[str, _HttpSession] = {}
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
        self.app.router.add_route("POST", ENDPOINT, self._post)
        self.app.router.add_route("GET", ENDPOINT, self._get)
        self.app.router.add_route("DELETE", ENDPOINT, self._delete)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert server is not None
        sock = server.sockets[0]  # type: ignore[attr-defined]
        host, port = sock.getsockname()[:2]
        self.port = port
        self.url = f"http://{host}:{port}{ENDPOINT}"
        self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        """End sessions idle for longer than ``idle_timeout`` (each holds a remote tool)."""
        loop = asyncio.get_running_loop()
        period = min(self.idle_timeout / 4, 60.0)
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for session in list(self.sessions.values()):
                if session.idle_since(now) > self.idle_timeout:
                    log.info("http session %s idle, closed", session.id[:8])
                    del self.sessions[session.id]
                    session.close()

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for session in list(self.sessions.values()):
            session.close()
        self.sessions.clear()
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not _origin_ok(request.headers.get("Origin")):
            return web.Response(status=403, text="origin not allowed")
        auth = request.headers.get("Authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self.token.encode()
        ):
            return web.Response(
                status=401, text="bearer token required", headers={"WWW-Authenticate": "Bearer"}
            )
        result: web.StreamResponse = await handler(request)
        return result

    def _session_of(self, request: web.Request) -> _HttpSession | web.Response:
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            return _json_error(400, -32600, f"Bad Request: missing {SESSION_HEADER}")
        session = self.sessions.get(sid)
        if session is None:
            return _json_error(404, -32600, "Session not found")
        session.touch()
        return session

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            msg = sniff(body)
        except JsonRpcError as exc:
            return _json_error(400, exc.code, str(exc), exc.request_id)
        if msg.kind is Kind.REQUEST and msg.method == "initialize":
            session = _HttpSession(self.client, secrets.token_hex(16))
            self.sessions[session.id] = session
        else:
            found = self._session_of(request)
            if isinstance(found, web.Response):
                return found
            session = found
        if msg.kind is not Kind.REQUEST:
            await session.tunnel.from_agent(body)
            return web.Response(status=202)
        assert msg.id is not None
        stream = _Stream()
        session.waiters[msg.id] = stream
        if msg.progress_token is not None:
            session.tokens[msg.progress_token] = stream
        session.posts.append(stream)
        response = _event_stream(session.id)
        try:
            await response.prepare(request)
            await session.tunnel.from_agent(body)
            await self._pump(response, stream)
        finally:
            session.touch()  # idle from the end of its last exchange
            session.posts.remove(stream)
            if msg.progress_token is not None:
                session.tokens.pop(msg.progress_token, None)
            session.waiters.pop(msg.id, None)
        return response

    async def _get(self, request: web.Request) -> web.StreamResponse:
        found = self._session_of(request)
        if isinstance(found, web.Response):
            return found
        session = found
        if "text/event-stream" not in request.headers.get("Accept", ""):
            return web.Response(status=406, text="Accept must include text/event-stream")
        old, stream = session.get_stream, _Stream()
        if old is not None:
            old.put(None)
        session.get_stream = stream
        while session.backlog:
            stream.put(session.backlog.popleft())
        response = _event_stream(session.id)
        try:
            await response.prepare(request)
            await self._pump(response, stream)
        finally:
            if session.get_stream is stream:
                session.get_stream = None
        return response

    async def _delete(self, request: web.Request) -> web.StreamResponse:
        found = self._session_of(request)
        if isinstance(found, web.Response):
            return found
        self.sessions.pop(found.id, None)
        found.close()
        return web.Response(status=200)

    @staticmethod
    async def _pump(response: web.StreamResponse, stream: _Stream) -> None:
        while True:
            line = await stream.queue.get()
            if line is None:
                break
            with contextlib.suppress(ConnectionResetError):
                await response.write(b"event: message\ndata: " + line + b"\n\n")
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()


def _event_stream(session_id: str) -> web.StreamResponse:
    """An SSE response bound to an MCP session (Streamable HTTP, POST and GET alike)."""
    return web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            SESSION_HEADER: session_id,
        }
    )
