"""``talosd send-file`` / ``talosd files`` (docs/PROTOCOL.md "File transfer", docs/cli.md).

Registered with one line, ``register_cli(sub, add)`` in talos/cli_parser.py;
the commands talk to the running node over its local socket (the ``files.*``
ops of talos/local/ops.py, docs/adr/0012-local-clients.md), like the other
client commands. Settings come from the ``transfer`` section of
``<home>/config.json`` (:class:`~talos.transfer.records.TransferConfig`);
received files land in ``<home>/files/`` unless ``--files-dir`` or that
section names another folder. Imports stay light: neither building
``talosd``'s parser nor running these commands loads aiohttp or pydantic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from talos import exit_codes
from talos.cli_help import seconds

__all__ = ["register_cli"]


def _call(args: argparse.Namespace, op: str, body: dict[str, Any] | None = None) -> Any:
    """``op`` on the node running on the home (NoNodeError when none runs there)."""
    from talos.local.call import call

    # talos.config.default_home, without importing pydantic.
    home = Path(args.home or os.environ.get("TALOS_HOME") or Path.home() / ".talos").expanduser()
    return call(home, op, body)


def cmd_send_file(args: argparse.Namespace) -> int:
    """``talosd send-file [--wait] DID PATH``."""
    from talos.peer_refs import check_peer_ref

    check_peer_ref(args.did, "PEER")
    # Resolved here: the node runs in another working directory.
    path = Path(args.path).expanduser().resolve()
    tid = _call(args, "files.send", {"to": args.did, "path": str(path)})["tid"]
    try:
        return _follow(args, tid)
    except KeyboardInterrupt:
        print(tid)
        print(f"talosd: interrupted: transfer {tid} goes on (talosd files)", file=sys.stderr)
        raise


def _follow(args: argparse.Namespace, tid: str) -> int:
    """``send-file`` after the offer: the progress bar, ``--wait``, the exit code."""
    from talos.transfer.protocol import TransferState, is_final

    if not args.wait and not sys.stderr.isatty():
        print(tid)
        return 0
    deadline = time.monotonic() + args.timeout
    info = _call(args, "files.get", {"id": tid})
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import Progress

        name, size = info["name"], max(info["size"], 1)
        # On stderr, the terminal: stdout carries only the transfer id (tid=$(...)).
        with Progress(console=Console(stderr=True)) as bar:
            task = bar.add_task(name, total=size)
            while not is_final(TransferState(info["state"])) and time.monotonic() < deadline:
                # Until the receiving user accepts, say so rather than sit at 0 %.
                waiting = info["state"] in (TransferState.OFFERED, TransferState.PENDING)
                bar.update(
                    task,
                    completed=min(info["transferred"], info["size"]),
                    description=f"{name} (waiting for the peer to accept)" if waiting else name,
                )
                time.sleep(0.1)
                info = _call(args, "files.get", {"id": tid})
            done = info["state"] == TransferState.COMPLETE.value
            bar.update(
                task,
                completed=size if done else min(info["transferred"], info["size"]),
                description=name if done else f"{name} ({info['state']})",
            )
    while args.wait and not is_final(TransferState(info["state"])):
        if time.monotonic() > deadline:
            print(tid)  # a script still learns which transfer goes on
            print(
                f"talosd: error: transfer {tid} not finished after {args.timeout} s",
                file=sys.stderr,
            )
            return exit_codes.TIMED_OUT
        time.sleep(0.05)
        info = _call(args, "files.get", {"id": tid})
    print(tid)
    if args.wait and info["state"] != TransferState.COMPLETE.value:
        from talos.logging import escape

        # The peer's words (a reject reason) reach a terminal: controls made visible.
        why = escape(info["error"])
        print(f"talosd: error: transfer {info['state']}: {why}", file=sys.stderr)
        return exit_codes.REFUSED if info["state"] == TransferState.REJECTED else exit_codes.FAILED
    return 0


def cmd_files(args: argparse.Namespace) -> int:
    """``talosd files [--json]`` / ``talosd files accept|reject ID``."""
    if args.action in ("accept", "reject", "cancel"):
        if not args.id:
            print(f"talosd: error: files {args.action} needs a transfer ID", file=sys.stderr)
            return 2
        info = _call(args, f"files.{args.action}", {"id": args.id})
        print(f"{info['tid']} {info['state']}")
        return 0
    rows = _call(args, "files.list")
    from talos.transfer.protocol import TransferState

    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        arrow = "<-" if r["direction"] == "in" else "->"
        peer = r.get("peer_name") or f"{r['peer'][:24]}…"
        print(
            f"{r['tid']} {arrow} {peer:25} {r['state']:9} {r['size']:>12} "
            f"{r['name']} {r['path'] if r['direction'] == 'in' else ''}".rstrip()
        )
        if r["state"] == TransferState.ACTIVE.value:
            done = f"{r['transferred'] * 100 // max(r['size'], 1)}% transferred"
            stalled = "; waiting for the peer to come back (files cancel ID ends it)"
            print(f"    {done}{'' if r.get('moving', True) else stalled}")
    return 0


def register_cli(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``send-file`` and ``files`` to ``talosd``'s subparsers through its ``add``."""
    sp = add(
        "send-file",
        "stream a file to a peer (encrypted, resumable)",
        "Offer a file to a peer and stream it, encrypted and resumable across link drops,"
        " through the running node. Prints the transfer id; the peer accepts it with"
        " `talosd files accept ID` unless its config.json's transfer.auto_accept lists"
        " this node. A progress bar shows on a terminal.",
        ("talosd send-file alice ./report.pdf", "talosd send-file --wait alice ./data.tar"),
    )
    sp.add_argument(
        "--wait",
        action="store_true",
        help="return once the peer received and verified the whole file",
    )
    sp.add_argument(
        "--timeout",
        type=seconds,
        default=3600.0,
        metavar="SECONDS",
        help="with --wait: give up waiting after SECONDS (the transfer goes on; exit 5)",
    )
    sp.add_argument("did", metavar="PEER", help="the recipient: a DID or a peer name")
    sp.add_argument("path", metavar="PATH", help="the file to send")
    sp.set_defaults(fn=cmd_send_file)
    sp = add(
        "files",
        "list transfers in and out; accept, reject or cancel one",
        "List file transfers of the running node (id, direction, peer, state, size, name),"
        " accept / reject a pending incoming one by its id, or cancel one in progress"
        " either way (a receiver's partial file is deleted, the peer is told).",
        (
            "talosd files",
            "talosd files accept 0f1e2d3c4b5a69788796a5b4c3d2e1f0",
            "talosd files cancel 0f1e2d3c4b5a69788796a5b4c3d2e1f0",
        ),
    )
    sp.add_argument(
        "action",
        nargs="?",
        choices=("list", "accept", "reject", "cancel"),
        default="list",
        metavar="ACTION",
        help="list (the default): show transfers; accept ID / reject ID: answer an incoming"
        " offer; cancel ID: end a transfer in progress",
    )
    sp.add_argument(
        "id", nargs="?", metavar="ID", help="transfer id (32 hex digits), for accept/reject/cancel"
    )
    sp.add_argument(
        "--json",
        action="store_true",
        help="print the list as JSON, for scripts (each transfer's ID is its 'tid')",
    )
    sp.set_defaults(fn=cmd_files)
