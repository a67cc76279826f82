"""Serving an aiohttp application on 127.0.0.1 with a deadline for the first request.

aiohttp times out idle keep-alive connections, but not a connection that has
sent part of its first request and stopped: it is held open for good. Anyone
on the machine could then hold every file descriptor of the node (the control
API, ``talos-proxy connect --http``) without a token, since the token is only
read once the headers are complete. :func:`serve_http` closes a connection
whose first request has not reached a handler within ``first_request``
seconds; later requests on a kept-alive connection fall under aiohttp's own
``keepalive_timeout``, which this module sets too.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

__all__ = ["FIRST_REQUEST_TIMEOUT", "KEEPALIVE_TIMEOUT", "HttpServer", "serve_http"]

#: Seconds a new connection has to deliver the headers of its first request.
FIRST_REQUEST_TIMEOUT = 10.0
#: Seconds an idle (or half-sent) kept-alive connection is held between requests.
KEEPALIVE_TIMEOUT = 75.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpServer:
    """A running :func:`serve_http`: its address, and ``cleanup()`` to stop it."""

    def __init__(self, runner: web.AppRunner, server: asyncio.Server) -> None:
        self.runner = runner
        self._server = server
        sock = server.sockets[0]
        self.host, self.port = sock.getsockname()[:2]

    async def cleanup(self) -> None:
        self._server.close()  # no new connections; the runner ends the open ones
        await self.runner.cleanup()


class _FirstRequestDeadline:
    """The protocol factory of the listening socket: aiohttp's, plus the deadline."""

    def __init__(
        self, factory: Callable[[], asyncio.Protocol], timeout: float, served: weakref.WeakSet[Any]
    ) -> None:
        self._factory = factory
        self._timeout = timeout
        self._served = served  # transports whose connection got a request to a handler

    def __call__(self) -> asyncio.Protocol:
        protocol = self._factory()
        asyncio.get_running_loop().call_later(self._timeout, self._check, protocol)
        return protocol

    def _check(self, protocol: Any) -> None:
        transport = getattr(protocol, "transport", None)  # None once the connection closed
        if transport is not None and not transport.is_closing() and transport not in self._served:
            transport.close()


def _marker(served: weakref.WeakSet[Any]) -> Any:
    @web.middleware
    async def mark(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.transport is not None:
            served.add(request.transport)
        return await handler(request)

    return mark


async def serve_http(
    app: web.Application,
    host: str,
    port: int,
    *,
    first_request: float = FIRST_REQUEST_TIMEOUT,
    **runner_args: Any,
) -> HttpServer:
    """Serve ``app`` on ``host:port`` (0: any free port) until ``cleanup()``."""
    served: weakref.WeakSet[Any] = weakref.WeakSet()
    app.middlewares.insert(0, _marker(served))  # outermost: a refused request counts too
    runner = web.AppRunner(app, keepalive_timeout=KEEPALIVE_TIMEOUT, **runner_args)
    await runner.setup()
    assert runner.server is not None
    factory = _FirstRequestDeadline(runner.server, first_request, served)
    server = await asyncio.get_running_loop().create_server(factory, host, port)
    return HttpServer(runner, server)
