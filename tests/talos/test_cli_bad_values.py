"""Numbers and text on the command line that cannot be used: exit 2 and one clear line.

Real ``talosd`` / ``talos-proxy`` processes on a real (stopped) home. Each of these
used to end in a traceback (``nan`` or ``1e999`` seconds, an unclosed IPv6 bracket,
a message number past u64, bytes that are not UTF-8) or to pass silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from talos.exit_codes import BAD_INPUT
from tests.talos.daemons import Daemon

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "error"}
DID = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"


def run(module: str, home: Path, *argv: str | bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", module, *argv, "--home", str(home)],
        capture_output=True,
        cwd=REPO,
        env=ENV,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad-values") / "home"
    done = run("talos.cli", path, "init", "--no-passphrase")
    assert done.returncode == 0, done.stderr
    return path


@pytest.mark.parametrize(
    ("module", "argv", "said"),
    [
        ("talos.cli", ["send", "--wait", "--timeout", "nan", DID, "x"], "finite number of seconds"),
        ("talos.cli", ["send", "--wait", "--timeout", "1e999", DID, "x"], "finite number"),
        ("talos.cli", ["send", "--wait", "--timeout", "-1", DID, "x"], "above 0"),
        ("talos.cli", ["send", DID, b"caf\xe9"], "TEXT is not valid UTF-8"),
        ("talos.cli", ["peers", "add", f"ws://[::1:17400#{DID}"], "peer address must look like"),
        ("talos.cli", ["inbox", "--after", str(10**23)], "from 0 to 2**64-1"),
        ("talos.cli", ["inbox", "--after", "-1"], "from 0 to 2**64-1"),
        ("talos.cli", ["run", "--ratchet-every", "0"], "from 1 to"),
        ("mcp_proxy.cli", ["connect", "--peer", f"ws://127.0.0.1:9#{DID}", "--link-wait", "inf"],
         "finite number"),
    ],
    ids=["nan", "inf", "negative", "not-utf8", "ipv6", "after-u64", "after-negative",
         "ratchet-zero", "proxy-inf"],
)  # fmt: skip
def test_refused_with_one_line(home: Path, module: str, argv: list[str | bytes], said: str) -> None:
    done = run(module, home, *argv)
    err = done.stderr.decode()
    assert done.returncode == BAD_INPUT, (done.returncode, err)
    assert done.stdout == b""
    assert said in err and "Traceback" not in err, err


def test_bytes_that_are_not_utf8_never_reach_a_running_node(home: Path) -> None:
    """The local socket's JSON cannot carry them: refused on the client's side, exit 2."""
    node = Daemon(home, "--listen", "127.0.0.1:0")
    try:
        done = run("talos.cli", home, "send-file", DID, b"/tmp/caf\xe9.txt")
        err = done.stderr.decode()
        assert done.returncode == BAD_INPUT, (done.returncode, err)
        assert "not valid UTF-8" in err and "Traceback" not in err, err
    finally:
        assert node.stop() == 0
