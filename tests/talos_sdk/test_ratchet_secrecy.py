"""Forward secrecy and post-compromise healing of the Double Ratchet (talos_sdk/ratchet.py).

The attacker here is concrete: it steals a party's serialised session state (and,
for forward secrecy, its long-term X25519 identity key too), then replays the
captured wire messages through its own copy. docs/security.md "Forward secrecy and healing"
states what each ``ratchet_every`` /
``ratchet_max_age`` setting guarantees; these tests hold it to that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.hmac import HMAC
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from talos_sdk.bundle import SUITE_X25519, IdentityKey, PrekeyBundle
from talos_sdk.errors import DecryptionError, UsageError
from talos_sdk.prekeys import PrekeySecrets
from talos_sdk.ratchet import PeerIdentity, Session
from talos_sdk.wallet import Wallet
from talos_sdk.x3dh import INFO_X25519

ALICE = Wallet.from_seed(b"\x1a" * 32)
BOB = Wallet.from_seed(b"\x1b" * 32)


def _dh(private: bytes, public: bytes) -> bytes:
    key = X25519PrivateKey.from_private_bytes(private)
    return key.exchange(X25519PublicKey.from_public_bytes(public))


def _kdf_rk(rk: bytes, dh: bytes) -> tuple[bytes, bytes]:
    out = HKDF(hashes.SHA256(), 64, salt=rk, info=b"Talos_DR_Root_v1").derive(dh)
    return out[:32], out[32:]


def _replay_as_alice(
    stolen: dict[str, str], alice_ik: IdentityKey, bundle: PrekeyBundle, candidate: bytes
) -> tuple[Session, bytes]:
    """Alice's session at its start, rebuilt from ``candidate`` taken as EK_A, and
    the chain key of her first sending chain.

    X3DH (docs/PROTOCOL.md "X3DH") with Alice's identity key and Bob's public
    bundle, then the first root step with ``candidate`` as the first ratchet key.
    """
    opk = bundle.one_time[0][1]
    sk = HKDF(hashes.SHA256(), 32, salt=bytes(32), info=INFO_X25519).derive(
        b"\xff" * 32
        + _dh(alice_ik.private, bundle.spk)
        + _dh(candidate, bundle.identity_dh)
        + _dh(candidate, bundle.spk)
        + _dh(candidate, opk)
    )
    rk, cks = _kdf_rk(sk, _dh(candidate, bundle.spk))
    public = X25519PrivateKey.from_private_bytes(candidate).public_key().public_bytes_raw()
    session = Session(
        suite=SUITE_X25519,
        local_did=ALICE.did,
        peer_identity=PeerIdentity(BOB.did, BOB.public_key, bundle.identity_dh),
        ad=bytes.fromhex(stolen["ad"]),
        rk=rk,
        dhs=(candidate, public),
        dhr=bundle.spk,
        cks=cks,
    )
    return session, cks


def _open_first(first: bytes, ad: bytes, chain_key: bytes) -> bytes:
    """Open message N = 0 of a chain by the documented formulas (ADR 0006)."""
    mac = HMAC(chain_key, hashes.SHA256())
    mac.update(b"\x01")
    header_len = 41 + 2 + int.from_bytes(first[41:43], "big")
    return ChaCha20Poly1305(mac.finalize()).decrypt(
        bytes(12), first[header_len:], ad + first[:header_len]
    )


def test_stolen_initiator_state_and_identity_key_do_not_open_earlier_messages() -> None:
    """X3DH's EK_A must not survive as the first ratchet key (Signal DR §3.3).

    Every 32-byte secret in Alice's stolen state is tried as EK_A; with it and
    Alice's identity key, X3DH against Bob's public bundle would give SK, and
    from SK both her first message and Bob's answer would open.
    """
    alice_ik = IdentityKey.generate(ALICE)
    secrets = PrekeySecrets.generate(BOB, one_time=1)
    bundle = secrets.bundle()
    alice = Session.initiate(ALICE, alice_ik, bundle, suite=SUITE_X25519)
    first = alice.encrypt(b"sent before the theft")
    bob, _ = Session.respond(BOB, secrets, first)
    reply = bob.encrypt(b"answered before the theft")
    assert alice.decrypt(reply) == b"answered before the theft"

    stolen = alice.to_dict()  # the whole state, right after the handshake
    candidates = [bytes.fromhex(v) for v in stolen.values() if isinstance(v, str) and len(v) == 64]
    assert bytes.fromhex(stolen["dhs_priv"]) in candidates
    opened: list[bytes] = []
    for candidate in candidates:
        attacker, chain_key = _replay_as_alice(stolen, alice_ik, bundle, candidate)
        with contextlib.suppress(DecryptionError):
            opened.append(attacker.decrypt(reply))
        with contextlib.suppress(InvalidTag):
            opened.append(_open_first(first, alice.associated_data, chain_key))
    assert opened == []


def _clone(session: Session) -> Session:
    return Session.from_bytes(session.to_bytes())


def _read_after_theft(
    make: Callable[[], tuple[Session, Session]],
    *,
    turns: int = 100,
    per_turn: int = 3,
    between_turns: Callable[[], None] = lambda: None,
    steal_after: int = 0,
) -> int:
    """Messages to Alice a passive attacker reads after stealing her state once.

    Alice and Bob take turns of ``per_turn`` messages. The attacker copies
    Alice's state after turn ``steal_after`` (one of hers: even) and feeds every
    later message to Alice through its copy (which never sends, so it never
    learns her new keys).
    """
    alice, bob = make()
    copy: Session | None = None
    read = 0
    for turn in range(turns):
        sender, receiver = (alice, bob) if turn % 2 == 0 else (bob, alice)
        for i in range(per_turn):
            wire = sender.encrypt(f"{turn}/{i}".encode())
            assert receiver.decrypt(wire) == f"{turn}/{i}".encode()
            if copy is not None and receiver is alice:
                try:
                    copy.decrypt(wire)
                    read += 1
                except DecryptionError:
                    pass
        if turn == steal_after:
            copy = _clone(alice)
        between_turns()
    return read


@pytest.mark.parametrize(("every", "bound"), [(1, 3), (4, 12), (64, 200)])
def test_healing_is_bounded_by_ratchet_every(every: int, bound: int) -> None:
    """ratchet_every=1 heals after one turn: only the turn in flight is readable."""
    read = _read_after_theft(lambda: Session.create_pair(ratchet_every=every))
    assert read <= bound
    if every == 1:
        assert read == 3
    else:
        assert read > 3  # the lazy mode is slower to heal, as documented


class _Bounded:
    """Session pairs lazy by ``every`` sends and ``max_age`` seconds of one shared fake clock."""

    def __init__(self, every: int, max_age: float, tick: float) -> None:
        self.every, self.max_age, self.step, self.now = every, max_age, tick, 0.0

    def make(self) -> tuple[Session, Session]:
        a, b = Session.create_pair(ratchet_every=self.every)
        for s in (a, b):
            s.clock, s.ratchet_max_age = (lambda: self.now), self.max_age
        return a, b

    def tick(self) -> None:
        self.now += self.step


def test_ratchet_max_age_heals_a_lazy_session_by_time() -> None:
    """A lazy session (ratchet_every=64) also ratchets once its chain is older than the bound."""
    pairs = _Bounded(64, 30.0, tick=31.0)
    lazy = _read_after_theft(lambda: Session.create_pair(ratchet_every=64))
    bounded = _read_after_theft(pairs.make, between_turns=pairs.tick)
    assert bounded == 3 < lazy


def test_ratchet_max_age_counts_from_the_chain_start() -> None:
    """Strict ping-pong with ratchet_every=1000 and a 10 s bound, 4 s per turn:
    a side opens a new sending chain only when its current one is >= 10 s old."""
    now = [100.0]
    a, b = Session.create_pair(ratchet_every=1000)
    for s in (a, b):
        s.clock, s.ratchet_max_age = (lambda: now[0]), 10.0
    keys: dict[str, set[str]] = {"a": set(), "b": set()}
    for _ in range(9):
        now[0] += 4.0
        for name, tx, rx in (("a", a, b), ("b", b, a)):
            rx.decrypt(tx.encrypt(b"x"))
            keys[name].add(tx.to_dict()["dhs_pub"])
    # 36 s of turns: about one new chain per 12 s on each side, never per turn.
    assert all(3 <= len(k) <= 5 for k in keys.values()), keys


def test_lazy_policy_is_checked() -> None:
    a, _ = Session.create_pair()
    with pytest.raises(UsageError, match="needs a clock"):
        Session(
            suite=a.suite,
            local_did=a.local_did,
            peer_identity=a.peer_identity,
            ad=a.associated_data,
            rk=bytes(32),
            dhs=(bytes(32), bytes(32)),
            dhr=None,
            cks=None,
            ratchet_every=4,
            ratchet_max_age=5.0,
        )
    a.ratchet_max_age = 0.0
    with pytest.raises(UsageError, match="ratchet_max_age must be > 0"):
        a.check_policy()
    a.ratchet_max_age, a.ratchet_every = None, 0
    with pytest.raises(UsageError, match="ratchet_every"):
        a.check_policy()


def test_restored_lazy_session_ratchets_at_its_next_owed_send() -> None:
    """The chain start time is not persisted: after a restore it counts as too old."""
    now = [0.0]
    a, b = Session.create_pair(ratchet_every=64)
    a.decrypt(b.encrypt(b"turn"))
    before = a.to_dict()["dhs_pub"]
    restored = Session.from_bytes(a.to_bytes())
    restored.clock, restored.ratchet_max_age = (lambda: now[0]), 3600.0
    b.decrypt(restored.encrypt(b"after restart"))
    assert restored.to_dict()["dhs_pub"] != before


@pytest.mark.parametrize(("spacing", "per_turn"), [(0.1, 1), (0.01, 1), (0.01, 5)])
def test_the_tunnels_schedule_heals_within_two_age_bounds(spacing: float, per_turn: int) -> None:
    """64 sends / 1 s on both sides (a talos-proxy home, ADR 0002): the victim steps only
    after the peer did, so messages to it stay readable for up to two age bounds (2 s
    of them), whatever the moment of the theft; with ``per_turn`` messages a turn the
    64-send bound counts for each side's own sends, so only time bounds the count.
    """
    worst = 0
    phase = 2 * round(1.0 / spacing)  # turns in 2 s: thefts spread over them
    for steal_after in range(0, phase + 2, 2 * max(1, phase // 24)):
        pairs = _Bounded(64, 1.0, tick=spacing)
        read = _read_after_theft(
            pairs.make,
            turns=phase + round(3.0 / spacing),
            per_turn=per_turn,
            between_turns=pairs.tick,
            steal_after=steal_after,
        )
        worst = max(worst, read)
    # Bob's turns (every other one) in 2 s, all their messages at most.
    assert 1 <= worst <= round(2.0 / spacing) // 2 * per_turn + per_turn
    signal = _read_after_theft(lambda: Session.create_pair(ratchet_every=1), per_turn=per_turn)
    assert signal <= per_turn < worst  # a step every turn: only the turn in flight
