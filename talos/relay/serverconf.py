"""A minimal nats-server configuration for a Talos relay (docs/operations.md "Relay").

Pure: it renders text. Every node is a NATS user named by its nkey (its
Ed25519 identity key, :mod:`talos.relay.names`) with permissions that let it
subscribe only to its own subjects. The NATS configuration format accepts JSON
values, so each block is written with :func:`json.dumps`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from talos.relay.names import RelayNames, nkey_public
from talos_sdk.did import public_key_from_did

__all__ = ["authorization_block", "render_server_config", "user_entry"]


def user_entry(did: str) -> dict[str, object]:
    """One ``authorization.users`` entry: the node's nkey and its permissions."""
    return {
        "nkey": nkey_public(public_key_from_did(did)),
        "permissions": RelayNames.for_did(did).permissions(),
    }


def authorization_block(dids: Iterable[str]) -> str:
    """``authorization { users: [...] }`` for the given nodes."""
    users = [user_entry(did) for did in dids]
    return "authorization: " + json.dumps({"users": users}, indent=2) + "\n"


def render_server_config(
    dids: Iterable[str],
    *,
    host: str = "0.0.0.0",
    port: int = 4222,
    store_dir: str = "/data/jetstream",
    max_store: str = "1G",
    max_payload: int = 1 << 20,
    monitor_port: int | None = None,
) -> str:
    """A whole ``nats-server -c`` file: listen address, JetStream store, the users."""
    lines = [
        f"host: {json.dumps(host)}",
        f"port: {port}",
        f"max_payload: {max_payload}",
        *([f"http_port: {monitor_port}"] if monitor_port else []),
        "jetstream: " + json.dumps({"store_dir": store_dir, "max_file_store": max_store}),
        authorization_block(dids),
    ]
    return "\n".join(lines)
