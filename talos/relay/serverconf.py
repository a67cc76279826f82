"""A minimal nats-server configuration for a Talos relay (docs/operations.md "Relay").

Pure: it renders text. Every node is a NATS user named by its nkey (its
Ed25519 identity key, :mod:`talos.relay.names`) in an *account of its own*
(docs/adr/0010-nats-relay.md, "One account per node"): a JetStream stream can
only take in subjects of its own account, so a node's mailbox stream, however
it is configured, never sees another node's traffic. Each account exports its
node's link and mailbox subjects as services and imports every other node's,
which is how nodes reach each other (request/reply and JetStream acks
included); its JetStream storage is capped at one mailbox. The user's
permissions narrow it further to its own subjects and stream. The NATS
configuration format accepts JSON values, so each block is written with
:func:`json.dumps`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from talos.relay.names import RelayNames, nkey_public
from talos_sdk.did import public_key_from_did

__all__ = [
    "DEFAULT_MAILBOX_BYTES",
    "account_name",
    "accounts_block",
    "render_server_config",
    "user_entry",
]

#: JetStream storage of each node's account: its mailbox (a node's config asks for at
#: most this much; docs/operations.md "Relay").
DEFAULT_MAILBOX_BYTES = 64 << 20
# Headroom of the server's file store over the sum of the accounts' (JetStream metadata).
_STORE_SLACK = 16 << 20


def account_name(did: str) -> str:
    """The NATS account of one node: named by its token, like everything on the relay."""
    return RelayNames.for_did(did).account


def user_entry(did: str) -> dict[str, object]:
    """One ``users`` entry of a node's account: its nkey and its permissions."""
    return {
        "nkey": nkey_public(public_key_from_did(did)),
        "permissions": RelayNames.for_did(did).permissions(),
    }


def _services(did: str) -> tuple[str, str]:
    names = RelayNames.for_did(did)
    return names.link, names.mailbox


def accounts_block(dids: Iterable[str], mailbox_bytes: int = DEFAULT_MAILBOX_BYTES) -> str:
    """``accounts { ... }``: one account per node, exporting its subjects to the others."""
    nodes = list(dict.fromkeys(dids))
    accounts: dict[str, object] = {}
    for did in nodes:
        accounts[account_name(did)] = {
            # One mailbox stream and its consumer (a few spare): nothing else to hold.
            "jetstream": {
                "max_file": mailbox_bytes,
                "max_mem": 0,
                "max_streams": 1,
                "max_consumers": 4,
            },
            "users": [user_entry(did)],
            "exports": [{"service": subject} for subject in _services(did)],
            "imports": [
                {"service": {"account": account_name(other), "subject": subject}}
                for other in nodes
                if other != did
                for subject in _services(other)
            ],
        }
    return "accounts: " + json.dumps(accounts, indent=2) + "\n"


def render_server_config(
    dids: Iterable[str],
    *,
    host: str = "0.0.0.0",
    port: int = 4222,
    store_dir: str = "/data/jetstream",
    max_store: str | None = None,
    mailbox_bytes: int = DEFAULT_MAILBOX_BYTES,
    max_payload: int = 1 << 20,
    monitor_port: int | None = None,
) -> str:
    """A whole ``nats-server -c`` file: listen address, JetStream store, the accounts.

    ``max_store`` (a NATS size such as ``"1G"``) defaults to every node's mailbox
    plus some headroom: each mailbox stream reserves its bytes in the store.
    """
    nodes = list(dict.fromkeys(dids))
    store: str | int = max_store or len(nodes) * mailbox_bytes + _STORE_SLACK
    lines = [
        f"host: {json.dumps(host)}",
        f"port: {port}",
        f"max_payload: {max_payload}",
        *([f"http_port: {monitor_port}"] if monitor_port else []),
        "jetstream: " + json.dumps({"store_dir": store_dir, "max_file_store": store}),
        accounts_block(nodes, mailbox_bytes),
    ]
    return "\n".join(lines)
