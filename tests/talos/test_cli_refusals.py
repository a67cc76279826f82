"""Refusals, unreachable peers and timeouts through real ``talosd`` processes on 127.0.0.1:
the exit codes of talos/exit_codes.py, the reason on stderr, ``status`` and ``outbox``.

Bounds are generous (the machine is shared); what is asserted is that a refusal
ends the wait long before its 60 s timeout, not how fast.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

from talos import exit_codes
from talos.link.refusals import peer_refusal_text
from tests.talos.daemons import Daemon, fast_config, talosd, wait_for

GENEROUS = 30.0  # far under the 60 s --timeout the refused sends are given


def _init(tmp_path: Path, name: str) -> tuple[Path, str]:
    home = tmp_path / name
    res = talosd("init", "--home", str(home), "--no-passphrase")
    assert res.returncode == 0, res.stderr
    fast_config(home, handshake_timeout=30.0)
    return home, res.stdout.strip()


def _json(*args: str) -> object:
    res = talosd(*args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _link(home: Path, did: str) -> dict[str, object]:
    status = _json("status", "--json", "--home", str(home))
    assert isinstance(status, dict)
    return next(row for row in status["links"] if row["did"] == did)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_link_ends_send_wait_at_once_and_shows_in_status_and_outbox(
    tmp_path: Path,
) -> None:
    home_a, did_a = _init(tmp_path, "a")
    home_b, did_b = _init(tmp_path, "b")
    b = Daemon(home_b, "--listen", "127.0.0.1:0")  # allows nobody
    a = Daemon(home_a, "--listen", "127.0.0.1:0", "--peer", b.addr)
    try:
        started = time.monotonic()
        res = talosd("send", "--home", str(home_a), "--wait", "--timeout", "60", did_b, "hi")
        elapsed = time.monotonic() - started
        assert res.returncode == exit_codes.REFUSED, res.stderr
        assert f"talosd: error: {did_b} refused the link: this node is not on its allow list" in (
            res.stderr
        )
        assert "close code 4003" in res.stderr and "stays queued" in res.stderr
        assert elapsed < GENEROUS

        # Without --wait the message is queued; status and outbox say why it stays.
        res = talosd("send", "--home", str(home_a), did_b, "second")
        assert res.returncode == 0, res.stderr
        row = _link(home_a, did_b)
        assert row["state"] == "refused_by_peer" and row["outbox"] == 2
        refusal = row["last_refusal"]
        assert isinstance(refusal, dict)
        assert refusal["code"] == 4003 and refusal["kind"] == "refused_by_peer"
        assert refusal["reason"] == peer_refusal_text(4003, "")  # says who can allow it
        assert "talosd peers allow DID" in refusal["reason"]
        human = talosd("status", "--home", str(home_a)).stdout
        assert f"node      {did_a}" in human
        assert f"{did_b} refused the link: this node is not on its allow list" in human
        assert "outbox    2" in human
        outbox = _json("outbox", "--json", "--home", str(home_a), did_b)
        assert isinstance(outbox, list) and len(outbox) == 1
        assert outbox[0]["count"] == 2
        assert outbox[0]["why"].startswith("link refused by peer: this node is not on its allow")
        assert [m["text"] for m in outbox[0]["messages"]] == ["hi", "second"]
        assert all(re.fullmatch(r"\d+\.\d+", m["seq_text"]) for m in outbox[0]["messages"])
        text = talosd("outbox", "--home", str(home_a)).stdout
        assert "not moving: link refused by peer: this node is not on its allow list" in text
        assert "'second'" in text

        # The refusing side names the stranger and its own reason.
        theirs = _link(home_b, did_a)
        refused = theirs["last_refusal"]
        assert isinstance(refused, dict)
        assert refused["kind"] == "refused_by_us" and refused["direction"] == "accept"
        assert "allow list" in str(refused["message"])

        # Once allowed, the queue drains and the refusal is cleared.
        port = b.listen.rsplit(":", 1)[1]
        assert b.stop() == 0
        b = Daemon(home_b, "--listen", f"127.0.0.1:{port}", "--allow", did_a)
        wait_for(lambda: _link(home_a, did_b)["outbox"] == 0, timeout=60, what="queue drained")
        row = _link(home_a, did_b)
        assert row["state"] == "ready" and row["last_refusal"] is None
        assert _json("outbox", "--json", "--home", str(home_a)) == []
    finally:
        a.stop()
        b.stop()


def test_unreachable_peer_timeout_and_bad_input_have_their_exit_codes(tmp_path: Path) -> None:
    home_a, _ = _init(tmp_path, "a")
    _, did_c = _init(tmp_path, "c")
    _, did_d = _init(tmp_path, "d")
    closed = _free_port()  # nothing listens there: connection refused
    silent = socket.socket()  # accepts TCP, never answers the WebSocket upgrade
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent_port = silent.getsockname()[1]
    a = Daemon(
        home_a,
        "--listen",
        "127.0.0.1:0",
        "--peer",
        f"ws://127.0.0.1:{closed}#{did_c}",
        "--peer",
        f"ws://127.0.0.1:{silent_port}#{did_d}",
    )
    try:
        res = talosd("send", "--home", str(home_a), "--wait", "--timeout", "3", did_c, "x")
        assert res.returncode == exit_codes.UNREACHABLE, res.stderr
        assert f"talosd: error: {did_c}: peer unreachable: cannot reach" in res.stderr
        outbox = _json("outbox", "--json", "--home", str(home_a), did_c)
        assert isinstance(outbox, list)
        assert outbox[0]["state"] == "unreachable"
        assert outbox[0]["why"].startswith("peer unreachable: cannot reach ws://127.0.0.1:")

        res = talosd("send", "--home", str(home_a), "--wait", "--timeout", "2", did_d, "y")
        assert res.returncode == exit_codes.TIMED_OUT, res.stderr
        assert f"no acknowledgement from {did_d} within 2 s" in res.stderr

        for bad in ("did:key:zBAD", "did:key:z6MkTYPO", "not-a-did"):
            res = talosd("send", "--home", str(home_a), bad, "z")
            assert res.returncode == exit_codes.BAD_INPUT, (bad, res.stderr)
            assert res.stderr.startswith("talosd: error: ") and "Traceback" not in res.stderr
        # The node's log says so once (it said nothing at its default level), not at
        # every redial: the sends above took several.
        said = [line for line in a.stderr if "dial_failed" in line and did_c in line]
        assert len(said) == 1 and "kind=unreachable" in said[0], said
    finally:
        a.stop()
        silent.close()
    # Offline (no node): a bad DID is still bad input, not a crash.
    res = talosd("send", "--home", str(home_a), "did:key:zBAD", "z")
    assert res.returncode == exit_codes.BAD_INPUT, res.stderr


def test_send_wait_to_a_peer_that_can_never_link_fails_at_once(tmp_path: Path) -> None:
    """A mistyped (but well-formed) DID: no address, no relay, not allowed to dial in."""
    home_a, _ = _init(tmp_path, "a")
    _, stranger = _init(tmp_path, "stranger")
    a = Daemon(home_a, "--listen", "127.0.0.1:0")
    try:
        started = time.monotonic()
        res = talosd("send", "--home", str(home_a), "--wait", "--timeout", "60", stranger, "x")
        assert time.monotonic() - started < GENEROUS
        assert res.returncode == exit_codes.UNREACHABLE, res.stderr
        assert "no address known for the peer, no relay" in res.stderr
        assert "check the DID" in res.stderr and "nothing was sent" in res.stderr
        assert _json("outbox", "--json", "--home", str(home_a)) == []
        # Without --wait it is queued, and the sender hears that nothing can move it yet.
        res = talosd("send", "--home", str(home_a), stranger, "queued")
        assert res.returncode == 0 and len(res.stdout.strip()) == 32, res.stderr
        assert res.stderr.startswith("note: no address known for the peer"), res.stderr
        assert "the message stays queued" in res.stderr
    finally:
        a.stop()
    # Allowed to dial in, the same DID is worth a wait: it runs its course.
    a = Daemon(home_a, "--listen", "127.0.0.1:0", "--allow", stranger)
    try:
        res = talosd("send", "--home", str(home_a), "--wait", "--timeout", "1", stranger, "y")
        assert res.returncode == exit_codes.UNREACHABLE, res.stderr
        assert "the message stays queued" in res.stderr  # it waited, and may go yet
    finally:
        a.stop()
