"""What every ``talosd`` client command needs: its home, and the node running there.

Client commands talk to the running node over its local socket (talos/local/call.py,
docs/adr/0012-local-clients.md) and open the home's store themselves only when no
node runs there; nothing here imports the node, aiohttp or pydantic.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from talos.local.call import NoNodeError
from talos.local.call import call as node_call
from talos_sdk.errors import UsageError

__all__ = ["NOT_RUNNING", "home_of", "home_path", "online", "out", "require_identity"]

NOT_RUNNING = object()


def out(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def home_path(args: argparse.Namespace) -> Path:
    # talos.config.default_home, without importing pydantic for a client command.
    env = os.environ.get("TALOS_HOME")
    return Path(args.home or env or Path.home() / ".talos").expanduser()


def home_of(args: argparse.Namespace) -> Any:
    from talos.config import Home

    return Home(home_path(args))


def online(path: Path, op: str, args: dict[str, Any] | None = None, timeout: float = 30) -> Any:
    """The running node's answer to ``op``, or NOT_RUNNING when no node runs on ``path``."""
    try:
        return node_call(path, op, args, timeout=timeout)
    except NoNodeError:
        return NOT_RUNNING


def require_identity(path: Path) -> None:
    if not (path / "identity.key").exists():  # talos.config.Home.identity
        raise UsageError(f"no identity in {path}: run `talosd init --home {path}` first")
