"""Exit codes shared by ``talosd`` and ``talos-proxy`` (docs/cli.md "Exit codes").

A script can tell a refusal from an outage from a slow peer without parsing
stderr. argparse already exits 2 on a usage error; BAD_INPUT widens that to
any input the command rejects after parsing (a DID that does not parse, a
file that is not there, a message over the bound, a wrong passphrase).
"""

from __future__ import annotations

__all__ = [
    "BAD_INPUT",
    "EPILOG",
    "FAILED",
    "INTERRUPTED",
    "OK",
    "REFUSED",
    "TIMED_OUT",
    "UNREACHABLE",
]

OK = 0
FAILED = 1  # anything not listed below
BAD_INPUT = 2  # usage errors and rejected arguments
REFUSED = 3  # the peer (or this node) refused the link or the request
UNREACHABLE = 4  # no node runs on the home, or the peer cannot be reached
TIMED_OUT = 5  # --wait / --timeout ran out
INTERRUPTED = 130  # Ctrl-C

EPILOG = (
    "exit codes: 0 ok, 1 failed, 2 bad input, 3 refused, 4 unreachable, 5 timed out,"
    " 130 interrupted"
)
