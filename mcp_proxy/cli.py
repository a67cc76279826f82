"""``talos-proxy``: expose a stdio MCP tool to peers (serve) or use a remote one (connect).

The commands (id, serve, connect, audit) and every option are described in
mcp_proxy/cli_parser.py, which ``talos-proxy <command> -h`` prints, and in
docs/cli.md.

Logs go to stderr only: on ``connect`` stdout is the MCP stdio channel.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from mcp_proxy.audit import AuditKey, AuditMode, Auditor, BlockLogSink
from mcp_proxy.cli_parser import build_parser
from mcp_proxy.client import TunnelClient
from mcp_proxy.connect_stdio import serve_stdio
from mcp_proxy.nodehost import http_token, make_node, node_did
from mcp_proxy.policy import Policy, PolicyError, load_policy_file
from mcp_proxy.server import TunnelServer
from mcp_proxy.toolenv import parse_env_assignments
from mcp_proxy.transport import NodeTransport
from talos import exit_codes
from talos.cli import exit_code_for, quiet_broken_pipe
from talos.cli_help import parse
from talos.local.call import NodeGoneError
from talos.logging import configure, event
from talos.peer_refs import check_did, check_peer_addr, check_peer_ref
from talos.runtime import run, settle_heap, stop_on_signals
from talos_sdk.errors import TalosError, UsageError

if TYPE_CHECKING:
    from mcp_proxy.audit_log import ChainCheck

__all__ = ["build_parser", "main"]

log = logging.getLogger("mcp_proxy")


def _keys(args: argparse.Namespace) -> dict[str, Any]:
    return {"passphrase_file": args.passphrase_file, "no_passphrase": args.no_passphrase}


def _headers(items: list[str]) -> dict[str, str]:
    """``--header K=V`` values; a malformed one is a usage error naming it."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or any(c in item for c in "\r\n\x00"):
            raise PolicyError(f"--header needs K=V, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _check_commands(policy: Policy) -> None:
    """Each tool command is an executable (on PATH, the tool's own PATH included): else
    every session would only learn "tool process exited (code 127)"."""
    for name, spec in policy.servers.items():
        if not spec.command:  # a Streamable HTTP upstream (url)
            continue
        found = shutil.which(spec.command) or shutil.which(spec.command, path=spec.env.get("PATH"))
        if found is None:
            raise UsageError(
                f"tool command {spec.command!r} (server {name!r}) is not an executable file"
                " on PATH: check its name, or give its full path"
            )


async def _serve(args: argparse.Namespace) -> None:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    tools = None if args.tools is None else [t for t in args.tools.split(",") if t]
    for ref in args.allow:
        check_peer_ref(ref, "--allow")
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
    if not policy.grants and not args.allow_none:
        raise PolicyError(
            "serve allows no caller, so it would refuse every link: give --allow DID (or a"
            ' peer name), a [peers."DID"] table in --policy, or --allow-none to start anyway'
        )
    if args.max_sessions < 1:
        raise UsageError("--max-sessions must be at least 1")
    _check_commands(policy)
    from mcp_proxy.attach import attach

    # A talosd already running on the home: serve through its identity and links (ADR 0012).
    attached = await attach(args.home)
    if attached is not None:
        await _serve_attached(args, policy, attached)
        return
    if not args.listen and not args.relay:
        raise UsageError("serve needs --listen HOST:PORT, --relay nats://HOST:PORT, or both")
    stop = stop_on_signals()
    node = make_node(args.home, listen=args.listen, relays=args.relay, **_keys(args))
    # Default deny at the link: a DID the policy does not name never gets a session.
    node.authorizer = policy.is_peer_allowed
    server = _tunnel_server(args, NodeTransport(node), policy)
    await node.start()
    auditor = Auditor(
        BlockLogSink(node.log, node.did, node.writer),
        mode=AuditMode(args.audit),
        key=AuditKey.load(args.home),
        plaintext=args.audit_plaintext,
    )
    await auditor.start()
    server.auditor = auditor
    settle_heap()
    print(f"talos-proxy: did {node.did}", file=sys.stderr)
    where = f"{node.listen_url}#{node.did}" if node.listen_url else f"relay {node.did}"
    print(f"talos-proxy: serving on {where}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
        await auditor.stop()
        await node.stop()


def _tunnel_server(args: argparse.Namespace, transport: Any, policy: Policy) -> TunnelServer:
    return TunnelServer(
        transport,
        policy,
        max_sessions=args.max_sessions,
        env=parse_env_assignments(args.env),
        pass_environment=args.pass_environment,
    )


async def _serve_attached(args: argparse.Namespace, policy: Policy, attached: Any) -> None:
    """``serve`` on the running node of the home: its links, its store (for the audit)."""
    from mcp_proxy.node_audit import NodeAuditSink
    from talos.local.call import LocalUsageError

    home = args.home
    if args.listen or args.relay:
        print(
            f"talos-proxy: attached to the running node of {home}: callers reach its own "
            "address; --listen/--relay are not used",
            file=sys.stderr,
        )
    stop = stop_on_signals()
    server = _tunnel_server(args, attached, policy)
    auditor = Auditor(
        NodeAuditSink(attached.client),
        mode=AuditMode(args.audit),
        key=AuditKey.load(home),
        plaintext=args.audit_plaintext,
    )
    await auditor.start()
    server.auditor = auditor
    try:
        try:
            # The policy's DIDs may link to the node while this serve is attached.
            await attached.claim(None, keyed=False, allow=sorted(policy.grants))
        except LocalUsageError as exc:
            raise LocalUsageError(
                exc.code, f"cannot serve through the running node of {home}: {exc}"
            ) from None
        did, listen = attached.did, attached.client.hello.get("listen")
        print(f"talos-proxy: did {did} (attached to the running node of {home})", file=sys.stderr)
        where = f"{listen}#{did}" if listen else f"the node's relays as {did}"
        settle_heap()
        print(f"talos-proxy: serving on {where}", file=sys.stderr, flush=True)
        signalled = asyncio.ensure_future(stop.wait())
        await asyncio.wait({signalled, attached.gone}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
    finally:
        node_gone = attached.gone.done()  # before our own close resolves it
        # A stopping node still answers until we leave: sessions end, their audit is written.
        await server.stop()
        try:
            await auditor.stop()
        except TalosError as exc:
            event(log, "audit_not_written", logging.ERROR, error=str(exc))
        await attached.close()
    if node_gone:
        raise NodeGoneError(f"{attached.gone.result()}; this proxy ends with it")


async def _connect(args: argparse.Namespace) -> None:
    from mcp_proxy.attach import attach
    from talos.config import parse_peer_addr

    if args.peer.startswith(("ws://", "wss://")):
        check_peer_addr(args.peer, "--peer")
    else:  # a DID through the relay, or a DID or peer name the running node knows
        check_peer_ref(args.peer, "--peer")
    relayed = args.relay and args.peer.startswith("did:")
    stop = stop_on_signals()
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
        node.dial_known = False  # the home may know other peers: this connect needs one
        transport = NodeTransport(node)
    client = TunnelClient(
        transport,
        peer_did,
        args.server,
        link_wait=args.link_wait,
        **({"first_sid": attached.first_sid, "sid_end": attached.sid_end} if attached else {}),
    )
    if node is not None:
        await node.start()
        print(f"talos-proxy: did {node.did}", file=sys.stderr, flush=True)
        if relayed:
            node.allow(peer_did)
            node.reach(peer_did)  # through the relay: the DID has no direct address
        else:
            await node.connect(args.peer)
    settle_heap()
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
                raise UsageError(str(exc)) from None
            await front.start()
            print(f"talos-proxy: Streamable HTTP on {front.url}", file=sys.stderr, flush=True)
            try:
                signalled = asyncio.ensure_future(stop.wait())
                waits: set[asyncio.Future[Any]] = {signalled, gone}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                signalled.cancel()
            finally:
                await front.stop()
        else:
            stdio = asyncio.create_task(serve_stdio(client))
            signalled = asyncio.create_task(stop.wait())
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


def _audit(args: argparse.Namespace) -> int:
    from mcp_proxy.audit_log import (
        AuditFilter,
        check_chain,
        format_entry,
        parse_since,
        read_entries,
        select,
    )

    if args.peer is not None:
        check_did(args.peer, "--peer")
    keep = AuditFilter(
        peer=args.peer,
        tool=args.tool,
        outcome=args.outcome,
        event=args.event,
        since_ms=None if args.since is None else parse_since(args.since),
    )
    if args.heads is not None and not args.verify:
        raise UsageError("--heads is checked with --verify: give both")
    # The check comes first: entries sealed after it are "unverified", never vouched for.
    check = check_chain(args.home, args.passphrase_file, args.heads) if args.verify else None
    entries = read_entries(args.home)
    for entry in select(entries, keep):
        if args.json:
            obj = entry.to_json()
            if check is not None:
                obj["verified"] = check.vouches(entry)
            sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
        else:
            print(format_entry(entry, None if check is None else check.verdict(entry)))
    sys.stdout.flush()
    unreadable = sum(1 for e in entries if e.body.get("outcome") == "unreadable")
    if unreadable:  # said whatever the filters: damage must not hide behind them
        print(
            f"talos-proxy: WARNING: {unreadable} stored record(s) could not be read"
            " (outcome 'unreadable'); run talosd chain verify",
            file=sys.stderr,
        )
    if not entries:  # on stderr: stdout stays the (empty) listing a script reads
        print(
            f"talos-proxy: no audit records in {args.home}; they are kept by the serving side "
            "(the home of talos-proxy serve, or of the node it attached to)",
            file=sys.stderr,
        )
    return exit_codes.OK if check is None else _said_of_chain(check, args.home)


def _said_of_chain(check: ChainCheck, home: Path) -> int:
    """What ``--verify`` found, on stderr whatever the filters; FAILED if the log has defects."""
    if not check.node_checked:
        print(
            "talos-proxy: NOTE: the node's DID was read from the key file's clear header, so"
            " no entry is marked verified: give --passphrase-file to check the log's owner",
            file=sys.stderr,
        )
    if not check.ok:
        print(
            f"talos-proxy: the block log does NOT verify: {check.defects} defect(s); entries"
            f" in a defective block are marked DEFECT (talosd chain verify --home {home}"
            " lists the defects)",
            file=sys.stderr,
        )
        return exit_codes.FAILED
    head = "no block yet" if check.head_height is None else f"up to block {check.head_height}"
    print(f"talos-proxy: block log verified, {head}, node {check.node}", file=sys.stderr)
    return exit_codes.OK


def main(argv: Sequence[str] | None = None) -> int:
    # The proxy's home holds a node identity and store: owner-only files.
    os.umask(0o077)
    args = parse(build_parser(), argv)
    configure(args.log_format, args.log_level, roots=("talos", "mcp_proxy"))
    try:
        if args.cmd == "id":
            print(node_did(args.home, **_keys(args)))
        elif args.cmd == "serve":
            run(_serve(args))
        elif args.cmd == "audit":
            return _audit(args)
        elif args.cmd == "completion":
            from talos.cli_completion import completion_script

            print(completion_script(build_parser(), args.shell), end="")
        else:
            run(_connect(args))
    except BrokenPipeError:  # stdout's reader went away (talos-proxy audit | head)
        return quiet_broken_pipe()
    except (TalosError, OSError) as exc:
        # The codes of talos/exit_codes.py: 2 bad input, 3 refused, 4 unreachable, ...
        print(f"talos-proxy: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        return exit_codes.INTERRUPTED
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
