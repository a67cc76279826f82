"""A proxy attached to the running talosd of its home (docs/adr/0012-local-clients.md).

When ``talosd run`` (or any node with a local socket) already runs on the
home, ``talos-proxy connect|serve`` use its identity and links through
:class:`AttachedTransport` instead of opening the store themselves, so any
number of agents share one node. A connecting proxy claims the ``mcp`` channel
*keyed*: the node allots it a range of tunnel session ids (the u32 at
:data:`SESSION_OFFSET` of every tunnel frame) from its half of the id space
toward that peer, and routes the serving peer's frames in that range to it
alone; its own tool sessions are therefore its own, on both sides, and never
collide with sessions the peer's own attached agents open toward this node. A
serving proxy claims the channel unkeyed and gets the rest; its callers may
link to the node while it is attached (the claim lends them ``allow``).

Stopping an attached proxy leaves the node running. When the node stops, every
link reads as down (pending requests are answered with an error by the tunnel
client) and :attr:`AttachedTransport.gone` says why, so the proxy can exit with
that message; until it leaves, the node still answers its calls (a serve
writes the audit of the sessions that ended with the node).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from mcp_proxy.transport import (
    APP_NAME,
    MAX_BATCH_BYTES,
    LinkListener,
    Receiver,
    RefusalListener,
)
from talos.link.refusals import MAX_PROBLEMS
from talos.local.client import LocalClient, NoNodeError
from talos.pipeline import text_limit

__all__ = ["SESSION_OFFSET", "AttachedTransport", "attach", "resolve_names"]

#: Where a tunnel frame carries its session id: version:u8 kind:u8 session:u32 (tunnel_wire).
SESSION_OFFSET = 2


class AttachedTransport:
    """A :class:`~mcp_proxy.transport.TunnelTransport` over the node's local socket."""

    def __init__(self, client: LocalClient, app: str = APP_NAME) -> None:
        self.client = client
        self.app = app
        self.did = client.did
        self.first_sid = 1
        self.sid_end = 1 << 20  # mcp_proxy.client.EMBEDDED_SID_END until a keyed claim
        self._up: set[str] = set(client.hello.get("up", ()))
        # Until a peer's bound is known, ours: what send_app refuses above anyway.
        self._own_bound = text_limit(int(client.hello["max_frame"]))
        self._bounds: dict[str, int] = {
            str(did): int(n) for did, n in client.hello.get("max_payload", {}).items()
        }
        self._listeners: list[LinkListener] = []
        self._refusal_listeners: list[RefusalListener] = []
        # Peers whose last link attempt was refused for good: DID -> why (talos/link/refusals.py).
        self._refused: dict[str, str] = dict(client.hello.get("refused", {}))
        self._problems: dict[str, str] = dict(self._refused)
        self._redials: set[asyncio.Task[Any]] = set()
        self._receiver: Receiver | None = None
        client.on_event(self._on_event)
        client.set_app_receiver(self._on_app)

    async def claim(self, peer: str | None, *, keyed: bool, allow: list[str] | None = None) -> None:
        """Receive the channel's frames: of ``peer`` in our own session range, or the rest.

        ``allow``: DIDs the node lets link while we are attached (a serve's callers).
        """
        args: dict[str, Any] = {"channel": self.app}
        if peer is not None:
            args["peer"] = peer
        if keyed:
            args["key_offset"] = SESSION_OFFSET
        if allow:
            args["allow"] = allow
        got = await self.client.call("app.claim", **args)
        if keyed:
            self.first_sid, self.sid_end = int(got["lo"]), int(got["hi"])

    @property
    def gone(self) -> asyncio.Future[str]:
        """Resolves with the reason once the node stops (or closed our connection)."""
        return self.client.stopping

    def max_payload_for(self, peer: str) -> int:
        # The node says the peer's bound with the link (hello, link-up event).
        return min(MAX_BATCH_BYTES, self._bounds.get(peer, self._own_bound))

    async def send(self, peer: str, payload: bytes) -> None:
        await self.client.send_app(self.app, peer, payload)

    def send_nowait(self, peer: str, payload: bytes) -> bool:
        return self.client.send_app_nowait(self.app, peer, payload)

    def set_receiver(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def add_link_listener(self, listener: LinkListener) -> None:
        self._listeners.append(listener)

    def is_up(self, peer: str) -> bool:
        return peer in self._up and not self.client.stopping.done()

    def add_refusal_listener(self, listener: RefusalListener) -> None:
        self._refusal_listeners.append(listener)

    def refusal(self, peer: str) -> str | None:
        return self._refused.get(peer)

    def problem(self, peer: str) -> str | None:
        return self._problems.get(peer)

    def redial(self, peer: str) -> None:
        if self.client.gone.done():
            return
        task = asyncio.ensure_future(self.client.call("peers.redial", peer=peer))
        self._redials.add(task)
        task.add_done_callback(self._redialled)

    def _redialled(self, task: asyncio.Task[Any]) -> None:
        self._redials.discard(task)
        if not task.cancelled():
            task.exception()  # a node that went meanwhile: the link events say so

    def _on_app(self, channel: str, peer: str, payload: bytes) -> Awaitable[None] | None:
        if channel == self.app and self._receiver is not None:
            return self._receiver(peer, payload)
        return None

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "link":
            did, up = str(event.get("did")), bool(event.get("up"))
            if up:
                self._up.add(did)
                self._refused.pop(did, None)
                self._problems.pop(did, None)
                if "max_payload" in event:
                    self._bounds[did] = int(event["max_payload"])
            else:
                self._up.discard(did)
            self._tell(did, up)
        elif kind == "link_problem":
            did, message = str(event.get("did")), str(event.get("message"))
            # What this node found dialling: a stranger's inbound attempt under a claimed
            # DID says nothing about that peer (talos/link/refusals.py), and is unbounded.
            if event.get("direction") == "dial":
                self._problems.pop(did, None)
                self._problems[did] = message
                while len(self._problems) > MAX_PROBLEMS:
                    del self._problems[next(iter(self._problems))]
            if not event.get("decisive"):
                return
            self._refused[did] = message
            for refusal_listener in list(self._refusal_listeners):
                refusal_listener(did, message)
        elif kind == "stopping":
            down, self._up = self._up, set()
            for did in down:
                self._tell(did, False)

    def _tell(self, did: str, up: bool) -> None:
        for listener in list(self._listeners):
            listener(did, up)

    async def close(self) -> None:
        self._listeners.clear()  # our own leaving is no link going down
        self._refusal_listeners.clear()
        for task in list(self._redials):
            task.cancel()
        await self.client.close()


async def attach(home: Path) -> AttachedTransport | None:
    """The transport of the node running on ``home``, or None when none runs there."""
    try:
        client = await LocalClient.connect(home, watch=True)
    except NoNodeError:
        return None
    return AttachedTransport(client)


def resolve_names(home: Path, refs: list[str]) -> list[str]:
    """``--allow`` entries as DIDs: a peer name is looked up in the home's node (local names)."""
    from talos.config import Home
    from talos.local.call import call
    from talos.peer_names import UnknownPeerNameError, is_did, offline_resolve

    out = []
    for ref in refs:
        if is_did(ref):
            out.append(ref)
            continue
        if not Home(home).exists():
            raise UnknownPeerNameError(f"unknown peer name {ref!r}: {home} has no node yet")
        try:
            out.append(str(call(home, "resolve", {"peer": ref})["did"]))
        except NoNodeError:
            out.append(offline_resolve(home, ref))
    return out
