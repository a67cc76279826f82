"""talos.chain.witness: a log checked against its node's signed heads held by others."""

from __future__ import annotations

from pathlib import Path

import pytest

from talos.chain.log import BlockLog
from talos.chain.witness import check_heads, statements_of
from talos.store import Store
from talos_sdk.errors import UsageError
from tests.talos.chain import ALICE, NODE, audit_record


@pytest.fixture
def sealed(tmp_path: Path) -> tuple[BlockLog, list[dict[str, object]]]:
    """A log of three blocks and the head statement signed after each."""
    log = BlockLog(Store(tmp_path / "store"), NODE, max_records=1)
    heads = []
    for i in range(3):
        log.append(audit_record(i))
        log.seal()
        head = log.heads()
        assert head is not None
        heads.append(head.statement)
    return log, heads


def hashes(log: BlockLog, below: int | None = None) -> dict[int, str]:
    return {
        b.height: b.hash().hex() for b in log.iter_blocks() if below is None or b.height < below
    }


def test_every_held_head_matches_the_log(sealed: tuple[BlockLog, list[dict[str, object]]]) -> None:
    log, heads = sealed
    report = check_heads(NODE.did, heads, hashes(log))
    assert (report.checked, report.skipped, report.defects) == (3, 0, [])
    log.store.close()


def test_truncation_and_rewrite_are_defects(
    sealed: tuple[BlockLog, list[dict[str, object]]],
) -> None:
    log, heads = sealed
    truncated = check_heads(NODE.did, heads, hashes(log, below=1))
    assert [(d.code, d.height) for d in truncated.defects] == [("truncated", 1), ("truncated", 2)]
    rewritten = hashes(log)
    rewritten[2] = "00" * 32
    report = check_heads(NODE.did, heads, rewritten)
    assert [(d.code, d.height) for d in report.defects] == [("rewritten", 2)]
    log.store.close()


def test_foreign_and_forged_statements_are_skipped(
    sealed: tuple[BlockLog, list[dict[str, object]]],
) -> None:
    log, heads = sealed
    forged = {**heads[2], "height": 7}  # the signature no longer covers the body
    report = check_heads(ALICE.did, heads, hashes(log))
    assert (report.checked, report.skipped) == (0, 3)
    # Not one statement is this node's: what a log whose owner was swapped (key file
    # and all) looks like, since the peers' heads name the real owner. It fails.
    assert [(d.code, d.height) for d in report.defects] == [("no_head", None)]
    assert NODE.did[:32] in report.defects[0].message
    report = check_heads(NODE.did, [forged], {})
    assert (report.checked, report.skipped) == (0, 1)
    report = check_heads(NODE.did, [forged, heads[0]], hashes(log))
    assert (report.checked, report.skipped, report.defects) == (1, 1, [])
    log.store.close()


def test_heads_file_shapes() -> None:
    one = {"node": "did:key:z", "signature": "00"}
    assert statements_of(one) == [one]
    assert statements_of([one, one]) == [one, one]
    assert statements_of({"did:key:z": one}) == [one]
    with pytest.raises(UsageError, match="--heads needs"):
        statements_of("nope")
