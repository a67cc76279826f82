"""``talosd completion`` / ``talos-proxy completion``: shell completion scripts (docs/cli.md).

The scripts are generated statically from the argparse parsers by ``shtab``
(so completing never starts Python): commands, subcommands, options and
choices, and file or folder names where an argument takes one (recognised by
its metavar: DIR, FILE, PATH). shtab is imported only by this command.
"""

from __future__ import annotations

import argparse
from typing import Any

from talos.cli_help import command, walk

__all__ = ["SHELLS", "add_completion_command", "completion_script"]

SHELLS = ("bash", "zsh")

# What shtab completes for an argument, by shell (its own DIRECTORY / FILE values).
_DIRS = {"bash": "_shtab_compgen_dirs", "zsh": "_files -/"}
_FILES = {"bash": "_shtab_compgen_files", "zsh": "_files"}
_BY_METAVAR = {"DIR": _DIRS, "FILE": _FILES, "PATH": _FILES}


def add_completion_command(sub: Any, prog: str) -> argparse.ArgumentParser:
    """Add ``completion SHELL`` to ``prog``'s subcommands; the caller sets its handler."""
    sp = command(
        sub,
        "completion",
        "print a shell completion script (bash or zsh)",
        "Print a completion script for SHELL on stdout: commands, subcommands, options,"
        " choices, and file or folder names where an argument takes one. Load it from"
        " your shell's start-up file.",
        (
            f"source <({prog} completion bash)    # in ~/.bashrc",
            f"{prog} completion zsh > ~/.zfunc/_{prog}    # ~/.zfunc on $fpath",
        ),
    )
    sp.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash or zsh")
    return sp


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``parser`` for ``shell``."""
    import shtab

    for _path, p in walk(parser):
        for action in p._actions:
            if isinstance(action.metavar, str) and action.metavar in _BY_METAVAR:
                action.complete = _BY_METAVAR[action.metavar]  # type: ignore[attr-defined]
    script: str = shtab.complete(parser, shell=shell)
    return script
