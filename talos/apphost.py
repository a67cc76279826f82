"""The app-host protocol: what a service on the node's app channel may use
(docs/ARCHITECTURE.md "Module map and contracts").

File transfer (talos/transfer/), the MCP tunnel (mcp_proxy/transport.py) and
head gossip (talos/chain/head_gossip.py) are all *app-channel services*: they
register a named channel, send sealed payloads to linked peers in link
order (not durable: a service that needs durability keeps its own rows), hear
when a peer's session comes up or goes away (and why a link was refused), and
write the store only through
the node's one writer. :class:`~talos.node.Node` implements this protocol;
tests implement it with in-process pairs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from talos.chain.log import BlockLog
from talos.store import Store
from talos.writer import StoreWriter

__all__ = ["AppHandler", "AppHost", "LinkCallback"]

#: ``handler(peer_did, payload)``; an awaitable result holds the link's next frame
#: until it is done (a service's backpressure).
AppHandler = Callable[[str, bytes], Awaitable[None] | None]
#: ``callback(peer_did, up)``: a peer's session became ready (True) or went away.
LinkCallback = Callable[[str, bool], None]


class AppHost(Protocol):
    """A node as its app-channel services see it."""

    @property
    def did(self) -> str: ...

    @property
    def store(self) -> Store:
        """For reads; every write goes through :attr:`writer`."""
        ...

    @property
    def writer(self) -> StoreWriter: ...

    @property
    def log(self) -> BlockLog: ...

    def register_app(self, name: str, handler: AppHandler) -> None: ...

    async def send_app(self, did: str, name: str, payload: bytes) -> None:
        """Seal and send now; ``NotConnectedError`` without a ready link."""
        ...

    def try_send_app(self, did: str, name: str, payload: bytes) -> bool:
        """Send without waiting; False (nothing sealed or sent) if the link is busy."""
        ...

    def max_app_payload(self, did: str | None = None) -> int:
        """The largest payload :meth:`send_app` takes for ``did``: the smaller of both
        nodes' frame bounds (only ours while the peer has not said, or for None),
        minus what sealing adds."""
        ...

    def on_link_change(self, callback: LinkCallback) -> None: ...

    def is_connected(self, did: str) -> bool: ...

    def on_link_problem(self, callback: Callable[[str, Any], None]) -> None:
        """``callback(did, problem)`` at each refused link or failed dial
        (a :class:`talos.link.refusals.LinkProblem`)."""
        ...

    def link_problem(self, did: str) -> Any:
        """The latest refusal or failed dial of ``did`` since its last ready link, or None."""
        ...

    def redial_now(self, did: str) -> None:
        """Dial ``did`` again at once if its last attempt failed (the refusal may be stale)."""
        ...

    def channel_binding(self, did: str) -> bytes:
        """The current link's handshake hash (b"" without a link): what tokens bind to."""
        ...

    def peer_host(self, did: str) -> str | None:
        """The IP address of the current direct link to ``did`` (None via a relay)."""
        ...
