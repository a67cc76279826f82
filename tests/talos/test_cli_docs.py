"""docs/cli.md documents every command and option of both CLIs (tools/cli_docs.py)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_proxy.cli import build_parser as proxy_parser
from talos import exit_codes
from talos.cli import build_parser as talosd_parser
from talos.cli_help import options_of, walk

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "cli.md"
SCRIPT = ROOT / "tools" / "cli_docs.py"


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--file", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_docs_cli_md_is_what_the_parsers_say() -> None:
    res = _check(DOC)
    assert res.returncode == 0, res.stderr  # the message says: run python tools/cli_docs.py


def test_check_catches_a_stale_reference(tmp_path: Path) -> None:
    stale = tmp_path / "cli.md"
    stale.write_text(DOC.read_text().replace("`--timeout SECONDS`", "`--timeout`", 1))
    res = _check(stale)
    assert res.returncode == 1
    assert "python tools/cli_docs.py" in res.stderr


def _sections() -> dict[str, str]:
    text = DOC.read_text()
    parts = re.split(r"^### `([^`]+)`$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


COMMANDS = [
    (" ".join((prog, *path)), p)
    for prog, root in (("talosd", talosd_parser()), ("talos-proxy", proxy_parser()))
    for path, p in walk(root)
]


@pytest.mark.parametrize(("name", "parser"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_option_is_in_its_commands_section(
    name: str, parser: argparse.ArgumentParser
) -> None:
    sections = _sections()
    assert name in sections, f"docs/cli.md has no section for `{name}`"
    section = sections[name]
    for action in options_of(parser):
        for flag in action.option_strings:
            assert f"`{flag}" in section, f"docs/cli.md `{name}` does not list {flag}"


def test_exit_codes_table_lists_every_code() -> None:
    text = DOC.read_text()
    table = text[text.index("## Exit codes") : text.index("## Configuration")]
    for name in exit_codes.__all__:
        value = getattr(exit_codes, name)
        if isinstance(value, int):
            assert f"| {value} |" in table, f"docs/cli.md exit codes lack {name} = {value}"
