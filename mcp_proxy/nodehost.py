"""The talos Node a proxy embeds: its own home, identity created on first use
(docs/DESIGN.md "Layers", layer 3).

Only the contract of docs/ARCHITECTURE.md ("Node contract") is used. The
node's control API is off: a proxy talks to its node in-process.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from talos.config import Home, NodeConfig
from talos_sdk.keyfile import load_wallet

__all__ = ["HTTP_TOKEN_FILE", "ensure_home", "http_token", "make_node", "node_did"]

HTTP_TOKEN_FILE = "proxy-http.token"


def ensure_home(home: Path) -> None:
    """Create the identity if the home is new (``talosd init`` without the ceremony)."""
    if Home(home).exists():
        return
    from talos.home import init_home

    init_home(home, NodeConfig(api=False))
    print(f"talos-proxy: created a new identity in {home}", file=sys.stderr)


def node_did(home: Path) -> str:
    """The DID of the identity in ``home`` (created if absent)."""

    ensure_home(home)
    return load_wallet(Home(home).identity).did


def make_node(home: Path, *, listen: str | None, relays: Sequence[str] = ()) -> Any:
    """A not yet started Node for ``home``; listens only when asked, no control API.

    ``relays`` (nats://HOST:PORT) make it reachable through a NATS relay as well.
    """
    from talos.config import parse_relay_url
    from talos.node import Node

    ensure_home(home)
    update: dict[str, Any] = {"listen": listen, "api": False}
    if relays:
        update["relays"] = tuple(parse_relay_url(r) for r in relays)
    config = Home(home).load_config().model_copy(update=update)
    return Node(home, config)


def http_token(home: Path) -> str:
    """The bearer token of ``connect --http``: created once, stored 0600 in the home."""
    path = home / HTTP_TOKEN_FILE
    try:
        return path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(token + "\n")
    tmp.replace(path)
    return token
