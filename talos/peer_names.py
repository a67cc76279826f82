"""Local names for peers (docs/adr/0012-local-clients.md, decision 5).

A name is a short handle the owner gives a peer's DID (``talosd peers add
ADDR --name bob``); it works wherever a DID does (CLI, ``talosd mcp``,
``talos-proxy --allow``). Names are local: they live in this node's ``meta``
table as ``name:<name> -> DID`` and are never sent to anyone.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from talos import pipeline as pl
from talos.peer_refs import is_did, validate_name
from talos.store import Store, Txn
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import UsageError

__all__ = [
    "UnknownPeerNameError",
    "is_did",
    "name_of",
    "names",
    "offline_names",
    "offline_resolve",
    "offline_set_name",
    "resolve_peer",
    "set_name",
    "validate_name",
]

_PREFIX = b"name:"


class UnknownPeerNameError(UsageError):
    """A peer name this node does not know."""


def _key(name: str) -> bytes:
    return _PREFIX + name.encode()


def _rows(txn: Txn) -> Iterable[tuple[str, str]]:
    for key, value in txn.items("meta", _PREFIX):
        if not key.startswith(_PREFIX):
            return
        yield key[len(_PREFIX) :].decode(), value.decode()


def names(txn: Txn) -> dict[str, str]:
    """DID -> name, for every named peer."""
    return {did: name for name, did in _rows(txn)}


def name_of(txn: Txn, did: str) -> str | None:
    return names(txn).get(did)


def resolve_peer(txn: Txn, ref: str) -> str:
    """The DID ``ref`` stands for: a DID (checked, DIDError if malformed) or a known name."""
    if is_did(ref):
        public_key_from_did(ref)
        return ref
    validate_name(ref)
    raw = txn.get("meta", _key(ref))
    if raw is None:
        raise UnknownPeerNameError(
            f"unknown peer name {ref!r}: known peers are listed by `talosd peers list` "
            f"(an agent's list_peers tool); name one with `talosd peers name DID {ref}` "
            "(name_peer)"
        )
    return bytes(raw).decode()


def set_name(txn: Txn, did: str, name: str) -> None:
    """Name ``did`` (replacing its old name); refuses a name another DID holds."""
    public_key_from_did(did)
    validate_name(name)
    held = txn.get("meta", _key(name))
    if held is not None and bytes(held).decode() != did:
        raise UsageError(f"peer name {name!r} already names {bytes(held).decode()}")
    for old, owner in list(_rows(txn)):
        if owner == did and old != name:
            txn.delete("meta", _key(old))
    txn.put("meta", _key(name), did.encode())


def forget_peer(txn: Txn, did: str) -> int:
    """Delete what the store keeps of peer ``did`` (``talosd peers remove``): its address,
    its name and its session; returns how many messages stay queued for it."""
    txn.delete("peers", did.encode())
    for name, owner in list(_rows(txn)):
        if owner == did:
            txn.delete("meta", _key(name))
    txn.delete("sessions", did.encode())
    return sum(1 for _ in pl.iter_outbox(txn, did))


# --- without a running node (the home lock proves none runs; talosd peers/send) -----------------


def _store(home: Path) -> Store:
    from talos.config import Home

    return Store(Home(home).store_dir, map_size=Home(home).load_config().map_size)


def offline_set_name(home: Path, ref: str, name: str) -> str:
    """Name the peer ``ref`` (DID or current name) in the store of ``home``; returns its DID."""
    with _store(home) as store, store.write() as txn:
        did = resolve_peer(txn, ref)
        set_name(txn, did, name)
    return did


def offline_resolve(home: Path, ref: str) -> str:
    if is_did(ref):
        return resolve_peer_no_store(ref)
    with _store(home) as store, store.read() as txn:
        return resolve_peer(txn, ref)


def offline_names(home: Path) -> dict[str, str]:
    with _store(home) as store, store.read() as txn:
        return names(txn)


def resolve_peer_no_store(did: str) -> str:
    public_key_from_did(did)
    return did
