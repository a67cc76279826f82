"""Peer discovery: where a DID can be dialled (docs/DESIGN.md "Discovery and scale").

The node asks one small interface, ``resolve(did) -> addresses``, so sources
can be added without touching the pipeline. An address is ``ws://HOST:PORT``
(or ``wss://``) without the ``#DID`` fragment: the DID is the question, not
part of the answer. Sources here:

* :class:`StaticResolver` — the peers table / ``--peer`` (operator's word);
* :class:`LearnedResolver` — addresses learned from authenticated peers
  (today: the address we dialled and the handshake proved), bounded, newest
  first;
* :class:`ChainResolver` — asks each source in order, concatenates, drops
  repeats.

LAN discovery (mDNS) and a DHT plug in later as further resolvers.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Final, Protocol, runtime_checkable

from talos.peer_refs import host_port_url
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import UsageError

__all__ = [
    "SOURCE_ANNOUNCED",
    "SOURCE_DIALLED",
    "SOURCE_STATIC",
    "BadAddressError",
    "ChainResolver",
    "LearnedResolver",
    "Resolver",
    "StaticResolver",
    "normalize_address",
]

#: The operator configured it (``--peer``, ``talosd peers add``).
SOURCE_STATIC: Final = "static"
#: We dialled it and the peer proved the DID in the link handshake.
SOURCE_DIALLED: Final = "dialled"
#: An authenticated peer told us its own listen address.
SOURCE_ANNOUNCED: Final = "announced"

_LEARNED_SOURCES: Final = frozenset({SOURCE_DIALLED, SOURCE_ANNOUNCED})


class BadAddressError(UsageError):
    """Not a dialable ``ws://HOST:PORT`` address (or an unknown source)."""


@runtime_checkable
class Resolver(Protocol):
    """Where a DID can be dialled; ``learn`` feeds back what worked."""

    def resolve(self, did: str) -> list[str]:
        """Addresses to try for ``did``, best first (may be empty)."""
        ...

    def learn(self, did: str, addr: str, source: str) -> None:
        """Note that ``did`` was reachable at ``addr`` (a resolver may ignore it)."""
        ...


def normalize_address(addr: str) -> str:
    """``ws://HOST:PORT`` from ``addr``; a ``#DID`` fragment is dropped.

    Raises :class:`BadAddressError` for anything that cannot be dialled.
    """
    if not isinstance(addr, str):
        raise BadAddressError(f"address must be a string, got {type(addr).__name__}")
    parts = host_port_url(
        addr, ("ws", "wss"), "address", "address must look like ws://HOST:PORT", BadAddressError
    )
    if parts.path not in ("", "/") or parts.query:
        raise BadAddressError(f"address must not carry a path or query: {addr!r}")
    return f"{parts.scheme}://{parts.netloc}"


def _unique(addrs: list[str]) -> list[str]:
    return list(dict.fromkeys(addrs))


class StaticResolver:
    """Addresses the operator configured: the node's peers table (DID -> ``ws://...#DID``).

    ``peers`` is a mapping or a zero-argument callable returning one, so the
    resolver follows a table the node replaces or edits while running.
    ``learn`` keeps only ``SOURCE_STATIC`` entries (in its own overlay).
    """

    def __init__(
        self, peers: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None
    ) -> None:
        self._peers = peers if peers is not None else {}
        self._extra: dict[str, list[str]] = {}

    def _table(self) -> Mapping[str, str]:
        return self._peers() if callable(self._peers) else self._peers

    def resolve(self, did: str) -> list[str]:
        out: list[str] = []
        row = self._table().get(did)
        if row:  # "" marks a peer that is only allowed, not dialable
            with contextlib.suppress(BadAddressError):  # a stale bad row must not hide the rest
                out.append(normalize_address(row))
        return _unique(out + self._extra.get(did, []))

    def learn(self, did: str, addr: str, source: str) -> None:
        if source != SOURCE_STATIC:
            return
        public_key_from_did(did)
        url = normalize_address(addr)
        known = self._extra.setdefault(did, [])
        if url not in known:
            known.append(url)


class LearnedResolver:
    """Addresses learned from authenticated peers, newest first, bounded.

    At most ``max_peers`` DIDs (least recently learned dropped first) and
    ``max_per_peer`` addresses each, so a chatty or hostile peer cannot grow
    the table without limit.
    """

    def __init__(self, max_peers: int = 1024, max_per_peer: int = 4) -> None:
        if max_peers < 1 or max_per_peer < 1:
            raise UsageError("max_peers and max_per_peer must be at least 1")
        self.max_peers = max_peers
        self.max_per_peer = max_per_peer
        self._addrs: OrderedDict[str, list[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._addrs)

    def resolve(self, did: str) -> list[str]:
        return list(self._addrs.get(did, ()))

    def learn(self, did: str, addr: str, source: str) -> None:
        if source == SOURCE_STATIC:
            return  # the static source keeps those
        if source not in _LEARNED_SOURCES:
            raise BadAddressError(f"unknown address source {source!r}")
        public_key_from_did(did)
        url = normalize_address(addr)
        known = [a for a in self._addrs.pop(did, []) if a != url]
        self._addrs[did] = [url, *known][: self.max_per_peer]
        while len(self._addrs) > self.max_peers:
            self._addrs.popitem(last=False)

    def forget(self, did: str) -> None:
        """Drop everything learned about ``did``."""
        self._addrs.pop(did, None)


class ChainResolver:
    """Ask each resolver in order; concatenate their answers without repeats."""

    def __init__(self, *resolvers: Resolver) -> None:
        self.resolvers = resolvers

    def resolve(self, did: str) -> list[str]:
        return _unique([a for r in self.resolvers for a in r.resolve(did)])

    def forget(self, did: str) -> None:
        """Drop what each resolver that learns has learned about ``did``."""
        for r in self.resolvers:
            forget = getattr(r, "forget", None)
            if forget is not None:
                forget(did)

    def learn(self, did: str, addr: str, source: str) -> None:
        for r in self.resolvers:
            r.learn(did, addr, source)
