"""Shared shape of ``talosd`` and ``talos-proxy`` help (docs/cli.md).

Every command's ``--help`` gives what it does, each argument explained,
defaults shown, and an epilog of examples ending in the exit-code line of
talos/exit_codes.py. The parsers are built with :func:`command`; tests,
the docs generator (tools/cli_docs.py) and shell completion walk them with
:func:`walk`. Only argparse is imported here: client commands start fast.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from talos.exit_codes import EPILOG

__all__ = ["HelpFormatter", "command", "epilog", "options_of", "walk"]


class HelpFormatter(argparse.HelpFormatter):
    """Wraps prose, keeps laid-out text; adds ``(default: X)`` where X says something.

    A paragraph (blank-line separated) of description or epilog written on one
    line is wrapped to the terminal; one written over several lines (examples,
    the exit-code table) is kept as it is.

    argparse's ArgumentDefaultsHelpFormatter also prints ``default: None``,
    ``False`` and ``[]``, which tell the reader nothing; here a default is
    shown only when it is a real value and the help text does not already
    name it.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = text.split("\n\n")
        return "\n\n".join(
            part if "\n" in part else super(HelpFormatter, self)._fill_text(part, width, indent)
            for part in paragraphs
        )

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or default == []
            or default == ""
            or isinstance(action, argparse._HelpAction)
        ):
            return action.help
        if action.option_strings or action.nargs in ("?", "*"):
            return f"{text} (default: %(default)s)"
        return action.help


def epilog(examples: Sequence[str] = ()) -> str:
    """An epilog: the examples (one command line each), then the exit-code line."""
    parts = []
    if examples:
        parts.append("examples:\n" + "\n".join(f"  {e}" for e in examples))
    parts.append(EPILOG)
    return "\n\n".join(parts)


def command(
    sub: Any,
    name: str,
    summary: str,
    description: str | None = None,
    examples: Sequence[str] = (),
) -> argparse.ArgumentParser:
    """A subcommand: ``summary`` in the parent's list, ``description`` atop its own help."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=description or _sentence(summary),
        epilog=epilog(examples),
        formatter_class=HelpFormatter,
    )
    # The innermost subcommand's default wins: parse() reports unknown arguments with it.
    parser.set_defaults(_command_parser=parser)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that an unknown argument is reported with
    the usage of the subcommand it was given to (argparse names the top level's), and
    that no arguments at all get the command list on stderr (exit 2), not only the
    usage line."""
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)
        parser.exit(2)
    args, extra = parser.parse_known_args(argv)
    if extra:
        owner: argparse.ArgumentParser = getattr(args, "_command_parser", None) or parser
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``(command path, parser)`` for ``parser`` and every subcommand below it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk(child, (*path, name))


def options_of(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """What a user gives this parser: options and positionals, not -h or subcommands."""
    return [
        a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        and a.help is not argparse.SUPPRESS
    ]


# --- argument types: a bad number is a usage error (exit 2), never a traceback later ---


def seconds(text: str) -> float:
    """A duration in seconds: a finite number above 0 (``nan`` and ``1e999`` are not)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0: {text!r}")
    return value


def _integer(text: str, low: int, high: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be {what}: {text!r}")
    return value


def count(text: str) -> int:
    """A whole number from 1 up (a count of things)."""
    return _integer(text, 1, 2**31 - 1, "a whole number from 1 to 2147483647")


def position(text: str) -> int:
    """A whole number from 0 up that fits a u64 (a message number, a sequence)."""
    return _integer(text, 0, 2**64 - 1, "a whole number from 0 to 2**64-1")
