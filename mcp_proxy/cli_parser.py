"""``talos-proxy``'s argument parser: every command and option explained (docs/cli.md).

Built with talos/cli_help.py like ``talosd``'s, so both CLIs read alike: a
description, each argument's help, defaults shown, examples and the exit-code
line in every epilog. ``connect`` on stdio never loads aiohttp, so nothing
here imports it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mcp_proxy.server import MAX_SESSIONS_PER_PEER
from mcp_proxy.toolenv import DEFAULT_PASS
from talos import __version__
from talos.cli_completion import add_completion_command
from talos.cli_help import HelpFormatter, command, count, epilog, seconds
from talos.logging import add_arguments as add_log_arguments

__all__ = ["build_parser"]

AGENT = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
HOME_HELP = "the proxy's home folder: identity, store, audit key (created if new)"


def _folder(value: str) -> Path:
    """A folder argument; "~/x" that no shell expanded (an MCP client's config) too."""
    return Path(value).expanduser()


def _home(p: argparse.ArgumentParser) -> None:
    p.add_argument("--home", type=_folder, required=True, metavar="DIR", help=HOME_HELP)


def _key_args(p: argparse.ArgumentParser) -> None:
    """The identity key's passphrase, had as for ``talosd`` (talos/keys.py)."""
    p.add_argument(
        "--passphrase-file",
        metavar="FILE",
        help="identity key passphrase: first line of FILE (else $TALOS_PASSPHRASE or a prompt)",
    )
    p.add_argument(
        "--no-passphrase",
        action="store_true",
        help="a new identity key is stored unencrypted (explicit opt-out)",
    )


def _relay(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="nats://HOST:PORT",
        help=f"{text} (repeatable: servers of one NATS cluster)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="talos-proxy",
        description="Tunnel MCP over Talos: `serve` exposes an MCP server (a stdio command or"
        " a Streamable HTTP URL) to the peers it allows; `connect` is the MCP server an"
        " agent launches, and forwards to a serve side over an end-to-end encrypted,"
        " audited link. Logs go to stderr only: on connect, stdout is the MCP channel.",
        epilog=epilog(
            (
                f"talos-proxy serve --home ./tool --listen 127.0.0.1:7500 --allow {AGENT}"
                " -- python -m mcp_server_time",
                "talos-proxy connect --home ./agent --peer ws://127.0.0.1:7500#DID",
                "talos-proxy serve -h    # help for one command",
            )
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_log_arguments(parser)
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")

    p_id = command(
        sub,
        "id",
        "print the DID of a home (created if new)",
        "Print the DID of the proxy's home, creating its identity on first use: the"
        " DID to give a serve side's --allow (or a connect side's --peer).",
        ("talos-proxy id --home ./agent",),
    )
    _home(p_id)
    _key_args(p_id)

    _serve_parser(sub)

    p_audit = command(
        sub,
        "audit",
        "read the audit records of a serve home (through its talosd, or once serve stops)",
        "Print the tunnel's audit records from a serve home's block log: time, event,"
        " outcome, caller, tool; never arguments (unless serve ran with"
        " --audit-plaintext, and even then not here). Filters combine. It reads through"
        " a talosd running on the home, or the store when nothing holds it; a serve"
        " that runs its own node holds the store, so read its records once it stops.",
        (
            "talos-proxy audit --home ./tool --since 2h",
            "talos-proxy audit --home ./tool --json --outcome denied",
            "talos-proxy audit --home ./tool --verify",
        ),
    )
    _home(p_audit)
    p_audit.add_argument("--json", action="store_true", help="one JSON object per line")
    p_audit.add_argument(
        "--since",
        metavar="WHEN",
        help="only records since WHEN: 15m, 2h, 7d ago, an ISO 8601 time, or epoch ms",
    )
    p_audit.add_argument("--peer", metavar="DID", help="only records of this caller")
    p_audit.add_argument("--tool", metavar="NAME", help="only calls of this tool")
    p_audit.add_argument(
        "--outcome", metavar="OUTCOME", help="only this outcome (ok, denied, tool-exited, ...)"
    )
    p_audit.add_argument(
        "--event",
        choices=["call", "request", "session", "refusal"],
        help="only this kind of record",
    )
    p_audit.add_argument(
        "--verify",
        action="store_true",
        help="verify the signed block log first and mark each sealed entry verified, DEFECT"
        " or unverified (sealed since); exit 1 if the log has defects",
    )
    p_audit.add_argument(
        "--heads",
        metavar="FILE",
        help="with --verify: also check the log against this node's signed heads that peers"
        " hold (`talosd chain heads` of a peer); only this catches a log cut short",
    )
    p_audit.add_argument(
        "--passphrase-file",
        metavar="FILE",
        help="with --verify on a stopped home: the identity key's passphrase (first line of"
        " FILE, else $TALOS_PASSPHRASE), to check the log's owner against the key",
    )

    _connect_parser(sub)
    add_completion_command(sub, "talos-proxy")
    return parser


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        sub,
        "serve",
        "expose an MCP server to authorised peers",
        "Expose an MCP server to the peers this side allows: each caller session gets"
        " its own tool process (the command after --), or is bridged to a Streamable"
        " HTTP MCP server (--url). Callers are refused at the link unless --allow or"
        " the policy file names their DID; every call is recorded in the audit log."
        " With talosd running on the home, attach to it: its DID, links and address"
        " (--listen/--relay unused), the audit kept by the node; it keeps running after.",
        (
            f"talos-proxy serve --home ./tool --listen 127.0.0.1:7500 --allow {AGENT}"
            " --tools get_current_time -- python -m mcp_server_time",
            "talos-proxy serve --home ./tool --relay nats://relay.example:4222 --allow DID"
            " --url https://mcp.example.com/mcp --header 'Authorization=Bearer TOKEN'",
        ),
    )
    _home(p)
    add_log_arguments(p, inherit=True)
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="accept peer links on HOST:PORT (or --relay, or both; unused when attached)",
    )
    _relay(p, "NATS relay peers reach this tool through (talosd run --relay)")
    _key_args(p)
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="DID",
        help="a caller DID (or peer name) allowed every server and tool (repeatable)",
    )
    p.add_argument(
        "--allow-none",
        action="store_true",
        help="start even though no caller is allowed (--allow, policy file): every link is"
        " refused; without it such a serve refuses to start",
    )
    p.add_argument(
        "--tools",
        metavar="NAME[,NAME...]",
        help="comma-separated tool allow list for every caller (default: every tool)",
    )
    p.add_argument(
        "--policy",
        type=Path,
        metavar="FILE",
        help="TOML policy file: named servers, and per-DID servers and tools",
    )
    p.add_argument(
        "--audit",
        choices=["group", "strict"],
        default="group",
        help="group: audit records commit off the hot path; strict: each reply waits for"
        " its durable record",
    )
    p.add_argument(
        "--audit-plaintext",
        action="store_true",
        help="also keep tool arguments and results in the audit records (off: keyed digests only)",
    )
    p.add_argument(
        "--max-sessions",
        type=count,
        default=MAX_SESSIONS_PER_PEER,
        metavar="N",
        help="tool processes one peer may hold at once",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a variable for every tool process (repeatable)",
    )
    p.add_argument(
        "--pass-environment",
        action="store_true",
        help=f"tools inherit serve's whole environment (default: only {', '.join(DEFAULT_PASS)},"
        " the policy's pass_env and env, and --env)",
    )
    p.add_argument(
        "--url", default="", metavar="URL", help="bridge to this Streamable HTTP MCP server"
    )
    p.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="K=V",
        help="HTTP header sent with every --url request (repeatable)",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- CMD [ARGS...]",
        help="the stdio MCP server to start for each session (unless --url or a policy file"
        " names the servers)",
    )


def _connect_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        sub,
        "connect",
        "be the MCP server an agent launches",
        "Be the MCP server an agent launches (stdio, or Streamable HTTP with --http) and"
        " forward every request to a serve side. When `talosd run` already runs on the"
        " home, attach to it (same DID and links); otherwise run a node in this process.",
        (
            f"talos-proxy connect --home ./agent --peer ws://127.0.0.1:7500#{AGENT}",
            "talos-proxy connect --home ./agent --peer DID --relay nats://relay.example:4222",
            "talos-proxy connect --home ./agent --peer ws://HOST:PORT#DID --http 127.0.0.1:8080",
        ),
    )
    _home(p)
    add_log_arguments(p, inherit=True)
    p.add_argument(
        "--peer",
        required=True,
        metavar="ADDR",
        help="the serve side: ws://HOST:PORT#DID, or its DID (or peer name) with --relay or"
        " an attached node that knows it",
    )
    _relay(p, "NATS relay to reach the serve side through")
    _key_args(p)
    p.add_argument(
        "--server",
        default="",
        metavar="NAME",
        help="which server to use when the serve side's policy offers several"
        " (default: its default one)",
    )
    p.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve Streamable HTTP at http://HOST:PORT/mcp instead of stdio (bearer token in"
        " <home>/proxy-http.token)",
    )
    p.add_argument(
        "--http-idle",
        type=seconds,
        default=1800.0,  # http_front.IDLE_TIMEOUT; not imported: stdio never loads aiohttp
        metavar="SECONDS",
        help="end an HTTP session (and its remote tool) idle this long",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="browser origin (SCHEME://HOST[:PORT]) allowed to use --http, with CORS (repeatable)",
    )
    p.add_argument(
        "--http-max-sessions",
        type=count,
        default=16,  # http_front.MAX_SESSIONS
        metavar="N",
        help="tool sessions this front holds at once, legacy and pooled",
    )
    p.add_argument(
        "--link-wait",
        type=seconds,
        default=15.0,
        metavar="SECONDS",
        help="how long a request waits for the link to the serve side to come up"
        " (a refusal of the link answers at once, -32004)",
    )
