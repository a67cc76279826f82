"""Every place ``talosd`` takes a DID refuses a malformed one: exit 2, place and fault named.

Real ``talosd`` processes on a real home; the DIDs and the phrase each error
must contain come from tests/talos/bad_dids.py (talos/peer_refs.py parses them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from talos.exit_codes import BAD_INPUT
from tests.talos.bad_dids import BAD_DIDS

REPO = Path(__file__).resolve().parents[2]
TALOSD = [sys.executable, "-m", "talos.cli"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "error"}

# The newcomer's typo and a key of the wrong length: one fault of the text, one of the bytes.
SOME_BAD = [BAD_DIDS[0], BAD_DIDS[1]]


def talosd(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    # A command that wrongly accepted the DID could run on (``run``): the timeout
    # turns that into a failure instead of a hung suite.
    return subprocess.run(
        [*TALOSD, *argv, "--home", str(home)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=60,
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad-dids") / "home"
    done = talosd(path, "init", "--no-passphrase")
    assert done.returncode == 0, done.stderr
    return path


def assert_refused(done: subprocess.CompletedProcess[str], where: str, did: str, what: str) -> None:
    assert done.returncode == BAD_INPUT, (done.returncode, done.stderr)
    assert done.stdout == ""
    line = done.stderr.strip()
    assert line.startswith(f"talosd: error: {where}"), line
    assert did in line and "not a valid did:key" in line and what in line, line
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("did", "what"), SOME_BAD)
@pytest.mark.parametrize(
    ("argv", "where"),
    [
        (["run", "--listen", "127.0.0.1:0", "--allow", "{did}"], "--allow "),
        (["run", "--listen", "127.0.0.1:0", "--peer", "ws://127.0.0.1:9#{did}"], "--peer "),
        (["peers", "add", "ws://127.0.0.1:9#{did}"], ""),
        (["peers", "name", "{did}", "bob"], ""),
        (["send", "{did}", "hello"], ""),
        (["send-file", "{did}", __file__], ""),
    ],
    ids=["run-allow", "run-peer", "peers-add", "peers-name", "send", "send-file"],
)
def test_command_line_did(home: Path, argv: list[str], where: str, did: str, what: str) -> None:
    done = talosd(home, *(a.replace("{did}", did) for a in argv))
    assert_refused(done, where, did, what)


@pytest.mark.parametrize(("did", "what"), BAD_DIDS)
def test_every_malformed_did_on_send(home: Path, did: str, what: str) -> None:
    assert_refused(talosd(home, "send", did, "hello"), "", did, what)


@pytest.mark.parametrize(("did", "what"), SOME_BAD)
@pytest.mark.parametrize("key", ["allow", "peers"])
def test_config_json_did(tmp_path: Path, key: str, did: str, what: str) -> None:
    path = tmp_path / "home"
    assert talosd(path, "init", "--no-passphrase").returncode == 0
    config = path / "config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    data[key] = [did] if key == "allow" else [f"ws://127.0.0.1:9#{did}"]
    config.write_text(json.dumps(data))
    done = talosd(path, "run", "--listen", "127.0.0.1:0")
    assert done.returncode == BAD_INPUT, (done.returncode, done.stderr)
    assert "not a valid did:key" in done.stderr and what in done.stderr, done.stderr
    assert "config.json" in done.stderr or str(config) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_peer_given_wrongly_gets_a_hint_of_the_right_form(home: Path) -> None:
    """Neither is a malformed DID: an address without its DID, and the arguments of send
    swapped (its TEXT a DID, its PEER a name nobody gave). Each says what to write."""
    done = talosd(home, "send", "127.0.0.1:7400", "hello")
    assert done.returncode == BAD_INPUT and "ws://HOST:PORT#DID" in done.stderr, done.stderr
    did = talosd(home, "id").stdout.strip()
    done = talosd(home, "send", "hello", did)  # stopped node: the store answers
    assert done.returncode == BAD_INPUT and "unknown peer name 'hello'" in done.stderr
    assert "The order is PEER, then TEXT" in done.stderr
    done = talosd(home, "send", "hello", "a text")  # not swapped: no such hint
    assert "unknown peer name 'hello'" in done.stderr and "order" not in done.stderr
