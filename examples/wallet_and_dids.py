"""Identities with the SDK alone: wallets, did:key, signatures, key files.

Shows (docs/DESIGN.md "Identity"; docs/PROTOCOL.md):

1. ``Wallet.generate()`` and the deterministic ``Wallet.from_seed(seed)``.
2. The did:key of a wallet and how it round-trips to the raw public key.
3. ``wallet.sign`` / ``wallet.verify`` and the module ``verify(did, data, sig)``
   that needs nothing but the sender's DID.
4. ``save_wallet`` / ``load_wallet`` with a passphrase; a wrong passphrase raises
   ``WrongPassphraseError``; the key file is created 0600.
5. The hybrid Ed25519 + ML-DSA-65 suite (``HybridWallet``): same DID for the
   same seed, a post-quantum signature for identity-bearing data.

No network, no node: ``talos_sdk`` is a pure library.
Run: ``python examples/wallet_and_dids.py``
"""

from __future__ import annotations

import stat
import tempfile
from pathlib import Path

from talos_sdk import (
    HybridWallet,
    Wallet,
    WrongPassphraseError,
    public_key_from_did,
    verify,
    verify_auth,
)
from talos_sdk.keyfile import load_wallet, save_wallet


def main() -> None:
    alice = Wallet.generate()
    print(f"fresh identity:      {alice.did}")

    # A fixed seed gives the same identity everywhere: useful for tests and vectors.
    seed = bytes(range(32))
    fixed = Wallet.from_seed(seed)
    assert fixed.did == Wallet.from_seed(seed).did
    print(f"identity from seed:  {fixed.did}")
    assert public_key_from_did(fixed.did) == fixed.public_key
    print(f"did:key -> public key {fixed.public_key.hex()[:16]}… (round-trips)")

    message = b"transfer 10 credits to bob"
    signature = alice.sign(message)
    print(f"signature: {len(signature)} bytes")
    print(f"alice.verify(message)            -> {alice.verify(message, signature)}")
    # Anyone who only knows alice's DID can check her signature.
    print(f"verify(alice.did, message)       -> {verify(alice.did, message, signature)}")
    print(f"verify(alice.did, tampered)      -> {verify(alice.did, message + b'0', signature)}")
    print(f"verify(other did, message)       -> {verify(fixed.did, message, signature)}")

    with tempfile.TemporaryDirectory(prefix="talos-wallet-") as tmp:
        path = Path(tmp) / "alice.key"
        save_wallet(alice, path, passphrase="correct horse battery staple")
        mode = stat.S_IMODE(path.stat().st_mode)
        print(f"saved key file, mode {mode:04o}")
        loaded = load_wallet(path, passphrase="correct horse battery staple")
        assert loaded.did == alice.did
        print(f"loaded with the passphrase: {loaded.did == alice.did}")
        try:
            load_wallet(path, passphrase="wrong")
        except WrongPassphraseError as exc:
            print(f"wrong passphrase -> {type(exc).__name__}: {exc}")
        else:
            raise SystemExit("a wrong passphrase was accepted")

    # Post-quantum hybrid: Ed25519 + ML-DSA-65 from the same seed (same DID).
    hybrid = HybridWallet.from_seed(seed)
    assert hybrid.did == fixed.did
    auth_sig = hybrid.sign_auth(b"prekey bundle bytes")
    ok = verify_auth(hybrid.did, hybrid.mldsa_public_key, b"prekey bundle bytes", auth_sig)
    print(
        f"hybrid suite {hybrid.suite}: same DID as the classical wallet: {hybrid.did == fixed.did}"
    )
    print(f"hybrid signature {len(auth_sig)} bytes, verify_auth -> {ok}")
    # Verifying against the pinned ML-DSA key refuses a classical-only signature.
    downgraded = verify_auth(
        hybrid.did,
        hybrid.mldsa_public_key,
        b"prekey bundle bytes",
        fixed.sign(b"prekey bundle bytes"),
    )
    print(f"classical signature where a hybrid one is pinned -> {downgraded}")


if __name__ == "__main__":
    main()
