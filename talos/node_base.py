"""What the parts of a running node share (docs/ARCHITECTURE.md "Module map and contracts").

:class:`~talos.node.Node` is assembled from parts that each hold one
concern: the peers and their links' session setup and read loop (:mod:`talos.node_links`),
the message pipeline's asyncio side (:mod:`talos.node_delivery`), the app
channels (:mod:`talos.node_apps`) and the lifecycle plus the public contract
(:mod:`talos.node`). They share the state declared here;
the rules themselves live in the sans-I/O :class:`~talos.peer_pipeline.PeerPipeline`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from talos.chain.block import Record
from talos.chain.log import BlockLog
from talos.config import NodeConfig
from talos.discovery import Resolver
from talos.link.peer import Link, LinkSettings
from talos.link.refusals import LinkProblems
from talos.link.supervisor import LinkSupervisor
from talos.metrics import Metrics
from talos.peer_pipeline import PeerPipeline
from talos.pipeline import OutboxEntry
from talos.sessions import Opened, SessionManager
from talos.store import Store
from talos_sdk.wallet import Wallet

if TYPE_CHECKING:
    from talos.writer import StoreWriter

__all__ = ["AppHandler", "Incoming", "LinkCallback", "NodeBase", "Peer"]

AppHandler = Callable[[str, bytes], Awaitable[None] | None]
LinkCallback = Callable[[str, bool], None]
#: Told once when a send's outbox row committed (None) or failed to (talos/node_send.py).
OnCommitted = Callable[[BaseException | None], None]


@dataclass(slots=True)
class Incoming:
    """An opened message waiting for the next receive commit, and its inbox row."""

    peer: str
    opened: Opened
    row: bytes


@dataclass(slots=True)
class Peer(PeerPipeline):
    """One peer: its sans-I/O message pipeline plus the link and the events tasks wait on."""

    link: Link | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pumping: bool = False
    dirty: bool = False
    #: Bytes of this peer's inbox rows: stored, and accepted for the next commit.
    inbox_bytes: int = 0
    #: The store's pruned mark when ``inbox_bytes`` was read (Node.prune_inbox).
    inbox_pruned: int = 0
    over_share: bool = False  # its messages wait at its end (logged once)


class NodeBase:
    """State shared by the node's parts (assigned by ``Node.__init__`` and ``Node.start``)."""

    did: str
    wallet: Wallet
    config: NodeConfig
    metrics: Metrics
    sessions: SessionManager
    store: Store
    log: BlockLog
    settings: LinkSettings
    resolver: Resolver
    authorizer: Callable[[str], bool]
    relay: Any
    links: LinkSupervisor
    started: bool
    _clock: Callable[[], float]
    _peers: dict[str, Peer]
    _known: dict[str, str]  # DID -> address ("" when only allowed)
    _allow: set[str]
    _stopping: bool
    _epoch: int
    _apps: dict[str, AppHandler]
    _link_callbacks: list[LinkCallback]
    _link_tasks: set[asyncio.Task[Any]]
    #: The supervisor's latest refusal / failed dial per peer (talos/link/refusals.py),
    #: and who hears of every one.
    _problems: LinkProblems
    _problem_callbacks: list[Callable[[str, Any], None]]
    _incoming: list[Incoming]
    _outgoing: list[tuple[OutboxEntry, OnCommitted, bool]]  # row, its caller, needs fsync
    _outbox_busy: bool
    _acks: dict[str, tuple[int, list[Record]]]  # per peer: highest ack, records to log
    _write_timer: asyncio.TimerHandle | None  # deferred ack writes and wait-send rows
    _committing: bool
    #: When the last receive commit started, and the time before which the node counts
    #: as receiving back to back: its end plus its length (time.monotonic(); ADR 0017).
    _commit_began: float
    _quiet_after: float
    #: Why the last receive commit failed (cleared by the next one that succeeds).
    storage_error: str | None
    _inbox_event: asyncio.Event

    if TYPE_CHECKING:
        # Defined by one part, used by another.
        @property
        def writer(self) -> StoreWriter: ...

        def _peer(self, did: str) -> Peer: ...

        def _spawn(self, coro: Awaitable[Any]) -> None: ...

        def _kick(self, peer: Peer) -> None: ...

        def _on_msg(self, peer: Peer, frame: Any) -> None: ...

        def _on_ack(self, peer: Peer, seq: int) -> None: ...

        def _on_defer(self, peer: Peer, frame: Any) -> None: ...

        def _check_recipient(self, did: str) -> None: ...

        async def pin_peer_key(self, did: str, key: bytes) -> None: ...

        def _notify_link(self, did: str, up: bool) -> None: ...

        async def _on_app(self, peer: Peer, frame: Any) -> None: ...

        def redial_now(self, did: str) -> None: ...

        def link_problem(self, did: str) -> Any: ...
