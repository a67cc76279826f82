"""The node's DH ratchet policy (talos/sessions.py, talos/config.py; ADR 0002).

By default every change of direction is a DH ratchet step; the lazy mode is
opt-in and bounded by age as well as count.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from talos.config import NodeConfig
from talos.pipeline import OutboxEntry
from talos.sessions import SessionManager
from talos.store import Store
from talos_sdk.wallet import Wallet


class Pair:
    """Two SessionManagers with one session between them, built from a NodeConfig."""

    def __init__(self, root: Path, config: NodeConfig, clock: list[float]) -> None:
        wallets = sorted((Wallet.generate(), Wallet.generate()), key=lambda w: w.did)
        self.stores = [Store(root / str(i), map_size=1 << 22) for i in range(2)]
        self.wallets = wallets
        self.sms = [
            SessionManager(
                store,
                w,
                pq=False,
                one_time=config.one_time_prekeys,
                ratchet_every=config.ratchet_every,
                ratchet_max_age=config.ratchet_max_age,
                clock=lambda: clock[0],
            )
            for store, w in zip(self.stores, wallets, strict=True)
        ]
        for sm, store in zip(self.sms, self.stores, strict=True):
            with store.write() as txn:
                sm.load(txn, discard=False)
        a, b = self.sms
        da, db = (w.did for w in wallets)
        offer_a, offer_b = a.offer(db), b.offer(da)
        assert b.on_offer(da, offer_a, ("x25519",)) is None
        init = a.on_offer(db, offer_b, ("x25519",))
        assert init is not None
        a.on_ack(db, b.on_init(da, init))

    def ratchet_keys_in_ping_pong(self, turns: int, tick: float, clock: list[float]) -> int:
        """Distinct sending ratchet keys both sides used over ``turns`` one-message turns."""
        seen: set[str] = set()
        seq = [0, 0]
        for turn in range(turns):
            clock[0] += tick
            i = turn % 2
            tx, rx = self.sms[i], self.sms[1 - i]
            me, peer = self.wallets[i].did, self.wallets[1 - i].did
            seq[i] += 1
            row = OutboxEntry(peer, seq[i], bytes([turn % 256]) * 16, 1, f"t{turn}")
            body, _ = tx.seal_message(peer, row)
            rx.open_message(me, body)
            seen.add(tx._get(peer).session.to_dict()["dhs_pub"])
        return len(seen)

    def close(self) -> None:
        for s in self.stores:
            s.close()


@pytest.fixture
def clock() -> list[float]:
    return [1000.0]


def make(tmp_path: Path, clock: list[float], **cfg: object) -> Iterator[Pair]:
    pair = Pair(tmp_path, NodeConfig.model_validate(cfg), clock)
    yield pair
    pair.close()


def test_default_node_config_ratchets_on_every_turn(tmp_path: Path, clock: list[float]) -> None:
    """Healing after a state theft needs a DH step per turn (docs/security.md)."""
    assert NodeConfig().ratchet_every == 1
    for pair in make(tmp_path, clock):
        # 40 one-message turns: a fresh sending key on each of them.
        assert pair.ratchet_keys_in_ping_pong(40, 0.001, clock) == 40


def test_lazy_mode_is_bounded_by_count(tmp_path: Path, clock: list[float]) -> None:
    for pair in make(tmp_path, clock, ratchet_every=4, ratchet_max_age=3600.0):
        keys = pair.ratchet_keys_in_ping_pong(40, 0.001, clock)
        assert 8 <= keys <= 14  # a step per 4 sends per side, not per turn


def test_lazy_mode_is_bounded_by_age(tmp_path: Path, clock: list[float]) -> None:
    for pair in make(tmp_path, clock, ratchet_every=1000, ratchet_max_age=5.0):
        # 3 s per turn: each side sends every 6 s, so its chain is always too old.
        assert pair.ratchet_keys_in_ping_pong(40, 3.0, clock) == 40
    for pair in make(tmp_path / "slow", clock, ratchet_every=1000, ratchet_max_age=3600.0):
        assert pair.ratchet_keys_in_ping_pong(40, 3.0, clock) == 2


def test_the_age_bound_of_a_lazy_home_is_capped_at_an_hour() -> None:
    """A typo cannot turn healing by time off (docs/security.md, lazy mode); a home
    stepping every turn, which never reads the value, keeps loading as before."""
    assert NodeConfig(ratchet_every=64, ratchet_max_age=3600.0).ratchet_max_age == 3600.0
    with pytest.raises(ValidationError, match="3600"):
        NodeConfig(ratchet_every=64, ratchet_max_age=1e9)
    assert NodeConfig(ratchet_every=1, ratchet_max_age=86400.0).ratchet_every == 1
