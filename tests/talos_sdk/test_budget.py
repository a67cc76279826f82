"""talos_sdk/budget.py: the token bucket, and a ratchet session paying skipped keys from one."""

from __future__ import annotations

import pytest

from talos_sdk.budget import TokenBucket
from talos_sdk.errors import DecryptionError, UsageError
from talos_sdk.ratchet import MAX_SKIP, Session


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_pays_up_to_its_level_and_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=10, burst=50, clock=clock)
    assert bucket.take(30) and bucket.take(20)
    assert not bucket.take(1)  # empty, and a refused take costs nothing
    clock.now += 0.5
    assert not bucket.take(6) and bucket.take(5)
    clock.now += 1000
    assert bucket.take(50) and not bucket.take(1)  # never above the burst
    clock.now -= 10  # a clock going back refills nothing
    assert not bucket.take(1)


@pytest.mark.parametrize(("rate", "burst"), [(0, 10), (10, 0), (-1, 10), (float("nan"), 10)])
def test_a_bucket_that_could_never_pay_is_a_usage_error(rate: float, burst: float) -> None:
    with pytest.raises(UsageError):
        TokenBucket(rate, burst, Clock())


def test_a_session_asks_its_budget_before_skipping_and_a_refusal_changes_nothing() -> None:
    alice, bob = Session.create_pair()
    bob.decrypt(alice.encrypt(b"first"))
    clock = Clock()
    bucket = TokenBucket(rate=1, burst=MAX_SKIP, clock=clock)
    bob.skip_budget = bucket.take
    lost = [alice.encrypt(b"lost %d" % i) for i in range(MAX_SKIP // 2 + 1)]
    late = alice.encrypt(b"after the gap")
    assert bob.decrypt(late) == b"after the gap"  # paid MAX_SKIP // 2 + 1 keys
    assert bob.decrypt(lost[3]) == b"lost 3"  # a stored skipped key costs nothing
    gap = [alice.encrypt(b"gap") for _ in range(MAX_SKIP // 2)]
    state = bob.to_bytes()
    with pytest.raises(DecryptionError):
        bob.decrypt(alice.encrypt(b"too far"))  # the budget cannot pay this gap
    assert bob.to_bytes() == state
    clock.now += MAX_SKIP  # refilled: the same kind of gap is paid again
    assert bob.decrypt(alice.encrypt(b"paid")) == b"paid"
    assert bob.decrypt(gap[0]) == b"gap"


def test_a_forged_header_on_a_new_chain_pays_for_both_chains() -> None:
    alice, bob = Session.create_pair()
    bob.decrypt(alice.encrypt(b"first"))
    bob.encrypt(b"reply")  # so that alice's next message starts a new chain
    paid: list[int] = []
    bob.skip_budget = lambda n: paid.append(n) or False
    forged = bytearray(alice.encrypt(b"x"))
    forged[1:33] = bytes(range(32))  # another ratchet key
    forged[33:37] = (700).to_bytes(4, "big")  # PN: bob took 0 and 1 of the old chain: 698
    forged[37:41] = (900).to_bytes(4, "big")  # N: 900 on the new one
    with pytest.raises(DecryptionError):
        bob.decrypt(bytes(forged))
    assert paid == [698 + 900]
