"""Serving an aiohttp application on 127.0.0.1 with a deadline for a trusted request.

aiohttp times out idle keep-alive connections, but not a connection that has
sent part of its first request and stopped: it is held open for good. Anyone
on the machine could then hold every file descriptor of the node (the control
API, ``talos-proxy connect --http``) without a token. :func:`serve_http`
closes a connection that has not carried a request the app trusted (its guard
calls :func:`trusted` once the token checked out) within ``first_request``
seconds: a half-sent request, or requests without the token (a 401, a
``/healthz``), do not keep a connection. Trusted connections then fall under
aiohttp's ``keepalive_timeout``, which this module sets too.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from aiohttp import web

from talos_sdk.errors import UsageError

__all__ = ["FIRST_REQUEST_TIMEOUT", "KEEPALIVE_TIMEOUT", "HttpServer", "serve_http", "trusted"]

#: Seconds a new connection has to carry a request the app trusts (its token checked out).
FIRST_REQUEST_TIMEOUT = 10.0
#: Seconds an idle (or half-sent) kept-alive connection is held between requests.
KEEPALIVE_TIMEOUT = 75.0


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
        self._served = served  # transports that carried a trusted request

    def __call__(self) -> asyncio.Protocol:
        protocol = self._factory()
        asyncio.get_running_loop().call_later(self._timeout, self._check, protocol)
        return protocol

    def _check(self, protocol: Any) -> None:
        transport = getattr(protocol, "transport", None)  # None once the connection closed
        if transport is not None and not transport.is_closing() and transport not in self._served:
            transport.close()


_SERVED = web.AppKey("talos_trusted_transports", weakref.WeakSet)


def trusted(request: web.Request) -> None:
    """Keep ``request``'s connection past the deadline (call it once the token checked out)."""
    served = request.app.get(_SERVED)
    if served is not None and request.transport is not None:
        served.add(request.transport)


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
    app[_SERVED] = served
    runner = web.AppRunner(app, keepalive_timeout=KEEPALIVE_TIMEOUT, **runner_args)
    await runner.setup()
    assert runner.server is not None
    factory = _FirstRequestDeadline(runner.server, first_request, served)
    try:
        server = await asyncio.get_running_loop().create_server(factory, host, port)
    except OSError as exc:  # a port in use, an address not of this machine
        await runner.cleanup()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return HttpServer(runner, server)
