"""Shared helpers for the block-log tests: fixed wallets and signed records."""

from __future__ import annotations

import hashlib

from talos.chain.block import Record
from talos_sdk.wallet import Wallet

NODE = Wallet.from_seed(bytes(range(32)))
ALICE = Wallet.from_seed(b"\x01" * 32)
BOB = Wallet.from_seed(b"\x02" * 32)


def make_record(i: int, sender: Wallet = ALICE, recipient: Wallet = BOB) -> Record:
    """Record ``i``: a commitment signed by ``sender``, id derived from ``i``."""
    commitment = b"talos-test-commitment|" + i.to_bytes(8, "big") + b"|" + recipient.did.encode()
    return Record(
        kind="msg",
        record_id=hashlib.sha256(b"id" + i.to_bytes(8, "big")).digest()[:16],
        sender=sender.did,
        recipient=recipient.did,
        commitment=commitment,
        signature=sender.sign(commitment),
        timestamp_ms=1_700_000_000_000 + i,
    )


def audit_record(i: int) -> Record:
    """A node-authored, unsigned record (the block signature vouches for it)."""
    return Record(
        kind="mcp",
        record_id=hashlib.sha256(b"audit" + i.to_bytes(8, "big")).digest(),
        sender=NODE.did,
        recipient=ALICE.did,
        commitment=hashlib.sha256(b"call" + i.to_bytes(8, "big")).digest(),
        signature=b"",
        timestamp_ms=1_700_000_000_000 + i,
        extra=b'{"tool":"get_time"}',
    )
