"""``talosd chain``: verify, show, prove and witness the node's block log (docs/PROTOCOL.md
"Block log"), from the running node or, when none runs, from the home's store."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from talos.cli_home import NOT_RUNNING as _NOT_RUNNING
from talos.cli_home import home_of as _home
from talos.cli_home import home_path as _home_path
from talos.cli_home import online as _online
from talos.cli_home import out as _out
from talos.cli_home import require_identity as _require_identity
from talos_sdk.errors import UsageError

if TYPE_CHECKING:  # talos.home loads the node's modules: imported where a command needs it
    from talos.home import LogOwner

__all__ = ["cmd_chain", "log_owner_of", "verify_report"]


def cmd_chain(args: argparse.Namespace) -> int:
    path = _home_path(args)
    _require_identity(path)

    owner = log_owner_of(path, args.passphrase_file)
    if args.chain_cmd == "verify":
        report = verify_report(path, owner, args.heads)
        if args.json:
            _out(report)
        for d in report["defects"]:
            where = "" if d["height"] is None else f" at block {d['height']}"
            where += "" if d["index"] is None else f" record {d['index']}"
            print(f"DEFECT {d['code']}{where}: {d['message']}", file=sys.stderr)
        # Quarantined records were never sealed, so the chain itself is intact: a
        # warning, not a failure (exit code 0 unless there are defects).
        quarantined = report.get("quarantined", [])
        for q in quarantined:
            print(
                f"WARNING quarantined record {q['record_id']} from {q['sender']}: {q['reason']}",
                file=sys.stderr,
            )
        if quarantined:
            print(
                f"WARNING: {len(quarantined)} quarantined record(s) refused at sealing"
                " (forged, badly signed, or not shown to be this node's); they are not in the"
                " chain",
                file=sys.stderr,
            )
        omitted = report.get("defects_omitted", 0)
        if omitted:
            print(f"... and {omitted} more defect(s), not listed", file=sys.stderr)
        if not report["ok"]:
            found = len(report["defects"]) + omitted
            print(
                f"chain verify FAILED: {found} defect(s), node {report.get('node')}",
                file=sys.stderr,
            )
            return 1
        if not args.json:
            print(f"chain ok: {report['blocks']} blocks, {report['records']} records")
            print(f"node: {report.get('node')}")
            if "witness" in report:
                print(f"heads held by others: {report['witness']['checked']} match")
        vouched = report.get("witness", {}).get("checked", 0) > 0  # by heads peers signed
        if not report.get("node_checked", True) and not vouched:
            from talos.keys import PASSPHRASE_ENV

            print(
                "NOTE: the node's DID was read from the key file's clear header, which only"
                f" the passphrase checks: give --passphrase-file or {PASSPHRASE_ENV} to check"
                " that the log's owner was not swapped (or --heads, which peers signed)",
                file=sys.stderr,
            )
        return 0
    if args.chain_cmd == "heads":
        heads = _online(path, "chain.peer_heads")
        _out(heads if heads is not _NOT_RUNNING else _offline_peer_heads(path))
        return 0
    if args.chain_cmd == "show":
        blocks = _online(path, "chain.show")
        if blocks is _NOT_RUNNING:
            from talos.home import offline_blocks

            blocks = offline_blocks(_home(args), owner())
        _out(blocks)
        return 0
    proof = _online(path, "chain.proof", {"id": args.id})
    if proof is _NOT_RUNNING:
        from talos.home import offline_proof

        proof = offline_proof(_home(args), args.id, owner())
    _out(proof)
    return 0


def log_owner_of(path: Path, passphrase_file: str | None) -> Callable[[], LogOwner]:
    """The log owner of the home at ``path`` (talos/home.py ``log_owner``), made on the
    first call and kept: a hybrid home's key is unlocked for it (an scrypt each time)."""

    @functools.cache
    def owner() -> LogOwner:
        from talos.config import Home
        from talos.home import log_owner

        return log_owner(Home(path), passphrase_file)

    return owner


def verify_report(
    path: Path, owner: Callable[[], LogOwner], heads: str | None = None
) -> dict[str, Any]:
    """The ``chain.verify`` report of the home at ``path``: its running node's, else made
    from its store for ``owner()``; with ``heads`` (a file of this node's signed heads that
    peers hold), checked against those too, which alone catches a log cut short."""
    report = _online(path, "chain.verify", timeout=600)
    if report is _NOT_RUNNING:
        from talos.config import Home
        from talos.home import offline_verify

        report = offline_verify(Home(path), owner())
    if heads is not None:
        _witness(path, heads, report, owner)
    return report


def _witness(
    home_path: Path, path: str, report: dict[str, Any], owner: Callable[[], LogOwner]
) -> None:
    """Check the log against signed heads of this node that others hold (``--heads FILE``):
    their defects join ``report``."""
    from talos.chain.witness import check_heads, statements_of

    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError:
        raise UsageError(f"{path} is not JSON") from None
    from talos.config import Home

    home = Home(home_path)
    blocks = _online(home_path, "chain.show")
    if blocks is _NOT_RUNNING:
        from talos.home import offline_blocks

        blocks = offline_blocks(home, owner())
    who = owner()
    witness = check_heads(
        who.identity.did,
        statements_of(document),
        {int(b["height"]): str(b["hash"]) for b in blocks},
        who.mldsa,
    )
    report["witness"] = witness.to_json()
    report["defects"] += report["witness"]["defects"]
    report["ok"] = report["ok"] and not witness.defects
    if witness.skipped:
        print(
            f"WARNING: {witness.skipped} head statement(s) in {path} are not this node's"
            " or do not verify; skipped",
            file=sys.stderr,
        )


def _offline_peer_heads(home_path: Path) -> dict[str, Any]:
    """The latest signed head kept for each peer (``meta`` rows ``head:DID``)."""
    from talos.config import Home
    from talos.store import Store

    home = Home(home_path)
    out: dict[str, Any] = {}
    with Store(home.store_dir, map_size=home.load_config().map_size) as store, store.read() as txn:
        for key, value in txn.items("meta", b"head:"):
            if not key.startswith(b"head:"):
                break
            out[key[5:].decode()] = json.loads(value)
    return out
