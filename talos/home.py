"""A node home without a running node: creating it, and the offline ``talosd`` commands.

``talosd init`` builds a home here; ``talosd id|peers|send|inbox|chain`` use
the helpers below when no node runs (the store's ``flock`` proves it: a
running node holds it, docs/operations.md "A home"). Each helper opens the
store, does one transaction and closes it again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from talos import pipeline as pl
from talos.chain.log import BlockLog, read_quarantine
from talos.chain.verify import verify_chain
from talos.config import Home, NodeConfig, configured_peer, parse_peer_addr
from talos.keys import (
    HYBRID_SINCE_FIELD,
    PASSPHRASE_ENV,
    hybrid_since,
    is_encrypted,
    key_file_did,
    key_file_suite,
    unlock,
)
from talos.peer_names import forget_peer, resolve_peer
from talos.peer_names import names as peer_names
from talos.sessions import SessionManager, load_secrets
from talos.store import Store
from talos.views import LinkView, block_json, outbox_listing, report_json
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import UsageError
from talos_sdk.keyfile import save_wallet
from talos_sdk.wallet import Wallet

__all__ = [
    "init_home",
    "offline_add_peer",
    "offline_blocks",
    "offline_identity",
    "offline_inbox",
    "offline_outbox",
    "offline_peers",
    "offline_proof",
    "offline_remove_peer",
    "offline_send",
    "offline_verify",
]


def init_home(
    path: Path,
    config: NodeConfig | None = None,
    *,
    suite: str | None = None,
    passphrase: str | None = None,
) -> Wallet:
    """Create a node home: identity (0600, sealed under ``passphrase`` if given), config,
    API token (0600). Refuses to overwrite. The home is made 0700 even if it existed.

    ``suite="ed25519-mldsa65"`` makes a hybrid identity (docs/adr/0005-hybrid-signatures.md).
    """
    home = Home(path)
    if home.exists():
        raise UsageError(f"{home.identity} already exists; refusing to overwrite an identity")
    # Owner-only: the home holds the identity and the store (docs/security.md).
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    config = config or NodeConfig()
    wallet = Wallet.generate(suite=suite)
    # A hybrid identity signs hybrid from its first block on: said under the seal.
    since = {HYBRID_SINCE_FIELD: 0} if wallet.hybrid_public_key is not None else None
    save_wallet(wallet, home.identity, passphrase, extra=since)
    home.save_config(config)
    home.create_api_token()
    with Store(home.store_dir, map_size=config.map_size) as store:
        manager = SessionManager(
            store,
            wallet,
            pq=config.pq,
            one_time=config.one_time_prekeys,
            ratchet_every=1,
            pq_one_time=config.pq_one_time_prekeys,
        )
        with store.write() as txn:
            manager.load(txn, discard=False)
    return wallet


def _offline_store(home: Home) -> Store:
    # A node stopping (or another offline command) may hold the lock a moment longer.
    return Store(home.store_dir, map_size=home.load_config().map_size, lock_wait=2.0)


def offline_identity(home: Home) -> dict[str, Any]:
    """``talosd id`` without a running node: wallet file plus stored prekeys."""
    did = key_file_did(home.identity)  # in clear: no passphrase needed to say who we are
    with _offline_store(home) as store, store.read() as txn:
        secrets = load_secrets(txn)
    out: dict[str, Any] = {"did": did, "x25519": None, "suites": [], "listen": None}
    if secrets is not None:
        out["x25519"] = secrets.identity.public.hex()
        out["suites"] = list(secrets.suites)
    return out


def _not_own(home: Home, did: str, what: str) -> None:
    """Refuse this node's own DID as a peer, as the running node does."""
    if did == key_file_did(home.identity):
        raise UsageError(f"{what} is this node's own DID")


def offline_add_peer(home: Home, addr: str) -> dict[str, str]:
    """``talosd peers add`` while stopped: the next run dials it."""
    peer = parse_peer_addr(addr)
    _not_own(home, peer.did, "that address")
    with _offline_store(home) as store, store.write() as txn:
        txn.put("peers", peer.did.encode(), str(peer).encode())
    return {"did": peer.did, "addr": str(peer)}


def offline_allow_peer(home: Home, did: str) -> dict[str, str]:
    """``talosd peers allow`` while stopped: the next run accepts its links."""
    _not_own(home, did, "that")
    with _offline_store(home) as store, store.write() as txn:
        pl.allow_row(txn, did)
    return {"did": did}


def offline_remove_peer(home: Home, ref: str) -> dict[str, Any]:
    """``talosd peers remove`` while stopped: as ``NodeLinks.remove_peer`` does it."""
    with _offline_store(home) as store, store.write() as txn:
        did = resolve_peer(txn, ref)
        queued = forget_peer(txn, did)
    return {"did": did, "queued": queued, "configured": configured_peer(home.load_config(), did)}


def offline_peers(home: Home) -> list[dict[str, Any]]:
    """The peers table (nobody is connected while the node is stopped)."""
    with _offline_store(home) as store, store.read() as txn:
        return [
            # A peers row, with an address or without (peers allow): it may link.
            {"did": k.decode(), "addr": v.decode() or None, "connected": False, "allowed": True}
            for k, v in txn.items("peers")
        ]


#: Why nothing moves in ``talosd outbox`` while the node is stopped.
STOPPED_WHY = "no node is running on this home; queued messages move once `talosd run` does"


def offline_outbox(home: Home, ref: str | None = None) -> list[dict[str, Any]]:
    """``talosd outbox`` while stopped: what waits for each peer (``ref``: a DID or name)."""

    def stopped(_: str) -> LinkView:
        # Whether a row went out before the stop is not known here: all read "queued".
        return "stopped", STOPPED_WHY, None, 0

    with _offline_store(home) as store, store.read() as txn:
        did = resolve_peer(txn, ref) if ref is not None else None
        return outbox_listing(txn, did, stopped)


def offline_drop(home: Home, ref: str) -> dict[str, Any]:
    """``talosd outbox PEER --drop`` while stopped: as ``Node.drop_queued`` does it."""
    with _offline_store(home) as store, store.write(durable=True) as txn:
        did = resolve_peer(txn, ref)
        first = next(pl.iter_outbox(txn, did), None)
        dropped = []
        if first is not None:
            last, _ = pl.next_prev(txn, did)
            dropped = pl.drop_outbox(txn, did, last, first.prev)
    # Whether a row went out before the stop is not known here (as in offline_outbox).
    return {"peer": did, "dropped": len(dropped), "sent": None}


def offline_send(home: Home, did: str, text: str) -> str:
    """Queue a message durably for the node's next run; returns its id."""
    public_key_from_did(did)
    limit = pl.text_limit(home.load_config().max_frame)
    if len(text.encode()) > limit:
        raise pl.MessageTooLargeError(
            f"message above the {limit}-byte limit of this node's frames; "
            "split it, or send it as a file (send-file)"
        )
    msg_id = os.urandom(pl.MSG_ID_LEN)
    with _offline_store(home) as store, store.write(durable=True) as txn:
        # A fresh epoch: the last run may have crashed with numbers on the wire (ADR 0007).
        epoch = pl.bump_epoch(txn)
        pl.enqueue(txn, did, msg_id, int(time.time() * 1000), text, epoch)
    return msg_id.hex()


def offline_inbox(home: Home, after: int = 0) -> list[dict[str, object]]:
    """``talosd inbox`` while stopped."""
    with _offline_store(home) as store, store.read() as txn:
        names = peer_names(txn)
        return [e.to_json(names) for e in pl.iter_inbox(txn, after)]


def offline_prune(home: Home, through: int) -> dict[str, int]:
    """``talosd inbox --prune-through`` while stopped (the node's ``inbox.prune``)."""
    pruned = 0
    with _offline_store(home) as store:
        while True:
            with store.write() as txn:
                count, _, _ = pl.prune_inbox(txn, through, pl.PRUNE_CHUNK)
            pruned += count
            if count < pl.PRUNE_CHUNK:
                return {"pruned": pruned, "through": through}


class _LogReader:
    """Who a stopped node's log belongs to, for reading it: a classical home's DID
    from the key file's clear header, so a sealed key needs no passphrase. Signs
    nothing (the offline chain commands only read). Nothing vouches for that DID:
    the AEAD that binds the header is opened with the key."""

    hybrid_public_key = None

    def __init__(self, did: str) -> None:
        self.did = did

    def sign(self, data: bytes) -> bytes:
        raise UsageError("a log opened to be read signs nothing")

    sign_auth = sign

    def private_bytes(self) -> bytes:
        raise UsageError("a log opened to be read appends and seals nothing")


@dataclass(frozen=True, slots=True)
class LogOwner:
    """Who a stopped node's log belongs to, as its key (not its store) says."""

    identity: Wallet | _LogReader
    #: The ML-DSA key its hybrid blocks must carry (None: a classical node).
    mldsa: bytes | None = None
    #: The first height that must be hybrid, from the unlocked key file (None: not kept
    #: there, the store's row decides).
    hybrid_since: int | None = None


def log_owner(home: Home, passphrase_file: str | None = None) -> LogOwner:
    """The identity to open the log with, and the ML-DSA key its blocks must carry.

    A hybrid home is unlocked: its ML-DSA public key is not in the key file's
    header (only its fingerprint), and it must come from the key, never from
    the store being audited. A classical home's sealed key is unlocked only when
    a passphrase is at hand without asking (``passphrase_file``, the
    environment): that checks its DID, which a disk thief could otherwise swap
    with the log (its clear header is authenticated by the seal alone).
    """
    path = home.identity
    at_hand = passphrase_file is not None or bool(os.environ.get(PASSPHRASE_ENV))
    if is_encrypted(path) and key_file_suite(path) == "ed25519" and not at_hand:
        return LogOwner(_LogReader(key_file_did(path)))
    wallet = unlock(path, passphrase_file=passphrase_file)
    return LogOwner(wallet, wallet.mldsa_public_key, hybrid_since(path))


def offline_verify(home: Home, owner: LogOwner) -> dict[str, Any]:
    """``talosd chain verify`` while stopped, as the API's JSON report."""
    identity = owner.identity
    with _offline_store(home) as store:
        report = verify_chain(
            store, identity.did, mldsa65_public_key=owner.mldsa, hybrid_since=owner.hybrid_since
        )
        checked = not isinstance(identity, _LogReader)
        return report_json(report, identity.did, read_quarantine(store), node_checked=checked)


def offline_blocks(home: Home, owner: LogOwner) -> list[dict[str, Any]]:
    """``talosd chain show`` while stopped."""
    with _offline_store(home) as store:
        return [block_json(b) for b in BlockLog(store, owner.identity).iter_blocks()]


def offline_proof(home: Home, record_id: str, owner: LogOwner) -> dict[str, Any]:
    """``talosd chain proof ID`` while stopped."""
    try:
        rid = bytes.fromhex(record_id)
    except ValueError:
        raise UsageError("record id must be hex") from None
    with _offline_store(home) as store:
        return BlockLog(store, owner.identity).inclusion_proof(rid)
