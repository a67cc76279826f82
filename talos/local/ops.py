"""What a local client may ask the running node (docs/PROTOCOL.md "Local clients").

Each op is ``async fn(node, args) -> JSON-able``; the local socket server and
``talosd mcp`` (when it runs the node in-process) call them alike, so an
attached client and an in-process one see the same answers. Errors are the
node's own (UsageError for bad input, TimeoutError, StorageFullError, ...);
:func:`error_json` turns them into the REPLY error object.
"""

from __future__ import annotations

import asyncio
import functools
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from talos import peer_names
from talos import pipeline as pl
from talos.chain.log import UnknownRecordError
from talos.config import configured_peer
from talos.local.log_ops import op_log_append, op_log_records
from talos.local.wire import MAX_LIMIT, MAX_SEND_WAIT, MAX_WAIT, SEND_WAIT
from talos.node_send import until_done
from talos.peer_refs import is_did
from talos_sdk.errors import (
    LinkRefusedError,
    PeerUnreachableError,
    StorageFullError,
    TalosError,
    UsageError,
)

if TYPE_CHECKING:
    from talos.node import Node
    from talos.node_send import Sending
    from talos.store import Txn

__all__ = ["OPS", "LocalHost", "error_json", "resolve", "run_op", "start_op_send"]


@dataclass(frozen=True, slots=True)
class LocalHost:
    """What the ops act on: the node and, in a daemon, its transfer manager."""

    node: Node
    transfers: Any = None  # talos.transfer.manager.TransferManager
    #: Peer name -> DID as last read from the store; cleared whenever an op names a peer
    #: (only ops write names while the node runs: the offline tools need its store lock).
    names: dict[str, str] = field(default_factory=dict)


Op = Callable[[LocalHost, dict[str, Any]], Awaitable[Any]]

_READ_KEY = b"inbox:read"
_U64 = struct.Struct(">Q")


def _str(args: dict[str, Any], key: str, *, optional: bool = False) -> Any:
    value = args.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise UsageError(f"{key!r} must be a non-empty string")
    return value


def _num(args: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = args.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"{key!r} must be a number")
    if not lo <= value <= hi:
        raise UsageError(f"{key!r} must be between {lo} and {hi}")
    return float(value)


def resolve(node: Node, ref: str) -> str:
    """A DID or a peer name -> DID (UnknownPeerNameError / DIDError otherwise)."""
    if is_did(ref):
        return _checked_did(ref)  # no store read: a DID stands for itself
    with node.store.read() as txn:
        return peer_names.resolve_peer(txn, ref)


@functools.lru_cache(maxsize=1024)
def _checked_did(did: str) -> str:
    """``did`` once its key parsed (DIDError otherwise); a DID is checked once, not per send."""
    return peer_names.resolve_peer_no_store(did)


def _names(node: Node) -> dict[str, str]:
    with node.store.read() as txn:
        return peer_names.names(txn)


def read_cursor(node: Node) -> int:
    with node.store.read() as txn:
        raw = txn.get("meta", _READ_KEY)
    return _U64.unpack(raw)[0] if raw is not None else 0


# --- ops ----------------------------------------------------------------------------------------


async def op_hello(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    # Every ready link, not only peers with an address: one that dialled in, or one
    # reached by DID through a relay, carries an attached proxy's tunnel as well.
    up = node.connected_peers()
    return {
        "did": node.did,
        "listen": node.listen_url,
        "max_frame": node.config.max_frame,
        "up": sorted(up),
        # Per linked peer: the largest app payload both nodes' frame bounds take.
        "max_payload": {d: node.max_app_payload(d) for d in up},
        # Per peer whose last link attempt was refused for good: why (talos/link/refusals.py).
        "refused": _refused(node),
    }


def _refused(node: Node) -> dict[str, str]:
    # Any peer's, not only those with an address: one reached by DID through a relay too.
    return {did: p.message(did) for did, p in node.link_problems() if p.decisive}


async def op_id(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    secrets = node.sessions.secrets
    return {
        "did": node.did,
        "x25519": secrets.identity.public.hex(),
        "suites": list(secrets.suites),
        "listen": node.listen_url,
    }


async def op_peers_list(host: LocalHost, args: dict[str, Any]) -> Any:
    """Every peer the node knows: by address, by name, allowed to link, or met on a link.

    A node that only accepts links has no address for the peers that dial it;
    they are listed all the same (``addr`` null), so its agents can find them.
    """
    node = host.node
    names = _names(node)
    known = node.known_peers()
    dids = set(known) | set(names) | node._allow | set(node._peers)  # names: DID -> name
    dids.discard(node.did)
    return [
        {
            "did": did,
            "name": names.get(did),
            "addr": known.get(did) or None,
            "connected": node.is_connected(did),
            "allowed": node.authorizer(did),  # may hold a link with this node
        }
        for did in sorted(dids)
    ]


async def op_peers_add(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    name = _str(args, "name", optional=True)
    if name is not None:
        peer_names.validate_name(name)
    peer = await node.add_peer(_str(args, "addr"))
    if name is not None:
        await node.writer.write(functools.partial(peer_names.set_name, did=peer.did, name=name))
        host.names.clear()  # after the commit: a send meanwhile may have cached the old
    return {
        "did": peer.did,
        "addr": str(peer),
        "name": name,
        "connected": node.is_connected(peer.did),
        "allowed": True,  # a peer added by address may link
    }


async def op_peers_name(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    did = resolve(node, _str(args, "peer"))
    name = peer_names.validate_name(_str(args, "name"))
    await node.writer.write(functools.partial(peer_names.set_name, did=did, name=name))
    host.names.clear()  # after the commit: a send meanwhile may have cached the old
    return {
        "did": did,
        "name": name,
        "connected": node.is_connected(did),
        "allowed": node.authorizer(did),
    }


async def op_peers_remove(host: LocalHost, args: dict[str, Any]) -> Any:
    """Forget a peer (talos/node_links.py remove_peer); its queued messages stay. Says
    whether the node's configuration names it (it is back at the next start) and
    whether it may still link (a local client's claim lends it the right)."""
    node = host.node
    did = resolve(node, _str(args, "peer"))
    queued = await node.remove_peer(did)
    host.names.clear()  # its name went with it
    return {
        "did": did,
        "queued": queued,
        "configured": configured_peer(node.config, did),
        "still_allowed": node.authorizer(did),
    }


async def op_peers_allow(host: LocalHost, args: dict[str, Any]) -> Any:
    """Allow the peer to link from now on, across restarts (until ``peers.remove``)."""
    node = host.node
    did = resolve(node, _str(args, "peer"))
    await node.allow_peer(did)
    return {"did": did}


async def op_peers_redial(host: LocalHost, args: dict[str, Any]) -> Any:
    """Dial the peer again now, skipping the backoff (its last refusal may be stale)."""
    node = host.node
    did = resolve(node, _str(args, "peer"))
    node.redial_now(did)
    return {"did": did}


async def op_resolve(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    return {"did": resolve(node, _str(args, "peer"))}


async def op_status(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    return node.status()


def _resolve_cached(host: LocalHost, ref: str) -> str:
    """:func:`resolve`, keeping names: a store read per send was 5 % of a sender's time."""
    did = host.names.get(ref)
    if did is None:
        did = resolve(host.node, ref)
        if not is_did(ref):
            host.names[ref] = did
    return did


def start_op_send(
    host: LocalHost, args: dict[str, Any], done: Callable[[Any, BaseException | None], None]
) -> Sending:
    """The ``send`` op without a task (the local socket's path, talos/node_send.py):
    ``done(result, None)`` or ``done(None, error)`` later; bad input raises here."""
    node = host.node
    did = _resolve_cached(host, _str(args, "to"))
    text = args.get("text")
    if not isinstance(text, str):
        raise UsageError("'text' must be a string")
    wait = bool(args.get("wait", False))
    timeout = _num(args, "timeout", SEND_WAIT, 0.001, MAX_SEND_WAIT)
    if wait:
        node.check_linkable(did)  # the wait could only time out: say why now

    def finished(msg_id: str | None, exc: BaseException | None) -> None:
        if exc is None:
            done({"id": msg_id, "to": did, "acked": wait}, None)
        elif wait and isinstance(exc, TimeoutError):
            done(None, node.not_acked(did, timeout))
        else:
            done(None, exc)

    return node.start_send(did, text, finished, wait=wait, timeout=timeout if wait else None)


async def op_send(host: LocalHost, args: dict[str, Any]) -> Any:
    return await until_done(lambda done: start_op_send(host, args, done))


async def op_outbox(host: LocalHost, args: dict[str, Any]) -> Any:
    """Queued messages per peer, their state, and why they do not move."""
    from talos.views import outbox_json

    node = host.node
    ref = _str(args, "peer", optional=True)
    return outbox_json(node, resolve(node, ref) if ref is not None else None)


async def op_outbox_drop(host: LocalHost, args: dict[str, Any]) -> Any:
    """Drop every message queued for ``peer`` that it has not acknowledged."""
    node = host.node
    return await node.drop_queued(resolve(node, _str(args, "peer")))


async def op_inbox(host: LocalHost, args: dict[str, Any]) -> Any:
    """Messages after ``after`` (default: the read cursor), waiting up to ``wait`` seconds."""
    node = host.node
    cursor = read_cursor(node)
    after = args.get("after")
    if after is None:
        after = cursor
    if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after < 2**64:
        raise UsageError("'after' must be a message number from 0 to 2**64-1")
    limit = int(_num(args, "limit", 50, 1, MAX_LIMIT))
    wait = _num(args, "wait", 0.0, 0.0, MAX_WAIT)
    # Only the page asked for is read and decoded (it was up to 1000 entries for 50).
    entries = await node.wait_inbox(after, wait, limit) if wait else node.inbox(after, limit)
    names = _names(node)
    # A page's texts fit half a local frame (pl.INBOX_PAGE_BYTES): the rest of each
    # entry is a few hundred bytes, so a whole page fits one frame.
    messages = [entry.to_json(names) for entry in pl.fit_page(entries)]
    with node.store.read() as txn:
        last = pl.last_inbox_n(txn)
    return {
        "messages": messages,
        "next": messages[-1]["n"] if messages else after,
        "read": cursor,
        "last": last,
    }


def _mark(txn: Txn, through: int) -> int:
    top = pl.last_inbox_n(txn)
    if through > top:
        # A cursor past the last message would hide every message still to come.
        raise UsageError(
            f"'through' ({through}) is past the last message in the inbox (n={top}): "
            "pass the n of a message you have read"
        )
    raw = txn.get("meta", _READ_KEY)
    now = max(_U64.unpack(raw)[0] if raw is not None else 0, through)
    txn.put("meta", _READ_KEY, _U64.pack(now))
    return now


async def op_mark_read(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    through = args.get("through")
    if isinstance(through, bool) or not isinstance(through, int) or through < 0:
        raise UsageError("'through' must be a non-negative integer (a message's n)")
    return {"read": await node.writer.write(functools.partial(_mark, through=through))}


async def op_inbox_prune(host: LocalHost, args: dict[str, Any]) -> Any:
    """Delete the inbox messages numbered up to ``through`` (their sender's share frees)."""
    through = args.get("through")
    if isinstance(through, bool) or not isinstance(through, int) or not 0 <= through < 2**64:
        raise UsageError("'through' must be a message number from 0 to 2**64-1")
    return {"pruned": await host.node.prune_inbox(through), "through": through}


async def op_chain_verify(host: LocalHost, args: dict[str, Any]) -> Any:
    from talos.views import node_verify_json

    return await asyncio.to_thread(node_verify_json, host.node)


async def op_chain_peer_heads(host: LocalHost, args: dict[str, Any]) -> Any:
    return await asyncio.to_thread(host.node.heads.peer_heads)


async def op_chain_show(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    from talos.views import block_json

    return [block_json(b) for b in node.log.iter_blocks()]


async def op_chain_proof(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    try:
        rid = bytes.fromhex(_str(args, "id"))
    except ValueError:
        raise UsageError("record id must be hex") from None
    return node.log.inclusion_proof(rid)


def _transfers(host: LocalHost) -> Any:
    if host.transfers is None:
        raise UsageError("file transfer is not running with this node")
    return host.transfers


async def op_files_send(host: LocalHost, args: dict[str, Any]) -> Any:
    node = host.node
    did = resolve(node, _str(args, "to"))
    path = Path(_str(args, "path")).expanduser().resolve()
    if path.is_dir():
        raise UsageError(f"{path} is a folder: send-file sends one file (archive the folder first)")
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    tid = await _transfers(host).send_file(did, str(path), _str(args, "name", optional=True))
    return _file_view(host, tid)


def _file_view(host: LocalHost, tid: str, names: dict[str, str] | None = None) -> dict[str, Any]:
    """A transfer as the HTTP route shows it, plus the peer's local name (None if unnamed)."""
    from talos.transfer.routes import view

    data = dict(view(_transfers(host), tid))
    data["peer_name"] = (names if names is not None else _names(host.node)).get(data["peer"])
    return data


async def op_files_list(host: LocalHost, args: dict[str, Any]) -> Any:
    manager = _transfers(host)
    names = _names(host.node)
    return [_file_view(host, i.tid, names) for i in manager.list()]


async def op_files_cancel(host: LocalHost, args: dict[str, Any]) -> Any:
    from talos.transfer.routes import parse_tid

    info = await _transfers(host).cancel(parse_tid(_str(args, "id")))
    return _file_view(host, info.tid)


async def op_files_accept(host: LocalHost, args: dict[str, Any]) -> Any:
    from talos.transfer.routes import parse_tid

    info = await _transfers(host).accept(parse_tid(_str(args, "id")))
    return _file_view(host, info.tid)


async def op_files_get(host: LocalHost, args: dict[str, Any]) -> Any:
    from talos.transfer.routes import parse_tid

    return _file_view(host, parse_tid(_str(args, "id")))


async def op_files_reject(host: LocalHost, args: dict[str, Any]) -> Any:
    from talos.transfer.routes import parse_tid

    info = await _transfers(host).reject(parse_tid(_str(args, "id")))
    return _file_view(host, info.tid)


OPS: dict[str, Op] = {
    "hello": op_hello,
    "id": op_id,
    "peers.list": op_peers_list,
    "peers.add": op_peers_add,
    "peers.name": op_peers_name,
    "peers.remove": op_peers_remove,
    "peers.allow": op_peers_allow,
    "peers.redial": op_peers_redial,
    "resolve": op_resolve,
    "status": op_status,
    "send": op_send,
    "inbox": op_inbox,
    "outbox": op_outbox,
    "outbox.drop": op_outbox_drop,
    "inbox.mark_read": op_mark_read,
    "inbox.prune": op_inbox_prune,
    "chain.verify": op_chain_verify,
    "chain.show": op_chain_show,
    "chain.peer_heads": op_chain_peer_heads,
    "chain.proof": op_chain_proof,
    "files.send": op_files_send,
    "files.list": op_files_list,
    "files.accept": op_files_accept,
    "files.cancel": op_files_cancel,
    "files.get": op_files_get,
    "files.reject": op_files_reject,
    "log.append": op_log_append,
    "log.records": op_log_records,
}


async def run_op(host: LocalHost, op: str, args: dict[str, Any]) -> Any:
    fn = OPS.get(op)
    if fn is None:
        raise UsageError(f"unknown local op {op!r}")
    return await fn(host, args)


#: REPLY error codes, first match wins: the specific classes before their TalosError root.
_ERROR_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (UnknownRecordError, "not_found"),
    (peer_names.UnknownPeerNameError, "not_found"),
    (UsageError, "usage"),
    (TimeoutError, "timeout"),
    (StorageFullError, "storage_full"),
    (LinkRefusedError, "refused"),
    (PeerUnreachableError, "unreachable"),
    (TalosError, "node"),
)


def error_json(exc: BaseException) -> dict[str, str]:
    """The REPLY error of a failed op: a code saying whose fault, and a message."""
    code = next((c for cls, c in _ERROR_CODES if isinstance(exc, cls)), "internal")
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    if code == "timeout" and not exc.args:
        message = "timed out"
    return {"code": code, "type": type(exc).__name__, "message": message}
