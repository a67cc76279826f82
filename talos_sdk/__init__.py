"""talos_sdk: the Talos protocol as a pure, synchronous library (docs/DESIGN.md layer 1).

Identity (:class:`Wallet`, did:key), RFC 8785 canonical JSON, prekey bundles,
X3DH (classical and ML-KEM-768 hybrid), the Double Ratchet :class:`Session`,
frame sealing (:class:`RatchetFrameCrypto`), RFC 6962 Merkle trees and the
:class:`TalosError` tree. No sockets, no event loop, no storage.

Names are resolved lazily so ``import talos_sdk`` stays cheap for tools that
only need one piece.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from talos_sdk.errors import (
    BundleError,
    ChainError,
    DecryptionError,
    DIDError,
    EncodingError,
    HandshakeError,
    KeyFileError,
    LinkRefusedError,
    MalformedFrameError,
    OversizeError,
    PeerUnreachableError,
    ProtocolError,
    SignatureError,
    StorageError,
    StorageFullError,
    TalosError,
    UsageError,
    WrongPassphraseError,
)
from talos_sdk.errors import __all__ as _error_names

_LAZY: dict[str, str] = {
    "Wallet": "talos_sdk.wallet",
    "HybridWallet": "talos_sdk.wallet",
    "verify": "talos_sdk.wallet",
    "verify_auth": "talos_sdk.wallet",
    "did_from_public_key": "talos_sdk.did",
    "public_key_from_did": "talos_sdk.did",
    "canonical_json_bytes": "talos_sdk.canonical",
    "PrekeyBundle": "talos_sdk.bundle",
    "PrekeySecrets": "talos_sdk.prekeys",
    "Session": "talos_sdk.ratchet",
    "RatchetFrameCrypto": "talos_sdk.frames",
    "Frame": "talos_sdk.frames",
    "Commitment": "talos_sdk.frames",
    "StreamSealer": "talos_sdk.aead",
    "StreamOpener": "talos_sdk.aead",
    "MerkleAccumulator": "talos_sdk.merkle",
    "merkle_root": "talos_sdk.merkle",
    "inclusion_proof": "talos_sdk.merkle",
    "verify_inclusion": "talos_sdk.merkle",
    "consistency_proof": "talos_sdk.merkle",
    "verify_consistency": "talos_sdk.merkle",
    "save_wallet": "talos_sdk.keyfile",
    "load_wallet": "talos_sdk.keyfile",
    # Errors defined beside the code that raises them (drawn in talos_sdk/errors.py's tree).
    "PartyMismatchError": "talos_sdk.frames",
    "PeerSuiteError": "talos_sdk.hybrid",
    "DowngradeError": "talos_sdk.hybrid",
    "PinnedKeyChangedError": "talos_sdk.hybrid",
    "PostQuantumRequiredError": "talos_sdk.hybrid",
}

__all__ = [  # noqa: RUF022 - grouped: errors first, then the lazily imported API
    "BundleError",
    "ChainError",
    "DIDError",
    "DecryptionError",
    "EncodingError",
    "HandshakeError",
    "KeyFileError",
    "LinkRefusedError",
    "MalformedFrameError",
    "OversizeError",
    "PeerUnreachableError",
    "ProtocolError",
    "SignatureError",
    "StorageError",
    "StorageFullError",
    "TalosError",
    "UsageError",
    "WrongPassphraseError",
    "DowngradeError",
    "PartyMismatchError",
    "PeerSuiteError",
    "PinnedKeyChangedError",
    "PostQuantumRequiredError",
    "Commitment",
    "Frame",
    "HybridWallet",
    "MerkleAccumulator",
    "PrekeyBundle",
    "PrekeySecrets",
    "RatchetFrameCrypto",
    "Session",
    "StreamOpener",
    "StreamSealer",
    "Wallet",
    "canonical_json_bytes",
    "consistency_proof",
    "did_from_public_key",
    "inclusion_proof",
    "load_wallet",
    "merkle_root",
    "public_key_from_did",
    "save_wallet",
    "verify",
    "verify_auth",
    "verify_consistency",
    "verify_inclusion",
]
assert set(__all__) == set(_error_names) | set(_LAZY)

if TYPE_CHECKING:
    from talos_sdk.aead import StreamOpener, StreamSealer
    from talos_sdk.bundle import PrekeyBundle
    from talos_sdk.canonical import canonical_json_bytes
    from talos_sdk.did import did_from_public_key, public_key_from_did
    from talos_sdk.frames import Commitment, Frame, PartyMismatchError, RatchetFrameCrypto
    from talos_sdk.hybrid import (
        DowngradeError,
        PeerSuiteError,
        PinnedKeyChangedError,
        PostQuantumRequiredError,
    )
    from talos_sdk.keyfile import load_wallet, save_wallet
    from talos_sdk.merkle import (
        MerkleAccumulator,
        consistency_proof,
        inclusion_proof,
        merkle_root,
        verify_consistency,
        verify_inclusion,
    )
    from talos_sdk.prekeys import PrekeySecrets
    from talos_sdk.ratchet import Session
    from talos_sdk.wallet import HybridWallet, Wallet, verify, verify_auth


def __dir__() -> list[str]:
    """The lazily imported names too, for help(), dir() and completion."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'talos_sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
