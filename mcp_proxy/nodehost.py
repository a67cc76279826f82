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
from typing import TYPE_CHECKING, Any

from talos.config import Home, NodeConfig

if TYPE_CHECKING:
    from talos_sdk.wallet import Wallet

__all__ = [
    "HTTP_TOKEN_FILE",
    "TUNNEL_RATCHET_EVERY",
    "TUNNEL_RATCHET_MAX_AGE",
    "ensure_home",
    "http_token",
    "make_node",
    "node_did",
]

HTTP_TOKEN_FILE = "proxy-http.token"

#: The DH ratchet schedule a new proxy home gets (docs/adr/0002-lazy-dh-ratchet.md,
#: "The tunnel's schedule"): a sending step after 64 messages or once the chain is
#: 1 s old. A tools/call is one turn, so the per-turn step of a ``talosd`` home
#: (Signal's schedule) cost ~250 us of CPU per call; this one heals within about
#: two seconds on a busy tunnel and at every turn of a slower one.
TUNNEL_RATCHET_EVERY = 64
TUNNEL_RATCHET_MAX_AGE = 1.0


def ensure_home(
    home: Path, *, passphrase_file: str | None = None, no_passphrase: bool = False
) -> Wallet | None:
    """Create the identity if the home is new (``talosd init`` without the ceremony);
    the new identity, or None when the home had one.

    The key is sealed under a passphrase had as for ``talosd init`` (talos/keys.py);
    with none to be had and no ``--no-passphrase`` it is stored unencrypted, and
    stderr says so: a proxy started by an agent has no terminal to ask on.
    """
    if Home(home).exists():
        return None
    from talos.home import init_home
    from talos.keys import PassphraseNeededError, new_key_passphrase

    try:
        passphrase = new_key_passphrase(
            passphrase_file=passphrase_file, no_passphrase=no_passphrase, command="talos-proxy"
        )
    except PassphraseNeededError:
        passphrase = None
        print(
            "talos-proxy: WARNING: the new identity key is stored WITHOUT a passphrase "
            "(give --passphrase-file or TALOS_PASSPHRASE to seal it; `talosd passphrase "
            f"--home {home}` adds one later)",
            file=sys.stderr,
        )
    config = NodeConfig(
        api=False, ratchet_every=TUNNEL_RATCHET_EVERY, ratchet_max_age=TUNNEL_RATCHET_MAX_AGE
    )
    wallet = init_home(home, config, passphrase=passphrase)
    print(f"talos-proxy: created a new identity in {home}", file=sys.stderr)
    return wallet


def node_did(home: Path, *, passphrase_file: str | None = None, no_passphrase: bool = False) -> str:
    """The DID of the identity in ``home`` (created if absent; read in clear)."""
    from talos.keys import key_file_did

    ensure_home(home, passphrase_file=passphrase_file, no_passphrase=no_passphrase)
    return key_file_did(Home(home).identity)


def make_node(
    home: Path,
    *,
    listen: str | None,
    relays: Sequence[str] = (),
    passphrase_file: str | None = None,
    no_passphrase: bool = False,
) -> Any:
    """A not yet started Node for ``home``, its identity unlocked (talos/keys.py);
    listens only when asked, no control API.

    ``relays`` (nats://HOST:PORT) make it reachable through a NATS relay as well.
    """
    from talos.config import parse_relay_url
    from talos.keys import unlock
    from talos.node import Node

    # A new identity is in hand already: asking for the passphrase just typed twice is noise.
    wallet = ensure_home(
        home, passphrase_file=passphrase_file, no_passphrase=no_passphrase
    ) or unlock(Home(home).identity, passphrase_file=passphrase_file)
    update: dict[str, Any] = {"listen": listen, "api": False}
    if relays:
        update["relays"] = tuple(parse_relay_url(r) for r in relays)
    config = Home(home).load_config().model_copy(update=update)
    return Node(home, config, wallet=wallet)


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
