"""``talosd completion`` / ``talos-proxy completion`` in real processes and a real bash
(talos/cli_completion.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _script(prog: str, shell: str) -> str:
    res = subprocess.run(
        [str(BIN / prog), "completion", shell],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def _complete(prog: str, script: Path, words: list[str]) -> list[str]:
    """What bash's completion function offers for ``words`` (the last one being typed)."""
    function = "_shtab_" + prog.replace("-", "_")
    quoted = " ".join(f"'{w}'" for w in words)
    line = " ".join(words)
    program = (
        f"source {script}; COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1};"
        f" COMP_LINE='{line}'; COMP_POINT={len(line)}; {function};"
        ' printf "%s\\n" "${COMPREPLY[@]}"'
    )
    res = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return [w for w in res.stdout.split("\n") if w]


@pytest.mark.parametrize("prog", ["talosd", "talos-proxy"])
def test_bash_script_is_valid_bash(prog: str, tmp_path: Path) -> None:
    script = tmp_path / prog
    script.write_text(_script(prog, "bash"))
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_bash_completes_talosd_commands_and_options(tmp_path: Path) -> None:
    script = tmp_path / "talosd.bash"
    script.write_text(_script("talosd", "bash"))
    assert _complete("talosd", script, ["talosd", "se"]) == ["send", "send-file"]
    assert _complete("talosd", script, ["talosd", "peers", ""]) == [
        "add",
        "allow",
        "name",
        "remove",
        "list",
    ]
    assert _complete("talosd", script, ["talosd", "chain", "pr"]) == ["proof"]
    assert set(_complete("talosd", script, ["talosd", "send", "--"])) >= {
        "--home",
        "--wait",
        "--timeout",
    }
    assert _complete("talosd", script, ["talosd", "init", "--suite", "ed25519-"]) == [
        "ed25519-mldsa65"
    ]
    assert _complete("talosd", script, ["talosd", "completion", "z"]) == ["zsh"]


def test_bash_completes_folders_for_home(tmp_path: Path) -> None:
    script = tmp_path / "talosd.bash"
    script.write_text(_script("talosd", "bash"))
    (tmp_path / "alice-home").mkdir()
    (tmp_path / "alice-file").write_text("")
    offered = _complete("talosd", script, ["talosd", "id", "--home", f"{tmp_path}/alice"])
    assert f"{tmp_path}/alice-home" in [w.rstrip("/") for w in offered]
    assert f"{tmp_path}/alice-file" not in offered


def test_bash_completes_talos_proxy(tmp_path: Path) -> None:
    script = tmp_path / "talos-proxy.bash"
    script.write_text(_script("talos-proxy", "bash"))
    assert _complete("talos-proxy", script, ["talos-proxy", "co"]) == ["connect", "completion"]
    assert "--allow-origin" in _complete(
        "talos-proxy", script, ["talos-proxy", "connect", "--allow-"]
    )
    assert _complete("talos-proxy", script, ["talos-proxy", "serve", "--audit", ""]) == [
        "group",
        "strict",
    ]


@pytest.mark.parametrize("prog", ["talosd", "talos-proxy"])
def test_zsh_script(prog: str, tmp_path: Path) -> None:
    text = _script(prog, "zsh")
    assert text.startswith(f"#compdef {prog}")
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("zsh is not installed: only the script's header is checked")
    script = tmp_path / f"_{prog}"
    script.write_text(text)
    res = subprocess.run([zsh, "-n", str(script)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    function = "_shtab_" + prog.replace("-", "_")
    loaded = subprocess.run(
        [zsh, "-fc", f"autoload -U compinit && compinit -u -d {tmp_path}/zcd;"
         f" source {script}; whence -w {function}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert loaded.stdout.strip() == f"{function}: function", loaded.stderr


def test_unknown_shell_is_a_usage_error() -> None:
    res = subprocess.run(
        [str(BIN / "talosd"), "completion", "fish"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2
    assert "invalid choice" in res.stderr
