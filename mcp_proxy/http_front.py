"""Streamable HTTP for ``connect --http``, both MCP eras (docs/adr/0008-http-front-eras.md).

One endpoint, ``/mcp``. Each request is classified by ``http_rules``: a
2026-07-28 request (``MCP-Protocol-Version: 2026-07-28``) is one stateless
exchange routed over a pool of tool sessions (``http_stateless``); anything
else follows the 2025-11-25 session rules (``http_legacy``): ``initialize``
creates a session named by ``Mcp-Session-Id`` (400 when missing later, 404
when unknown), GET opens its stream for server-initiated messages or resumes
one (``Last-Event-ID``), DELETE ends it. A response is ``application/json``
when the client accepts it and the response is the only message, otherwise
SSE (``http_sse``). An unsupported ``MCP-Protocol-Version`` gets 400 naming
the supported ones.

Security (spec "Security Warning"): binds 127.0.0.1 unless told otherwise,
``Origin`` is checked and CORS answered by ``http_cors``, every request but a
CORS preflight must carry ``Authorization: Bearer <token>`` (token stored 0600
in the home). The front is one caller of the serve side: legacy sessions plus
pooled stateless sessions stay within ``max_sessions``. A legacy session no
request has touched for ``idle_timeout`` seconds (a client listening for a
response counts as a touch, a cancelled request does not), and a pooled
session idle as long, is closed with its remote tool; an expired session id
then gets 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any

from aiohttp import web

from mcp_proxy.client import TunnelClient
from mcp_proxy.http_cors import LOOPBACK_HOSTS, OriginRules
from mcp_proxy.http_legacy import LegacySession
from mcp_proxy.http_rules import Era, Rejection, classify
from mcp_proxy.http_sse import parse_event_id, respond
from mcp_proxy.http_stateless import StatelessPool
from mcp_proxy.jsonrpc import (
    INTERNAL_ERROR,
    JsonRpcError,
    Kind,
    Sniffed,
    error_reply,
    one_line,
    sniff,
)
from talos.http_serve import HttpServer, serve_http, trusted
from talos.logging import event

__all__ = ["ENDPOINT", "MAX_SESSIONS", "HttpFront", "parse_bind"]

log = logging.getLogger(__name__)

ENDPOINT = "/mcp"
SESSION_HEADER = "Mcp-Session-Id"
MAX_BODY = 16 * 1024 * 1024
IDLE_TIMEOUT = 30 * 60.0
# Tool sessions one front holds at once (the serve side's default per-caller limit).
MAX_SESSIONS = 16
BUSY = -32003


def _json_error(
    status: int, code: int, message: str, rid: Any = None, data: Any = None
) -> web.Response:
    return web.Response(
        status=status, body=error_reply(rid, code, message, data), content_type="application/json"
    )


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
        allow_origins: tuple[str, ...] | list[str] = (),
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        if idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive")
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.client = client
        self.token = token
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions
        self.origins = OriginRules(allow_origins)
        self._reaper: asyncio.Task[None] | None = None
        self.host, self.port = parse_bind(bind)
        if self.host not in LOOPBACK_HOSTS:
            event(log, "http_not_loopback", logging.WARNING, host=self.host)
        self.sessions: dict[str, LegacySession] = {}
        self.pool = StatelessPool(client, self._may_open)
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
        self.app.router.add_route("POST", ENDPOINT, self._post)
        self.app.router.add_route("GET", ENDPOINT, self._get)
        self.app.router.add_route("DELETE", ENDPOINT, self._delete)
        self.app.router.add_route("OPTIONS", ENDPOINT, self._preflight)
        self.app.on_response_prepare.append(self._add_cors)
        self._server: HttpServer | None = None
        self.url = ""

    def _may_open(self) -> bool:
        return len(self.sessions) + len(self.pool) < self.max_sessions

    async def start(self) -> None:
        # A client that disconnects cancels its handler: a stateless request is then cancelled.
        server = await serve_http(
            self.app,
            self.host,
            self.port,
            access_log=None,
            shutdown_timeout=1.0,
            handler_cancellation=True,
        )
        self._server = server
        self.port = server.port
        self.url = f"http://{server.host}:{server.port}{ENDPOINT}"
        self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        """Close sessions idle for longer than ``idle_timeout`` (each holds a remote tool)."""
        loop = asyncio.get_running_loop()
        period = min(self.idle_timeout / 4, 60.0)
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for session in list(self.sessions.values()):
                if session.idle_since(now) > self.idle_timeout:
                    event(log, "http_session_idle_closed", http_session=session.id[:8])
                    del self.sessions[session.id]
                    session.close()
            if closed := self.pool.reap(now, self.idle_timeout):
                event(log, "stateless_sessions_idle_closed", count=closed)

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for session in list(self.sessions.values()):
            session.close()
        self.sessions.clear()
        self.pool.close()
        if self._server is not None:
            await self._server.cleanup()

    # --- guard and CORS ---------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "OPTIONS":
            result: web.StreamResponse = await handler(request)
            return result
        if not self.origins.admits(request.headers.get("Origin")):
            return web.Response(status=403, text="origin not allowed")
        auth = request.headers.get("Authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode("utf-8", "surrogateescape"), self.token.encode()
        ):
            return web.Response(
                status=401, text="bearer token required", headers={"WWW-Authenticate": "Bearer"}
            )
        trusted(request)
        result = await handler(request)
        return result

    async def _preflight(self, request: web.Request) -> web.StreamResponse:
        headers = self.origins.preflight(request.headers)
        if headers is None:
            return web.Response(status=403, text="CORS preflight refused")
        return web.Response(status=204, headers=headers)

    async def _add_cors(self, request: web.Request, response: web.StreamResponse) -> None:
        for name, value in self.origins.cors(request.headers.get("Origin")).items():
            response.headers.setdefault(name, value)

    # --- requests ---------------------------------------------------------------------------

    async def _post(self, request: web.Request) -> web.StreamResponse:
        accept = request.headers.get("Accept", "*/*")
        json_ok = "application/json" in accept or "*/*" in accept
        if not json_ok and "text/event-stream" not in accept:
            return web.Response(status=406, text="Accept must include application/json")
        body = await request.read()
        try:
            msg = sniff(body)
            body = one_line(body, msg)  # raw CR/LF can only be whitespace: forward one line
        except JsonRpcError as exc:
            return _json_error(400, exc.code, str(exc), exc.request_id)
        sid = request.headers.get(SESSION_HEADER)
        era = classify(request.headers, msg, sid is not None)
        if isinstance(era, Rejection):
            return _json_error(era.status, era.code, era.message, msg.id, era.data)
        if era is Era.STATELESS:
            return await self._stateless(request, msg, body, json_ok)
        return await self._legacy(request, msg, body, json_ok)

    async def _stateless(
        self, request: web.Request, msg: Sniffed, body: bytes, json_ok: bool
    ) -> web.StreamResponse:
        if msg.kind is Kind.NOTIFICATION:
            return web.Response(status=202)  # 2026-07-28 defines none from client to server
        if msg.kind is not Kind.REQUEST:
            return _json_error(400, -32600, "Invalid Request: 2026-07-28 servers send no requests")
        assert msg.id is not None
        member = self.pool.pick(msg)
        if member is None:
            return _json_error(503, BUSY, "every tool session is busy; retry", msg.id)
        exchange = member.start(msg)
        queue = exchange.attach()
        try:
            await member.tunnel.from_agent(body)
            return await respond(request, exchange, queue, json_ok=json_ok, headers={})
        finally:
            if not exchange.done:
                member.abandon(msg.id)

    def _session_of(self, request: web.Request) -> LegacySession | web.Response:
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            return _json_error(400, -32600, f"Bad Request: missing {SESSION_HEADER}")
        session = self.sessions.get(sid)
        if session is None:
            return _json_error(404, -32600, "Session not found")
        session.touch()
        return session

    async def _legacy(
        self, request: web.Request, msg: Sniffed, body: bytes, json_ok: bool
    ) -> web.StreamResponse:
        if msg.kind is Kind.REQUEST and msg.method == "initialize":
            if not self._may_open():
                reason = f"too many sessions (limit {self.max_sessions})"
                return _json_error(503, INTERNAL_ERROR, reason, msg.id)
            session = LegacySession(self.client)
            self.sessions[session.id] = session
        else:
            found = self._session_of(request)
            if isinstance(found, web.Response):
                return found
            session = found
        if msg.kind is not Kind.REQUEST:
            if msg.method == "notifications/cancelled" and isinstance(msg.params, dict):
                cancelled = msg.params.get("requestId")
                if isinstance(cancelled, int | str):
                    session.cancelled(cancelled)
            await session.tunnel.from_agent(body)
            return web.Response(status=202)
        exchange = session.open_request(msg)
        queue = exchange.attach()
        try:
            await session.tunnel.from_agent(body)
            headers = {SESSION_HEADER: session.id}
            response = await respond(request, exchange, queue, json_ok=json_ok, headers=headers)
            if exchange.done:
                session.forget(exchange)  # delivered whole: nothing left to resume
            return response
        finally:
            session.touch()  # idle from the end of its last exchange

    async def _get(self, request: web.Request) -> web.StreamResponse:
        era = classify(request.headers, None, SESSION_HEADER in request.headers)
        if isinstance(era, Rejection):
            return _json_error(era.status, era.code, era.message, None, era.data)
        if era is Era.STATELESS:
            return web.Response(status=405, headers={"Allow": "POST"})
        found = self._session_of(request)
        if isinstance(found, web.Response):
            return found
        session = found
        if "text/event-stream" not in request.headers.get("Accept", ""):
            return web.Response(status=406, text="Accept must include text/event-stream")
        last = request.headers.get("Last-Event-ID")
        parsed = parse_event_id(last) if last is not None else None
        exchange = session.find(parsed[0]) if parsed is not None else session.get_stream
        if last is not None and (parsed is None or exchange is None):
            return _json_error(400, -32600, "no stream to resume for this Last-Event-ID")
        assert exchange is not None
        after = parsed[1] if parsed is not None else None
        if exchange is session.get_stream:
            queue, prime = session.attach_get(after)
        else:
            prime = after or 0
            queue = exchange.attach(prime)
        headers = {SESSION_HEADER: session.id}
        return await respond(
            request,
            exchange,
            queue,
            json_ok=False,
            headers=headers,
            prime=exchange.seq if after is None else after,
        )

    async def _delete(self, request: web.Request) -> web.StreamResponse:
        era = classify(request.headers, None, SESSION_HEADER in request.headers)
        if isinstance(era, Rejection):
            return _json_error(era.status, era.code, era.message, None, era.data)
        if era is Era.STATELESS:
            return web.Response(status=405, headers={"Allow": "POST"})
        found = self._session_of(request)
        if isinstance(found, web.Response):
            return found
        self.sessions.pop(found.id, None)
        found.close()
        return web.Response(status=200)
