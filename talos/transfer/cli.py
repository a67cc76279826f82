"""``talosd send-file`` / ``talosd files`` and the control-API routes behind them
(docs/PROTOCOL.md "File transfer").

Hooked in with one line each: ``register_routes(app, manager)`` in talos/api.py
(the manager itself is built, started and stopped by talos/daemon.py, with or
without the API) and ``register_cli(sub, add)`` in talos/cli.py. Settings come
from the optional ``<home>/transfer.json``
(:class:`~talos.transfer.manager.TransferConfig`); received files land in
``<home>/files/`` unless ``--files-dir`` or that file names another folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from talos.transfer.manager import TransferManager
from talos.transfer.protocol import TransferState, is_final

__all__ = ["register_cli", "register_routes"]

MANAGER_KEY: web.AppKey[TransferManager] = web.AppKey("transfers", TransferManager)


class SendRequest(BaseModel):
    """Body of ``POST /v1/files``."""

    model_config = ConfigDict(extra="forbid")

    did: str
    path: str
    name: str | None = None


def _view(manager: TransferManager, tid: str) -> dict[str, Any]:
    info = manager.get(tid)
    data = info.to_public()
    key = bytes.fromhex(info.tid)
    moved = manager.bytes_sent.get(key) if info.direction == "out" else manager.progress.get(key)
    data["transferred"] = (
        info.size if info.state is TransferState.COMPLETE else moved or info.offset
    )
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
        return reply([_view(manager, i.tid) for i in manager.list()])

    async def one(request: web.Request) -> web.Response:
        return reply(_view(request.app[MANAGER_KEY], request.match_info["tid"]))

    async def accept(request: web.Request) -> web.Response:
        manager = request.app[MANAGER_KEY]
        info = await manager.accept(_tid(request.match_info["tid"]))
        return reply(_view(manager, info.tid))

    async def reject(request: web.Request) -> web.Response:
        manager = request.app[MANAGER_KEY]
        info = await manager.reject(_tid(request.match_info["tid"]))
        return reply(_view(manager, info.tid))

    app.router.add_post("/v1/files", send)
    app.router.add_get("/v1/files", listing)
    app.router.add_get("/v1/files/{tid}", one)
    app.router.add_post("/v1/files/{tid}/accept", accept)
    app.router.add_post("/v1/files/{tid}/reject", reject)


def _tid(text: str) -> str:
    from talos_sdk.errors import UsageError

    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise UsageError(f"transfer id must be hex, got {text!r}") from None
    if len(raw) != 16:
        raise UsageError("transfer id must be 32 hex digits")
    return text.lower()


# --------------------------------------------------------------------------- CLI


def _client(args: argparse.Namespace) -> Any:
    from talos.client import ApiClient
    from talos.config import Home, default_home

    return ApiClient.for_home(Home(Path(args.home) if args.home else default_home()))


def cmd_send_file(args: argparse.Namespace) -> int:
    """``talosd send-file [--wait] DID PATH``."""
    client = _client(args)
    path = Path(args.path).resolve()
    tid = client.call("POST", "/v1/files", {"did": args.did, "path": str(path)})["id"]
    if not args.wait and not sys.stderr.isatty():
        print(tid)
        return 0
    deadline = time.monotonic() + args.timeout
    info = client.call("GET", f"/v1/files/{tid}")
    if sys.stderr.isatty():
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task(info["name"], total=max(info["size"], 1))
            while not is_final(TransferState(info["state"])) and time.monotonic() < deadline:
                bar.update(task, completed=min(info["transferred"], info["size"]))
                time.sleep(0.1)
                info = client.call("GET", f"/v1/files/{tid}")
    while args.wait and not is_final(TransferState(info["state"])):
        if time.monotonic() > deadline:
            print(
                f"talosd: error: transfer {tid} not finished after {args.timeout} s",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.05)
        info = client.call("GET", f"/v1/files/{tid}")
    print(tid)
    if args.wait and info["state"] != TransferState.COMPLETE.value:
        print(f"talosd: error: transfer {info['state']}: {info['error']}", file=sys.stderr)
        return 1
    return 0


def cmd_files(args: argparse.Namespace) -> int:
    """``talosd files [--json]`` / ``talosd files accept|reject ID``."""
    client = _client(args)
    if args.action in ("accept", "reject"):
        if not args.id:
            print(f"talosd: error: files {args.action} needs a transfer ID", file=sys.stderr)
            return 2
        info = client.call("POST", f"/v1/files/{args.id}/{args.action}", {})
        print(f"{info['tid']} {info['state']}")
        return 0
    rows = client.call("GET", "/v1/files")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        arrow = "<-" if r["direction"] == "in" else "->"
        print(
            f"{r['tid']} {arrow} {r['peer'][:24]}… {r['state']:9} {r['size']:>12} "
            f"{r['name']} {r['path'] if r['direction'] == 'in' else ''}".rstrip()
        )
    return 0


def register_cli(
    sub: Any, add: Callable[[str, str], argparse.ArgumentParser] | None = None
) -> None:
    """Add ``send-file`` and ``files`` to ``talosd``'s subparsers."""

    def make(name: str, text: str) -> argparse.ArgumentParser:
        if add is not None:
            return add(name, text)
        sp: argparse.ArgumentParser = sub.add_parser(name, help=text)
        sp.add_argument("--home", help="node home (default $TALOS_HOME or ~/.talos)")
        return sp

    sp = make("send-file", "stream a file to a peer (encrypted, resumable)")
    sp.add_argument("--wait", action="store_true", help="return once the peer verified it")
    sp.add_argument("--timeout", type=float, default=3600.0)
    sp.add_argument("did")
    sp.add_argument("path")
    sp.set_defaults(fn=cmd_send_file)
    sp = make("files", "transfers in and out; `files accept ID` accepts a pending one")
    sp.add_argument("action", nargs="?", choices=("list", "accept", "reject"), default="list")
    sp.add_argument("id", nargs="?")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_files)
