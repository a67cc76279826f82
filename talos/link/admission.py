"""Link admission and the duplicate-link rule, pure (docs/PROTOCOL.md "Link protocol", Admission).

An inbound WebSocket may hold buffers and CPU before it proves anything, so
:class:`Admission` bounds the handshakes in flight in total and per source
address (more get close code 1013, "try again later"). :func:`keep_new_link`
(over :func:`prefer_new_link`) is the rule both ends of a doubled link apply
alike, and :class:`Backoff` the dialler's delay, which only a link that
reached a ready session resets. The asyncio side is talos/link/supervisor.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from talos.link.handshake import Role

__all__ = ["Admission", "Backoff", "LinkFacts", "keep_new_link", "prefer_new_link"]


@dataclass(slots=True)
class Admission:
    """Counts of handshakes in flight; ``enter`` says whether one more may start."""

    max_total: int
    max_per_address: int
    total: int = 0
    by_address: dict[str, int] = field(default_factory=dict)

    def enter(self, address: str) -> bool:
        """Admit one handshake from ``address`` (False: refuse it, nothing counted)."""
        if self.total >= self.max_total or self.by_address.get(address, 0) >= self.max_per_address:
            return False
        self.total += 1
        self.by_address[address] = self.by_address.get(address, 0) + 1
        return True

    def leave(self, address: str) -> None:
        """The handshake admitted for ``address`` ended (either way)."""
        self.total -= 1
        left = self.by_address[address] - 1
        if left:
            self.by_address[address] = left
        else:
            del self.by_address[address]


def prefer_new_link(
    our_did: str,
    peer_did: str,
    new_dialler: str,
    old_dialler: str,
    new_direct: bool = True,
    old_direct: bool = True,
) -> bool:
    """Whether a new link to ``peer_did`` replaces the open one; both sides decide alike.

    A direct link beats a relayed one; a redial by the same side replaces a
    link that died without us noticing; of two links dialled by opposite
    sides, the one the smaller DID dialled stays.
    """
    if new_direct != old_direct:
        return new_direct
    if new_dialler == old_dialler:
        return True
    return new_dialler == min(our_did, peer_did)


class LinkFacts(Protocol):
    """What the duplicate-link rule reads of a link (talos.link.peer.Link has it)."""

    @property
    def peer_did(self) -> str: ...

    @property
    def role(self) -> Role: ...

    @property
    def via(self) -> str: ...


def keep_new_link(our_did: str, new: LinkFacts, old: LinkFacts) -> bool:
    """Whether ``new`` replaces the open ``old`` link to the same peer (:func:`prefer_new_link`).

    Who dialled a link follows from our role in it: the initiator dialled.
    """

    def dialler(link: LinkFacts) -> str:
        return our_did if link.role is Role.INITIATOR else link.peer_did

    return prefer_new_link(
        our_did,
        new.peer_did,
        dialler(new),
        dialler(old),
        new.via == "direct",
        old.via == "direct",
    )


@dataclass(slots=True)
class Backoff:
    """Exponential backoff, capped; the caller adds jitter (a random 0.5-1 x delay)."""

    initial: float
    maximum: float
    delay: float = 0.0

    def __post_init__(self) -> None:
        self.delay = self.initial

    def failed(self) -> float:
        """A dial, handshake or session setup failed: the delay to wait now."""
        current = self.delay
        self.delay = min(self.delay * 2, self.maximum)
        return current

    def ready(self) -> None:
        """A link reached a ready session: start over from the initial delay."""
        self.delay = self.initial
