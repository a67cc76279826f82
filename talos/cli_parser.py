"""``talosd``'s argument parser: every command, argument and option, explained (docs/cli.md).

The handlers live in talos/cli.py (and talos/transfer/cli.py, talos/relay/cli.py,
which register their own commands); they are handed in by name so this module
imports nothing but argparse, os and the help helpers: ``talosd -h`` and client
commands start without the node, aiohttp or pydantic.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

from talos import __version__
from talos.cli_completion import add_completion_command
from talos.cli_help import HelpFormatter, command, count, epilog, position, seconds
from talos.logging import add_arguments as add_log_arguments

__all__ = ["HOME_HELP", "Handler", "build_parser"]

Handler = Callable[[argparse.Namespace], int]

HOME_HELP = "node home folder (default: $TALOS_HOME, else ~/.talos)"
DID_EXAMPLE = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"


def _home(sp: argparse.ArgumentParser, inherited: bool = False) -> None:
    # Under a command group the group's --home is already parsed; SUPPRESS keeps
    # a subcommand that is not given --home from resetting it to None.
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS} if inherited else {}
    # expanduser: a "~/x" that no shell expanded (quoted, or in an MCP client's config).
    sp.add_argument("--home", metavar="DIR", help=HOME_HELP, type=os.path.expanduser, **kwargs)


def _name_and_home(sp: argparse.ArgumentParser) -> None:
    """``--name`` for a peer being added or allowed, and the inherited ``--home``."""
    sp.add_argument(
        "--name", metavar="NAME", help="a local name for the peer, usable wherever a DID is"
    )
    _home(sp, inherited=True)


def _json(sp: argparse.ArgumentParser, what: str) -> None:
    sp.add_argument("--json", action="store_true", help=f"print {what} as JSON, for scripts")


def _passphrase_args(sp: argparse.ArgumentParser, opt_out: str | None = None) -> None:
    sp.add_argument(
        "--passphrase-file",
        metavar="FILE",
        help="identity key passphrase: first line of FILE (else $TALOS_PASSPHRASE or a prompt)",
    )
    if opt_out is not None:
        sp.add_argument("--no-passphrase", action="store_true", help=opt_out)


def build_parser(handlers: Mapping[str, Handler]) -> argparse.ArgumentParser:
    """The ``talosd`` parser; ``handlers[name]`` runs command ``name`` (set as ``fn``)."""
    p = argparse.ArgumentParser(
        prog="talosd",
        description="Talos peer-to-peer node for AI agents: a did:key identity, end-to-end"
        " encrypted messages and files between peers, and a tamper-evident log of every"
        " message. Commands that need the node talk to the one running on the home;"
        " id, peers, send, inbox, outbox and chain also work with the node stopped.",
        epilog=epilog(
            (
                "talosd init --home ./alice --no-passphrase",
                "talosd run --home ./alice --listen 127.0.0.1:7400",
                "talosd send -h    # help for one command",
            )
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")

    def add(
        name: str, summary: str, description: str | None = None, examples: tuple[str, ...] = ()
    ) -> argparse.ArgumentParser:
        sp = command(sub, name, summary, description, examples)
        _home(sp)
        if name in handlers:
            sp.set_defaults(fn=handlers[name])
        return sp

    sp = add(
        "init",
        "create an identity in a home folder",
        "Create a new node identity (Ed25519 key, optionally with ML-DSA-65) and an empty"
        " home: identity.key (sealed under a passphrase unless --no-passphrase),"
        " config.json, api.token and the store. Prints the node's DID. Refuses to"
        " overwrite an existing identity.",
        (
            "talosd init --home ./alice",
            "talosd init --home ./alice --suite ed25519-mldsa65 --no-passphrase",
        ),
    )
    sp.add_argument(
        "--suite",
        choices=("ed25519", "ed25519-mldsa65"),
        default="ed25519",
        help="signature suite: ed25519-mldsa65 adds a post-quantum ML-DSA-65 key (same DID)",
    )
    _passphrase_args(sp, opt_out="store the identity key unencrypted (explicit opt-out)")

    sp = add(
        "passphrase",
        "change (or remove) the identity key's passphrase",
        "Re-seal the identity key under a new passphrase, or store it unencrypted with"
        " --no-passphrase. The key itself (and so the DID) does not change.",
        ("talosd passphrase --home ./alice --new-passphrase-file new.txt",),
    )
    _passphrase_args(sp, opt_out="store the key unencrypted from now on")
    sp.add_argument(
        "--new-passphrase-file",
        metavar="FILE",
        help="new passphrase: first line of FILE (else $TALOS_NEW_PASSPHRASE or the terminal)",
    )

    sp = add(
        "id",
        "show this node's identity",
        "Print this node's DID; with --json also its X25519 key, key-agreement suites and"
        " listen address (when running).",
        ("talosd id --home ./alice", "talosd id --home ./alice --json"),
    )
    _json(sp, "the DID, X25519 key, suites and listen address")

    sp = add(
        "run",
        "run the node in the foreground",
        "Run the node until SIGINT/SIGTERM: accept and dial peer links, deliver queued"
        " messages, seal the block log, serve local clients on the home's socket."
        " Options given here add to (or override) the home's config.json for this run.",
        (
            "talosd run --home ./alice --listen 127.0.0.1:7400",
            f"talosd run --home ./bob --peer ws://127.0.0.1:7400#{DID_EXAMPLE}",
            "talosd run --home ./alice --relay nats://relay.example:4222",
        ),
    )
    _passphrase_args(sp)
    sp.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="accept peer links on HOST:PORT (port 0 picks a free one; default: config.json's"
        " listen, else no listening socket)",
    )
    sp.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="ADDR",
        help="dial this peer, ADDR = ws://HOST:PORT#DID; it is also allowed (repeatable)",
    )
    sp.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="DID",
        help="accept links from this DID (or peer name) without dialling it (repeatable)",
    )
    sp.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="nats://HOST:PORT",
        help="NATS relay to reach peers through and keep a mailbox on (repeatable: servers"
        " of one NATS cluster)",
    )
    sp.add_argument(
        "--files-dir",
        metavar="DIR",
        help="where received files land (default: <home>/files)",
    )
    sp.add_argument(
        "--require-pq",
        action="store_true",
        help="refuse peers that do not authenticate with Ed25519 + ML-DSA-65",
    )
    sp.add_argument(
        "--ratchet-every",
        type=count,
        metavar="N",
        help="DH ratchet step every turn (1, the default) or after N sends (lazy, ADR 0002)",
    )
    sp.add_argument(
        "--ratchet-max-age",
        type=seconds,
        metavar="SECONDS",
        help="lazy mode: also renew a sending chain older than SECONDS (default: 60, at most 3600)",
    )
    add_log_arguments(sp, format_default="config.json's log_format, else kv")

    sp = add(
        "peers",
        "add, allow, name, remove or list peers",
        "Manage the peers this node dials and accepts. Works on the running node, or on the"
        " home directly when the node is stopped.",
        (
            f"talosd peers add ws://127.0.0.1:7400#{DID_EXAMPLE} --name alice",
            "talosd peers list --json",
        ),
    )
    sp.set_defaults(json=False)
    psub = sp.add_subparsers(dest="peers_cmd", required=True, metavar="ACTION", title="actions")
    pa = command(
        psub,
        "add",
        "add a peer to dial (and allow)",
        "Add a peer by address; the node dials it and accepts links from its DID.",
        (f"talosd peers add ws://127.0.0.1:7400#{DID_EXAMPLE} --name alice",),
    )
    pa.add_argument("addr", metavar="ADDR", help="the peer's address: ws://HOST:PORT#DID")
    _name_and_home(pa)
    pw = command(
        psub,
        "allow",
        "allow a peer that dials in (no address needed)",
        "Allow a peer to link with this node from now on, across restarts, without an"
        " address to dial it at (for a peer that only dials out, behind NAT say); until"
        " 'peers remove'. A known peer keeps its address.",
        (f"talosd peers allow {DID_EXAMPLE} --name alice",),
    )
    pw.add_argument("did", metavar="DID", help="the peer's did:key")
    _name_and_home(pw)
    pn = command(
        psub,
        "name",
        "give a peer a local name (never sent to anyone)",
        "Name a known peer locally; the name then works wherever a DID does"
        " (send, send-file, connect). Names are never sent to anyone.",
        (f"talosd peers name {DID_EXAMPLE} alice", "talosd peers name alice alice-laptop"),
    )
    pn.add_argument("peer", metavar="PEER", help="DID (or current name) of the peer")
    pn.add_argument("name", metavar="NAME", help="the new local name")
    _home(pn, inherited=True)
    pr = command(
        psub,
        "remove",
        "forget a peer: no more dialling or accepting it",
        "Forget a peer: its address, its name and its session. The node stops dialling it,"
        " closes its link and no longer accepts it. Said on stderr when something undoes"
        " that: the node's configuration naming it (config.json, --peer, --allow: back at"
        " the next start), or a local client's claim for it (an attached talos-proxy"
        " connect: it may link while the claim lasts). Messages queued for it stay in the"
        " outbox and go if it is added again (talosd outbox PEER --drop drops them); its"
        " pinned ML-DSA-65 key stays pinned.",
        (f"talosd peers remove {DID_EXAMPLE}", "talosd peers remove alice"),
    )
    pr.add_argument("peer", metavar="PEER", help="DID (or name) of the peer")
    _home(pr, inherited=True)
    pl = command(
        psub,
        "list",
        "list peers with address and link state",
        "List known peers, one a line: DID, (name), address, connected/offline.",
        ("talosd peers list", "talosd peers list --json"),
    )
    _json(pl, "the peer list")
    _home(pl, inherited=True)

    sp = add(
        "status",
        "links with their state and last refusal, sessions, queues",
        "Show the running node's state: each peer's link (ready, connecting, refused by"
        " the peer or by this node, unreachable) with its last refusal and outbox depth,"
        " sessions, queues, chain height, post-quantum settings. Sequence numbers read"
        " epoch.n.",
        ("talosd status --home ./alice", "talosd status --json"),
    )
    _json(sp, "the full status")

    sp = add(
        "outbox",
        "queued messages per peer and why they are not moving",
        "List the messages waiting for a peer's acknowledgement, per peer: their"
        " sequence number (epoch.n), time, id and state, and why they do not move"
        " (link refused by the peer, peer unreachable, waiting for session, ...)."
        " With the node stopped, it reads the store: every message reads queued."
        " --drop drops every message queued for PEER (one sent to a mistyped DID,"
        " say): they are not sent again and the next message to PEER follows the"
        " last one it acknowledged. One that had gone out may still have arrived.",
        ("talosd outbox", f"talosd outbox --json {DID_EXAMPLE}", "talosd outbox bob --drop"),
    )
    sp.add_argument("peer", nargs="?", metavar="PEER", help="only this peer (a DID or a peer name)")
    sp.add_argument(
        "--drop",
        action="store_true",
        help="drop the messages queued for PEER instead of listing them",
    )
    _json(sp, "the queued messages")

    sp = add(
        "send",
        "send a text message to a peer",
        "Queue a text message for a peer and print its id. The message is stored"
        " durably and delivered when a link to the peer is up; with the node stopped it"
        " waits for the next run. --wait blocks until the peer acknowledged it, and fails"
        " at once (exit 3) with the reason when the peer refuses the link.",
        (
            "talosd send alice 'hello'",
            f"talosd send --wait --timeout 10 {DID_EXAMPLE} 'hi'",
            "git log -1 | talosd send alice -",
        ),
    )
    sp.add_argument(
        "--wait",
        action="store_true",
        help="return only once the peer acknowledged the message (needs a running node)",
    )
    sp.add_argument(
        "--timeout",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="with --wait: give up after SECONDS (exit 5; 4 if unreachable), still queued",
    )
    sp.add_argument("did", metavar="PEER", help="the recipient: a DID or a peer name")
    sp.add_argument(
        "text", metavar="TEXT", help="the message (UTF-8 text); - reads it from standard input"
    )

    sp = add(
        "inbox",
        "read received messages",
        "Print received messages, oldest first: time, sender, text. A message's lines"
        " after its first are indented; control characters in a text are shown escaped"
        " (\\x1b), never sent to the terminal; --json gives each text as it came.",
        ("talosd inbox", "talosd inbox --follow --json"),
    )
    _json(sp, "messages (one JSON object per line with --follow)")
    sp.add_argument(
        "--follow",
        action="store_true",
        help="keep printing new messages as they arrive (needs a running node; Ctrl-C ends)",
    )
    sp.add_argument("--after", type=position, default=0, help=argparse.SUPPRESS)
    sp.add_argument(
        "--prune-through",
        type=position,
        metavar="N",
        help="delete the messages numbered up to N (their n in --json) instead of printing;"
        " frees their senders' inbox shares (inbox_share in config.json)",
    )

    sp = add(
        "chain",
        "audit the block log",
        "Inspect and verify the node's tamper-evident block log of messages.",
        ("talosd chain verify", "talosd chain proof 5b0c9e0f7d3a4c21a8e6f1b2c3d4e5f6"),
    )
    sp.set_defaults(json=False, passphrase_file=None)  # `chain heads` asks for no key
    csub = sp.add_subparsers(dest="chain_cmd", required=True, metavar="ACTION", title="actions")
    cv = command(
        csub,
        "verify",
        "check every block; quarantined records are warnings (exit 0), defects exit 1",
        "Verify every block: hashes, links, signatures, Merkle roots. Defects are printed on"
        " stderr and exit 1; records quarantined at sealing (forged, badly signed, or not"
        " shown to be the node's) are warnings only, since they never entered the chain.",
        ("talosd chain verify", "talosd chain verify --heads peer-heads.json --json"),
    )
    _json(cv, "the verification report")
    _home(cv, inherited=True)
    _passphrase_args(cv)  # a stopped hybrid home's key is unlocked to read its log
    cv.add_argument(
        "--heads",
        metavar="FILE",
        help="also check the log against this node's signed heads held by others"
        " (JSON: a statement, a list, or `talosd chain heads` output of a peer)",
    )
    ch = command(
        csub,
        "heads",
        "print the latest signed head kept for each peer (JSON)",
        "Print, as JSON, the latest signed chain head each peer sent this node; give a"
        " peer's file to its `talosd chain verify --heads` to witness its log.",
        ("talosd chain heads > heads.json",),
    )
    _home(ch, inherited=True)
    cs = command(
        csub,
        "show",
        "print the blocks (JSON)",
        "Print every block of the log as JSON: height, hash, previous hash, records.",
        ("talosd chain show",),
    )
    _home(cs, inherited=True)
    _passphrase_args(cs)  # a stopped hybrid home's key is unlocked to read its log
    cp = command(
        csub,
        "proof",
        "print the inclusion proof of one message (JSON)",
        "Print, as JSON, the Merkle proof that a message's record is in a sealed block.",
        ("talosd chain proof 5b0c9e0f7d3a4c21a8e6f1b2c3d4e5f6",),
    )
    cp.add_argument("id", metavar="ID", help="record (message) id, hex, as `talosd send` printed")
    _home(cp, inherited=True)
    _passphrase_args(cp)  # a stopped hybrid home's key is unlocked to read its log

    sp = add(
        "mcp",
        "stdio MCP server for an agent: message other agents through this node",
        "Serve MCP on stdin/stdout for an agent (tools to send, read and list peers)."
        " Attaches to the node running on the home; with none running, runs one in"
        " this process until the agent exits, configured by the home's config.json"
        " only (unlocking the identity with --passphrase-file or $TALOS_PASSPHRASE)."
        " Every agent on a node shares its inbox read cursor. Logs go to stderr.",
        ("talosd mcp --home ./alice    # as an MCP client's server command",),
    )
    _passphrase_args(sp)  # used only when no node runs and this process runs one

    from talos.relay.cli import register_cli as register_relay_cli
    from talos.transfer.cli import register_cli  # send-file / files

    register_cli(sub, add)
    register_relay_cli(sub, add)
    add_completion_command(sub, "talosd").set_defaults(fn=handlers.get("completion"))
    return p
