"""The node's prekeys over time (talos/sessions.py on talos_sdk/prekeys.py): signed
prekey rotation with a grace period, one-time ML-KEM prekeys reserved per peer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from talos.sessions import SessionManager
from talos.store import Store
from talos_sdk.bundle import PrekeyBundle
from talos_sdk.errors import BundleError
from talos_sdk.prekeys import PQ_OPK_ID_BASE
from talos_sdk.wallet import Wallet

WEEK, DAY = 7 * 86_400, 86_400


class Side:
    def __init__(self, root: Path, wallet: Wallet, now: list[float]) -> None:
        self.wallet = wallet
        self.store = Store(root, map_size=1 << 22)
        self.sm = SessionManager(
            self.store,
            wallet,
            pq=True,
            one_time=1,
            ratchet_every=1,
            pq_one_time=2,
            prekey_rotation=WEEK,
            prekey_grace=2 * DAY,
            wall_clock=lambda: now[0],
        )
        with self.store.write() as txn:
            self.sm.load(txn, discard=False)

    def maintain(self) -> bool:
        with self.store.write() as txn:
            return self.sm.maintain_prekeys(txn)


@pytest.fixture
def sides(tmp_path: Path) -> Iterator[tuple[Side, Side, list[float]]]:
    now = [1_000_000.0]
    lo, hi = sorted((Wallet.generate(), Wallet.generate()), key=lambda w: w.did)
    a, b = Side(tmp_path / "a", lo, now), Side(tmp_path / "b", hi, now)
    yield a, b, now  # a initiates (smaller DID)
    a.store.close()
    b.store.close()


def test_each_peer_is_offered_its_own_signed_mlkem_one_time_prekey(
    sides: tuple[Side, Side, list[float]],
) -> None:
    a, b, _ = sides
    offers = [PrekeyBundle.from_bytes(b.sm.offer(Wallet.generate().did).bundle) for _ in range(3)]
    ids = [o.verify().pq_one_time[0][0] for o in offers]
    assert len(set(ids)) == 3 and all(i >= PQ_OPK_ID_BASE for i in ids)  # minted as needed
    # A session set up over the link uses (and consumes) the peer's reserved one.
    offer_b = b.sm.offer(a.wallet.did)
    reserved = PrekeyBundle.from_bytes(offer_b.bundle).pq_one_time[0][0]
    assert b.sm.on_offer(a.wallet.did, a.sm.offer(b.wallet.did), ("x25519-mlkem768",)) is None
    init = a.sm.on_offer(b.wallet.did, offer_b, ("x25519-mlkem768",))
    assert init is not None
    b.sm.on_init(a.wallet.did, init)
    assert reserved not in b.sm.secrets.pq_one_time_ids


def test_signed_prekey_rotates_on_schedule_and_the_old_one_expires(
    sides: tuple[Side, Side, list[float]],
) -> None:
    a, b, now = sides
    old_offer = b.sm.offer(a.wallet.did)
    old = PrekeyBundle.from_bytes(old_offer.bundle)
    assert not b.sm.prekeys_due()
    now[0] += WEEK
    assert b.sm.prekeys_due() and b.maintain()
    new = PrekeyBundle.from_bytes(b.sm.offer(a.wallet.did).bundle).verify()
    assert new.spk_id != old.spk_id and new.pq_id != old.pq_id
    # Stored: a restart keeps the rotated keys and the retired one.
    again = SessionManager(
        b.store, b.wallet, pq=True, one_time=1, ratchet_every=1, wall_clock=lambda: now[0]
    )
    with b.store.write() as txn:
        again.load(txn, discard=False)
    assert again.secrets.spk_id == new.spk_id and again.secrets.retired_ids == [old.spk_id]
    # A peer that took the old bundle before the rotation still gets a session ...
    init = a.sm.on_offer(b.wallet.did, old_offer, ("x25519-mlkem768",))
    assert init is not None
    b.sm.on_init(a.wallet.did, init)
    # ... but not once the grace period is over.
    now[0] += 2 * DAY
    assert b.sm.prekeys_due() and b.maintain()
    assert b.sm.secrets.retired_ids == []
    a.sm.drop(b.wallet.did)
    late = a.sm.on_offer(b.wallet.did, old_offer, ("x25519-mlkem768",))
    assert late is not None
    with pytest.raises(BundleError, match="unknown signed prekey"):
        b.sm.on_init(a.wallet.did, late)
