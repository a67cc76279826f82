"""``talosd relay-config``: a nats-server configuration for a set of nodes (docs/operations.md)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from talos.peer_refs import check_did
from talos.relay.serverconf import render_server_config

__all__ = ["register_cli"]


def cmd_relay_config(args: argparse.Namespace) -> int:
    from talos.config import Home
    from talos.keys import key_file_did

    dids = list(args.did)
    for home in args.node_home:
        # The DID in the key file's clear header: no passphrase needed for a sealed key.
        dids.append(key_file_did(Home(Path(home)).identity))
    for did in args.did:
        check_did(did, "DID")
    if not dids:
        print("talosd: error: name at least one DID or --node-home", file=sys.stderr)
        return 1
    if args.mailbox_mb < 1:
        print("talosd: error: --mailbox-mb must be at least 1", file=sys.stderr)
        return 2
    store = _size(args.max_store) if args.max_store else None
    nodes = len(dict.fromkeys(dids))
    mailbox = args.mailbox_mb << 20
    if store is not None and store < nodes * mailbox:
        # Each mailbox reserves its bytes: the nodes past the store's room get none.
        print(
            f"talosd: warning: --max-store {args.max_store} holds {store // mailbox} of the"
            f" {nodes} mailboxes of {args.mailbox_mb} MiB",
            file=sys.stderr,
        )
    text = render_server_config(
        dict.fromkeys(dids),
        host=args.host,
        port=args.port,
        store_dir=args.store_dir,
        max_store=args.max_store,
        mailbox_bytes=args.mailbox_mb << 20,
        monitor_port=args.monitor_port,
    )
    sys.stdout.write(text)
    return 0


def _size(text: str) -> int | None:
    """A NATS size such as ``4G`` or ``512MB`` in bytes (powers of 1024); None if not one."""
    match = re.fullmatch(r"(\d+)\s*([KMGT]?)B?", text.strip(), re.IGNORECASE)
    if match is None:
        return None
    return int(match[1]) << (10 * " KMGT".index(match[2].upper() or " "))


def register_cli(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``relay-config`` to ``talosd``'s subparsers (no ``--home``: it is about several)."""
    from talos.cli_help import command

    sp = command(
        sub,
        "relay-config",
        "print a nats-server config whose users are these nodes (nkey = node key)",
        "Print a nats-server configuration for a Talos relay: one account per node, whose"
        " user signs in with the node's own Ed25519 key as its nkey, and JetStream on for"
        " the nodes' mailboxes (docs/operations.md). Name the nodes by DID, by home, or both.",
        (
            "talosd relay-config --node-home ./alice --node-home ./bob > relay.conf",
            "talosd relay-config DID1 DID2 --port 4222 --monitor-port 8222",
        ),
    )
    sp.add_argument("did", nargs="*", metavar="DID", help="DIDs of nodes allowed on the relay")
    sp.add_argument(
        "--node-home",
        "--home",  # what every other command calls a home
        action="append",
        default=[],
        metavar="DIR",
        help="include the node of this home (its identity.key; repeatable)",
    )
    sp.add_argument("--host", default="0.0.0.0", help="address nats-server listens on")
    sp.add_argument("--port", type=int, default=4222, help="client port of nats-server")
    sp.add_argument(
        "--store-dir", default="/data/jetstream", metavar="DIR", help="JetStream store directory"
    )
    sp.add_argument(
        "--max-store",
        metavar="SIZE",
        help="JetStream file store limit, such as 4G (default: every mailbox, plus 16 MiB)",
    )
    sp.add_argument(
        "--mailbox-mb",
        type=int,
        default=64,
        metavar="MIB",
        help="storage of each node's mailbox on the relay, in MiB",
    )
    sp.add_argument(
        "--monitor-port",
        type=int,
        metavar="PORT",
        help="HTTP monitoring port (/healthz); none if unset",
    )
    sp.set_defaults(fn=cmd_relay_config)
