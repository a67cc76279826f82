"""Tests for talos_sdk.merkle: CT vectors, an independent recursive reference, proofs, bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talos_sdk.errors import UsageError
from talos_sdk.merkle import (
    EMPTY_ROOT,
    MerkleAccumulator,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    merkle_root,
    verify_consistency,
    verify_inclusion,
    verify_inclusion_hash,
)

VEC: dict[str, Any] = json.loads(
    (Path(__file__).parent.parent / "vectors" / "merkle" / "rfc6962_ct.json").read_text()
)
LEAVES = [bytes.fromhex(x) for x in VEC["leaves"]]


# --- an independent, literal transcription of RFC 9162 2.1 (recursive, slow) ---


def _k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_mth(d: list[bytes]) -> bytes:
    if not d:
        return hashlib.sha256(b"").digest()
    if len(d) == 1:
        return hashlib.sha256(b"\x00" + d[0]).digest()
    k = _k(len(d))
    return hashlib.sha256(b"\x01" + ref_mth(d[:k]) + ref_mth(d[k:])).digest()


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    if len(d) == 1:
        return []
    k = _k(len(d))
    if m < k:
        return [*ref_path(m, d[:k]), ref_mth(d[k:])]
    return [*ref_path(m - k, d[k:]), ref_mth(d[:k])]


def ref_subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    if m == len(d):
        return [] if b else [ref_mth(d)]
    k = _k(len(d))
    if m <= k:
        return [*ref_subproof(m, d[:k], b), ref_mth(d[k:])]
    return [*ref_subproof(m - k, d[k:], False), ref_mth(d[:k])]


# --- vectors ---


def test_empty_root() -> None:
    assert merkle_root([]) == EMPTY_ROOT == bytes.fromhex(VEC["empty_root"])
    assert MerkleAccumulator().root() == EMPTY_ROOT


@pytest.mark.parametrize("size", range(1, 9))
def test_ct_roots(size: int) -> None:
    expected = bytes.fromhex(VEC["roots"][size - 1])
    assert ref_mth(LEAVES[:size]) == expected  # the vector agrees with the RFC text
    assert merkle_root(LEAVES[:size]) == expected
    acc = MerkleAccumulator()
    acc.extend(LEAVES[:size])
    assert len(acc) == size and acc.root() == expected


@pytest.mark.parametrize("vec", VEC["inclusion"])
def test_ct_inclusion(vec: dict[str, Any]) -> None:
    leaves = LEAVES[: vec["size"]]
    path = [bytes.fromhex(x) for x in vec["path"]]
    assert ref_path(vec["index"], leaves) == path
    assert inclusion_proof(leaves, vec["index"]) == path
    assert verify_inclusion(leaves[vec["index"]], vec["index"], vec["size"], path, ref_mth(leaves))


@pytest.mark.parametrize("vec", VEC["consistency"])
def test_ct_consistency(vec: dict[str, Any]) -> None:
    m, n = vec["old_size"], vec["new_size"]
    proof = [bytes.fromhex(x) for x in vec["proof"]]
    assert ref_subproof(m, LEAVES[:n], True) == proof
    assert consistency_proof(LEAVES[:n], m) == proof
    assert verify_consistency(m, n, proof, ref_mth(LEAVES[:m]), ref_mth(LEAVES[:n]))


# --- properties over all sizes / indices ---


@pytest.mark.parametrize("n", range(1, 34))
def test_all_proofs_against_reference(n: int) -> None:
    leaves = [i.to_bytes(2, "big") for i in range(n)]
    root = merkle_root(leaves)
    assert root == ref_mth(leaves)
    for i in range(n):
        proof = inclusion_proof(leaves, i)
        assert proof == ref_path(i, leaves)
        assert verify_inclusion(leaves[i], i, n, proof, root)
        assert verify_inclusion_hash(leaf_hash(leaves[i]), i, n, proof, root)
        assert not verify_inclusion(leaves[i] + b"x", i, n, proof, root)
        if n > 1:
            assert not verify_inclusion(leaves[i], (i + 1) % n, n, proof, root)
    for m in range(0, n + 1):
        proof = consistency_proof(leaves, m)
        if 0 < m < n:
            assert proof == ref_subproof(m, leaves, True)
        assert verify_consistency(m, n, proof, merkle_root(leaves[:m]), root)


@pytest.mark.parametrize("n", [255, 256, 257, 1000])
def test_root_of_a_block_against_reference_and_accumulator(n: int) -> None:
    # merkle_root hashes level by level; the reference splits at powers of two.
    leaves = [i.to_bytes(4, "big") * 50 for i in range(n)]
    acc = MerkleAccumulator()
    acc.extend(leaves)
    assert merkle_root(leaves) == ref_mth(leaves) == acc.root()


@settings(max_examples=40)
@given(st.lists(st.binary(max_size=8), min_size=1, max_size=40), st.data())
def test_tampered_proofs_fail(leaves: list[bytes], data: st.DataObject) -> None:
    n = len(leaves)
    i = data.draw(st.integers(0, n - 1))
    root = merkle_root(leaves)
    proof = inclusion_proof(leaves, i)
    assert verify_inclusion(leaves[i], i, n, proof, root)
    if proof:
        j = data.draw(st.integers(0, len(proof) - 1))
        bad = list(proof)
        bad[j] = bytes([bad[j][0] ^ 1]) + bad[j][1:]
        assert not verify_inclusion(leaves[i], i, n, bad, root)
        assert not verify_inclusion(leaves[i], i, n, proof[:-1], root)
    assert not verify_inclusion(leaves[i], i, n, [*proof, root], root)
    m = data.draw(st.integers(1, n))
    cproof = consistency_proof(leaves, m)
    old = merkle_root(leaves[:m])
    assert verify_consistency(m, n, cproof, old, root)
    if m < n:
        bad_old = bytes([old[0] ^ 1]) + old[1:]
        assert not verify_consistency(m, n, cproof, bad_old, root)
        assert not verify_consistency(m, n, cproof[:-1], old, root)
        changed = [*leaves[: m - 1], leaves[m - 1] + b"!", *leaves[m:]]
        assert not verify_consistency(m, n, cproof, old, merkle_root(changed))


def test_accumulator_incremental_roots() -> None:
    acc = MerkleAccumulator()
    for i, leaf in enumerate(LEAVES):
        acc.append(leaf)
        assert acc.root() == bytes.fromhex(VEC["roots"][i])


# --- bad inputs ---


@pytest.mark.parametrize("index", [-1, 8, 100])
def test_inclusion_proof_bad_index(index: int) -> None:
    with pytest.raises(UsageError, match=f"leaf index {index} out of range for a tree of 8"):
        inclusion_proof(LEAVES, index)


def test_inclusion_proof_empty_tree_and_non_int() -> None:
    with pytest.raises(UsageError, match="out of range for a tree of 0"):
        inclusion_proof([], 0)
    with pytest.raises(UsageError, match="out of range"):
        inclusion_proof(LEAVES, 1.0)  # type: ignore[arg-type]


def test_verify_inclusion_bad_arguments() -> None:
    root = merkle_root(LEAVES)
    proof = inclusion_proof(LEAVES, 3)
    with pytest.raises(UsageError, match="root must be 32 bytes"):
        verify_inclusion(LEAVES[3], 3, 8, proof, root[:31])
    with pytest.raises(UsageError, match="leaf hash must be 32 bytes"):
        verify_inclusion_hash(b"short", 3, 8, proof, root)
    with pytest.raises(UsageError, match="non-negative integers"):
        verify_inclusion(LEAVES[3], -1, 8, proof, root)
    with pytest.raises(UsageError, match="non-negative integers"):
        verify_inclusion(LEAVES[3], 3, -8, proof, root)
    assert not verify_inclusion(LEAVES[3], 8, 8, proof, root)  # index >= size
    assert not verify_inclusion(LEAVES[3], 3, 8, [*proof[:2], b"short"], root)


def test_consistency_bad_arguments() -> None:
    root = merkle_root(LEAVES)
    with pytest.raises(UsageError, match="old_size 9 out of range"):
        consistency_proof(LEAVES, 9)
    with pytest.raises(UsageError, match="old_size -1 out of range"):
        consistency_proof(LEAVES, -1)
    # Sizes a peer claims: an impossible pair is a failed check, not a crash.
    assert verify_consistency(5, 4, [], root, root) is False
    assert verify_consistency(-1, 8, [], root, root) is False
    with pytest.raises(UsageError, match="tree sizes must be integers"):
        verify_consistency(1.0, 8, [], root, root)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="old root must be 32 bytes"):
        verify_consistency(1, 8, [], b"", root)
    with pytest.raises(UsageError, match="new root must be 32 bytes"):
        verify_consistency(1, 8, [], root, b"")
    old = merkle_root(LEAVES[:3])
    assert not verify_consistency(3, 8, [], old, root)  # empty proof for m < n
    assert not verify_consistency(3, 8, [b"short"], old, root)
    assert verify_consistency(8, 8, [], root, root)
    assert not verify_consistency(8, 8, [root], root, root)
    assert verify_consistency(0, 8, [], EMPTY_ROOT, root)
    assert not verify_consistency(0, 8, [], root, root)
