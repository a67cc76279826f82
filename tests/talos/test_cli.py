"""``talosd`` as a user runs it: real subprocesses, real sockets on 127.0.0.1 (talos/cli.py)."""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from talos.chain.block import Record
from talos.chain.log import BlockLog
from talos.store import Store
from talos_sdk.keyfile import load_wallet
from tests.talos.api_client import ApiClient, ApiError
from tests.talos.daemons import ENV, TALOSD, Daemon, fast_config, talosd, wait_for


def init(tmp_path: Path, name: str) -> tuple[Path, str]:
    home = tmp_path / name
    res = talosd("init", "--home", str(home), "--no-passphrase")
    assert res.returncode == 0, res.stderr
    fast_config(home)
    return home, res.stdout.strip()


def test_init_creates_private_files_and_refuses_to_overwrite(tmp_path: Path) -> None:
    home, did = init(tmp_path, "a")
    assert did.startswith("did:key:z6Mk")
    for name in ("identity.key", "api.token"):
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o600
    again = talosd("init", "--home", str(home), "--no-passphrase")
    assert again.returncode == 2
    assert "refusing to overwrite" in again.stderr
    assert "Traceback" not in again.stderr
    res = talosd("id", "--home", str(home), "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["did"] == did
    assert len(bytes.fromhex(info["x25519"])) == 32
    assert talosd("id", "--home", str(home)).stdout.strip() == did


def test_init_home_and_store_are_owner_only_under_a_lax_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)  # what the child inherits; talosd must not rely on it
    try:
        home, _ = init(tmp_path, "a")
    finally:
        os.umask(old)
    modes = {
        p.relative_to(home).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in home.rglob("*")
    }
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert modes["store"] == 0o700
    assert modes["store/data.mdb"] == 0o600
    assert modes["store/lock.mdb"] == 0o600
    # Nothing in the home is readable by group or others (config.json relies on the umask).
    assert {k: v for k, v in modes.items() if v & 0o077} == {}


def test_commands_on_a_missing_home_fail_clearly(tmp_path: Path) -> None:
    # Exit codes (talos/exit_codes.py): 2 bad input, 4 no node to talk to.
    res = talosd("id", "--home", str(tmp_path / "nope"))
    assert res.returncode == 2
    assert "talosd init" in res.stderr and "Traceback" not in res.stderr
    home, _ = init(tmp_path, "a")
    res = talosd("status", "--home", str(home))
    assert res.returncode == 4 and "no node is running" in res.stderr
    res = talosd("outbox", "--home", str(home))  # read from the store while stopped
    assert res.returncode == 0 and res.stdout.strip() == "outbox empty", res.stderr
    res = talosd("peers", "add", "ws://127.0.0.1:1", "--home", str(home))
    assert res.returncode == 2 and "needs the peer's DID" in res.stderr
    res = talosd("run", "--home", str(home), "--listen", "nonsense")
    assert res.returncode == 2 and "HOST:PORT" in res.stderr


def test_a_home_given_with_an_unexpanded_tilde_is_the_users(tmp_path: Path) -> None:
    """ "~/x" quoted on a command line or set in an MCP client's config reaches talosd
    unexpanded: it is the user's folder, not a folder named "~" in the working one."""
    env = {**ENV, "HOME": str(tmp_path)}
    argv = [*TALOSD, "init", "--home", "~/x", "--no-passphrase"]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    did = res.stdout.strip()
    assert (tmp_path / "x" / "identity.key").exists() and not (tmp_path / "~").exists()
    for home in ({"TALOS_HOME": "~/x"}, {}):
        argv = [*TALOSD, "id", *([] if home else ["--home", "~/x"])]
        res = subprocess.run(argv, capture_output=True, text=True, env={**env, **home}, timeout=60)
        assert res.returncode == 0 and res.stdout.strip() == did, res.stderr


def test_outbox_while_stopped_lists_what_waits_and_why(tmp_path: Path) -> None:
    home, _ = init(tmp_path, "a")
    peer, _ = init(tmp_path, "b")
    did_b = talosd("id", "--home", str(peer)).stdout.strip()
    msg_id = talosd("send", "--home", str(home), did_b, "queued while stopped").stdout.strip()
    assert talosd("peers", "name", did_b, "bob", "--home", str(home)).returncode == 0
    res = talosd("outbox", "--home", str(home), "--json")
    assert res.returncode == 0, res.stderr
    [row] = json.loads(res.stdout)
    assert row["did"] == did_b and row["name"] == "bob" and row["state"] == "stopped"
    assert "talosd run" in row["why"] and row["count"] == 1
    assert [m["id"] for m in row["messages"]] == [msg_id]
    assert row["messages"][0]["state"] == "queued"
    text = talosd("outbox", "--home", str(home), "bob").stdout
    assert "bob" in text and "not moving: no node is running" in text
    assert "'queued while stopped'" in text


def test_ctrl_c_during_send_wait_says_the_message_stays_queued(tmp_path: Path) -> None:
    home, _ = init(tmp_path, "a")
    _, did_b = init(tmp_path, "b")
    a = Daemon(home, "--listen", "127.0.0.1:0", "--peer", f"ws://127.0.0.1:9#{did_b}")  # shut
    try:
        send = subprocess.Popen(
            [*TALOSD, "send", "--home", str(home), "--wait", did_b, "hi"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )

        def queued() -> list[dict[str, object]]:
            return list(json.loads(talosd("outbox", "--json", "--home", str(home)).stdout))

        wait_for(lambda: bool(queued()), what="the message queued")
        send.send_signal(signal.SIGINT)  # what Ctrl-C at the terminal sends
        _, err = send.communicate(timeout=30)
        assert send.returncode == 130 and "Traceback" not in err, err
        assert "interrupted: the message stays queued" in err and "talosd outbox" in err
        assert queued()[0]["count"] == 1  # and it does
    finally:
        a.stop()


def test_run_api_and_clean_shutdown(tmp_path: Path) -> None:
    home, did = init(tmp_path, "a")
    other = talosd("init", "--home", str(tmp_path / "b"), "--no-passphrase").stdout.strip()
    d = Daemon(home, "--listen", "127.0.0.1:0")
    try:
        assert d.line.startswith("listening on ws://127.0.0.1:")
        assert d.did == did
        node_json = json.loads((home / "node.json").read_text())
        assert node_json["listen"] == d.listen and node_json["api"].startswith("http://127.0.0.1:")
        # The token guards every route but /healthz.
        with pytest.raises(ApiError) as exc:
            ApiClient(node_json["api"], "wrong").call("GET", "/v1/status")
        assert exc.value.status == 401
        assert ApiClient(node_json["api"], "").call("GET", "/healthz")["ok"] is True
        res = talosd("peers", "add", f"ws://127.0.0.1:9#{other}", "--home", str(home))
        assert res.returncode == 0, res.stderr
        listed = talosd("peers", "list", "--json", "--home", str(home))
        assert json.loads(listed.stdout)[0]["did"] == other
        status = json.loads(talosd("status", "--json", "--home", str(home)).stdout)
        assert status["did"] == did and status["queues"]["outbox"] == 0
        assert "talos_peers_connected 0" in d.api.call("GET", "/metrics")
        # A second node on the same home is refused clearly, before any passphrase prompt.
        twin = talosd("run", "--home", str(home), "--listen", "127.0.0.1:0", timeout=30)
        assert twin.returncode == 1, twin.stderr
        assert f"a node is already running on {home}" in twin.stderr
        assert "Traceback" not in twin.stderr
    finally:
        assert d.stop() == 0
    assert not (home / "node.json").exists()
    # Stopped: offline commands read the store directly.
    res = talosd("peers", "list", "--home", str(home))
    assert other in res.stdout
    res = talosd("chain", "verify", "--home", str(home))
    assert res.returncode == 0, res.stderr


def test_send_wait_inbox_and_chain_between_two_daemons(tmp_path: Path) -> None:
    home_a, did_a = init(tmp_path, "a")
    home_b, did_b = init(tmp_path, "b")
    b = Daemon(home_b, "--listen", "127.0.0.1:0", "--allow", did_a)
    a = Daemon(home_a, "--listen", "127.0.0.1:0", "--peer", b.addr)
    follow = subprocess.Popen(
        [*TALOSD, "inbox", "--follow", "--json", "--home", str(home_b)],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        res = talosd("send", "--home", str(home_a), "--wait", did_b, "hello from A")
        assert res.returncode == 0, res.stderr
        msg_id = res.stdout.strip()
        inbox = json.loads(talosd("inbox", "--home", str(home_b), "--json").stdout)
        assert len(inbox) == 1
        assert inbox[0]["id"] == msg_id
        assert inbox[0]["from"] == did_a and inbox[0]["text"] == "hello from A"
        assert set(inbox[0]) == {"n", "id", "from", "from_name", "text", "ts"}
        status = json.loads(talosd("status", "--json", "--home", str(home_a)).stdout)
        assert status["sessions"][0]["suite"] == "x25519-mlkem768"
        wait_for(lambda: b.api.call("GET", "/v1/chain/heads")["height"] >= 0, what="a block")
        res = talosd("chain", "proof", msg_id, "--home", str(home_b))
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["size"] >= 1
        res = talosd("chain", "verify", "--home", str(home_b))
        assert res.returncode == 0 and "chain ok" in res.stdout
        # Plain inbox: the sender's name, and a peer's control characters shown, not obeyed.
        assert talosd("peers", "name", did_a, "alice", "--home", str(home_b)).returncode == 0
        evil = "\x1b[2J\nforged line"
        assert talosd("send", "--home", str(home_a), "--wait", did_b, evil).returncode == 0
        lines = talosd("inbox", "--home", str(home_b)).stdout.splitlines()
        assert len(lines) == 3 and lines[1].endswith(" alice: \\x1b[2J"), lines
        assert lines[2] == "    forged line"  # a line of the message, indented
        res = talosd("send", "--home", str(home_a), "bob", did_b)  # swapped, node running
        assert res.returncode == 2 and "The order is PEER, then TEXT" in res.stderr
        # TEXT "-" reads standard input (less its last line ending); an empty message
        # (an unset shell variable, say) is refused, and nothing is queued.
        res = talosd("send", "--home", str(home_a), "--wait", did_b, "-", stdin="two\nlines\n")
        assert res.returncode == 0, res.stderr
        for empty in (("",), ("-",)):
            res = talosd("send", "--home", str(home_a), did_b, *empty, stdin="")
            assert res.returncode == 2 and "empty message: nothing sent" in res.stderr
        inbox = json.loads(talosd("inbox", "--home", str(home_b), "--json").stdout)
        assert [m["text"] for m in inbox[2:]] == ["two\nlines"]
        # inbox --follow streamed the message as one JSON line.
        assert follow.stdout is not None
        ready, _, _ = select.select([follow.stdout], [], [], 20)  # bounded wait
        assert ready, "inbox --follow printed nothing"
        assert json.loads(follow.stdout.readline())["id"] == msg_id
    finally:
        follow.kill()
        follow.wait(10)
        if follow.stdout is not None:
            follow.stdout.close()
        a.stop()
        b.stop()
    res = talosd("chain", "verify", "--home", str(home_b))
    assert res.returncode == 0, res.stderr
    assert "WARNING" not in res.stderr
    # A record with a forged signature is quarantined at sealing; verify
    # names it in a warning line and still exits 0 (it never entered the chain).
    forged_id = b"\x07" * 16
    with Store(home_b / "store") as store:
        wallet = load_wallet(home_b / "identity.key")
        log = BlockLog(store, wallet)
        log.append(
            Record("msg", forged_id, did_a, wallet.did, b"commitment", b"\0" * 64, 1),
            durable=True,
        )
        log.seal()
    res = talosd("chain", "verify", "--home", str(home_b))
    assert res.returncode == 0, res.stderr
    assert f"WARNING quarantined record {forged_id.hex()} from {did_a}" in res.stderr
    assert "1 quarantined record(s)" in res.stderr
    res = talosd("chain", "verify", "--json", "--home", str(home_b))
    assert [q["record_id"] for q in json.loads(res.stdout)["quarantined"]] == [forged_id.hex()]
    # Tamper with one sealed record on the stopped node: verify says where and exits 1.
    with Store(home_b / "store") as store, store.write() as txn:
        key, value = next(iter(txn.items("block_records")))
        txn.put("block_records", key, value[:-1] + bytes([value[-1] ^ 1]))
    res = talosd("chain", "verify", "--home", str(home_b))
    assert res.returncode == 1
    assert "DEFECT" in res.stderr and "block 0" in res.stderr
    assert "Traceback" not in res.stderr
    # The newest block cut by a byte (a torn tail write): named as a defect too. Verify
    # used to open the log to list quarantined records, which decodes the newest block,
    # and ended with that error and no report.
    with Store(home_b / "store") as store, store.write() as txn:
        key, value = txn.last("blocks") or (b"", b"")
        txn.put("blocks", key, value[:-1])
    tip = int.from_bytes(key, "big")
    res = talosd("chain", "verify", "--json", "--home", str(home_b))
    assert res.returncode == 1, res.stderr
    report = json.loads(res.stdout)
    assert ("malformed", tip) in {(d["code"], d["height"]) for d in report["defects"]}
    assert [q["record_id"] for q in report["quarantined"]] == [forged_id.hex()]


@pytest.mark.parametrize("victim", ["receiver", "sender"])
def test_kill_9_mid_stream_loses_nothing_acknowledged(tmp_path: Path, victim: str) -> None:
    home_a, did_a = init(tmp_path, "a")
    home_b, did_b = init(tmp_path, "b")
    b = Daemon(home_b, "--listen", "127.0.0.1:0", "--allow", did_a)
    b_listen = b.listen.removeprefix("ws://")
    a = Daemon(home_a, "--listen", "127.0.0.1:0", "--peer", b.addr)
    sent: list[str] = []
    try:
        for i in range(150):
            sent.append(a.api.call("POST", "/v1/send", {"to": did_b, "text": f"m{i}"})["id"])
            if i == 100:
                (b if victim == "receiver" else a).kill()
                break
        if victim == "receiver":
            b = Daemon(home_b, "--listen", b_listen, "--allow", did_a)
        else:
            a = Daemon(home_a, "--listen", "127.0.0.1:0")
        for i in range(101, 150):
            sent.append(a.api.call("POST", "/v1/send", {"to": did_b, "text": f"m{i}"})["id"])
        wait_for(
            lambda: a.api.call("GET", "/v1/status")["queues"]["outbox"] == 0,
            timeout=60,
            what="every message acknowledged",
        )
        ids = [m["id"] for m in b.api.call("GET", "/v1/inbox")["messages"]]
        # Exactly once, in order: every queued message was acknowledged after B's commit.
        assert ids == sent
    finally:
        a.stop()
        b.stop()
    res = talosd("chain", "verify", "--home", str(home_b))
    assert res.returncode == 0, res.stdout + res.stderr
    inbox = json.loads(talosd("inbox", "--json", "--home", str(home_b)).stdout)
    assert [m["id"] for m in inbox] == sent


def _home_with_inbox(home: Path, count: int) -> tuple[Path, str]:
    """A new home whose store holds ``count`` received messages, texts m1..mN, from
    one sender (whose DID is returned with the home)."""
    from talos import pipeline as pl
    from talos.config import Home

    assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
    fast_config(home, listen="127.0.0.1:0")
    sender = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
    with Store(Home(home).store_dir) as store, store.write() as txn:
        for n in range(1, count + 1):
            row = pl.encode_inbox(n.to_bytes(16, "big"), sender, n, 1_700_000_000_000 + n, f"m{n}")
            txn.put("inbox", pl.inbox_key(n), row)
    return home, sender


def test_inbox_json_is_whole_and_the_same_running_or_stopped(tmp_path: Path) -> None:
    """More messages than one inbox call returns: the CLI pages through them all, and a
    stopped home prints the same objects (n and from_name included)."""
    home, sender = _home_with_inbox(tmp_path / "full", 1205)
    assert talosd("peers", "name", sender, "carol", "--home", str(home)).returncode == 0
    stopped = json.loads(talosd("inbox", "--json", "--home", str(home)).stdout)
    node = Daemon(home)
    try:
        running = json.loads(talosd("inbox", "--json", "--home", str(home)).stdout)
    finally:
        node.stop()
    assert len(running) == 1205 and [m["text"] for m in running[-2:]] == ["m1204", "m1205"]
    assert running == stopped
    assert running[0]["n"] == 1 and running[0]["from_name"] == "carol"


def test_inbox_prune_through_running_or_stopped(tmp_path: Path) -> None:
    """``talosd inbox --prune-through N`` deletes the messages numbered up to N, by the
    running node or from the stopped home's store alike."""
    home, _ = _home_with_inbox(tmp_path / "pruned", 5)
    done = talosd("inbox", "--prune-through", "2", "--home", str(home))
    assert done.returncode == 0 and done.stdout == "pruned 2 message(s) numbered up to 2\n"
    node = Daemon(home)
    try:
        done = talosd("inbox", "--prune-through", "4", "--json", "--home", str(home))
        assert json.loads(done.stdout) == {"pruned": 2, "through": 4}
        left = json.loads(talosd("inbox", "--json", "--home", str(home)).stdout)
    finally:
        node.stop()
    assert [m["text"] for m in left] == ["m5"]


def test_peers_allow_lets_a_dialling_peer_in_now_and_after_a_restart(tmp_path: Path) -> None:
    """A peer with no address to give (it only dials out) is allowed on the running node
    by ``talosd peers allow``; the refusal it met said how; the allow outlives a restart."""
    home_a, did_a = init(tmp_path, "a")
    home_b, did_b = init(tmp_path, "b")
    b = Daemon(home_b, "--listen", "127.0.0.1:0")
    a = Daemon(home_a, "--listen", "127.0.0.1:0", "--peer", b.addr)  # B never learns it
    try:
        refused = talosd("send", "--home", str(home_a), "--wait", did_b, "first")
        assert refused.returncode == 3 and "talosd peers allow DID" in refused.stderr
        # Named, and listed, yet refused: the list says so.
        assert talosd("peers", "name", did_a, "alice", "--home", str(home_b)).returncode == 0
        listed = talosd("peers", "list", "--home", str(home_b)).stdout
        assert f"{did_a} (alice) - offline (its links refused: peers allow)" in listed
        done = talosd("peers", "allow", did_a, "--name", "alice", "--home", str(home_b))
        assert done.returncode == 0 and done.stdout == f"allowed {did_a} as alice\n"
        res = talosd("send", "--home", str(home_a), "--wait", did_b, "second")
        assert res.returncode == 0, res.stderr
        [row] = json.loads(talosd("peers", "list", "--json", "--home", str(home_b)).stdout)
        assert row["allowed"] and row["connected"] and row["name"] == "alice"
        port = b.listen.rsplit(":", 1)[1]
        b.stop()
        b = Daemon(home_b, "--listen", f"127.0.0.1:{port}")
        res = talosd("send", "--home", str(home_a), "--wait", did_b, "third")
        assert res.returncode == 0, res.stderr
        inbox = json.loads(talosd("inbox", "--json", "--home", str(home_b)).stdout)
        # The refused message stayed queued at A and came with the others.
        assert [(m["text"], m["from_name"]) for m in inbox] == [
            ("first", "alice"),
            ("second", "alice"),
            ("third", "alice"),
        ]
    finally:
        a.stop()
        b.stop()
    # Stopped or running, a node refuses its own DID as a peer.
    for cmd in (("allow", did_b), ("add", f"ws://127.0.0.1:9#{did_b}")):
        res = talosd("peers", *cmd, "--home", str(home_b))
        assert res.returncode == 2 and "this node's own DID" in res.stderr, res.stderr
