"""``talos-proxy``: expose a stdio MCP tool to peers (serve) or use a remote one (connect).

::

    talos-proxy id --home DIR
    talos-proxy serve --home DIR --listen HOST:PORT --allow DID [--allow DID ...]
    talos-proxy serve --home DIR --relay nats://HOST:PORT --allow DID ...  (no open port)
                      [--tools NAME[,NAME...]] [--policy FILE] [--audit strict|group]
                      [--audit-plaintext] [--env KEY=VALUE ...] [--pass-environment]
                      (-- CMD [ARGS...] | --url URL [--header K=V ...])
    talos-proxy connect --home DIR --peer ws://HOST:PORT#DID [--server NAME] [--http HOST:PORT]
                        [--allow-origin ORIGIN ...] [--http-max-sessions N]
    talos-proxy audit --home DIR [--json] [--since 2h|ISO] [--peer DID] [--tool NAME]
                      [--outcome OUTCOME] [--event call|request|session|refusal]

Logs go to stderr only: on ``connect`` stdout is the MCP stdio channel.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from mcp_proxy.audit import AuditKey, AuditMode, Auditor, BlockLogSink
from mcp_proxy.client import TunnelClient, serve_stdio
from mcp_proxy.nodehost import http_token, make_node, node_did
from mcp_proxy.policy import Policy, PolicyError, load_policy_file
from mcp_proxy.server import MAX_SESSIONS_PER_PEER, TunnelServer
from mcp_proxy.toolenv import DEFAULT_PASS, parse_env_assignments
from mcp_proxy.transport import NodeTransport
from talos.local.call import NodeGoneError
from talos.runtime import run
from talos_sdk.errors import TalosError

__all__ = ["main"]

log = logging.getLogger("mcp_proxy")


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


def _keys(args: argparse.Namespace) -> dict[str, Any]:
    return {"passphrase_file": args.passphrase_file, "no_passphrase": args.no_passphrase}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="talos-proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="INFO", help="stderr log level (default INFO)")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p_id = sub.add_parser("id", help="print the DID of a home (created if new)")
    p_id.add_argument("--home", type=Path, required=True)
    _key_args(p_id)

    p_serve = sub.add_parser("serve", help="expose a stdio MCP server to authorised peers")
    p_serve.add_argument("--home", type=Path, required=True)
    p_serve.add_argument("--listen", help="HOST:PORT for peer links (or --relay, or both)")
    p_serve.add_argument(
        "--relay", action="append", default=[], metavar="nats://HOST:PORT",
        help="NATS relay peers reach this tool through (talosd run --relay)",
    )  # fmt: skip
    _key_args(p_serve)
    p_serve.add_argument("--allow", action="append", default=[], metavar="DID")
    p_serve.add_argument("--tools", help="comma-separated tool allow list for every caller")
    p_serve.add_argument("--policy", type=Path, help="TOML policy file (servers, per-DID tools)")
    p_serve.add_argument("--audit", choices=["group", "strict"], default="group")
    p_serve.add_argument("--audit-plaintext", action="store_true", help="keep args/results")
    p_serve.add_argument(
        "--max-sessions",
        type=int,
        default=MAX_SESSIONS_PER_PEER,
        help=f"tool processes one peer may hold at once (default {MAX_SESSIONS_PER_PEER})",
    )
    p_serve.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a variable for every tool process (repeatable)",
    )
    p_serve.add_argument(
        "--pass-environment",
        action="store_true",
        help=f"tools inherit serve's whole environment (default: only {', '.join(DEFAULT_PASS)},"
        " the policy's pass_env and env, and --env)",
    )
    p_serve.add_argument("--url", default="", help="bridge to this Streamable HTTP MCP server")
    p_serve.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="K=V",
        help="HTTP header sent with every --url request (repeatable)",
    )
    p_serve.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")

    p_audit = sub.add_parser("audit", help="read the audit records of a (stopped) serve home")
    p_audit.add_argument("--home", type=Path, required=True)
    p_audit.add_argument("--json", action="store_true", help="one JSON object per line")
    p_audit.add_argument("--since", help="15m, 2h, 7d ago, an ISO 8601 time, or epoch ms")
    p_audit.add_argument("--peer", metavar="DID", help="only this caller")
    p_audit.add_argument("--tool", help="only calls of this tool")
    p_audit.add_argument("--outcome", help="only this outcome (ok, denied, tool-exited, ...)")
    p_audit.add_argument("--event", choices=["call", "request", "session", "refusal"])

    p_conn = sub.add_parser("connect", help="be the MCP server an agent launches")
    p_conn.add_argument("--home", type=Path, required=True)
    p_conn.add_argument(
        "--peer",
        required=True,
        help="ws://HOST:PORT#DID of the serve side (its DID with --relay)",
    )
    p_conn.add_argument(
        "--relay", action="append", default=[], metavar="nats://HOST:PORT",
        help="NATS relay to reach the serve side through",
    )  # fmt: skip
    _key_args(p_conn)
    p_conn.add_argument("--server", default="", help="server name when the peer offers several")
    p_conn.add_argument("--http", metavar="HOST:PORT", help="serve Streamable HTTP, not stdio")
    p_conn.add_argument(
        "--http-idle",
        type=float,
        default=1800.0,  # http_front.IDLE_TIMEOUT; not imported: stdio never loads aiohttp
        metavar="SECONDS",
        help="end an HTTP session (and its remote tool) idle this long (default 1800)",
    )
    p_conn.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="browser origin (SCHEME://HOST[:PORT]) allowed to use --http, with CORS (repeatable)",
    )
    p_conn.add_argument(
        "--http-max-sessions",
        type=int,
        default=16,  # http_front.MAX_SESSIONS
        metavar="N",
        help="tool sessions this front holds at once, legacy and pooled (default 16)",
    )
    p_conn.add_argument("--link-wait", type=float, default=15.0, help="seconds to wait for a link")
    return parser


async def _until_signalled() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _headers(items: list[str]) -> dict[str, str]:
    """``--header K=V`` values; a malformed one is a usage error naming it."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or any(c in item for c in "\r\n\x00"):
            raise PolicyError(f"--header needs K=V, got {item!r}")
        out[key.strip()] = value.strip()
    return out


async def _serve(args: argparse.Namespace) -> None:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    tools = None if args.tools is None else [t for t in args.tools.split(",") if t]
    policy_file = load_policy_file(args.policy) if args.policy is not None else None
    headers = _headers(args.header)
    from mcp_proxy.attach import resolve_names

    policy = Policy.build(
        allow=resolve_names(args.home, args.allow),
        tools=tools,
        command=command,
        policy_file=policy_file,
        url=args.url,
        headers=headers,
    )
    if not args.listen and not args.relay:
        raise SystemExit("serve needs --listen HOST:PORT, --relay nats://HOST:PORT, or both")
    node = make_node(args.home, listen=args.listen, relays=args.relay, **_keys(args))
    # Default deny at the link: a DID the policy does not name never gets a session.
    node.authorizer = policy.is_peer_allowed
    if args.max_sessions < 1:
        raise SystemExit("--max-sessions must be at least 1")
    server = TunnelServer(
        NodeTransport(node),
        policy,
        max_sessions=args.max_sessions,
        env=parse_env_assignments(args.env),
        pass_environment=args.pass_environment,
    )
    await node.start()
    auditor = Auditor(
        BlockLogSink(node.log, node.did),
        mode=AuditMode(args.audit),
        key=AuditKey.load(args.home),
        plaintext=args.audit_plaintext,
    )
    await auditor.start()
    server.auditor = auditor
    print(f"talos-proxy: did {node.did}", file=sys.stderr)
    where = f"{node.listen_url}#{node.did}" if node.listen_url else f"relay {node.did}"
    print(f"talos-proxy: serving on {where}", file=sys.stderr, flush=True)
    try:
        await _until_signalled()
    finally:
        await server.stop()
        await auditor.stop()
        await node.stop()


async def _connect(args: argparse.Namespace) -> None:
    from mcp_proxy.attach import attach
    from talos.config import parse_peer_addr

    relayed = args.relay and args.peer.startswith("did:")
    # A talosd already running on the home: share its identity and links (ADR 0012).
    attached = None if args.relay else await attach(args.home)
    node: Any = None
    if attached is not None:
        if args.peer.startswith(("ws://", "wss://")):
            peer_did = parse_peer_addr(args.peer).did
            await attached.client.call("peers.add", addr=args.peer)
        else:  # a DID or a peer name the node knows
            peer_did = (await attached.client.call("resolve", peer=args.peer))["did"]
        await attached.claim(peer_did, keyed=True)
        transport: Any = attached
        print(
            f"talos-proxy: did {attached.did} (attached to the running node of {args.home})",
            file=sys.stderr,
            flush=True,
        )
    else:
        peer_did = args.peer if relayed else parse_peer_addr(args.peer).did
        node = make_node(args.home, listen=None, relays=args.relay, **_keys(args))
        transport = NodeTransport(node)
    client = TunnelClient(
        transport,
        peer_did,
        args.server,
        link_wait=args.link_wait,
        first_sid=attached.first_sid if attached is not None else 1,
    )
    if node is not None:
        await node.start()
        print(f"talos-proxy: did {node.did}", file=sys.stderr, flush=True)
        if relayed:
            node.allow(peer_did)
            node.reach(peer_did)  # through the relay: the DID has no direct address
        else:
            await node.connect(args.peer)
    gone: asyncio.Future[str] = (
        attached.gone if attached is not None else asyncio.get_running_loop().create_future()
    )
    try:
        if args.http:
            from mcp_proxy.http_front import HttpFront

            try:
                front = HttpFront(
                    client,
                    http_token(args.home),
                    args.http,
                    idle_timeout=args.http_idle,
                    allow_origins=args.allow_origin,
                    max_sessions=args.http_max_sessions,
                )
            except ValueError as exc:
                raise SystemExit(f"talos-proxy: {exc}") from None
            await front.start()
            print(f"talos-proxy: Streamable HTTP on {front.url}", file=sys.stderr, flush=True)
            try:
                signalled = asyncio.ensure_future(_until_signalled())
                waits: set[asyncio.Future[Any]] = {signalled, gone}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                signalled.cancel()
            finally:
                await front.stop()
        else:
            stdio = asyncio.create_task(serve_stdio(client))
            signalled = asyncio.create_task(_until_signalled())
            ends: set[asyncio.Future[Any]] = {stdio, signalled, gone}
            await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
            for task in (stdio, signalled):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    finally:
        node_gone = gone.done()  # before our own close resolves it
        await client.close()
        if node is not None:
            await node.stop()
        if attached is not None:
            await attached.close()
    if node_gone:
        raise NodeGoneError(f"{gone.result()}; this proxy ends with it")


def _audit(args: argparse.Namespace) -> None:
    from mcp_proxy.audit_log import AuditFilter, format_entry, parse_since, read_entries, select

    keep = AuditFilter(
        peer=args.peer,
        tool=args.tool,
        outcome=args.outcome,
        event=args.event,
        since_ms=None if args.since is None else parse_since(args.since),
    )
    for entry in select(read_entries(args.home), keep):
        if args.json:
            sys.stdout.buffer.write(orjson.dumps(entry.to_json()) + b"\n")
        else:
            print(format_entry(entry))
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    # The proxy's home holds a node identity and store: owner-only files.
    os.umask(0o077)
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.cmd == "id":
            print(node_did(args.home, **_keys(args)))
        elif args.cmd == "serve":
            run(_serve(args))
        elif args.cmd == "audit":
            _audit(args)
        else:
            run(_connect(args))
    except TalosError as exc:
        print(f"talos-proxy: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
