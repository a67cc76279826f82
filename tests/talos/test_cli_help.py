"""Every ``talosd`` / ``talos-proxy`` command explains itself (talos/cli_help.py, docs/cli.md).

The parsers are walked, so a command or option added later without a help
text, a description or an epilog fails here with the command and option named.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_proxy.cli import build_parser as proxy_parser
from talos.cli import build_parser as talosd_parser
from talos.cli_help import options_of, walk
from talos.exit_codes import EPILOG

BIN = Path(sys.executable).parent


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    out = []
    for prog, parser in (("talosd", talosd_parser()), ("talos-proxy", proxy_parser())):
        out += [(" ".join((prog, *path)), p) for path, p in walk(parser)]
    return out


COMMANDS = _commands()


@pytest.mark.parametrize(("name", "parser"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_help_explains_every_argument(name: str, parser: argparse.ArgumentParser) -> None:
    text = _flat(parser.format_help())
    assert parser.description, f"`{name}` has no description (pass one to cli_help.command)"
    assert "examples:" in text, f"`{name} --help` has no examples (cli_help.command examples=)"
    assert _flat(EPILOG) in text, f"`{name} --help` lacks the exit codes line"
    for action in options_of(parser):
        label = "/".join(action.option_strings) or (action.metavar or action.dest)
        assert action.help, f"`{name}`: argument {label} has no help text"
        for flag in action.option_strings:
            assert flag in text, f"`{name} --help` does not mention {flag}"
        if not action.option_strings:
            choices = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else None
            shown = action.metavar or choices or action.dest
            assert str(shown) in text, f"`{name} --help` does not show positional {shown}"


def test_walk_reaches_every_subcommand() -> None:
    names = {n for n, _ in COMMANDS}
    for expected in (
        "talosd send",
        "talosd peers add",
        "talosd peers list",
        "talosd chain show",
        "talosd chain proof",
        "talosd send-file",
        "talosd relay-config",
        "talos-proxy id",
        "talos-proxy serve",
        "talos-proxy connect",
        "talos-proxy audit",
    ):
        assert expected in names


def test_defaults_shown_and_metavars_meaningful() -> None:
    send = dict(COMMANDS)["talosd send"].format_help()
    assert "--timeout SECONDS" in send
    assert "(default: 30.0)" in send
    assert "PEER" in send and "TEXT" in send
    # Defaults that say nothing (None, False, []) are not printed.
    run = _flat(dict(COMMANDS)["talosd run"].format_help())
    assert "default: None" not in run
    assert "default: False" not in run
    assert "default: []" not in run


@pytest.mark.parametrize("prog", ["talosd", "talos-proxy"])
def test_top_level_help_in_a_real_process(prog: str) -> None:
    res = subprocess.run(
        [str(BIN / prog), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: {prog}")
    assert "exit codes:" in res.stdout and "examples:" in res.stdout
    sub = subprocess.run(
        [str(BIN / prog), "serve" if prog == "talos-proxy" else "send", "-h"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert sub.returncode == 0, sub.stderr
    assert "--home" in sub.stdout


@pytest.mark.parametrize("prog", ["talosd", "talos-proxy"])
def test_no_arguments_at_all_list_the_commands(prog: str) -> None:
    res = subprocess.run([str(BIN / prog)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith(f"usage: {prog}") and "commands:" in res.stderr
    assert ("  send " if prog == "talosd" else "  serve ") in res.stderr


def test_talosd_parser_does_not_load_heavy_modules() -> None:
    """Client commands start fast: building and using the parser imports no aiohttp/pydantic."""
    code = "from talos.cli import build_parser; build_parser().parse_args(['send', 'x', 'y'])"
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines()}
    heavy = {m for m in loaded if m.split(".")[0] in ("aiohttp", "pydantic", "rich", "mcp")}
    assert not heavy, f"talosd's parser loads {sorted(heavy)}"


@pytest.mark.parametrize(
    ("command", "options"),
    [("talosd chain verify", []), ("talosd inbox", []), ("talos-proxy serve", ["--home", "h"])],
)
def test_an_unknown_option_gets_its_subcommands_usage(command: str, options: list[str]) -> None:
    prog, *path = command.split()
    res = subprocess.run(
        [str(BIN / prog), *path, *options, "--nope"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2
    assert res.stderr.startswith(f"usage: {command} "), res.stderr
    assert f"{command}: error: unrecognized arguments: --nope" in res.stderr


@pytest.mark.parametrize("command", [["talosd", "completion", "bash"], ["talos-proxy", "--help"]])
def test_a_reader_that_goes_away_is_not_an_error(command: list[str]) -> None:
    """``talosd ... | head``: stdout's reader closes early; no "Broken pipe" error."""
    proc = subprocess.Popen(
        [str(BIN / command[0]), *command[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command has written anything
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0  # the reader had what it wanted: not a failure
    assert "Broken pipe" not in err and "Traceback" not in err, err
