"""The local control API (docs/DESIGN.md layer 2): aiohttp on loopback, bearer token.

The token lives in ``<home>/api.token`` (0600); every route but ``/healthz``
needs ``Authorization: Bearer <token>`` (RFC 6750), compared in constant time.
Bodies are pydantic models; errors are ``{"error": "..."}`` with a status
that says whose fault it was (4xx: the request, 5xx: the node).
"""

from __future__ import annotations

import asyncio
import hmac
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from talos import pipeline as pl
from talos.chain.log import UnknownRecordError
from talos.config import LOOPBACK_HOSTS
from talos.http_serve import HttpServer, serve_http, trusted
from talos.transfer.routes import register_routes
from talos.views import block_json, node_verify_json
from talos_sdk.errors import (
    LinkRefusedError,
    PeerUnreachableError,
    StorageFullError,
    TalosError,
    UsageError,
)

if TYPE_CHECKING:
    from talos.node import Node
    from talos.transfer.manager import TransferManager

__all__ = ["InboxResponse", "PeerAddRequest", "SendRequest", "SendResponse", "start_api"]


class SendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: str
    text: str
    wait: bool = False
    timeout: float = Field(default=30.0, gt=0, le=3600)


class SendResponse(BaseModel):
    id: str
    acked: bool


class PeerAddRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    addr: str


class InboxMessage(BaseModel):
    id: str
    from_: str = Field(serialization_alias="from")
    text: str
    ts: int


class InboxResponse(BaseModel):
    messages: list[InboxMessage]
    next: int


class IdResponse(BaseModel):
    did: str
    x25519: str
    suites: list[str]
    listen: str | None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(model: BaseModel | dict[str, Any], status: int = 200) -> web.Response:
    if isinstance(model, BaseModel):
        body = model.model_dump_json(by_alias=True)
    else:
        import json

        body = json.dumps(model)
    return web.Response(text=body, status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


#: Set on a request whose token checked out (``/healthz`` is answered without one).
_AUTHORISED = web.RequestKey("authorised", bool)


def _middleware(token: str) -> Any:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        # Header bytes that are not UTF-8 come as surrogates: a wrong token, not a crash.
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(got, expected):
            trusted(request)
            request[_AUTHORISED] = True
        elif request.path != "/healthz":
            return _error(401, "missing or wrong API token")
        try:
            return await handler(request)
        except ValidationError as exc:
            return _error(400, f"bad request body: {exc.errors(include_url=False)}")
        except UnknownRecordError as exc:
            return _error(404, str(exc.args[0]) if exc.args else "unknown record")
        except TimeoutError as exc:
            return _error(504, str(exc) or "timed out")
        except (PeerUnreachableError, LinkRefusedError) as exc:
            return _error(502, str(exc))  # the node could not reach the peer; the text says more
        except UsageError as exc:
            return _error(400, str(exc))
        except StorageFullError as exc:
            return _error(507, str(exc))
        except TalosError as exc:
            return _error(500, str(exc))

    return guard


def build_app(node: Node, token: str, transfers: TransferManager | None = None) -> web.Application:
    """The aiohttp application for ``node``; ``/v1/files`` when given a transfer manager."""
    app = web.Application(middlewares=[_middleware(token)], client_max_size=4 << 20)
    routes = web.RouteTableDef()

    @routes.get("/healthz")
    async def healthz(request: web.Request) -> web.Response:
        # Not ok while received messages cannot be stored (a full map, a failing disk).
        # Without the token only that: a page in a browser (DNS rebinding) may ask too,
        # and the node's DID and its error's words are not its to read.
        error = node.storage_error
        if not request.get(_AUTHORISED, False):
            return _json({"ok": error is None})
        return _json({"ok": error is None, "did": node.did, "storage_error": error})

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=node.metrics.render(), content_type="text/plain")

    @routes.get("/v1/id")
    async def ident(request: web.Request) -> web.Response:
        secrets = node.sessions.secrets
        return _json(
            IdResponse(
                did=node.did,
                x25519=secrets.identity.public.hex(),
                suites=list(secrets.suites),
                listen=node.listen_url,
            )
        )

    @routes.get("/v1/peers")
    async def peers(request: web.Request) -> web.Response:
        known = node.known_peers()
        return _json(
            {
                "peers": [
                    {"did": did, "addr": addr or None, "connected": node.is_connected(did)}
                    for did, addr in sorted(known.items())
                ]
            }
        )

    @routes.post("/v1/peers")
    async def add_peer(request: web.Request) -> web.Response:
        req = PeerAddRequest.model_validate_json(await request.read())
        peer = await node.add_peer(req.addr)
        return _json({"did": peer.did, "addr": str(peer)})

    @routes.get("/v1/status")
    async def status(request: web.Request) -> web.Response:
        return _json(node.status())

    @routes.post("/v1/send")
    async def send(request: web.Request) -> web.Response:
        req = SendRequest.model_validate_json(await request.read())
        if not req.wait:
            msg_id = await node.send_message(req.to, req.text)
            return _json(SendResponse(id=msg_id, acked=False))
        node.check_linkable(req.to)  # the wait could only time out: say why now
        try:
            # The node's own timeout: its answer comes once the queued row is durable.
            msg_id = await node.send_message(req.to, req.text, wait=True, timeout=req.timeout)
        except TimeoutError:
            raise node.not_acked(req.to, req.timeout) from None
        return _json(SendResponse(id=msg_id, acked=True))

    @routes.get("/v1/inbox")
    async def inbox(request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "0"))
            wait = float(request.query.get("wait", "0"))
        except ValueError:
            return _error(400, "after must be an integer and wait a number")
        if not 0 <= after < 2**64:
            return _error(400, "after must be a message number from 0 to 2**64-1")
        if not math.isfinite(wait):
            return _error(400, "wait must be a finite number of seconds")
        wait = min(max(wait, 0.0), 300.0)
        entries = await node.wait_inbox(after, wait) if wait else node.inbox(after)
        entries = pl.fit_page(entries)
        return _json(
            InboxResponse(
                messages=[
                    InboxMessage(id=e.msg_id.hex(), from_=e.sender, text=e.text, ts=e.ts_ms)
                    for e in entries
                ],
                next=entries[-1].n if entries else after,
            )
        )

    @routes.get("/v1/chain/heads")
    async def heads(request: web.Request) -> web.Response:
        head = node.log.heads()
        if head is None:
            return _json({"height": -1, "hash": None, "statement": None})
        return _json({"height": head.height, "hash": head.hash.hex(), "statement": head.statement})

    @routes.get("/v1/chain/peer-heads")
    async def peer_heads(request: web.Request) -> web.Response:
        return _json(await asyncio.to_thread(node.heads.peer_heads))

    @routes.get("/v1/chain/verify")
    async def verify(request: web.Request) -> web.Response:
        return _json(await asyncio.to_thread(node_verify_json, node))

    @routes.get("/v1/chain/show")
    async def show(request: web.Request) -> web.Response:
        return _json({"blocks": [block_json(b) for b in node.log.iter_blocks()]})

    @routes.get("/v1/chain/proof/{record_id}")
    async def proof(request: web.Request) -> web.Response:
        try:
            rid = bytes.fromhex(request.match_info["record_id"])
        except ValueError:
            return _error(400, "record id must be hex")
        return _json(node.log.inclusion_proof(rid))

    app.add_routes(routes)
    if transfers is not None:
        register_routes(app, transfers)  # file transfer owns /v1/files
    return app


async def start_api(
    node: Node, transfers: TransferManager | None, host: str, port: int
) -> tuple[HttpServer, str]:
    """Serve the API; returns the server (``await server.cleanup()`` to stop) and its URL."""
    if host not in LOOPBACK_HOSTS:  # NodeConfig refuses it first; callers may pass any host
        raise UsageError(f"api_host {host!r}: the control API listens on loopback only")
    # Long-polls are woken by node.stop(); never let shutdown hang on a stuck client.
    app = build_app(node, node.home.api_token(), transfers)
    server = await serve_http(app, host, port, access_log=None, shutdown_timeout=2.0)
    return server, f"http://{server.host}:{server.port}"
