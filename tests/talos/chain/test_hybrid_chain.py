"""Hybrid-signed block logs (ADR 0005): talos/chain/block.py, log.py, verify.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from talos.chain.block import (
    Block,
    BlockSignatureError,
    validate_block,
    verify_head_statement,
    verify_inclusion_proof,
)
from talos.chain.log import HYBRID_SINCE_KEY, BlockLog, block_key
from talos.chain.verify import verify_chain
from talos.store import Store
from talos_sdk.errors import MalformedFrameError, UsageError
from talos_sdk.hybrid import HYBRID_SIGNATURE_SIZE, SUITE_HYBRID
from talos_sdk.wallet import Wallet
from tests.talos.chain import NODE, audit_record, make_record

HNODE = Wallet.from_seed(NODE.seed, suite=SUITE_HYBRID)  # same DID as NODE
OTHER = Wallet.from_seed(b"\x07" * 32, suite=SUITE_HYBRID)
KEY = HNODE.mldsa_public_key


@pytest.fixture
def hybrid_chain(tmp_path: Path) -> Iterator[tuple[Store, BlockLog]]:
    store = Store(tmp_path / "store")
    log = BlockLog(store, HNODE, max_records=3, clock=lambda: 1_700_000_000.0)
    for i in range(8):
        log.append(make_record(i))
    log.append(audit_record(1))
    log.seal()
    yield store, log
    store.close()


def codes(store: Store, key: bytes | None = KEY) -> list[tuple[str, int | None]]:
    report = verify_chain(store, HNODE.did, workers=1, mldsa65_public_key=key)
    return [(d.code, d.height) for d in report.defects]


def test_hybrid_blocks_round_trip_and_verify(hybrid_chain: tuple[Store, BlockLog]) -> None:
    store, log = hybrid_chain
    blocks = list(log.iter_blocks())
    assert len(blocks) == 3
    for b in blocks:
        assert b.version == 2 and b.key_id == HNODE.hybrid_public_key.key_id
        assert len(b.signature) == HYBRID_SIGNATURE_SIZE
        assert Block.from_bytes(b.to_bytes()) == b
    validate_block(
        blocks[0],
        log.block_records(0),
        bytes(32),
        HNODE.did,
        expected_height=0,
        auth_key=HNODE.hybrid_public_key,
    )
    assert codes(store) == []


def test_hybrid_chain_needs_the_mldsa_key(hybrid_chain: tuple[Store, BlockLog]) -> None:
    store, _ = hybrid_chain
    # Only the DID: every hybrid block is reported, none silently accepted.
    assert codes(store, None) == [("block_signature", h) for h in range(3)]
    # Someone else's ML-DSA key under this DID is refused at once.
    with pytest.raises(UsageError):
        verify_chain(store, HNODE.did, mldsa65_public_key=b"\x00" * 5)
    # A valid key that is not the node's: key ids differ in every block.
    wrong = [
        d for d in verify_chain(store, HNODE.did, mldsa65_public_key=OTHER.mldsa_public_key).defects
    ]
    assert [d.code for d in wrong] == ["block_signature"] * 3
    assert "not the node's hybrid key" in wrong[0].message


def test_stripped_mldsa_half_is_a_defect(hybrid_chain: tuple[Store, BlockLog]) -> None:
    store, log = hybrid_chain
    b = log.get_block(1)
    assert b is not None
    # Re-signed classically by the (same-seed) Ed25519 key, key_id dropped: a downgrade.
    classical = dataclasses.replace(b, key_id=None, signature=b"")
    classical = dataclasses.replace(classical, signature=NODE.sign(classical.header_bytes()))
    with store.write() as txn:
        txn.put("blocks", block_key(1), classical.to_bytes())
    found = verify_chain(store, HNODE.did, workers=1, mldsa65_public_key=KEY).defects
    assert ("block_signature", 1) in [(d.code, d.height) for d in found]
    assert any("downgrade" in d.message for d in found)


def test_swapped_halves_between_blocks(hybrid_chain: tuple[Store, BlockLog]) -> None:
    store, log = hybrid_chain
    b0, b1 = log.get_block(0), log.get_block(1)
    assert b0 is not None and b1 is not None
    mixed = dataclasses.replace(b1, signature=b1.signature[:64] + b0.signature[64:])
    with store.write() as txn:
        txn.put("blocks", block_key(1), mixed.to_bytes())
    found = verify_chain(store, HNODE.did, workers=1, mldsa65_public_key=KEY).defects
    assert ("block_signature", 1) in [(d.code, d.height) for d in found]


def test_wrong_context_signature_is_refused(hybrid_chain: tuple[Store, BlockLog]) -> None:
    _store, log = hybrid_chain
    b = log.get_block(0)
    assert b is not None
    # A genuine hybrid signature, of other bytes (the header with a prefix).
    forged = dataclasses.replace(b, signature=HNODE.sign_auth(b"head:" + b.header_bytes()))
    with pytest.raises(BlockSignatureError, match="hybrid node signature"):
        validate_block(
            forged, log.block_records(0), bytes(32), HNODE.did, auth_key=HNODE.hybrid_public_key
        )


def test_upgrade_from_classical_keeps_old_blocks_valid(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as store:
        log = BlockLog(store, NODE, max_records=2)
        for i in range(4):
            log.append(make_record(i))
        log.seal()
        log = BlockLog(store, HNODE, max_records=2)  # same seed, now hybrid
        with store.read() as txn:
            assert txn.get("meta", HYBRID_SINCE_KEY) == (2).to_bytes(8, "big")
        for i in range(4, 6):
            log.append(make_record(i))
        log.seal()
        assert [b.version for b in log.iter_blocks()] == [1, 1, 2]
        assert verify_chain(store, HNODE.did, workers=1, mldsa65_public_key=KEY).ok
        # A hybrid-era block rewritten classically is still caught.
        b2 = log.get_block(2)
        assert b2 is not None
        c = dataclasses.replace(b2, key_id=None, signature=b"")
        c = dataclasses.replace(c, signature=NODE.sign(c.header_bytes()))
        with store.write() as txn:
            txn.put("blocks", block_key(2), c.to_bytes())
        report = verify_chain(store, HNODE.did, workers=1, mldsa65_public_key=KEY)
        assert next((d.code, d.height) for d in report.defects) == ("block_signature", 2)


def test_a_downgrade_that_moves_the_stores_hybrid_height_is_caught_by_the_key_file(
    hybrid_chain: tuple[Store, BlockLog],
) -> None:
    # A forger of Ed25519 (not of ML-DSA) rewrites every hybrid block classically and
    # sets the store's chain:hybrid_since past the tip, so no block "must" be hybrid.
    # The store alone cannot tell; the height the node's key file keeps (0 for a node
    # made hybrid) can.
    store, log = hybrid_chain
    prev = bytes(32)
    with store.write() as txn:
        for block in list(log.iter_blocks()):
            c = dataclasses.replace(block, key_id=None, prev_hash=prev, signature=b"")
            c = dataclasses.replace(c, signature=NODE.sign(c.header_bytes()))
            txn.put("blocks", block_key(block.height), c.to_bytes())
            prev = c.hash()
        txn.put("meta", HYBRID_SINCE_KEY, (3).to_bytes(8, "big"))
    assert codes(store) == []  # what the store's row alone allows
    report = verify_chain(store, HNODE.did, workers=1, mldsa65_public_key=KEY, hybrid_since=0)
    assert [(d.code, d.height) for d in report.defects] == [
        ("hybrid_since", None),
        *(("block_signature", h) for h in range(3)),
    ]
    assert "key file at 0" in report.defects[0].message


def test_parallel_audit_of_a_hybrid_chain(hybrid_chain: tuple[Store, BlockLog]) -> None:
    store, _ = hybrid_chain
    report = verify_chain(store, HNODE.did, workers=2, parallel_threshold=0, mldsa65_public_key=KEY)
    assert report.ok and report.workers == 2


def test_hybrid_heads_and_inclusion_proofs(hybrid_chain: tuple[Store, BlockLog]) -> None:
    _, log = hybrid_chain
    head = log.heads()
    assert head is not None
    assert verify_head_statement(head.statement, HNODE.did, KEY)
    # Classical check of a hybrid head, or another identity's key: refused.
    assert not verify_head_statement(head.statement, HNODE.did)
    assert not verify_head_statement(head.statement, HNODE.did, OTHER.mldsa_public_key)
    stripped = {**head.statement, "signature": head.statement["signature"][:128]}
    assert not verify_head_statement(stripped, HNODE.did, KEY)
    rec = make_record(4)
    proof = log.inclusion_proof(rec.record_id)
    assert verify_inclusion_proof(proof, HNODE.did, KEY)
    assert not verify_inclusion_proof(proof, HNODE.did)
    assert not verify_inclusion_proof(proof, HNODE.did, OTHER.mldsa_public_key)


def test_block_layout_errors() -> None:
    b = Block(0, bytes(32), 1, bytes(32), 0, HNODE.did, key_id=bytes(32))
    with pytest.raises(UsageError, match="3373 bytes"):
        dataclasses.replace(b, signature=b"\x00" * 64)
    with pytest.raises(UsageError, match="key_id must be 32"):
        dataclasses.replace(b, key_id=b"\x00")
    signed = dataclasses.replace(b, signature=HNODE.sign_auth(b.header_bytes()))
    raw = signed.to_bytes()
    for bad in (raw[:-1], raw + b"\x00", raw[:4] + b"\x03" + raw[5:]):
        with pytest.raises(MalformedFrameError):
            Block.from_bytes(bad)
