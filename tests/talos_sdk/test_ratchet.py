"""Double Ratchet sessions (talos_sdk/ratchet.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.hmac import HMAC
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from talos_sdk.bundle import SUITE_HYBRID, SUITE_X25519, IdentityKey
from talos_sdk.errors import (
    BundleError,
    DecryptionError,
    EncodingError,
    MalformedFrameError,
    UsageError,
)
from talos_sdk.prekeys import PrekeySecrets
from talos_sdk.ratchet import MAX_SKIP, MAX_SKIPPED_KEYS, Session
from talos_sdk.wallet import Wallet

ALICE = Wallet.from_seed(b"\x0a" * 32)
BOB = Wallet.from_seed(b"\x0b" * 32)


def converse(a: Session, b: Session, rounds: int = 3, per_round: int = 2) -> None:
    for r in range(rounds):
        for sender, receiver in ((a, b), (b, a)):
            for i in range(per_round):
                text = f"{r}/{i} from {sender.local_did[-6:]}".encode()
                assert receiver.decrypt(sender.encrypt(text)) == text


@pytest.mark.parametrize("suite", [SUITE_X25519, SUITE_HYBRID])
def test_create_pair_talks_both_ways(suite: str) -> None:
    a, b = Session.create_pair(suite)
    assert a.suite == b.suite == suite
    assert a.peer_did == b.local_did and b.peer_did == a.local_did
    assert a.associated_data == b.associated_data
    assert b.decrypt(a.encrypt(b"hello", ad=b"ctx"), ad=b"ctx") == b"hello"
    assert a.decrypt(b.encrypt(b"")) == b""
    converse(a, b)


def test_create_pair_unknown_suite() -> None:
    with pytest.raises(UsageError, match="unknown suite 'x25519-kyber'"):
        Session.create_pair("x25519-kyber")


def test_initiate_respond_consumes_opk_once() -> None:
    secrets = PrekeySecrets.generate(BOB, one_time=2)
    alice = Session.initiate(ALICE, None, secrets.bundle(), suite=SUITE_X25519)
    first = alice.encrypt(b"hi bob")
    bob, plaintext = Session.respond(BOB, secrets, first)
    assert plaintext == b"hi bob"
    assert bob.peer_identity.did == ALICE.did
    assert bob.peer_identity.signing_key == ALICE.public_key
    assert secrets.one_time_ids == [2]
    with pytest.raises(BundleError, match="already used"):
        Session.respond(BOB, secrets, first)
    converse(alice, bob)


def test_failed_first_message_keeps_the_opk() -> None:
    secrets = PrekeySecrets.generate(BOB, one_time=1, pq=True)
    alice = Session.initiate(ALICE, None, secrets.bundle(), suite=SUITE_HYBRID)
    first = bytearray(alice.encrypt(b"hi"))
    first[-1] ^= 1
    with pytest.raises(DecryptionError):
        Session.respond(BOB, secrets, bytes(first))
    assert secrets.one_time_ids == [1]
    first[-1] ^= 1
    assert Session.respond(BOB, secrets, bytes(first))[1] == b"hi"


def test_respond_needs_initial_message() -> None:
    secrets = PrekeySecrets.generate(BOB)
    _, b = Session.create_pair()
    normal = b.encrypt(b"x")
    with pytest.raises(MalformedFrameError, match="does not carry X3DH initial data"):
        Session.respond(BOB, secrets, normal)
    with pytest.raises(MalformedFrameError, match="too short"):
        Session.respond(BOB, secrets, b"\x02" + bytes(20))
    alice = Session.initiate(ALICE, None, secrets.bundle())
    first = alice.encrypt(b"x")
    with pytest.raises(MalformedFrameError, match="truncated"):
        Session.respond(BOB, secrets, first[:60])


def test_initial_data_sent_until_first_reply() -> None:
    secrets = PrekeySecrets.generate(BOB)
    alice = Session.initiate(ALICE, None, secrets.bundle())
    m1, m2 = alice.encrypt(b"1"), alice.encrypt(b"2")
    assert m1[0] == m2[0] == 2
    # The second message alone can start the session (the first was lost)...
    bob, text = Session.respond(BOB, secrets, m2)
    assert text == b"2"
    assert bob.decrypt(m1) == b"1"  # ...and the first still opens later
    assert alice.encrypt(b"3")[0] == 2
    alice.decrypt(bob.encrypt(b"reply"))
    assert alice.encrypt(b"4")[0] == 1


def snapshot(s: Session) -> bytes:
    return s.to_bytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_order_drops_and_duplicates(data: st.DataObject) -> None:
    a, b = Session.create_pair()
    for r in range(data.draw(st.integers(1, 5), label="rounds")):
        sender, receiver = (a, b) if r % 2 == 0 else (b, a)
        msgs = [
            (f"{r}:{i}".encode(), sender.encrypt(f"{r}:{i}".encode()))
            for i in range(data.draw(st.integers(1, 6), label="count"))
        ]
        order = data.draw(st.permutations(msgs), label="order")
        keep = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
        delivered = []
        for (text, wire), kept in zip(order, keep, strict=True):
            if kept:
                assert receiver.decrypt(wire) == text
                delivered.append(wire)
        for wire in delivered:
            before = snapshot(receiver)
            with pytest.raises(DecryptionError):
                receiver.decrypt(wire)
            assert snapshot(receiver) == before


@settings(max_examples=60, deadline=None)
@given(
    position=st.integers(min_value=0),
    bit=st.integers(0, 7),
    cut=st.integers(0, 80),
    kind=st.sampled_from(["flip", "truncate", "ad"]),
)
def test_tampering_leaves_state_untouched(position: int, bit: int, cut: int, kind: str) -> None:
    a, b = TAMPER_PAIR
    wire = a.encrypt(b"attack at dawn")
    if kind == "flip":
        bad = bytearray(wire)
        bad[position % len(bad)] ^= 1 << bit
        args: tuple[bytes, bytes] = (bytes(bad), b"")
    elif kind == "truncate":
        args = (wire[: max(0, len(wire) - 1 - cut)], b"")
    else:
        args = (wire, b"other context")
    before = snapshot(b)
    with pytest.raises(DecryptionError):
        b.decrypt(*args)
    assert snapshot(b) == before
    assert b.decrypt(wire) == b"attack at dawn"  # the genuine message still opens


TAMPER_PAIR = Session.create_pair()


def test_header_fields_are_authenticated() -> None:
    a, b = Session.create_pair()
    b.decrypt(a.encrypt(b"warm up"))
    a.decrypt(b.encrypt(b"reply"))
    wire = bytearray(a.encrypt(b"x"))
    for offset in (0, 1, 33, 37, 40):  # type, ratchet key, PN, N
        bad = bytearray(wire)
        bad[offset] ^= 0x04
        with pytest.raises(DecryptionError):
            b.decrypt(bytes(bad))


def test_beyond_max_skip_rejected() -> None:
    a, b = Session.create_pair()
    msgs = [a.encrypt(b"%d" % i) for i in range(MAX_SKIP + 2)]
    before = snapshot(b)
    with pytest.raises(DecryptionError):
        b.decrypt(msgs[MAX_SKIP + 1])
    assert snapshot(b) == before
    assert b.decrypt(msgs[MAX_SKIP]) == b"%d" % MAX_SKIP  # exactly MAX_SKIP skipped is fine
    assert b.decrypt(msgs[3]) == b"3"


def test_skipped_keys_bounded_oldest_evicted() -> None:
    a, b = Session.create_pair()
    oldest = None
    for epoch in range(3):
        sender, receiver = (a, b) if epoch % 2 == 0 else (b, a)
        msgs = [sender.encrypt(b"m") for _ in range(MAX_SKIP)]
        if epoch == 0:
            oldest = msgs[0]
        receiver.decrypt(msgs[-1])
        if epoch == 1:
            b.decrypt(a.encrypt(b"keep b current"))
    msgs = [a.encrypt(b"n") for _ in range(300)]
    b.decrypt(msgs[-1])
    assert len(b.to_dict()["skipped"]) == MAX_SKIPPED_KEYS
    assert oldest is not None
    with pytest.raises(DecryptionError):
        b.decrypt(oldest)  # evicted
    assert b.decrypt(msgs[0]) == b"n"


def test_message_for_another_session() -> None:
    a1, b1 = Session.create_pair()
    _, b2 = Session.create_pair()
    wire = a1.encrypt(b"secret")
    with pytest.raises(DecryptionError):
        b2.decrypt(wire)
    with pytest.raises(DecryptionError):
        a1.decrypt(wire)  # its own message
    assert b1.decrypt(wire) == b"secret"


@pytest.mark.parametrize("garbage", [b"", b"\x01" * 56, b"\x03" + bytes(80)])
def test_decrypt_garbage(garbage: bytes) -> None:
    _, b = Session.create_pair()
    with pytest.raises(DecryptionError):
        b.decrypt(garbage)


def test_persistence_round_trip_mid_conversation() -> None:
    a, b = Session.create_pair(SUITE_HYBRID, ratchet_every=2)
    msgs = [a.encrypt(b"%d" % i) for i in range(5)]
    b.decrypt(msgs[4])
    a.decrypt(b.encrypt(b"r"))
    for s in (a, b):
        via_json = Session.from_dict(json.loads(json.dumps(s.to_dict())))
        via_bytes = Session.from_bytes(s.to_bytes())
        assert via_json == s and via_bytes == s
        assert via_json.to_dict() == s.to_dict()
        assert via_bytes.ratchet_every == 2
    b2 = Session.from_bytes(b.to_bytes())
    assert b2.decrypt(msgs[1]) == b"1"  # skipped keys survived the restart
    assert a.decrypt(b2.encrypt(b"after restart")) == b"after restart"


@pytest.mark.parametrize(
    "garbage", [b"", b"TDRS\x01", b"XXXX\x01" + bytes(50), b"TDRS\x01\x00\x07x25519"]
)
def test_from_bytes_garbage(garbage: bytes) -> None:
    with pytest.raises(EncodingError):
        Session.from_bytes(garbage)


def test_from_bytes_truncated_and_bad_dict() -> None:
    a, _ = Session.create_pair()
    raw = a.to_bytes()
    for cut in (1, 10, len(raw) // 2):
        with pytest.raises(EncodingError):
            Session.from_bytes(raw[:-cut])
    d = a.to_dict()
    for key, value in (("version", 9), ("rk", "zz"), ("suite", "rot13"), ("rk", "00")):
        with pytest.raises(EncodingError):
            Session.from_dict(d | {key: value})
    with pytest.raises(EncodingError):
        Session.from_dict({"version": 1})


# --- lazy DH ratchet (docs/adr/0002-lazy-dh-ratchet.md) --------------------


def ratchet_keys(messages: list[bytes]) -> set[bytes]:
    return {m[1:33] for m in messages}


@pytest.mark.parametrize(("every_a", "every_b"), [(1, 1), (1, 4), (4, 1), (3, 5)])
def test_lazy_ratchet_interoperates(every_a: int, every_b: int) -> None:
    a, b = Session.create_pair(ratchet_every=every_a)
    b.ratchet_every = every_b  # receivers need no change: only the sender's choice differs
    for r in range(15):
        for sender, receiver, count in ((a, b, r % 3 + 1), (b, a, (r + 1) % 2 + 1)):
            for i in range(count):
                text = b"%d.%d" % (r, i)
                assert receiver.decrypt(sender.encrypt(text)) == text
            # Every root step one side took, the other mirrored on receipt: the root
            # chains agree whenever all sent messages have been delivered.
            assert a.to_dict()["rk"] == b.to_dict()["rk"]


def test_lazy_ratchet_reduces_key_pairs() -> None:
    counts = {}
    for every in (1, 4):
        a, b = Session.create_pair(ratchet_every=every)
        sent: list[bytes] = []
        for _ in range(40):  # strict ping-pong: the worst case for DH cost
            wire = a.encrypt(b"ping")
            sent.append(wire)
            b.decrypt(wire)
            a.decrypt(b.encrypt(b"pong"))
        counts[every] = len(ratchet_keys(sent))
    assert counts[1] == 40  # Signal: a new ratchet key on every turn
    # One new key once 4 messages went out on a chain. create_pair already sent one
    # message on the first chain, so it carries 3 pings, then 9 full chains and 1 more.
    assert counts[4] == 11


def test_lazy_sessions_still_heal_after_out_of_order() -> None:
    a, b = Session.create_pair(ratchet_every=3)
    early = [a.encrypt(b"e%d" % i) for i in range(4)]
    b.decrypt(early[3])
    late = [b.encrypt(b"l%d" % i) for i in range(5)]
    for wire in reversed(late):
        a.decrypt(wire)
    more = [a.encrypt(b"m%d" % i) for i in range(4)]
    assert [
        b.decrypt(w) for w in (more[2], early[0], more[0], early[2], more[3], more[1], early[1])
    ] == [b"m2", b"e0", b"m0", b"e2", b"m3", b"m1", b"e1"]
    assert a.to_dict()["rk"] == b.to_dict()["rk"]


# --- known-answer vectors (tests/vectors/ratchet, made by make_session_vectors.py) ---

VECTORS = Path(__file__).parents[1] / "vectors"


def _vector_key(label: str) -> bytes:
    return hashlib.sha256(b"talos-vector:" + label.encode()).digest()


def vector_sessions(ratchet_every: int) -> tuple[Session, Session, bytes]:
    def rng(labels: list[str]) -> Callable[[int], bytes]:
        it = iter(labels)
        return lambda n: _key(next(it))

    _key = _vector_key

    alice_w = Wallet.from_seed(_key("alice-seed"))
    bob_w = Wallet.from_seed(_key("bob-seed"))
    ik = IdentityKey.generate(alice_w, rng(["alice-ik"]))
    secrets = PrekeySecrets.generate(bob_w, one_time=1, rng=rng(["bob-ik", "bob-spk", "bob-opk-1"]))
    alice = Session.initiate(
        alice_w,
        ik,
        secrets.bundle(),
        suite=SUITE_X25519,
        ratchet_every=ratchet_every,
        rng=rng(["alice-ek"] + [f"alice-ratchet-{i}" for i in range(8)]),
    )
    first = alice.encrypt(b"first")
    bob, text = Session.respond(
        bob_w,
        secrets,
        first,
        ratchet_every=ratchet_every,
        rng=rng([f"bob-ratchet-{i}" for i in range(8)]),
    )
    assert text == b"first"
    return alice, bob, first


@pytest.mark.parametrize("name", ["conversation.json", "conversation-lazy.json"])
def test_ratchet_vectors(name: str) -> None:
    v = json.loads((VECTORS / "ratchet" / name).read_text())
    assert v["source"] and v["note"]
    alice, bob, first = vector_sessions(v["ratchet_every"])
    assert first.hex() == v["first"]
    sides = {"alice": (alice, bob), "bob": (bob, alice)}
    for m in v["messages"]:
        tx, rx = sides[m["from"]]
        ad = m["ad"].encode()
        # Same keys, same script: the same bytes, and the recorded bytes open.
        assert tx.encrypt(m["plaintext"].encode(), ad).hex() == m["wire"]
        assert rx.decrypt(bytes.fromhex(m["wire"]), ad) == m["plaintext"].encode()
    assert alice.to_dict()["rk"] == bob.to_dict()["rk"] == v["final_root_key"]


@pytest.mark.parametrize("name", ["conversation.json", "conversation-lazy.json"])
def test_prepare_send_changes_no_byte_of_the_conversation(name: str) -> None:
    """The owed sending step taken right after each receipt: the vectors' bytes exactly."""
    v = json.loads((VECTORS / "ratchet" / name).read_text())
    alice, bob, _ = vector_sessions(v["ratchet_every"])
    sides = {"alice": (alice, bob), "bob": (bob, alice)}
    steps = 0
    *messages, last = v["messages"]
    for m in messages:
        tx, rx = sides[m["from"]]
        ad = m["ad"].encode()
        assert tx.encrypt(m["plaintext"].encode(), ad).hex() == m["wire"]
        assert rx.decrypt(bytes.fromhex(m["wire"]), ad) == m["plaintext"].encode()
        steps += rx.prepare_send()
        assert not rx.prepare_send()  # one step per turn, never a second
    assert steps > 0
    tx, rx = sides[last["from"]]
    rx.decrypt(tx.encrypt(last["plaintext"].encode(), last["ad"].encode()), last["ad"].encode())
    # Not prepared after the last message: the recorded final state has not taken that step yet.
    assert alice.to_dict()["rk"] == bob.to_dict()["rk"] == v["final_root_key"]


def test_prepare_send_takes_no_step_that_is_not_owed() -> None:
    a, b = Session.create_pair()
    assert not a.prepare_send()  # nothing received since its last send
    b.decrypt(a.encrypt(b"x"))
    assert not a.prepare_send()
    keys = {b.to_dict()["dhs_pub"]}
    assert b.prepare_send()
    keys.add(b.to_dict()["dhs_pub"])
    assert len(keys) == 2
    assert a.decrypt(b.encrypt(b"y")) == b"y"
    assert b.to_dict()["dhs_pub"] in keys  # encrypt took no second step


def test_first_message_matches_the_documented_formulas() -> None:
    """Open the vector's first message with cryptography's HKDF, HMAC and AEAD only."""
    x = json.loads((VECTORS / "x3dh" / "x25519.json").read_text())
    first = bytes.fromhex(
        json.loads((VECTORS / "ratchet" / "conversation.json").read_text())["first"]
    )
    # Alice's first ratchet key is the fresh alice-ratchet-0, not EK_A; Bob's is
    # his signed prekey. DH computed with OpenSSL, not the SDK's libsodium.
    ratchet0 = X25519PrivateKey.from_private_bytes(_vector_key("alice-ratchet-0"))
    ratchet0_public = ratchet0.public_key().public_bytes_raw()
    assert first[1:33] == ratchet0_public
    ek = X25519PrivateKey.from_private_bytes(bytes.fromhex(x["keys"]["alice-ek"]))
    assert ek.public_key().public_bytes_raw() != ratchet0_public
    spk = X25519PrivateKey.from_private_bytes(bytes.fromhex(x["keys"]["bob-spk"]))
    dh = ratchet0.exchange(spk.public_key())
    sk = bytes.fromhex(x["shared_secret"])
    root = HKDF(hashes.SHA256(), 64, salt=sk, info=b"Talos_DR_Root_v1").derive(dh)
    chain_key = root[32:]
    mac = HMAC(chain_key, hashes.SHA256())
    mac.update(b"\x01")
    mk = mac.finalize()
    header_len = 41 + 2 + int.from_bytes(first[41:43], "big")
    assert first[0] == 2 and first[33:41] == bytes(8)  # PN = 0, N = 0
    aad = bytes.fromhex(x["associated_data"]) + first[:header_len]
    # ADR 0006: mk is the AEAD key, nonce = 8 zero bytes || N (here 0).
    plain = ChaCha20Poly1305(mk).decrypt(bytes(12), first[header_len:], aad)
    assert plain == b"first"

    # The third message on that chain (N = 2, caller AD "ctx"): the nonce carries N.
    conv = json.loads((VECTORS / "ratchet" / "conversation.json").read_text())
    third = bytes.fromhex(conv["messages"][1]["wire"])
    ck = chain_key
    for _ in range(2):
        mac = HMAC(ck, hashes.SHA256())
        mac.update(b"\x02")
        ck = mac.finalize()
    mac = HMAC(ck, hashes.SHA256())
    mac.update(b"\x01")
    mk2 = mac.finalize()
    header_len = 41 + 2 + int.from_bytes(third[41:43], "big")
    assert third[37:41] == (2).to_bytes(4, "big")
    aad = bytes.fromhex(x["associated_data"]) + third[:header_len] + b"ctx"
    nonce = bytes(8) + (2).to_bytes(4, "big")
    plain = ChaCha20Poly1305(mk2).decrypt(nonce, third[header_len:], aad)
    assert plain == conv["messages"][1]["plaintext"].encode()
    with pytest.raises(InvalidTag):  # the same key under N = 0's nonce does not open it
        ChaCha20Poly1305(mk2).decrypt(bytes(12), third[header_len:], aad)


def test_constructor_usage_errors() -> None:
    secrets = PrekeySecrets.generate(BOB)
    alice_secrets = PrekeySecrets.generate(ALICE)
    # An initiator may use the identity key held in its own prekey secrets.
    alice = Session.initiate(ALICE, alice_secrets, secrets.bundle())
    bob, _ = Session.respond(BOB, secrets, alice.encrypt(b"x"))
    assert bob.peer_identity.identity_dh == alice_secrets.identity.public
    with pytest.raises(UsageError, match="another wallet"):
        Session.initiate(BOB, alice_secrets, secrets.bundle())
    with pytest.raises(UsageError, match="another wallet"):
        Session.respond(ALICE, secrets, alice.encrypt(b"y"))
    with pytest.raises(UsageError, match="ratchet_every"):
        Session.create_pair(ratchet_every=0)


def test_forged_header_naming_peer_prekey_before_any_reply_is_opaque() -> None:
    # An initiator that has not heard back has no receiving chain; the peer's
    # ratchet key it holds is the (public) signed prekey, so anyone can forge a
    # header naming it. That must be an ordinary DecryptionError, state untouched.
    from talos_sdk.ratchet import _HEADER, _TYPE_NORMAL

    alice, _bob = Session.create_pair()
    before = snapshot(alice)
    forged = _HEADER.pack(_TYPE_NORMAL, alice._dhr, 0, 0) + bytes(32)
    with pytest.raises(DecryptionError):
        alice.decrypt(forged)
    assert snapshot(alice) == before


# --- the caller's types: bytes-like accepted, anything else a UsageError ----------------


def test_bytes_like_messages_open_as_bytes_do() -> None:
    a, b = Session.create_pair()
    wire = a.encrypt(bytearray(b"from a socket buffer"), ad=memoryview(b"ctx"))
    assert b.decrypt(memoryview(wire), ad=bytearray(b"ctx")) == b"from a socket buffer"
    assert a.decrypt(bytearray(b.encrypt(b"back"))) == b"back"

    class Wire(bytes):
        """A bytes subclass, as some frameworks hand out."""

    assert b.decrypt(Wire(a.encrypt(Wire(b"sub")))) == b"sub"


@pytest.mark.parametrize("bad", ["text", None, 42])
def test_a_wrong_type_is_the_callers_mistake_not_a_forgery(bad: object) -> None:
    a, b = Session.create_pair()
    wire = a.encrypt(b"kept")
    with pytest.raises(UsageError, match="must be bytes"):
        b.decrypt(bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="must be bytes"):
        a.encrypt(bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="ad must be bytes"):
        b.decrypt(wire, ad=bad)  # type: ignore[arg-type]
    assert b.decrypt(wire) == b"kept"  # nothing was consumed by the refusals


def test_initiate_wants_a_parsed_bundle() -> None:
    alice, bob = Wallet.generate(), Wallet.generate()
    published = PrekeySecrets.generate(bob).bundle().to_bytes()
    with pytest.raises(UsageError, match=r"PrekeyBundle\.from_bytes"):
        Session.initiate(alice, None, published)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [("ns", -1), ("nr", 2**40), ("pn", 2**32)])
def test_from_dict_refuses_counters_outside_u32(field: str, value: int) -> None:
    a, _ = Session.create_pair()
    state = a.to_dict()
    state[field] = value
    with pytest.raises(EncodingError, match=f"{field} {value} out of range"):
        Session.from_dict(state)
