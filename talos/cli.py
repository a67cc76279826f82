"""``talosd``: the node's command line (docs/DESIGN.md "Who uses it").

Commands that need the running node talk to its control API (talos/client.py);
those that make sense offline (id, peers, send, inbox, chain) open the home's
store directly when no node runs there. Expected failures print one line on
stderr and exit 1; argparse usage errors exit 2; nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from talos import runtime
from talos.client import ApiClient, ApiError, NodeNotRunningError
from talos.config import (
    Home,
    NodeConfig,
    default_home,
    parse_listen,
    parse_peer_addr,
    parse_relay_url,
)
from talos_sdk.errors import TalosError, UsageError

__all__ = ["main"]


def _out(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _home(args: argparse.Namespace) -> Home:
    return Home(Path(args.home) if args.home else default_home())


def _client_or_none(home: Home) -> ApiClient | None:
    try:
        return ApiClient.for_home(home)
    except NodeNotRunningError:
        return None


def _require_identity(home: Home) -> None:
    if not home.exists():
        raise UsageError(f"no identity in {home.path}: run `talosd init --home {home.path}` first")


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
    _require_identity(home)
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
    home = _home(args)
    _require_identity(home)
    client = _client_or_none(home)
    if client is not None:
        info = client.call("GET", "/v1/id")
    else:
        from talos.home import offline_identity

        info = offline_identity(home)
    if args.json:
        _out(info)
    else:
        print(info["did"])
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from talos.daemon import Daemon
    from talos.keys import unlock
    from talos.logging import configure

    home = _home(args)
    _require_identity(home)
    wallet = unlock(home.identity, passphrase_file=args.passphrase_file)
    config = home.load_config()
    updates: dict[str, Any] = {}
    if args.listen:
        parse_listen(args.listen)
        updates["listen"] = args.listen
    if args.peer:
        for addr in args.peer:
            parse_peer_addr(addr)
        updates["peers"] = (*config.peers, *args.peer)
    if args.allow:
        updates["allow"] = (*config.allow, *args.allow)
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
    except ValueError as exc:  # pydantic's ValidationError: a bad flag value
        raise UsageError(f"invalid run option: {exc}") from None
    configure(config.log_format)

    async def run() -> None:
        daemon = Daemon(home.path, config, files_dir=args.files_dir, wallet=wallet)
        node = daemon.node
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await daemon.start()
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


def cmd_peers(args: argparse.Namespace) -> int:
    home = _home(args)
    _require_identity(home)
    client = _client_or_none(home)
    if args.peers_cmd == "add":
        if client is not None:
            res = client.call("POST", "/v1/peers", {"addr": args.addr})
        else:
            from talos.home import offline_add_peer

            res = offline_add_peer(home, args.addr)
        print(f"added {res['did']}")
        return 0
    if client is not None:
        peers = client.call("GET", "/v1/peers")["peers"]
    else:
        from talos.home import offline_peers

        peers = offline_peers(home)
    if args.json:
        _out(peers)
    else:
        for p in peers:
            state = "connected" if p.get("connected") else "offline"
            print(f"{p['did']} {p.get('addr') or '-'} {state}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    home = _home(args)
    _require_identity(home)
    client = _client_or_none(home)
    if client is None:
        raise NodeNotRunningError(f"no node is running on {home.path}")
    _out(client.call("GET", "/v1/status"))
    return 0


def cmd_send(args: argparse.Namespace) -> int:
    home = _home(args)
    _require_identity(home)
    client = _client_or_none(home)
    if client is not None:
        body = {"to": args.did, "text": args.text, "wait": args.wait, "timeout": args.timeout}
        res = client.call("POST", "/v1/send", body, timeout=args.timeout + 5)
        print(res["id"])
        return 0
    if args.wait:
        raise NodeNotRunningError(
            f"no node is running on {home.path}; --wait needs a running node "
            "(without --wait the message is queued for the next run)"
        )
    from talos.home import offline_send

    print(offline_send(home, args.did, args.text))
    return 0


def _print_messages(messages: list[dict[str, Any]], as_json: bool, stream: bool) -> None:
    if as_json and not stream:
        _out(messages)
        return
    for m in messages:
        if as_json:
            print(json.dumps(m), flush=True)
        else:
            ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["ts"] / 1000))
            print(f"{ts} {m['from']}: {m['text']}", flush=True)


def cmd_inbox(args: argparse.Namespace) -> int:
    home = _home(args)
    _require_identity(home)
    client = _client_or_none(home)
    if client is None:
        if args.follow:
            raise NodeNotRunningError(f"--follow needs a running node on {home.path}")
        from talos.home import offline_inbox

        _print_messages(offline_inbox(home, args.after), args.json, False)
        return 0
    res = client.call("GET", f"/v1/inbox?after={args.after}")
    _print_messages(res["messages"], args.json, args.follow)
    cursor = res["next"]
    while args.follow:
        res = client.call("GET", f"/v1/inbox?after={cursor}&wait=25", timeout=40)
        _print_messages(res["messages"], args.json, True)
        cursor = res["next"]
    return 0


def cmd_chain(args: argparse.Namespace) -> int:
    home = _home(args)
    _require_identity(home)
    client = _client_or_none(home)
    if args.chain_cmd == "verify":
        if client is not None:
            report = client.call("GET", "/v1/chain/verify", timeout=600)
        else:
            from talos.home import offline_verify

            report = offline_verify(home)
        if args.heads is not None:
            _witness(home, client, args.heads, report)
        if args.json:
            _out(report)
        for d in report["defects"]:
            where = f"block {d['height']}" + (
                f" record {d['index']}" if d["index"] is not None else ""
            )
            print(f"DEFECT {d['code']} at {where}: {d['message']}", file=sys.stderr)
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
                " (forged or bad signature); they are not in the chain",
                file=sys.stderr,
            )
        if not report["ok"]:
            print(f"chain verify FAILED: {len(report['defects'])} defect(s)", file=sys.stderr)
            return 1
        if not args.json:
            print(f"chain ok: {report['blocks']} blocks, {report['records']} records")
            if "witness" in report:
                print(f"heads held by others: {report['witness']['checked']} match")
        return 0
    if args.chain_cmd == "heads":
        if client is not None:
            _out(client.call("GET", "/v1/chain/peer-heads"))
        else:
            _out(_offline_peer_heads(home))
        return 0
    if args.chain_cmd == "show":
        if client is not None:
            blocks = client.call("GET", "/v1/chain/show")["blocks"]
        else:
            from talos.home import offline_blocks

            blocks = offline_blocks(home)
        _out(blocks)
        return 0
    if client is not None:
        proof = client.call("GET", f"/v1/chain/proof/{args.id}")
    else:
        from talos.home import offline_proof

        proof = offline_proof(home, args.id)
    _out(proof)
    return 0


def _witness(home: Home, client: ApiClient | None, path: str, report: dict[str, Any]) -> None:
    """Check the log against signed heads of this node that others hold (``--heads FILE``)."""
    from talos.chain.witness import check_heads, statements_of
    from talos_sdk.keyfile import load_wallet

    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError:
        raise UsageError(f"{path} is not JSON") from None
    if client is not None:
        blocks = client.call("GET", "/v1/chain/show")["blocks"]
    else:
        from talos.home import offline_blocks

        blocks = offline_blocks(home)
    wallet = load_wallet(home.identity)
    witness = check_heads(
        wallet.did,
        statements_of(document),
        {int(b["height"]): str(b["hash"]) for b in blocks},
        wallet.mldsa_public_key,
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


def _offline_peer_heads(home: Home) -> dict[str, Any]:
    """The latest signed head kept for each peer (``meta`` rows ``head:DID``)."""
    from talos.store import Store

    out: dict[str, Any] = {}
    with Store(home.store_dir, map_size=home.load_config().map_size) as store, store.read() as txn:
        for key, value in txn.items("meta", b"head:"):
            if not key.startswith(b"head:"):
                break
            out[key[5:].decode()] = json.loads(value)
    return out


# --- parser ------------------------------------------------------------------------------------


def _passphrase_args(sp: argparse.ArgumentParser, opt_out: str | None = None) -> None:
    sp.add_argument(
        "--passphrase-file",
        metavar="FILE",
        help="identity key passphrase: first line of FILE (else $TALOS_PASSPHRASE or a prompt)",
    )
    if opt_out is not None:
        sp.add_argument("--no-passphrase", action="store_true", help=opt_out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="talosd", description="Talos peer-to-peer node")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text)
        sp.add_argument("--home", help="node home (default $TALOS_HOME or ~/.talos)")
        return sp

    sp = add("init", "create an identity in a home folder")
    sp.add_argument(
        "--suite",
        choices=("ed25519", "ed25519-mldsa65"),
        default="ed25519",
        help="signature suite: ed25519-mldsa65 adds a post-quantum ML-DSA-65 key (same DID)",
    )
    _passphrase_args(sp, opt_out="store the identity key unencrypted (explicit opt-out)")
    sp.set_defaults(fn=cmd_init)
    sp = add("passphrase", "change (or remove) the identity key's passphrase")
    _passphrase_args(sp, opt_out="store the key unencrypted from now on")
    sp.add_argument(
        "--new-passphrase-file",
        metavar="FILE",
        help="new passphrase: first line of FILE (else $TALOS_NEW_PASSPHRASE or the terminal)",
    )
    sp.set_defaults(fn=cmd_passphrase)
    sp = add("id", "show this node's identity")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_id)
    sp = add("run", "run the node in the foreground")
    _passphrase_args(sp)
    sp.add_argument("--listen", help="HOST:PORT for peer links (port 0 picks one)")
    sp.add_argument("--peer", action="append", default=[], help="ws://HOST:PORT#DID")
    sp.add_argument("--allow", action="append", default=[], help="DID allowed to link")
    sp.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="nats://HOST:PORT",
        help="NATS relay to reach peers through and keep a mailbox on (repeatable: servers"
        " of one NATS cluster)",
    )
    sp.add_argument("--files-dir", help="where received files land (default <home>/files)")
    sp.add_argument(
        "--require-pq",
        action="store_true",
        help="refuse peers that do not authenticate with Ed25519 + ML-DSA-65",
    )
    sp.add_argument(
        "--ratchet-every",
        type=int,
        metavar="N",
        help="DH ratchet step every turn (1, the default) or after N sends (lazy, ADR 0002)",
    )
    sp.add_argument(
        "--ratchet-max-age",
        type=float,
        metavar="S",
        help="lazy mode: also renew a sending chain older than S seconds (default 60)",
    )
    sp.set_defaults(fn=cmd_run)
    sp = add("peers", "add or list peers")
    psub = sp.add_subparsers(dest="peers_cmd", required=True)
    pa = psub.add_parser("add")
    pa.add_argument("addr", help="ws://HOST:PORT#DID")
    pa.add_argument("--home", default=argparse.SUPPRESS)
    pl = psub.add_parser("list")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--home", default=argparse.SUPPRESS)
    sp.set_defaults(fn=cmd_peers, json=False)
    add("status", "links, sessions, queues").set_defaults(fn=cmd_status)
    sp = add("send", "queue a message for a peer")
    sp.add_argument("--wait", action="store_true", help="return once the peer acknowledged")
    sp.add_argument("--timeout", type=float, default=30.0)
    sp.add_argument("did")
    sp.add_argument("text")
    sp.set_defaults(fn=cmd_send)
    sp = add("inbox", "read received messages")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--follow", action="store_true")
    sp.add_argument("--after", type=int, default=0, help=argparse.SUPPRESS)
    sp.set_defaults(fn=cmd_inbox)
    sp = add("chain", "audit the block log")
    csub = sp.add_subparsers(dest="chain_cmd", required=True)
    cv = csub.add_parser(
        "verify",
        help="check every block; quarantined records are warnings (exit 0), defects exit 1",
    )
    cv.add_argument("--json", action="store_true")
    cv.add_argument("--home", default=argparse.SUPPRESS)
    cv.add_argument(
        "--heads",
        metavar="FILE",
        help="also check the log against this node's signed heads held by others"
        " (JSON: a statement, a list, or `talosd chain heads` output of a peer)",
    )
    ch = csub.add_parser("heads", help="print the latest signed head kept for each peer (JSON)")
    ch.add_argument("--home", default=argparse.SUPPRESS)
    cs = csub.add_parser("show")
    cs.add_argument("--home", default=argparse.SUPPRESS)
    cp = csub.add_parser("proof")
    cp.add_argument("id", help="record (message) id, hex")
    cp.add_argument("--home", default=argparse.SUPPRESS)
    sp.set_defaults(fn=cmd_chain, json=False)
    from talos.transfer.cli import register_cli  # send-file / files

    register_cli(sub, add)
    from talos.relay.cli import register_cli as register_relay_cli

    register_relay_cli(sub, add)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # Everything a node writes (keys, store, config, logs) is for its owner only.
    os.umask(0o077)
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ApiError as exc:
        print(f"talosd: error: {exc} (HTTP {exc.status})", file=sys.stderr)
    except (TalosError, OSError) as exc:
        print(f"talosd: error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
