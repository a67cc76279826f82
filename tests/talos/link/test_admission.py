"""Link admission, the duplicate-link rule and the dialler's backoff (talos/link/admission.py)."""

from __future__ import annotations

from dataclasses import dataclass

from talos.link.admission import Admission, Backoff, keep_new_link, prefer_new_link
from talos.link.handshake import Role


def test_admission_bounds_total_and_per_address() -> None:
    adm = Admission(max_total=3, max_per_address=2)
    assert adm.enter("10.0.0.1") and adm.enter("10.0.0.1")
    assert not adm.enter("10.0.0.1")  # per-address cap
    assert adm.enter("10.0.0.2")
    assert not adm.enter("10.0.0.3")  # total cap
    assert adm.total == 3
    adm.leave("10.0.0.1")
    assert adm.enter("10.0.0.3")
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        adm.leave(address)
    assert adm.total == 0 and adm.by_address == {}


def test_duplicate_link_rule_is_symmetric() -> None:
    low, high = "did:key:zA", "did:key:zB"
    # A redial by the same side replaces the old link.
    assert prefer_new_link(low, high, new_dialler=high, old_dialler=high)
    # Opposite diallers: both ends keep the link the smaller DID dialled.
    for ours, theirs in ((low, high), (high, low)):
        assert prefer_new_link(ours, theirs, new_dialler=low, old_dialler=high)
        assert not prefer_new_link(ours, theirs, new_dialler=high, old_dialler=low)
        # A direct link beats a relayed one whoever dialled.
        assert prefer_new_link(ours, theirs, high, low, new_direct=True, old_direct=False)
        assert not prefer_new_link(ours, theirs, low, high, new_direct=False, old_direct=True)


def test_backoff_grows_until_a_ready_session_resets_it() -> None:
    b = Backoff(initial=0.1, maximum=1.0)
    assert [b.failed() for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    # An authenticated link whose session setup failed is a failure too:
    # nothing resets the delay until a session became ready.
    b.ready()
    assert b.failed() == 0.1


@dataclass(frozen=True)
class _Facts:
    """What keep_new_link reads of a link (talos.link.admission.LinkFacts)."""

    peer_did: str
    role: Role
    via: str = "direct"


def test_keep_new_link_decides_alike_on_both_ends() -> None:
    """Same dialler -> the newer wins; otherwise the smaller DID's dial; direct beats relayed."""
    a, b = "did:key:zA", "did:key:zB"
    # On A: the link A dialled (A is INITIATOR) and the one B dialled; mirrored on B.
    a_dials_on_a, b_dials_on_a = _Facts(b, Role.INITIATOR), _Facts(b, Role.RESPONDER)
    a_dials_on_b, b_dials_on_b = _Facts(a, Role.RESPONDER), _Facts(a, Role.INITIATOR)
    a_wins = a < b
    assert keep_new_link(a, a_dials_on_a, b_dials_on_a) is a_wins
    assert keep_new_link(b, a_dials_on_b, b_dials_on_b) is a_wins
    assert keep_new_link(a, b_dials_on_a, a_dials_on_a) is not a_wins
    assert keep_new_link(b, b_dials_on_b, a_dials_on_b) is not a_wins
    assert keep_new_link(a, a_dials_on_a, _Facts(b, Role.INITIATOR)) is True
    relayed_on_a = _Facts(b, Role.INITIATOR, "relay")
    relayed_on_b = _Facts(a, Role.RESPONDER, "relay")
    assert keep_new_link(a, b_dials_on_a, relayed_on_a) is True
    assert keep_new_link(b, b_dials_on_b, relayed_on_b) is True
    assert keep_new_link(a, relayed_on_a, b_dials_on_a) is False
