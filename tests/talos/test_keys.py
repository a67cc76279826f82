"""The identity key at rest (talos/keys.py, ``talosd init / run / passphrase``, talos-proxy).

Real ``talosd`` and ``talos-proxy`` subprocesses; a pseudo-terminal where a
prompt is the point. docs/security.md "Keys at rest".
"""

from __future__ import annotations

import os
import pty
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from talos import keys
from talos.keys import is_encrypted, key_file_did, unlock
from talos.relay.names import nkey_public
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import UsageError, WrongPassphraseError
from tests.talos.daemons import ENV, TALOSD, Daemon, fast_config, talosd

PROXY = [sys.executable, "-m", "mcp_proxy.cli"]


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**ENV, **(env or {})},
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _secret(tmp_path: Path, text: str, name: str = "pass.txt") -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def test_init_without_a_passphrase_choice_fails_and_names_the_options(tmp_path: Path) -> None:
    home = tmp_path / "a"
    res = talosd("init", "--home", str(home))
    assert res.returncode == 2  # bad input: no way to get a passphrase
    assert "Traceback" not in res.stderr
    for option in ("--passphrase-file", "TALOS_PASSPHRASE", "--no-passphrase"):
        assert option in res.stderr
    assert not (home / "identity.key").exists()


def test_init_makes_an_existing_home_owner_only(tmp_path: Path) -> None:
    home = tmp_path / "lax"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    res = talosd("init", "--home", str(home), "--no-passphrase")
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert not is_encrypted(home / "identity.key")  # the explicit opt-out


def test_sealed_identity_init_run_and_offline_commands(tmp_path: Path) -> None:
    home = tmp_path / "a"
    good = _secret(tmp_path, "correct horse battery staple")
    res = talosd("init", "--home", str(home), "--passphrase-file", good)
    assert res.returncode == 0, res.stderr
    did = res.stdout.strip()
    key = home / "identity.key"
    assert is_encrypted(key) and key_file_did(key) == did
    assert b"correct horse" not in key.read_bytes()
    fast_config(home)
    # Who we are needs no passphrase (the DID is in clear in the key file).
    assert talosd("id", "--home", str(home)).stdout.strip() == did
    # run without any means to unlock: one clear line, no prompt, no traceback.
    res = talosd("run", "--home", str(home))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "encrypted" in res.stderr and "--passphrase-file" in res.stderr
    res = _run([*TALOSD, "run", "--home", str(home)], {"TALOS_PASSPHRASE": "wrong"})
    assert res.returncode == 2 and "wrong passphrase" in res.stderr  # bad input
    # ... naming the file and where the passphrase came from (a stale variable, here)
    assert str(home / "identity.key") in res.stderr and "$TALOS_PASSPHRASE" in res.stderr
    # The right one, from a file or the environment.
    node = Daemon(home, "--listen", "127.0.0.1:0", "--passphrase-file", good)
    try:
        assert node.did == did
    finally:
        node.stop()
    res = _run(
        [*TALOSD, "chain", "verify", "--home", str(home)],
        {"TALOS_PASSPHRASE": "correct horse battery staple"},
    )
    assert res.returncode == 0, res.stderr


def test_passphrase_command_changes_and_removes_it(tmp_path: Path) -> None:
    home = tmp_path / "a"
    old, new = _secret(tmp_path, "old one", "old"), _secret(tmp_path, "new one", "new")
    assert talosd("init", "--home", str(home), "--passphrase-file", old).returncode == 0
    key = home / "identity.key"
    did = key_file_did(key)
    res = talosd("passphrase", "--home", str(home), "--passphrase-file", new)
    assert res.returncode == 2 and "wrong passphrase" in res.stderr  # bad input
    assert f"from --passphrase-file {new}" in res.stderr
    # the current passphrase unlocks, and no new one can be had: the message says "new"
    res = talosd("passphrase", "--home", str(home), "--passphrase-file", old)
    assert res.returncode == 2 and "needs a new passphrase" in res.stderr
    res = talosd(
        "passphrase", "--home", str(home), "--passphrase-file", old, "--new-passphrase-file", new
    )
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    with pytest.raises(WrongPassphraseError):
        unlock(key, passphrase_file=old)
    assert unlock(key, passphrase_file=new).did == did
    # The new one from the environment works too; a missing one is refused clearly.
    res = talosd("passphrase", "--home", str(home), "--passphrase-file", new)
    assert res.returncode == 2 and "TALOS_NEW_PASSPHRASE" in res.stderr
    res = _run(
        [*TALOSD, "passphrase", "--home", str(home), "--passphrase-file", new],
        {"TALOS_NEW_PASSPHRASE": "third"},
    )
    assert res.returncode == 0, res.stderr
    assert unlock(key, passphrase_file=_secret(tmp_path, "third", "third")).did == did
    res = _run(
        [*TALOSD, "passphrase", "--home", str(home), "--no-passphrase"],
        {"TALOS_PASSPHRASE": "third"},
    )
    assert res.returncode == 0, res.stderr
    assert not is_encrypted(key) and unlock(key).did == did


def _on_terminal(args: list[str], answers: list[str]) -> tuple[int, str]:
    """Run ``args`` with a pseudo-terminal as standard input, answering each prompt."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        args,
        stdin=secondary,
        stdout=subprocess.PIPE,
        stderr=secondary,
        env=ENV,
        start_new_session=True,  # no controlling terminal: getpass uses stdin, the pty
    )
    os.close(secondary)
    seen = b""
    deadline = time.monotonic() + 60
    try:
        for i, answer in enumerate(answers):
            while seen.count(b"passphrase") <= i:
                left = max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([primary], [], [], left)
                assert ready, f"no prompt; got {seen!r}"
                seen += os.read(primary, 1024)
            os.write(primary, answer.encode() + b"\n")
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out.decode()


def test_init_asks_on_a_terminal(tmp_path: Path) -> None:
    home = tmp_path / "a"
    typed = ["typed secret", "typed secret"]  # asked twice
    code, out = _on_terminal([*TALOSD, "init", "--home", str(home)], typed)
    assert code == 0
    assert out.strip() == key_file_did(home / "identity.key")
    assert unlock(home / "identity.key", passphrase_file=_secret(tmp_path, "typed secret")).did


def _at_the_prompt(args: list[str], act: Callable[[subprocess.Popen[bytes], int], int]) -> bytes:
    """Run ``args`` on a pseudo-terminal; at the passphrase prompt ``act(proc, pty)`` acts
    and returns the exit code it expects; what the terminal showed is returned."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        args, stdin=secondary, stdout=subprocess.DEVNULL, stderr=secondary, env=ENV,
        start_new_session=True,  # getpass reads the pty, not a real terminal
    )  # fmt: skip
    os.close(secondary)
    seen = b""
    try:
        while b"passphrase" not in seen:
            ready, _, _ = select.select([primary], [], [], 60)
            assert ready, f"no prompt; got {seen!r}"
            seen += os.read(primary, 1024)
        expected = act(proc, primary)
        assert proc.wait(timeout=20) == expected
        while select.select([primary], [], [], 0.5)[0]:
            try:
                seen += os.read(primary, 1024)
            except OSError:  # the other side closed
                break
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"Traceback" not in seen, seen
    return seen


def test_end_of_input_at_the_prompt_is_a_clear_error(tmp_path: Path) -> None:
    home = tmp_path / "a"

    def ctrl_d(proc: subprocess.Popen[bytes], terminal: int) -> int:
        os.write(terminal, b"\x04")  # Ctrl-D on an empty line
        return 2  # bad input, as with no passphrase at all

    seen = _at_the_prompt([*TALOSD, "init", "--home", str(home)], ctrl_d)
    assert b"no passphrase given" in seen
    assert not (home / "identity.key").exists()


def test_a_stopped_sealed_home_reads_its_log_without_the_passphrase(tmp_path: Path) -> None:
    home = tmp_path / "a"
    res = _run([*TALOSD, "init", "--home", str(home)], {"TALOS_PASSPHRASE": "sealed"})
    assert res.returncode == 0, res.stderr
    did = res.stdout.strip()
    # Public facts only: the DID is in the key file's clear header.
    assert _run([*TALOSD, "chain", "verify", "--home", str(home)]).stdout.startswith("chain ok")
    shown = _run([*TALOSD, "chain", "show", "--home", str(home)])
    assert shown.returncode == 0 and shown.stdout.strip() == "[]", shown.stderr
    proof = _run([*TALOSD, "chain", "proof", "--home", str(home), "00" * 16])
    assert proof.returncode == 2 and "Traceback" not in proof.stderr  # no such record
    relay = _run([*TALOSD, "relay-config", "--node-home", str(home), "--store-dir", "/x"])
    assert relay.returncode == 0, relay.stderr
    assert nkey_public(public_key_from_did(did)) in relay.stdout  # the node's relay user


def test_a_stopped_hybrid_home_takes_the_passphrase_file_to_read_its_log(tmp_path: Path) -> None:
    home = tmp_path / "h"
    secret = _secret(tmp_path, "hybrid secret")
    init = [*TALOSD, "init", "--home", str(home), "--suite", "ed25519-mldsa65"]
    assert _run([*init, "--passphrase-file", secret]).returncode == 0
    # Its ML-DSA key is not in the clear header: the key is unlocked to check blocks.
    res = _run([*TALOSD, "chain", "verify", "--home", str(home)])
    assert res.returncode == 2 and "--passphrase-file" in res.stderr
    res = _run([*TALOSD, "chain", "verify", "--home", str(home), "--passphrase-file", secret])
    assert res.returncode == 0 and res.stdout.startswith("chain ok"), res.stderr
    # Hybrid from its first block: said under the seal, where the store cannot move it,
    # and kept through a change of passphrase.
    key = home / "identity.key"
    assert keys.hybrid_since(key) == 0
    other = _secret(tmp_path, "another", "other")
    change = ["passphrase", "--home", str(home), "--passphrase-file", secret]
    assert talosd(*change, "--new-passphrase-file", other).returncode == 0
    assert keys.hybrid_since(key) == 0 and unlock(key, passphrase_file=other).did
    key.write_text(key.read_text().replace('"hybrid_since": 0', '"hybrid_since": 9'))
    res = _run([*TALOSD, "chain", "verify", "--home", str(home), "--passphrase-file", other])
    assert res.returncode == 2 and "header was modified" in res.stderr


def test_proxy_seals_a_new_identity_and_unlocks_it(tmp_path: Path) -> None:
    sealed, plain = tmp_path / "sealed", tmp_path / "plain"
    res = _run([*PROXY, "id", "--home", str(sealed)], {"TALOS_PASSPHRASE": "proxy secret"})
    assert res.returncode == 0, res.stderr
    assert is_encrypted(sealed / "identity.key")
    assert res.stdout.strip() == key_file_did(sealed / "identity.key")
    # serve unlocks by the same means; the wrong passphrase is one clear line.
    serve = ["serve", "--home", str(sealed), "--listen", "127.0.0.1:0", "--allow-none"]
    res = _run([*PROXY, *serve, "--", "true"], {"TALOS_PASSPHRASE": "not it"})
    assert res.returncode == 2 and "wrong passphrase" in res.stderr
    assert "Traceback" not in res.stderr
    # No passphrase to be had: created unencrypted, and said so; --no-passphrase is quiet.
    res = _run([*PROXY, "id", "--home", str(plain)])
    assert res.returncode == 0 and "WITHOUT a passphrase" in res.stderr
    assert not is_encrypted(plain / "identity.key")
    res = _run([*PROXY, "id", "--home", str(tmp_path / "quiet"), "--no-passphrase"])
    assert res.returncode == 0 and "WITHOUT" not in res.stderr


class _Terminal:
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("confirm", "said"),
    [(True, "use --no-passphrase"), (False, "the identity key is sealed; type its passphrase")],
    ids=["new-key", "unlock"],
)
def test_an_empty_passphrase_gets_advice_that_fits_the_command(
    monkeypatch: pytest.MonkeyPatch, confirm: bool, said: str
) -> None:
    """``--no-passphrase`` is an option of init and passphrase, never of an unlock."""
    monkeypatch.setattr(keys.sys, "stdin", _Terminal())
    monkeypatch.setattr(keys.getpass, "getpass", lambda prompt: "")
    with pytest.raises(UsageError, match=said):
        keys._prompt("passphrase: ", confirm=confirm)


@pytest.mark.parametrize(
    "command",
    [
        [
            *PROXY,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--allow-none",
            "--home",
            "{home}",
            "--",
            "true",
        ],
        [*TALOSD, "mcp", "--home", "{home}"],
    ],
    ids=["talos-proxy serve", "talosd mcp"],
)
def test_ctrl_c_at_a_passphrase_prompt_under_an_event_loop_ends_it_at_once(
    tmp_path: Path, command: list[str]
) -> None:
    """Both ask from inside their event loop; SIGINT there used to wait for Enter."""
    home = tmp_path / "sealed"
    res = _run([*TALOSD, "init", "--home", str(home)], {"TALOS_PASSPHRASE": "s"})
    assert res.returncode == 0, res.stderr

    def ctrl_c(proc: subprocess.Popen[bytes], terminal: int) -> int:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C at the terminal sends
        return 130

    _at_the_prompt([arg.format(home=home) for arg in command], ctrl_c)


def test_a_mistype_at_the_unlock_prompt_can_be_typed_again_up_to_three_times(
    tmp_path: Path,
) -> None:
    # (Not "passphrase" in the test's name: _on_terminal counts prompts by that word,
    # and the home's path, which the prompt shows, holds the name.)
    home = tmp_path / "a"
    good = _secret(tmp_path, "right one", "good")
    assert talosd("init", "--home", str(home), "--passphrase-file", good).returncode == 0
    unseal = [*TALOSD, "passphrase", "--no-passphrase", "--home", str(home)]
    code, _ = _on_terminal(unseal, ["wrong", "wrong again", "still wrong"])
    assert code == 2 and is_encrypted(home / "identity.key")  # bad input, after the third
    code, _ = _on_terminal(unseal, ["wrong", "right one"])
    assert code == 0 and not is_encrypted(home / "identity.key")
