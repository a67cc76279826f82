"""``talosd``: the node's command line (docs/DESIGN.md "Who uses it").

Commands that need the running node talk to it over its local socket
(talos/local/call.py, docs/adr/0012-local-clients.md); those that make sense
offline (id, peers, send, inbox, chain) open the home's store directly when no
node runs there. Client commands import neither the node, aiohttp nor
pydantic until they need them. Expected failures print one line on stderr and
exit with the code of talos/exit_codes.py that says what kind of failure it
was (:func:`exit_code_for`); nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from talos import exit_codes
from talos.cli_chain import cmd_chain
from talos.cli_home import NOT_RUNNING as _NOT_RUNNING
from talos.cli_home import home_of as _home
from talos.cli_home import home_path as _home_path
from talos.cli_home import online as _online
from talos.cli_home import out as _out
from talos.cli_home import require_identity as _require_identity
from talos.local.call import NoNodeError
from talos.local.call import call as node_call
from talos.local.wire import MAX_LIMIT
from talos.peer_refs import check_did, check_peer_addr, check_peer_ref, is_did
from talos_sdk.errors import (
    LinkRefusedError,
    PeerUnreachableError,
    TalosError,
    UsageError,
    WrongPassphraseError,
)

__all__ = ["exit_code_for", "main", "quiet_broken_pipe"]

# --- commands ---------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    from talos.home import init_home
    from talos.keys import new_key_passphrase

    home = _home(args)
    if home.exists():  # before asking for a passphrase that would not be used
        raise UsageError(f"{home.identity} already exists; refusing to overwrite an identity")
    passphrase = new_key_passphrase(
        passphrase_file=args.passphrase_file, no_passphrase=args.no_passphrase
    )
    wallet = init_home(home.path, suite=args.suite, passphrase=passphrase)
    print(wallet.did)
    return 0


def cmd_passphrase(args: argparse.Namespace) -> int:
    from talos.keys import change_passphrase

    home = _home(args)
    _require_identity(home.path)
    sealed = change_passphrase(
        home.identity,
        passphrase_file=args.passphrase_file,
        new_passphrase_file=args.new_passphrase_file,
        no_passphrase=args.no_passphrase,
    )
    state = "sealed under the new passphrase" if sealed else "stored WITHOUT a passphrase"
    print(f"{home.identity}: {state}", file=sys.stderr)
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    path = _home_path(args)
    _require_identity(path)
    info = _online(path, "id")
    if info is _NOT_RUNNING and not args.json:
        # The DID is in the key file's clear header: no store to open, which another
        # process (a talos-proxy serve on this home) may hold.
        from talos.keys import key_file_did

        info = {"did": key_file_did(_home(args).identity)}
    elif info is _NOT_RUNNING:
        from talos.home import offline_identity

        info = offline_identity(_home(args))
    if args.json:
        _out(info)
    else:
        print(info["did"])
    return 0


def cmd_run(args: argparse.Namespace) -> int:

    from pydantic import ValidationError

    from talos import runtime
    from talos.config import NodeConfig, parse_listen, parse_relay_url, validation_text
    from talos.daemon import Daemon
    from talos.keys import unlock
    from talos.logging import configure

    home = _home(args)
    _require_identity(home.path)
    # Every DID in full (and config.json's) before the passphrase prompt: bad input costs nothing.
    for addr in args.peer:
        check_peer_addr(addr, "--peer")
    for ref in args.allow:
        check_peer_ref(ref, "--allow")
    config = home.load_config()
    allow = [_allowed_did(home.path, ref) for ref in args.allow]
    if _online(home.path, "id", timeout=5) is not _NOT_RUNNING:  # before asking for a passphrase
        from talos.store import StoreInUseError

        raise StoreInUseError(
            f"a node is already running on {home.path}: stop it first "
            f"(its clients: talosd status --home {home.path})"
        )
    wallet = unlock(home.identity, passphrase_file=args.passphrase_file)
    updates: dict[str, Any] = {}
    if args.listen:
        parse_listen(args.listen)
        updates["listen"] = args.listen
    if args.peer:
        updates["peers"] = (*config.peers, *args.peer)
    if allow:
        updates["allow"] = (*config.allow, *allow)
    if args.relay:
        updates["relays"] = tuple(
            dict.fromkeys([*config.relays, *(parse_relay_url(r) for r in args.relay)])
        )
    if args.require_pq:
        updates["require_pq"] = True
    if args.ratchet_every is not None:
        updates["ratchet_every"] = args.ratchet_every
    if args.ratchet_max_age is not None:
        updates["ratchet_max_age"] = args.ratchet_max_age
    try:
        config = NodeConfig.model_validate({**config.model_dump(), **updates})
    except ValidationError as exc:  # a bad flag value
        raise UsageError(f"invalid run option: {validation_text(exc)}") from None
    configure(args.log_format or config.log_format, args.log_level)

    async def run() -> None:
        daemon = Daemon(home.path, config, files_dir=args.files_dir, wallet=wallet)
        node = daemon.node
        stop = runtime.stop_on_signals()
        await daemon.start()
        runtime.settle_heap()
        try:
            if node.listen_url:
                print(f"listening on {node.listen_url} did={node.did}", flush=True)
            else:
                print(f"running did={node.did}", flush=True)
            await stop.wait()
        finally:
            await daemon.stop()

    runtime.run(run())
    return 0


def _allowed_did(home: Path, ref: str) -> str:
    """``run --allow`` takes a peer name too: the store (no node runs yet) knows its DID."""
    from talos.peer_names import is_did, offline_resolve

    return ref if is_did(ref) else offline_resolve(home, ref)


def cmd_peers(args: argparse.Namespace) -> int:
    path = _home_path(args)
    _require_identity(path)
    if args.peers_cmd == "add":
        check_peer_addr(args.addr, "ADDR")
    elif args.peers_cmd == "allow":
        check_did(args.did, "DID")
    elif args.peers_cmd in ("name", "remove"):
        check_peer_ref(args.peer, "PEER")
    if args.peers_cmd == "add":
        res = _online(path, "peers.add", {"addr": args.addr, "name": args.name})
        if res is _NOT_RUNNING:
            from talos.home import offline_add_peer
            from talos.peer_names import offline_set_name

            res = offline_add_peer(_home(args), args.addr)
            if args.name:
                offline_set_name(path, res["did"], args.name)
        print(f"added {res['did']}" + (f" as {args.name}" if args.name else ""))
        return 0
    if args.peers_cmd == "allow":
        res = _online(path, "peers.allow", {"peer": args.did})
        if res is _NOT_RUNNING:
            from talos.home import offline_allow_peer
            from talos.peer_names import offline_set_name

            res = offline_allow_peer(_home(args), args.did)
            if args.name:
                offline_set_name(path, res["did"], args.name)
        elif args.name:
            node_call(path, "peers.name", {"peer": res["did"], "name": args.name})
        print(f"allowed {res['did']}" + (f" as {args.name}" if args.name else ""))
        return 0
    if args.peers_cmd == "name":
        res = _online(path, "peers.name", {"peer": args.peer, "name": args.name})
        if res is _NOT_RUNNING:
            from talos.peer_names import offline_set_name

            res = {"did": offline_set_name(path, args.peer, args.name)}
        print(f"{res['did']} is {args.name}")
        return 0
    if args.peers_cmd == "remove":
        res = _online(path, "peers.remove", {"peer": args.peer})
        if res is _NOT_RUNNING:
            from talos.home import offline_remove_peer

            res = offline_remove_peer(_home(args), args.peer)
        queued = ""
        if res["queued"]:
            queued = (
                f"; {res['queued']} message(s) stay queued for it"
                f" (talosd outbox {res['did']} --drop drops them)"
            )
        print(f"removed {res['did']}{queued}")
        if res.get("configured"):
            print(
                "WARNING: the node's configuration (config.json peers/allow, or --peer/--allow)"
                " names it: it is back at the next start unless removed there too",
                file=sys.stderr,
            )
        if res.get("still_allowed"):
            print(
                "WARNING: it may still link while a local client claims a channel for it"
                " (an attached talos-proxy connect)",
                file=sys.stderr,
            )
        return 0
    peers = _online(path, "peers.list")
    if peers is _NOT_RUNNING:
        from talos.home import offline_peers
        from talos.peer_names import offline_names

        names = offline_names(path)
        peers = [{**p, "name": names.get(p["did"])} for p in offline_peers(_home(args))]
    if args.json:
        _out(peers)
    else:
        for p in peers:
            state = "connected" if p.get("connected") else "offline"
            name = f" ({p['name']})" if p.get("name") else ""
            # Named or met, but not allowed: its links are refused (4003) until allowed.
            refused = "" if p.get("allowed", True) else " (its links refused: peers allow)"
            print(f"{p['did']}{name} {p.get('addr') or '-'} {state}{refused}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    path = _home_path(args)
    _require_identity(path)
    status = _online(path, "status")
    if status is _NOT_RUNNING:
        raise NoNodeError(
            f"no node is running on {path}; start one with `talosd run --home {path}`"
        )
    if args.json:
        _out(status)
    else:
        from talos.status_text import status_lines

        print("\n".join(status_lines(status)))
    return 0


def cmd_outbox(args: argparse.Namespace) -> int:
    path = _home_path(args)
    _require_identity(path)
    if args.drop:
        return _drop_queued(path, args)
    peers = _online(path, "outbox", {"peer": args.peer})
    if peers is _NOT_RUNNING:
        from talos.home import offline_outbox

        peers = offline_outbox(_home(args), args.peer)
    if args.json:
        _out(peers)
    else:
        from talos.status_text import outbox_lines

        print("\n".join(outbox_lines(peers)))
    return 0


def _drop_queued(path: Path, args: argparse.Namespace) -> int:
    if args.peer is None:
        raise UsageError("--drop needs the PEER whose queued messages to drop")
    res = _online(path, "outbox.drop", {"peer": args.peer})
    if res is _NOT_RUNNING:
        from talos.home import offline_drop

        res = offline_drop(_home(args), args.peer)
    if args.json:
        _out(res)
        return 0
    print(f"dropped {res['dropped']} message(s) queued for {res['peer']}")
    if res["sent"]:
        print(f"{res['sent']} of them may have reached the peer already (sent, not acknowledged)")
    return 0


#: The most ``send -`` reads: above any node's frame limit, so the node's own refusal
#: (which names the peer's limit) is what a user sees, without reading a stream forever.
_STDIN_MAX = 16 << 20


def _stdin_text() -> str:
    """``send``'s TEXT from standard input, less one final line ending (as ``$(...)`` does)."""
    data = sys.stdin.buffer.read(_STDIN_MAX + 1)
    if len(data) > _STDIN_MAX:
        raise UsageError(f"standard input holds more than {_STDIN_MAX} bytes: send it as a file")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise UsageError("standard input is not valid UTF-8 text") from None
    return text.removesuffix("\n").removesuffix("\r")


def cmd_send(args: argparse.Namespace) -> int:
    path = _home_path(args)
    _require_identity(path)
    check_peer_ref(args.did, "PEER")
    if args.text == "-":
        args.text = _stdin_text()
    try:
        args.text.encode()
    except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (surrogateescape)
        raise UsageError("TEXT is not valid UTF-8") from None
    if not args.text:
        # Most often an unset shell variable ("$MSG"): a blank message is never the intent.
        raise UsageError("empty message: nothing sent")
    try:
        return _send(path, args)
    except KeyboardInterrupt:
        # The node took the message (or not) before the ack was awaited: say which way to look.
        print(
            "talosd: interrupted: the message stays queued if the node took it (talosd outbox)",
            file=sys.stderr,
        )
        raise
    except UsageError as exc:
        if is_did(args.text) and _unknown_name(exc):  # talosd send "hello" did:key:...
            order = "The order is PEER, then TEXT: talosd send PEER TEXT"
            raise UsageError(f"{exc}. {order}") from None
        raise


def _unknown_name(exc: UsageError) -> bool:
    """Whether ``exc`` says a peer name is unknown, from the running node or the store."""
    from talos.local.call import LocalUsageError
    from talos.peer_names import UnknownPeerNameError

    return isinstance(exc, UnknownPeerNameError) or (
        isinstance(exc, LocalUsageError) and exc.code == "not_found"
    )


def _send(path: Path, args: argparse.Namespace) -> int:
    body = {"to": args.did, "text": args.text, "wait": args.wait, "timeout": args.timeout}
    res = _online(path, "send", body, timeout=args.timeout + 5)
    if res is not _NOT_RUNNING:
        print(res["id"])
        if not args.wait:  # queued: say so when nothing can move it (a mistyped DID, say)
            for peer in node_call(path, "outbox", {"peer": res["to"]}):
                if peer["state"] == "no_address":
                    print(
                        f"note: {peer['why']}; the message stays queued"
                        f" (talosd outbox {res['to']} --drop drops it)",
                        file=sys.stderr,
                    )
        return 0
    if args.wait:
        raise NoNodeError(
            f"no node is running on {path}; --wait needs a running node "
            "(without --wait the message is queued for the next run)"
        )
    from talos.home import offline_send
    from talos.peer_names import offline_resolve

    print(offline_send(_home(args), offline_resolve(path, args.did), args.text))
    return 0


#: Messages per ``inbox`` call (the op's most); ``talosd inbox`` pages through them all.
_INBOX_PAGE = MAX_LIMIT


def _print_messages(messages: list[dict[str, Any]], as_json: bool, stream: bool) -> None:
    if as_json and not stream:
        _out(messages)
        return
    from talos.logging import escape

    for m in messages:
        if as_json:
            print(json.dumps(m), flush=True)
        else:
            ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["ts"] / 1000))
            # A peer's text reaches a terminal: its control characters (escape sequences)
            # are shown, never obeyed, and each line after its first is indented, so no
            # line of a message can pass for a message of its own.
            who = m.get("from_name") or m["from"]
            text = "\n    ".join(escape(line) for line in m["text"].splitlines() or [""])
            print(f"{ts} {escape(who)}: {text}", flush=True)


def _prune_inbox(path: Path, args: argparse.Namespace) -> int:
    res = _online(path, "inbox.prune", {"through": args.prune_through})
    if res is _NOT_RUNNING:
        from talos.home import offline_prune

        res = offline_prune(_home(args), args.prune_through)
    if args.json:
        _out(res)
    else:
        print(f"pruned {res['pruned']} message(s) numbered up to {res['through']}")
    return 0


def cmd_inbox(args: argparse.Namespace) -> int:
    path = _home_path(args)
    _require_identity(path)
    if args.prune_through is not None:
        return _prune_inbox(path, args)
    res = _online(path, "inbox", {"after": args.after, "limit": _INBOX_PAGE})
    if res is _NOT_RUNNING:
        if args.follow:
            raise NoNodeError(f"--follow needs a running node on {path}")
        from talos.home import offline_inbox

        _print_messages(offline_inbox(_home(args), args.after), args.json, False)
        return 0
    messages = res["messages"]
    while res["messages"] and res["next"] < res["last"]:  # pages end early past a byte bound
        res = node_call(path, "inbox", {"after": res["next"], "limit": _INBOX_PAGE}, timeout=40)
        messages += res["messages"]
    _print_messages(messages, args.json, args.follow)
    cursor = res["next"]
    while args.follow:
        res = node_call(
            path, "inbox", {"after": cursor, "wait": 25, "limit": _INBOX_PAGE}, timeout=40
        )
        _print_messages(res["messages"], args.json, True)
        cursor = res["next"]
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    """``talosd mcp``: stdout is the MCP channel, logs go to stderr."""
    import logging

    from talos import runtime
    from talos.agent_mcp.server import serve
    from talos.logging import configure

    path = _home_path(args)
    _require_identity(path)
    # Warnings with their fields (peer, address, reason), as talosd run writes them.
    configure("kv", logging.WARNING)
    runtime.run(serve(path, passphrase_file=args.passphrase_file))
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    from talos.cli_completion import completion_script

    print(completion_script(build_parser(), args.shell), end="")
    return 0


# --- parser (talos/cli_parser.py) -----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from talos.cli_parser import build_parser as build

    return build(
        {
            "init": cmd_init,
            "passphrase": cmd_passphrase,
            "id": cmd_id,
            "run": cmd_run,
            "peers": cmd_peers,
            "status": cmd_status,
            "outbox": cmd_outbox,
            "send": cmd_send,
            "inbox": cmd_inbox,
            "chain": cmd_chain,
            "mcp": cmd_mcp,
            "completion": cmd_completion,
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    # Everything a node writes (keys, store, config, logs) is for its owner only.
    os.umask(0o077)
    from talos.cli_help import parse

    args = parse(build_parser(), argv)
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return exit_codes.INTERRUPTED
    except BrokenPipeError:
        return quiet_broken_pipe()
    except (TalosError, OSError) as exc:
        print(f"talosd: error: {exc}", file=sys.stderr)
        return exit_code_for(exc)


def quiet_broken_pipe() -> int:
    """The reader of stdout went away (``talosd inbox | head``): it had what it wanted,
    so no error to tell and exit 0 (a ``set -o pipefail`` script goes on).

    stdout then points at /dev/null, so the interpreter's last flush at exit
    cannot fail again (Python's "Note on SIGPIPE", signal module docs).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return exit_codes.OK


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a failed command (talos/exit_codes.py): whose fault, what kind."""
    if isinstance(exc, UsageError | WrongPassphraseError):
        return exit_codes.BAD_INPUT
    if isinstance(exc, LinkRefusedError):
        return exit_codes.REFUSED
    if isinstance(exc, TimeoutError):
        return exit_codes.TIMED_OUT
    if isinstance(exc, NoNodeError | PeerUnreachableError | ConnectionError):
        return exit_codes.UNREACHABLE
    return exit_codes.FAILED


if __name__ == "__main__":
    sys.exit(main())
