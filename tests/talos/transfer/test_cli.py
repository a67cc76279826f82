"""End-to-end: two real `talosd run` processes on 127.0.0.1, files moved with the real CLI."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from talos import exit_codes

CLI = [sys.executable, "-m", "talos.cli"]


def _run(*args: str, timeout: float = 30) -> str:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _node_info(home: Path) -> dict[str, str]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (home / "node.json").exists():
            return dict(json.loads((home / "node.json").read_text()))
        time.sleep(0.05)
    raise TimeoutError(f"node on {home} did not start")


def _nodes(tmp_path: Path, *b_extra: str) -> Generator[tuple[Path, Path, str, str]]:
    a, b = tmp_path / "a", tmp_path / "b"
    did_a = _run("init", "--home", str(a), "--no-passphrase")
    did_b = _run("init", "--home", str(b), "--no-passphrase")
    if b_extra:  # B auto-accepts A (config.json's transfer section)
        config = json.loads((b / "config.json").read_text())
        config["transfer"] = {"auto_accept": [did_a]}
        (b / "config.json").write_text(json.dumps(config))
    procs = [
        subprocess.Popen(
            [*CLI, "run", "--home", str(b), "--listen", "127.0.0.1:0", "--allow", did_a, *b_extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        listen = _node_info(b)["listen"]
        procs.append(
            subprocess.Popen(
                [*CLI, "run", "--home", str(a), "--listen", "127.0.0.1:0", "--peer",
                 f"{listen}#{did_b}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        _node_info(a)
        yield a, b, did_a, did_b
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[Path, Path, str, str]]:
    yield from _nodes(tmp_path)


def _ready(home: Path, did: str) -> bool:
    links = json.loads(_run("status", "--json", "--home", str(home)))["links"]
    return any(link["did"] == did and link["ready"] for link in links)


def _wait_linked(home: Path, did: str) -> None:
    deadline = time.monotonic() + 20
    while not _ready(home, did):  # the link comes up asynchronously
        if time.monotonic() > deadline:
            raise TimeoutError(f"{home} never linked to {did}")
        time.sleep(0.1)


def _wait_state(home: Path, tid: str, state: str) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for row in json.loads(_run("files", "--home", str(home), "--json")):
            if row["tid"] == tid and row["state"] == state:
                return dict(row)
        time.sleep(0.05)
    raise TimeoutError(f"{tid} never reached {state}")


def test_send_file_pending_accept_and_list(
    tmp_path: Path, two_nodes: tuple[Path, Path, str, str]
) -> None:
    a, b, did_a, did_b = two_nodes
    src = tmp_path / "payload.bin"
    src.write_bytes(os.urandom(3 * (1 << 20) + 11))
    deadline = time.monotonic() + 20
    while not _ready(a, did_b) and time.monotonic() < deadline:  # the link comes up later
        time.sleep(0.1)
    tid = _run("send-file", "--home", str(a), did_b, str(src))
    pending = _wait_state(b, tid, "pending")
    assert pending["from"] == did_a
    assert not (b / "files" / "payload.bin").exists()
    # the listing names the peer by its local name once it has one, else by its DID
    assert f"<- {did_a[:24]}…" in _run("files", "--home", str(b))
    _run("peers", "name", "--home", str(b), did_a, "alice")
    assert f"{tid} <- alice " in _run("files", "--home", str(b))
    assert pending["peer_name"] is None  # read before the name was given
    _run("files", "--home", str(b), "accept", tid)
    row = _wait_state(b, tid, "complete")
    assert Path(str(row["path"])) == b / "files" / "payload.bin"
    assert (b / "files" / "payload.bin").read_bytes() == src.read_bytes()
    assert row["size"] == src.stat().st_size
    assert _wait_state(a, tid, "complete")["to"] == did_b
    # a file received into the home's files/ may be sent on
    back = _run("send-file", "--home", str(b), did_a, str(b / "files" / "payload.bin"))
    assert _wait_state(a, back, "pending")["from"] == did_b


def _linked_with_file(
    nodes: tuple[Path, Path, str, str], src: Path, size: int
) -> tuple[Path, Path, str, Path]:
    """A's home, B's home, B's DID and ``src`` filled with ``size`` random bytes,
    once A is linked to B."""
    a, b, _, did_b = nodes
    src.write_bytes(os.urandom(size))
    _wait_linked(a, did_b)
    return a, b, did_b, src


def test_send_file_progress_on_a_terminal_says_it_waits_then_ends_full(
    tmp_path: Path, two_nodes: tuple[Path, Path, str, str]
) -> None:
    a, b, did_b, src = _linked_with_file(two_nodes, tmp_path / "shown.bin", 2 << 20)
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, "send-file", "--home", str(a), "--wait", did_b, str(src)],
        stdout=subprocess.PIPE,
        stderr=secondary,  # the bar draws on a terminal only
        text=True,
    )
    os.close(secondary)
    shown = b""

    def read_until(text: bytes, limit: float = 30) -> None:
        nonlocal shown
        deadline = time.monotonic() + limit
        while text not in shown:
            ready, _, _ = select.select([primary], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"{text!r} never shown: {shown!r}"
            try:
                shown += os.read(primary, 4096)
            except OSError:  # the writer closed the terminal
                break

    try:
        read_until(b"waiting for the peer to accept")
        rows = json.loads(_run("files", "--home", str(b), "--json"))
        _run("files", "--home", str(b), "accept", rows[0]["tid"])
        out, _ = proc.communicate(timeout=60)
        read_until(b"100%")
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert out.strip() == rows[0]["tid"]  # stdout: the id alone, the bar went to stderr


def test_send_file_wait_exit_codes_timeout_and_rejection(
    tmp_path: Path, two_nodes: tuple[Path, Path, str, str]
) -> None:
    a, b, did_b, src = _linked_with_file(two_nodes, tmp_path / "unwanted.bin", 1 << 16)
    send = [*CLI, "send-file", "--home", str(a), "--wait", did_b, str(src)]
    late = subprocess.run([*send, "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert late.returncode == exit_codes.TIMED_OUT, late.stderr
    tid = late.stdout.strip()  # the id still reaches a script: the transfer goes on
    assert _wait_state(b, tid, "pending")["size"] == 1 << 16
    waiting = subprocess.Popen(send, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(json.loads(_run("files", "--home", str(b), "--json"))) < 2:
            assert time.monotonic() < deadline, "second offer never arrived"
            time.sleep(0.1)
        for row in json.loads(_run("files", "--home", str(b), "--json")):
            if row["state"] == "pending":
                _run("files", "--home", str(b), "reject", row["tid"])
        out, err = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.communicate()
    assert waiting.returncode == exit_codes.REFUSED, err
    assert out.strip() and "rejected" in err


def test_run_files_dir_receives_there(tmp_path: Path) -> None:
    inbox = tmp_path / "elsewhere" / "inbox"
    nodes = _nodes(tmp_path, "--files-dir", str(inbox))
    a, b, _, did_b = next(nodes)
    try:
        src = tmp_path / "notes.txt"
        src.write_bytes(os.urandom(70_000))
        _wait_linked(a, did_b)
        tid = _run("send-file", "--home", str(a), "--wait", did_b, str(src))
        row = _wait_state(b, tid, "complete")
        assert Path(str(row["path"])) == inbox / "notes.txt"
        assert (inbox / "notes.txt").read_bytes() == src.read_bytes()
        assert not (b / "files" / "notes.txt").exists()
    finally:
        nodes.close()


def _fail(*args: str, code: int = exit_codes.BAD_INPUT) -> str:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert done.stderr.startswith("talosd: error:") and "Traceback" not in done.stderr
    return done.stderr


def test_reject_and_bad_input_over_the_local_socket(
    tmp_path: Path, two_nodes: tuple[Path, Path, str, str]
) -> None:
    a, b, _, did_b = two_nodes
    src = tmp_path / "offer.bin"
    src.write_bytes(os.urandom(10_000))
    _wait_linked(a, did_b)
    tid = _run("send-file", "--home", str(a), did_b, str(src))
    _wait_state(b, tid, "pending")
    assert _run("files", "--home", str(b), "reject", tid) == f"{tid} rejected"
    assert _wait_state(a, tid, "rejected")["to"] == did_b
    # each bad input is one line on stderr; the nodes keep running
    assert "must be 32 hex digits" in _fail("files", "--home", str(b), "accept", "zz")
    assert "no transfer with id" in _fail("files", "--home", str(b), "accept", "0" * 32)
    assert "not a pending incoming" in _fail("files", "--home", str(b), "accept", tid)
    assert "rejected: nothing to cancel" in _fail("files", "--home", str(a), "cancel", tid)
    assert "unknown peer name 'carol'" in _fail("send-file", "--home", str(a), "carol", str(src))
    assert "no such file" in _fail("send-file", "--home", str(a), did_b, str(tmp_path / "nope"))
    assert "is a folder" in _fail("send-file", "--home", str(a), did_b, str(tmp_path))
    # nothing of the node's home leaves (its key first of all), even through a symlink
    (tmp_path / "innocent.txt").symlink_to(a / "identity.key")
    for path in (a / "identity.key", a / "config.json", tmp_path / "innocent.txt"):
        assert "in the node's home" in _fail("send-file", "--home", str(a), did_b, str(path))
    idle = tmp_path / "idle"
    _run("init", "--home", str(idle), "--no-passphrase")
    assert "no node is running" in _fail("files", "--home", str(idle), code=exit_codes.UNREACHABLE)
    # the commands load neither the node's HTTP stack nor its models
    code = (
        "import sys\n"
        "from talos.cli import main\n"
        "assert main(['files', '--json', '--home', sys.argv[1]]) == 0\n"
        "heavy = [m for m in ('aiohttp', 'pydantic', 'talos.node', 'lmdb') if m in sys.modules]\n"
        "print(','.join(heavy), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(b)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
    assert json.loads(done.stdout)[0]["tid"] == tid
