"""Why a peer has no link, or takes no messages: refusals, failed dials, deferrals, in words.

docs/PROTOCOL.md "Link protocol" (close codes) and docs/operations.md
("Why a message does not move"). Pure: the node (talos/node_links.py) hands
in what happened and the wall clock; this module keeps the latest problem per
peer, bounded, and turns close codes into sentences. A problem is cleared when
a link to that peer reaches a ready session.

A refusal seen while *dialling* (the peer refused us, or we refused what
answered at its address) is the node's own knowledge of that peer; a refusal
of an *inbound* handshake only names the DID the stranger claimed, so it is
shown but never fails a waiting sender (:attr:`LinkProblem.decisive`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final, Literal

from talos.link.wire import DEFER_FAILING, DEFER_FULL

__all__ = [
    "BY_PEER",
    "BY_US",
    "DEFER_WHY",
    "DEFINITE",
    "MAX_PROBLEMS",
    "UNREACHABLE",
    "LinkProblem",
    "LinkProblems",
    "our_refusal_text",
    "peer_refusal_text",
]

#: A DEFER frame's reason (docs/PROTOCOL.md "Link protocol") as the sender's outbox
#: and log say it: the link is up, the peer cannot store what it is sent.
DEFER_WHY: Final = {
    DEFER_FULL: "the peer cannot store messages: its store is full (they stay queued here)",
    DEFER_FAILING: "the peer cannot store messages: its storage fails (they stay queued here)",
}

Kind = Literal["refused_by_peer", "refused_by_us", "unreachable"]
BY_PEER: Final = "refused_by_peer"
BY_US: Final = "refused_by_us"
UNREACHABLE: Final = "unreachable"

#: Close codes that are a decision about this pair of nodes, not a passing state:
#: a redial gets the same answer until someone changes a configuration. Not 4000 or
#: 4001 (a malformed or unauthenticated handshake message, a handshake timeout): a
#: network attacker, or a broken path, causes those at will for as long as it likes.
DEFINITE: Final = frozenset({4003, 4004, 4005, 4008, 4009})
#: Peers remembered at most (a stranger may claim any number of DIDs).
MAX_PROBLEMS: Final = 256

# What the refusing side's close code means, said from the refused side.
_BY_PEER: Final = {
    4000: "protocol error during the link handshake",
    4001: "this node's handshake did not authenticate",
    4003: "this node is not on its allow list"
    " (its operator allows it with --allow DID or talosd peers allow DID)",
    4004: "it is not the DID this node expected",
    4005: "no session suite in common",
    4006: "a duplicate link",
    4007: "it is shutting down",
    4008: "its pin for this node's ML-DSA-65 key does not match (downgrade refused)",
    4009: "it requires post-quantum (hybrid ML-DSA-65) authentication",
    1013: "too many link handshakes in progress there; retrying",
}
# The same codes when this node refused.
_BY_US: Final = {
    4000: "protocol error during the link handshake",
    4001: "its handshake did not authenticate",
    4003: "it is not on this node's allow list (talosd peers allow DID, or talosd run --allow DID)",
    4004: "the node at that address has another DID",
    4005: "no session suite in common",
    4008: "it does not match the ML-DSA-65 key pinned for it (downgrade refused)",
    4009: "this node requires post-quantum authentication (--require-pq)",
    1013: "too many link handshakes in progress here",
}


# The head of a problem's sentence per kind: naming the peer, and without its DID.
_HEADS: Final[dict[str, tuple[str, str]]] = {
    BY_PEER: ("{did} refused the link", "link refused by peer"),
    BY_US: ("this node refused the link with {did}", "link refused by this node"),
    UNREACHABLE: ("{did} is unreachable", "peer unreachable"),
}


def peer_refusal_text(code: int, reason: str) -> str:
    """Why the peer refused us: the table's words, else the peer's own close reason."""
    return _BY_PEER.get(code) or reason or f"close code {code}"


def our_refusal_text(code: int, reason: str) -> str:
    """Why this node refused the peer."""
    return _BY_US.get(code) or reason or f"close code {code}"


@dataclass(frozen=True, slots=True)
class LinkProblem:
    """The latest reason a peer has no link: a refusal (either way) or a failed dial."""

    kind: Kind
    #: Human words (close code table above, or the dial error).
    reason: str
    at_ms: int
    #: The WebSocket close code of a refusal; None for a failed dial.
    code: int | None = None
    #: "dial" (we dialled the peer) or "accept" (the peer dialled us).
    direction: str = "dial"

    @property
    def refused(self) -> bool:
        return self.kind != UNREACHABLE

    @property
    def decisive(self) -> bool:
        """A refusal a waiting sender should hear of at once (not a passing state)."""
        return self.refused and self.direction == "dial" and self.code in DEFINITE

    def _sentence(self, did: str | None) -> str:
        with_did, without_did = _HEADS[self.kind]
        head = without_did if did is None else with_did.format(did=did)
        code = f" (close code {self.code})" if self.refused and self.code is not None else ""
        return f"{head}: {self.reason}{code}"

    def message(self, did: str) -> str:
        """One sentence for an error line or a status row."""
        return self._sentence(did)

    def why(self) -> str:
        """Why a queued message does not move (``talosd outbox``), without the DID."""
        return self._sentence(None)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "code": self.code,
            "reason": self.reason,
            "direction": self.direction,
            "at_ms": self.at_ms,
        }


class LinkProblems:
    """The latest :class:`LinkProblem` per peer, at most ``limit`` peers (oldest dropped)."""

    def __init__(self, limit: int = MAX_PROBLEMS) -> None:
        self._limit = limit
        self._by_did: OrderedDict[str, LinkProblem] = OrderedDict()

    def note(self, did: str, problem: LinkProblem) -> None:
        """Remember ``problem`` for ``did``; an inbound guess never hides a dial's finding."""
        old = self._by_did.get(did)
        if old is not None and old.direction == "dial" and problem.direction != "dial":
            return
        self._by_did.pop(did, None)
        self._by_did[did] = problem
        while len(self._by_did) > self._limit:
            self._by_did.popitem(last=False)

    def clear(self, did: str) -> None:
        """A link to ``did`` reached a ready session."""
        self._by_did.pop(did, None)

    def get(self, did: str) -> LinkProblem | None:
        return self._by_did.get(did)

    def items(self) -> list[tuple[str, LinkProblem]]:
        return list(self._by_did.items())
