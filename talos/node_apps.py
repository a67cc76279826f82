"""The node's app channels: the app-host protocol (talos/apphost.py) over its links.

Named channels that services (file transfer, the MCP tunnel, head gossip)
register; their payloads are sealed with the peer's session and travel in
link order, not durably (docs/PROTOCOL.md "Link protocol", App channels). Part
of :class:`~talos.node.Node` (see :mod:`talos.node_base`).
"""

from __future__ import annotations

import inspect
import logging

from websockets.exceptions import ConnectionClosed

from talos.link import wire
from talos.logging import event
from talos.node_base import AppHandler, LinkCallback, NodeBase, Peer
from talos.pipeline import text_limit
from talos_sdk.errors import ProtocolError, TalosError, UsageError

__all__ = ["ConnectTimeoutError", "NodeApps", "NotConnectedError"]

_log = logging.getLogger("talos.node")
#: The link frame type byte of APP (docs/PROTOCOL.md "Link protocol").
_APP = b"\x30"


class NotConnectedError(TalosError, ConnectionError):
    """No authenticated link with a ready session to that peer right now."""


class ConnectTimeoutError(NotConnectedError, TimeoutError):
    """``wait_connected`` gave up."""


class NodeApps(NodeBase):
    """Register channels, send on them, hear about links (an :class:`~talos.apphost.AppHost`)."""

    def register_app(self, name: str, handler: AppHandler) -> None:
        """Deliver app frames named ``name`` to ``handler(peer_did, payload)`` in link order."""
        if not name or len(name.encode()) > 255:
            raise UsageError("app channel name must be 1..255 bytes")
        self._apps[name] = handler

    async def send_app(self, did: str, name: str, payload: bytes) -> None:
        """Seal ``payload`` with the peer's session and send it now (ordered, not durable)."""
        peer = self._peers.get(did)
        link = peer.link if peer is not None else None
        if peer is None or link is None or not peer.ready.is_set():
            raise NotConnectedError(f"no link with {did}")
        body = self.sessions.seal_app(did, name, payload)
        if len(body) > self.config.max_frame:
            raise UsageError(f"app payload above the {self.config.max_frame}-byte frame bound")
        try:
            await link.send(_APP + body)
        except ConnectionClosed:
            raise NotConnectedError(f"link with {did} closed") from None

    def max_app_payload(self, did: str | None = None) -> int:
        """The largest payload :meth:`send_app` takes for ``did`` (the smaller of both
        nodes' frame bounds, minus what sealing adds; ours alone for None)."""
        peer = self._peers.get(did) if did is not None else None
        if peer is not None:
            return peer.text_limit()
        return text_limit(self.config.max_frame)

    def try_send_app(self, did: str, name: str, payload: bytes) -> bool:
        """:meth:`send_app` without waiting: False (nothing sealed or sent) if the link is busy.

        For callbacks on the hot path (the MCP tunnel): the frame leaves from the
        caller, no task hop. Raises like :meth:`send_app` when there is no link.
        """
        peer = self._peers.get(did)
        link = peer.link if peer is not None else None
        if peer is None or link is None or not peer.ready.is_set():
            raise NotConnectedError(f"no link with {did}")
        if not link.writable:
            return False
        body = self.sessions.seal_app(did, name, payload)
        if len(body) > self.config.max_frame:
            raise UsageError(f"app payload above the {self.config.max_frame}-byte frame bound")
        try:
            sent = link.send_nowait(_APP + body)
        except ConnectionClosed:
            raise NotConnectedError(f"link with {did} closed") from None
        assert sent  # writable was checked and nothing ran in between
        return True

    def on_link_change(self, callback: LinkCallback) -> None:
        """Call ``callback(did, up)`` whenever a peer's session becomes ready or goes away."""
        self._link_callbacks.append(callback)

    def is_connected(self, did: str) -> bool:
        peer = self._peers.get(did)
        return peer is not None and peer.ready.is_set()

    def connected_peers(self) -> list[str]:
        """Every peer with a ready link: dialled, dialled in, or through a relay."""
        return [did for did, peer in self._peers.items() if peer.ready.is_set()]

    def channel_binding(self, did: str) -> bytes:
        """The handshake hash of the current link to ``did`` (b"" without one).

        What a token sent over the link is bound to
        (docs/PROTOCOL.md "Link protocol", Link handshake).
        """
        peer = self._peers.get(did)
        link = peer.link if peer is not None else None
        return link.transcript_hash if link is not None else b""

    def peer_host(self, did: str) -> str | None:
        """The IP address of the current direct link to ``did``; None over a relay or
        without a link. The one address a peer's request to be dialled may name."""
        peer = self._peers.get(did)
        link = peer.link if peer is not None else None
        return link.remote_host if link is not None else None

    def _notify_link(self, did: str, up: bool) -> None:
        for cb in list(self._link_callbacks):
            try:
                cb(did, up)
            except Exception as exc:
                event(_log, "link_callback_failed", level=logging.ERROR, error=repr(exc))

    async def _on_app(self, peer: Peer, frame: wire.App) -> None:
        name, payload = self.sessions.open_app(peer.did, frame.body)
        handler = self._apps.get(name)
        if handler is None:
            raise ProtocolError(f"no app channel named {name!r}")
        self.metrics.inc("app_frames_in")
        result = handler(peer.did, payload)
        if inspect.isawaitable(result):
            await result
        # What arrived has been handed on: the reply is being made elsewhere (an agent,
        # a tool). Ratchet now rather than when that reply is sealed, which takes the
        # key pair + DH (~2/3 of a turn's ratchet cost) off the round trip.
        self.sessions.prepare_send(peer.did)
