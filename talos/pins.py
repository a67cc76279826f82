"""ML-DSA-65 pins: rows of the ``meta`` database (docs/adr/0005-hybrid-signatures.md).

``pin:mldsa65:`` || DID -> raw key, written once, on first hybrid contact,
never overwritten (the ``peers`` rows are DID -> address and are listed as
such). The node reads them for :class:`talos.link.auth.AuthPolicy` and writes
them on its writer thread; the link layer never touches the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from talos_sdk.hybrid import PinnedKeyChangedError

if TYPE_CHECKING:
    from talos.store import Txn

__all__ = ["PIN_PREFIX", "load_pin", "store_pin"]

PIN_PREFIX: Final = b"pin:mldsa65:"


def load_pin(txn: Txn, did: str) -> bytes | None:
    """The ML-DSA-65 key pinned for ``did``, or None."""
    return txn.get("meta", PIN_PREFIX + did.encode())


def store_pin(txn: Txn, did: str, key: bytes) -> None:
    """Pin ``key`` for ``did``; an existing different pin is never replaced."""
    old = txn.get("meta", PIN_PREFIX + did.encode())
    if old is not None and bytes(old) != bytes(key):
        raise PinnedKeyChangedError(f"refusing to replace the ML-DSA-65 key pinned for {did}")
    txn.put("meta", PIN_PREFIX + did.encode(), bytes(key))
