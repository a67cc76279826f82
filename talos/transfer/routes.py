"""The control API's ``/v1/files`` routes over a TransferManager (docs/PROTOCOL.md "File transfer").

Hooked in with one line, ``register_routes(app, manager)`` in talos/api.py; the
manager itself is built, started and stopped by talos/daemon.py. The
``talosd send-file`` / ``files`` commands are in talos/transfer/cli.py.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from talos.transfer.manager import TransferManager
from talos.transfer.protocol import TransferState
from talos_sdk.errors import UsageError

__all__ = ["parse_tid", "register_routes", "view"]

MANAGER_KEY: web.AppKey[TransferManager] = web.AppKey("transfers", TransferManager)


class SendRequest(BaseModel):
    """Body of ``POST /v1/files``."""

    model_config = ConfigDict(extra="forbid")

    did: str
    path: str
    name: str | None = None


def view(manager: TransferManager, tid: str) -> dict[str, Any]:
    info = manager.get(tid)
    data = info.to_public()
    key = bytes.fromhex(info.tid)
    # The receiver's row holds its committed offset; the sender counts what it has sent.
    moved = manager.bytes_sent.get(key) if info.direction == "out" else None
    data["transferred"] = (
        info.size if info.state is TransferState.COMPLETE else moved or info.offset
    )
    data["moving"] = manager.moving(key)
    return data


def register_routes(app: web.Application, manager: TransferManager) -> None:
    """Add the ``/v1/files`` routes over ``manager`` (started and stopped by its owner)."""
    app[MANAGER_KEY] = manager

    def reply(data: Any, status: int = 200) -> web.Response:
        return web.Response(text=json.dumps(data), status=status, content_type="application/json")

    async def send(request: web.Request) -> web.Response:
        body = SendRequest.model_validate_json(await request.read())
        tid = await request.app[MANAGER_KEY].send_file(body.did, body.path, body.name)
        return reply({"id": tid}, 201)

    async def listing(request: web.Request) -> web.Response:
        manager = request.app[MANAGER_KEY]
        return reply([view(manager, i.tid) for i in manager.list()])

    async def one(request: web.Request) -> web.Response:
        return reply(view(request.app[MANAGER_KEY], parse_tid(request.match_info["tid"])))

    async def accept(request: web.Request) -> web.Response:
        manager = request.app[MANAGER_KEY]
        info = await manager.accept(parse_tid(request.match_info["tid"]))
        return reply(view(manager, info.tid))

    async def reject(request: web.Request) -> web.Response:
        manager = request.app[MANAGER_KEY]
        info = await manager.reject(parse_tid(request.match_info["tid"]))
        return reply(view(manager, info.tid))

    app.router.add_post("/v1/files", send)
    app.router.add_get("/v1/files", listing)
    app.router.add_get("/v1/files/{tid}", one)
    app.router.add_post("/v1/files/{tid}/accept", accept)
    app.router.add_post("/v1/files/{tid}/reject", reject)


def parse_tid(text: str) -> str:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise UsageError(f"transfer id must be 32 hex digits, got {text!r} ({len(text)})")
    return text.lower()
