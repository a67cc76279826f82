"""Every example runs as a newcomer would run it: ``python examples/NAME.py``.

The examples start together (they are mostly waiting on subprocesses and
sockets) and each test then collects one of them with a deadline. Each runs
with its own TMPDIR, which must be empty afterwards: the examples clean up.
Each has a pseudo-terminal as its standard input, as when typed into a shell
(and no controlling terminal, so nothing can read the real one): a command
an example runs that stopped at a passphrase prompt would hang it here.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DEADLINE_S = 180.0  # generous: a loaded 2-core machine; they take seconds when idle

# For each example, lines (regexes) its output must contain.
EXPECTED: dict[str, list[str]] = {
    "demo": [
        r"message id [0-9a-f]+ acknowledged",
        r"bob's inbox: from did:key:z6Mk\w+…: 'hello bob'",
        r"get_current_time\(UTC\) -> \{",
        r"chain ok: 1 blocks, 1 records",
        r"Done: nodes stopped cleanly",
    ],
    "wallet_and_dids": [
        r"verify\(alice\.did, message\)\s+-> True",
        r"verify\(alice\.did, tampered\)\s+-> False",
        r"saved key file, mode 0600",
        r"wrong passphrase -> WrongPassphraseError",
        r"hybrid signature 3373 bytes, verify_auth -> True",
        r"classical signature where a hybrid one is pinned -> False",
    ],
    "session_messaging": [
        r"delivered 3, 1, 2 -> \['message 3', 'message 1', 'message 2'\]",
        r"tampered\s+-> DecryptionError",
        r"replayed\s+-> DecryptionError",
        r"restored session decrypts: b'after restart'",
        r"hybrid suite x25519-mlkem768: b'post-quantum'",
        r"the same init replayed -> BundleError",
        r"verify_commitment\(commitment, bob\) -> True",
        r"verify_commitment\(commitment, alice\) -> False",
    ],
    "two_agents": [
        r"acknowledged after bob's durable commit",
        r"bob's inbox #1: from alice: 'hello bob, can you summarise the report\?'",
        r"alice's inbox: 'done: three findings, one risk'",
        r"bob's inbox #2: 'sent while you were offline'",
        r"delivered in order: \['ping 0', 'ping 1', 'ping 2'\]",
        r"mallory \(not allowed by bob\) gets no link: LinkRefusedError: .*not on its allow list",
        r"nodes stopped",
    ],
    "mcp_tool": [
        r"tools/list -> \['get_current_time'\]",
        r"get_current_time\(Europe/Paris\) -> .*\"timezone\": \"Europe/Paris\"",
        r"convert_time -> refused: tool 'convert_time' not allowed .* \(code -32001\)",
        r"tool node audit log: chain ok: \d+ blocks, [1-9]\d* records",
    ],
    "send_file": [
        r"bob: pending offer [0-9a-f]{32} dataset\.bin \(16777216 B\)",
        r"progress\s+16777216 / 16777216 B \(100%\)",
        r"send-file --wait returned [0-9a-f]{32}",
        r"sha256 matches",
    ],
    "agents_mcp": [
        r"alice's agent sees tools \[.*'read_inbox'.*'send_message'.*\]",
        r"alice: send_message -> id [0-9a-f]{32} acked=True",
        r"bob: read_inbox -> from alice: 'hello bob, lunch at noon\?'",
        r"alice: notifications/resources/updated talos://inbox",
        r"alice: talos://inbox -> \['yes, see you there'\]",
        r"Done: nodes stopped cleanly",
    ],
    "verify_log": [
        r"chain ok: \d+ blocks, 3 records",
        r"verify_inclusion_proof\(proof, bob\) -> True",
        r"signed by the node: True",
        r"to the root: True",
        r"sender's signature over its commitment: True",
        r"with another record swapped in -> False",
        r"checked against alice's DID instead -> False",
        r"after flipping one bit of a record: exit 1",
        r"DEFECT merkle_root at block 0",
    ],
}


@dataclass
class Running:
    proc: subprocess.Popen[str]
    tmpdir: Path
    terminal: int  # the pseudo-terminal's primary side, open while the example runs


def test_every_example_is_covered() -> None:
    assert {p.stem for p in EXAMPLES.glob("*.py")} == set(EXPECTED)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Running]]:
    procs: dict[str, Running] = {}
    try:
        for name in EXPECTED:
            tmpdir = tmp_path_factory.mktemp(f"tmp-{name}")
            env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}
            primary, secondary = pty.openpty()
            try:
                proc = subprocess.Popen(
                    [sys.executable, str(EXAMPLES / f"{name}.py")],
                    cwd=tmpdir,
                    env=env,
                    stdin=secondary,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            except BaseException:
                os.close(primary)
                raise
            finally:
                os.close(secondary)
            procs[name] = Running(proc, tmpdir, primary)
        yield procs
    finally:
        for r in procs.values():
            if r.proc.poll() is None:
                r.proc.kill()
            if r.proc.stdout is not None and not r.proc.stdout.closed:
                r.proc.communicate()  # reaped, pipe closed (also for a deselected example)
            os.close(r.terminal)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_example_runs(name: str, running: dict[str, Running]) -> None:
    r = running[name]
    try:
        out, _ = r.proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        r.proc.kill()
        out, _ = r.proc.communicate()
        pytest.fail(f"examples/{name}.py did not finish in {DEADLINE_S:.0f}s:\n{out}")
    assert r.proc.returncode == 0, out
    assert "Traceback" not in out, out
    for pattern in EXPECTED[name]:
        assert re.search(pattern, out), f"{pattern!r} not in the output of {name}:\n{out}"
    leftovers = [p.name for p in r.tmpdir.iterdir()]
    assert leftovers == [], f"examples/{name}.py left {leftovers} in its TMPDIR"
