"""Tests for the pure block-log rules in talos/chain/block.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from talos.chain.block import (
    GENESIS_PREV,
    Block,
    BlockHeightError,
    BlockLinkError,
    BlockNodeError,
    BlockSignatureError,
    ChainDefect,
    MerkleRootError,
    Record,
    RecordCountError,
    RecordSignatureError,
    check_record_signature,
    collect_block_defects,
    head_signing_bytes,
    head_statement,
    validate_block,
    verify_head_statement,
)
from talos_sdk.errors import ChainError, MalformedFrameError, UsageError
from talos_sdk.merkle import merkle_root
from tests.talos.chain import ALICE, BOB, NODE, audit_record, make_record


def sealed(records: list[Record], height: int = 0, prev: bytes = GENESIS_PREV) -> Block:
    unsigned = Block(
        height,
        prev,
        1_700_000_000_500,
        merkle_root([r.encoded for r in records]),
        len(records),
        NODE.did,
    )
    return dataclasses.replace(unsigned, signature=NODE.sign(unsigned.header_bytes()))


# --- records ------------------------------------------------------------------------------------


def test_record_round_trip() -> None:
    for record in (make_record(1), audit_record(2)):
        assert Record.from_bytes(record.to_bytes()) == record
        decoded = Record.from_bytes(record.to_bytes())
        assert dataclasses.replace(decoded).encoded == record.encoded  # canonical layout
    assert len(make_record(1).commitment_hash) == 32


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kind": ""}, "kind"),
        ({"kind": "k" * 33}, "kind"),
        ({"record_id": b"\x00" * 15}, "16 or 32"),
        ({"sender": ""}, "sender"),
        ({"commitment": b"c" * 4097}, "commitment"),
        ({"signature": b"s" * 63}, "signature"),
        ({"timestamp_ms": -1}, "timestamp"),
        ({"timestamp_ms": 1 << 64}, "timestamp"),
        ({"extra": b"e" * 4097}, "extra"),
    ],
)
def test_record_rejects_bad_fields(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        dataclasses.replace(make_record(1), **change)


def test_record_decode_rejects_every_truncation_and_trailing_bytes() -> None:
    data = make_record(3).to_bytes()
    for cut in range(len(data)):
        with pytest.raises(MalformedFrameError):
            Record.from_bytes(data[:cut])
    with pytest.raises(MalformedFrameError, match="trailing"):
        Record.from_bytes(data + b"\x00")


def test_record_decode_rejects_bad_version_utf8_and_lengths() -> None:
    data = bytearray(make_record(4).to_bytes())
    with pytest.raises(MalformedFrameError, match="version"):
        Record.from_bytes(b"\x02" + bytes(data[1:]))
    bad_kind = bytearray(data)
    bad_kind[2] = 0xFF  # first byte of kind "msg"
    with pytest.raises(MalformedFrameError, match="UTF-8"):
        Record.from_bytes(bytes(bad_kind))
    # record id length 5 with the bytes present: parses structurally, refused by bounds
    short_id = b"\x01\x03msg\x05" + b"12345" + data[1 + 1 + 3 + 1 + 16 :]
    with pytest.raises(MalformedFrameError, match="16 or 32"):
        Record.from_bytes(short_id)


def test_check_record_signature() -> None:
    assert check_record_signature(make_record(1), NODE.did) is None
    assert check_record_signature(audit_record(1), NODE.did) is None
    forged = dataclasses.replace(make_record(1), signature=BOB.sign(make_record(1).commitment))
    assert check_record_signature(forged, NODE.did) == "sender signature does not verify"
    unsigned = dataclasses.replace(make_record(1), signature=b"")
    assert "not authored by the node" in str(check_record_signature(unsigned, NODE.did))
    bad_did = dataclasses.replace(make_record(1), sender="did:key:nonsense")
    assert "DID unusable" in str(check_record_signature(bad_did, NODE.did))


# --- blocks -------------------------------------------------------------------------------------


def test_block_round_trip_and_hash_covers_signature() -> None:
    block = sealed([make_record(i) for i in range(5)])
    assert Block.from_bytes(block.to_bytes()) == block
    assert block.to_bytes() == block.header_bytes() + block.signature
    other_sig = dataclasses.replace(block, signature=bytes(64))
    assert other_sig.header_bytes() == block.header_bytes()
    assert other_sig.hash() != block.hash()
    with pytest.raises(UsageError, match="unsigned"):
        dataclasses.replace(block, signature=b"").to_bytes()


def test_block_decode_rejects_garbage() -> None:
    data = sealed([make_record(1)]).to_bytes()
    with pytest.raises(MalformedFrameError, match="truncated"):
        Block.from_bytes(data[:50])
    with pytest.raises(MalformedFrameError, match="version 1"):
        Block.from_bytes(b"XXXX" + data[4:])
    with pytest.raises(MalformedFrameError, match="length"):
        Block.from_bytes(data + b"\x00")
    with pytest.raises(MalformedFrameError, match="length"):
        Block.from_bytes(data[:-1])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"height": -1}, "height"),
        ({"prev_hash": b"x"}, "32 bytes"),
        ({"merkle_root": b""}, "32 bytes"),
        ({"record_count": 1 << 32}, "count"),
        ({"signature": b"s"}, "64 bytes"),
        ({"node_did": ""}, "DID"),
    ],
)
def test_block_rejects_bad_fields(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        dataclasses.replace(sealed([make_record(1)]), **change)


def test_valid_block_passes() -> None:
    records = [make_record(i) for i in range(7)] + [audit_record(8)]
    first = sealed(records)
    validate_block(first, records, GENESIS_PREV, NODE.did, expected_height=0)
    second = sealed([make_record(20)], height=1, prev=first.hash())
    validate_block(second, [make_record(20)], first.hash(), NODE.did, expected_height=1)


def test_each_block_defect_is_named_with_its_place() -> None:
    records = [make_record(i) for i in range(4)]
    block = sealed(records, height=3, prev=b"\x11" * 32)

    def fails(exc: type[ChainDefect], **kw: Any) -> ChainDefect:
        args: dict[str, Any] = {
            "block": block,
            "records": records,
            "prev_hash": b"\x11" * 32,
            "node_did": NODE.did,
            "expected_height": 3,
        }
        args.update(kw)
        with pytest.raises(exc) as info:
            validate_block(**args)
        assert isinstance(info.value, ChainError)
        assert info.value.height == args["expected_height"]  # where it is stored
        return info.value

    assert "header says height 3, expected 2" in str(fails(BlockHeightError, expected_height=2))
    fails(BlockLinkError, prev_hash=b"\x22" * 32)
    fails(BlockNodeError, node_did=ALICE.did)
    fails(RecordCountError, records=records[:3])
    fails(MerkleRootError, records=[records[1], records[0], *records[2:]])
    fails(
        BlockSignatureError,
        block=dataclasses.replace(block, signature=ALICE.sign(block.header_bytes())),
    )
    forged = dataclasses.replace(records[2], signature=BOB.sign(records[2].commitment))
    bad = [*records[:2], forged, records[3]]
    err = fails(RecordSignatureError, block=sealed(bad, height=3, prev=b"\x11" * 32), records=bad)
    assert err.index == 2
    assert "block 3, record 2" in str(err)


def test_collect_reports_every_defect() -> None:
    records = [make_record(i) for i in range(3)]
    block = sealed(records)
    found = collect_block_defects(block, records[:2], b"\x01" * 32, NODE.did, expected_height=5)
    assert [d.code for d in found] == ["height", "prev_link", "record_count", "merkle_root"]


# --- signed heads -------------------------------------------------------------------------------


def test_head_statement_signed_and_checked() -> None:
    h = b"\xab" * 32
    sig = NODE.sign(head_signing_bytes(NODE.did, 9, h, 1234))
    statement = head_statement(NODE.did, 9, h, 1234, sig)
    assert verify_head_statement(statement, NODE.did)
    assert verify_head_statement(statement)
    assert not verify_head_statement(statement, ALICE.did)
    assert not verify_head_statement({**statement, "height": 10})
    assert not verify_head_statement({**statement, "hash": "zz"})
    assert not verify_head_statement({**statement, "type": "other"})
    assert not verify_head_statement({k: v for k, v in statement.items() if k != "signature"})
    assert not verify_head_statement({**statement, "node": "did:key:bad"})
    # The same values spelt another way would check, then compare as another head.
    for respelt in (
        {"hash": statement["hash"].upper()},
        {"hash": " ".join(statement["hash"])},
        {"height": 9.0},
        {"height": True, "timestamp_ms": 1234},
        {"unsigned": "x" * 1000},
    ):
        assert not verify_head_statement({**statement, **respelt}), respelt
