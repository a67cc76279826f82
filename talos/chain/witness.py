"""A log checked against heads other nodes hold (``talosd chain verify --heads FILE``).

DESIGN.md "Block log": nodes exchange signed heads "so a node cannot quietly
rewrite history". A log re-verified on its own cannot show that its newest
blocks were removed: what is left is still a valid chain. The heads a node's
peers kept (docs/PROTOCOL.md "Link protocol", Signed heads; ``talosd chain heads`` exports
them) can: a head this node signed at height *h* must match block *h* of its
log. Pure: the caller hands in the statements and the log's block hashes.

Defects: ``truncated`` (the log ends below a height this node signed),
``rewritten`` (block *h* has another hash than the one signed) and
``no_head`` (statements were given and not one is a valid statement of this
node: whoever swapped the log's owner, key file and all, would be its node).
Statements of other nodes, or whose signature does not verify, are skipped and
counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from talos.chain.block import verify_head_statement
from talos.chain.verify import Defect
from talos_sdk.errors import UsageError

__all__ = ["WitnessReport", "check_heads", "statements_of"]


@dataclass(slots=True)
class WitnessReport:
    """What the held heads say about a log."""

    checked: int = 0
    skipped: int = 0
    defects: list[Defect] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "skipped": self.skipped,
            "defects": [
                {"code": d.code, "height": d.height, "index": d.index, "message": d.message}
                for d in self.defects
            ],
        }


def statements_of(document: Any) -> list[dict[str, Any]]:
    """Head statements in a ``--heads`` file: one statement, a list, or ``{DID: statement}``."""
    if isinstance(document, dict) and "signature" in document:
        return [document]
    if isinstance(document, dict):
        document = list(document.values())
    if not isinstance(document, list) or not all(isinstance(s, dict) for s in document):
        raise UsageError("--heads needs a head statement, a list of them, or {DID: statement}")
    return list(document)


def check_heads(
    node_did: str,
    statements: Iterable[dict[str, Any]],
    block_hashes: Mapping[int, str],
    mldsa65_public_key: bytes | None = None,
) -> WitnessReport:
    """Check ``block_hashes`` (height -> hex hash of this node's log) against signed heads."""
    report = WitnessReport()
    tip = max(block_hashes, default=-1)
    statements = list(statements)
    for statement in statements:
        if statement.get("node") != node_did or not verify_head_statement(
            statement, node_did, mldsa65_public_key
        ):
            report.skipped += 1
            continue
        report.checked += 1
        height, signed = int(statement["height"]), str(statement["hash"])
        held = block_hashes.get(height)
        if held is None:
            report.defects.append(
                Defect(
                    "truncated",
                    height,
                    None,
                    f"a head signed by this node names block {height} ({signed[:16]}...),"
                    f" but the log ends at {tip}: its newest blocks were removed",
                )
            )
        elif held != signed:
            report.defects.append(
                Defect(
                    "rewritten",
                    height,
                    None,
                    f"block {height} is {held[:16]}..., but this node signed {signed[:16]}...",
                )
            )
    if report.skipped and not report.checked:
        names = sorted({str(s.get("node"))[:32] for s in statements})[:3]
        report.defects.append(
            Defect(
                "no_head",
                None,
                None,
                f"none of the {report.skipped} head statement(s) is a valid one of {node_did}"
                f" (they name {', '.join(names)}): a log whose owner was swapped looks so",
            )
        )
    return report
