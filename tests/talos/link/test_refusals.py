"""The latest link problem per peer, and close codes in words (talos/link/refusals.py)."""

from __future__ import annotations

from talos.link.auth import CLOSE_DOWNGRADE, CLOSE_PQ_REQUIRED
from talos.link.handshake import CLOSE_SHUTDOWN, CLOSE_UNAUTHORIZED
from talos.link.refusals import (
    BY_PEER,
    BY_US,
    UNREACHABLE,
    LinkProblem,
    LinkProblems,
    our_refusal_text,
    peer_refusal_text,
)

DID = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"


def test_close_codes_read_from_the_side_they_reach() -> None:
    assert peer_refusal_text(CLOSE_UNAUTHORIZED, "unknown peer") == (
        "this node is not on its allow list"
        " (its operator allows it with --allow DID or talosd peers allow DID)"
    )
    assert "requires post-quantum" in peer_refusal_text(CLOSE_PQ_REQUIRED, "x")
    assert "downgrade" in peer_refusal_text(CLOSE_DOWNGRADE, "x")
    assert our_refusal_text(CLOSE_UNAUTHORIZED, "unknown peer").startswith(
        "it is not on this node's allow list"
    )
    # A code the table does not know keeps the peer's own words.
    assert peer_refusal_text(4999, "gone fishing") == "gone fishing"
    assert peer_refusal_text(4999, "") == "close code 4999"


def test_messages_name_the_peer_the_reason_and_the_code() -> None:
    refused = LinkProblem(BY_PEER, "this node is not on its allow list", 1, CLOSE_UNAUTHORIZED)
    assert refused.message(DID) == (
        f"{DID} refused the link: this node is not on its allow list (close code 4003)"
    )
    assert refused.why().startswith("link refused by peer: this node is not on its allow list")
    ours = LinkProblem(BY_US, "x", 1, 4004)
    assert ours.message(DID).startswith(f"this node refused the link with {DID}: x")
    down = LinkProblem(UNREACHABLE, "connection refused", 1)
    assert down.message(DID) == f"{DID} is unreachable: connection refused"
    assert down.why() == "peer unreachable: connection refused"
    assert refused.to_json() == {
        "kind": "refused_by_peer",
        "code": 4003,
        "reason": "this node is not on its allow list",
        "direction": "dial",
        "at_ms": 1,
    }


def test_message_and_why_say_the_same_sentence_with_and_without_the_did() -> None:
    cases = [
        (LinkProblem(BY_PEER, "r", 1, 4005), f"{DID} refused the link", "link refused by peer"),
        (
            LinkProblem(BY_US, "r", 1, 4005, "accept"),
            f"this node refused the link with {DID}",
            "link refused by this node",
        ),
        (LinkProblem(UNREACHABLE, "r", 1), f"{DID} is unreachable", "peer unreachable"),
    ]
    for problem, with_did, without_did in cases:
        code = " (close code 4005)" if problem.refused else ""
        assert problem.message(DID) == f"{with_did}: r{code}"
        assert problem.why() == f"{without_did}: r{code}"
    # A refusal whose code is unknown says no code.
    assert LinkProblem(BY_PEER, "r", 1).why() == "link refused by peer: r"


def test_only_a_definite_refusal_met_while_dialling_is_decisive() -> None:
    assert LinkProblem(BY_PEER, "r", 1, CLOSE_UNAUTHORIZED).decisive
    assert LinkProblem(BY_US, "r", 1, 4004).decisive
    # Passing states: the peer stops, or is busy; a dial error is an outage.
    assert not LinkProblem(BY_PEER, "r", 1, CLOSE_SHUTDOWN).decisive
    assert not LinkProblem(BY_PEER, "r", 1, 1013).decisive
    assert not LinkProblem(UNREACHABLE, "r", 1).decisive
    # A malformed or unauthenticated handshake message: a network attacker's at will.
    assert not LinkProblem(BY_US, "r", 1, 4001).decisive
    assert not LinkProblem(BY_PEER, "r", 1, 4000).decisive
    # A stranger's claimed DID on an inbound handshake is shown, never decisive.
    assert not LinkProblem(BY_US, "r", 1, CLOSE_UNAUTHORIZED, "accept").decisive


def test_problems_are_latest_per_peer_bounded_and_cleared() -> None:
    problems = LinkProblems(limit=2)
    dialled = LinkProblem(BY_PEER, "a", 1, CLOSE_UNAUTHORIZED)
    problems.note(DID, dialled)
    # What an inbound stranger claims does not hide what dialling found.
    problems.note(DID, LinkProblem(BY_US, "b", 2, CLOSE_UNAUTHORIZED, "accept"))
    assert problems.get(DID) is dialled
    later = LinkProblem(UNREACHABLE, "c", 3)
    problems.note(DID, later)
    assert problems.get(DID) is later
    problems.note("did:x:1", later)
    problems.note("did:x:2", later)  # over the limit: the oldest peer goes
    assert problems.get(DID) is None
    assert [d for d, _ in problems.items()] == ["did:x:1", "did:x:2"]
    problems.clear("did:x:1")
    assert problems.get("did:x:1") is None
