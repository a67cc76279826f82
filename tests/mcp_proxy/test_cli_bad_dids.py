"""``talos-proxy`` refuses a malformed DID wherever it takes one, a serve that allows nobody,
and a serve whose tool command is not there.

Real ``talos-proxy`` processes; the DIDs and the phrase each error must contain
come from tests/talos/bad_dids.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from talos.exit_codes import BAD_INPUT
from tests.mcp_proxy.e2e import ENV, EVERYTHING, PROXY, REPO, serving
from tests.talos.bad_dids import BAD_DIDS

SOME_BAD = [BAD_DIDS[0], BAD_DIDS[1]]


def proxy(*argv: str) -> subprocess.CompletedProcess[str]:
    # A serve that wrongly started would run on: the timeout makes that a failure.
    return subprocess.run(
        [*PROXY, *argv], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=60
    )


def assert_bad_input(done: subprocess.CompletedProcess[str], *phrases: str) -> None:
    assert done.returncode == BAD_INPUT, (done.returncode, done.stderr)
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    for phrase in phrases:
        assert phrase in done.stderr, (phrase, done.stderr)


@pytest.mark.parametrize(("did", "what"), SOME_BAD)
def test_serve_allow(tmp_path: Path, did: str, what: str) -> None:
    done = proxy("serve", "--home", str(tmp_path / "h"), "--listen", "127.0.0.1:0",
                 "--allow", did, "--", *EVERYTHING)  # fmt: skip
    assert_bad_input(done, f"--allow {did}: not a valid did:key", what)


@pytest.mark.parametrize(("did", "what"), SOME_BAD)
def test_serve_policy_file(tmp_path: Path, did: str, what: str) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[peers."{did}"]\n')
    done = proxy("serve", "--home", str(tmp_path / "h"), "--listen", "127.0.0.1:0",
                 "--policy", str(policy), "--", *EVERYTHING)  # fmt: skip
    assert_bad_input(done, f"policy file {policy}", "not a valid did:key", what)


@pytest.mark.parametrize(("did", "what"), SOME_BAD)
def test_connect_peer(tmp_path: Path, did: str, what: str) -> None:
    done = proxy("connect", "--home", str(tmp_path / "h"), "--peer", f"ws://127.0.0.1:9#{did}")
    assert_bad_input(done, did, "not a valid did:key", what)


@pytest.mark.parametrize(("did", "what"), SOME_BAD)
def test_audit_peer(tmp_path: Path, did: str, what: str) -> None:
    done = proxy("audit", "--home", str(tmp_path / "h"), "--peer", did)
    assert_bad_input(done, f"--peer {did}: not a valid did:key", what)


def test_serve_allowing_nobody_refuses_to_start(tmp_path: Path) -> None:
    done = proxy("serve", "--home", str(tmp_path / "h"), "--listen", "127.0.0.1:0",
                 "--", *EVERYTHING)  # fmt: skip
    assert_bad_input(done, "serve allows no caller", "--allow-none")


async def test_serve_allow_none_starts_when_told(tmp_path: Path) -> None:
    async with serving(tmp_path / "h", ["--allow-none"]) as serve:
        assert serve.address.startswith("ws://127.0.0.1:")


def test_serve_with_a_tool_command_that_does_not_exist_refuses_to_start(tmp_path: Path) -> None:
    # Else it served, and every session only learned "tool process exited (code 127)".
    did = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
    done = proxy("serve", "--home", str(tmp_path / "h"), "--listen", "127.0.0.1:0",
                 "--allow", did, "--", "no-such-tool-xyz", "--flag")  # fmt: skip
    assert_bad_input(done, "tool command 'no-such-tool-xyz'", "not an executable file on PATH")
