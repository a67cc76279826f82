"""End-to-end encryption with the SDK alone: X3DH + Double Ratchet, then signed frames.

Shows (docs/PROTOCOL.md "X3DH", "Double Ratchet", "Frames"):

1. ``Session.create_pair()``: two connected sessions through the real X3DH
   path (classical ``x25519`` and the post-quantum hybrid ``x25519-mlkem768``).
2. ``encrypt`` / ``decrypt`` both ways, and out-of-order delivery (skipped
   message keys are kept, bounded by MAX_SKIP).
3. A tampered or replayed ciphertext -> the one opaque ``DecryptionError``.
4. ``to_bytes`` / ``from_bytes``: a session survives a restart.
5. ``RatchetFrameCrypto``: sessions built from your own wallets with a
   published prekey bundle; ``seal`` puts the sender's signed commitment inside
   the ciphertext, ``open`` returns it, ``verify_commitment`` checks it.

Run: ``python examples/session_messaging.py``
"""

from __future__ import annotations

import hashlib

from talos_sdk import (
    BundleError,
    DecryptionError,
    Frame,
    PrekeyBundle,
    PrekeySecrets,
    RatchetFrameCrypto,
    Session,
    Wallet,
)


def ratchet_basics() -> None:
    alice, bob = Session.create_pair()
    print(f"session pair ({alice.suite}): {alice.local_did[:24]}… <-> {bob.local_did[:24]}…")

    wire = alice.encrypt(b"hello bob")
    print(f"alice -> bob: {len(wire)} bytes on the wire -> {bob.decrypt(wire)!r}")
    print(f"bob -> alice: {alice.decrypt(bob.encrypt(b'hello alice'))!r}")

    # Out of order: bob receives the third message first, then the others.
    m1, m2, m3 = (alice.encrypt(f"message {i}".encode()) for i in (1, 2, 3))
    order = [bob.decrypt(m) for m in (m3, m1, m2)]
    print(f"delivered 3, 1, 2 -> {[p.decode() for p in order]}")

    # Tampering anywhere (header or ciphertext) is one opaque error; state is untouched.
    m4 = alice.encrypt(b"pay 10")
    tampered = m4[:-1] + bytes([m4[-1] ^ 1])
    for label, bad in (("tampered", tampered), ("replayed", m1), ("garbage", b"\x00" * 8)):
        try:
            bob.decrypt(bad)
        except DecryptionError as exc:
            print(f"{label:9} -> {type(exc).__name__}")
        else:
            raise SystemExit(f"a {label} message was accepted")
    print(f"the genuine message still opens: {bob.decrypt(m4)!r}")

    # Persist (e.g. to LMDB) and restore: the restored session carries on.
    saved = bob.to_bytes()
    restored = Session.from_bytes(saved)
    print(f"bob's state: {len(saved)} bytes; restored session decrypts:", end=" ")
    print(repr(restored.decrypt(alice.encrypt(b"after restart"))))

    pq_alice, pq_bob = Session.create_pair("x25519-mlkem768")
    print(f"hybrid suite {pq_alice.suite}: {pq_bob.decrypt(pq_alice.encrypt(b'post-quantum'))!r}")


def signed_frames() -> None:
    # Bob publishes a prekey bundle (signed by his identity); alice fetches and verifies it.
    alice_w, bob_w = Wallet.generate(), Wallet.generate()
    bob_secrets = PrekeySecrets.generate(bob_w, one_time=2, pq=True)
    published = bob_secrets.bundle().to_bytes()
    bundle = PrekeyBundle.from_bytes(published)
    print(f"\nbob's bundle: {len(published)} bytes, suites {list(bundle.suites)}")

    alice_s = Session.initiate(alice_w, None, bundle, suite="x25519-mlkem768")
    # The first message carries the X3DH initial data; bob answers it with his secrets.
    # (A node sends it as a session-init frame before any application frame.)
    init = alice_s.encrypt(b"")
    bob_s, _ = Session.respond(bob_w, bob_secrets, init)
    print(f"bob accepted alice's X3DH init ({alice_s.suite}); its one-time prekey is consumed")
    try:
        Session.respond(bob_w, bob_secrets, init)
    except BundleError as exc:
        print(f"the same init replayed -> {type(exc).__name__}: {exc}")
    else:
        raise SystemExit("a replayed X3DH init was accepted")

    alice, bob = RatchetFrameCrypto(alice_w, alice_s), RatchetFrameCrypto(bob_w, bob_s)
    frame = Frame(type=1, sender=alice_w.did, recipient=bob_w.did, sequence=1,
                  timestamp=1_700_000_000_000, payload=b"the report is ready")  # fmt: skip
    got, _ = bob.open(alice.seal(frame))
    print(f"bob opened {got.payload!r} seq {got.sequence}")
    reply = bob.seal(Frame(1, bob_w.did, alice_w.did, 1, 1_700_000_000_500, b"thanks"))
    got, commitment = alice.open(reply)
    print(f"alice opened {got.payload!r} from {got.sender[:24]}… seq {got.sequence}")
    print(f"commitment: sha256(payload) = {commitment.payload_hash.hex()[:16]}…,", end=" ")
    print(f"signature {len(commitment.signature)} bytes")
    # The audit record keeps the commitment: anyone with the sender's DID can check it.
    for name, did in (("bob", bob_w.did), ("alice", alice_w.did)):
        ok = RatchetFrameCrypto.verify_commitment(commitment, did)
        print(f"verify_commitment(commitment, {name}) -> {ok}")
    assert commitment.payload_hash == hashlib.sha256(b"thanks").digest()


def main() -> None:
    ratchet_basics()
    signed_frames()


if __name__ == "__main__":
    main()
