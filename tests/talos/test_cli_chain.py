"""``talosd chain verify`` of a stopped node against someone holding its disk but not its
passphrase (docs/security.md "What is not protected"): real subprocesses, real LMDB."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from talos.chain.block import Record
from talos.chain.log import BlockLog
from talos.keys import unlock
from talos.store import Store
from talos_sdk.wallet import Wallet
from tests.talos.daemons import talosd

PEER = Wallet.from_seed(b"\x01" * 32)


def _message(i: int) -> Record:
    commitment = b"commitment|%d" % i
    rid = hashlib.sha256(b"m%d" % i).digest()[:16]
    return Record("msg", rid, PEER.did, "", commitment, PEER.sign(commitment), 1_700 + i)


def test_a_log_and_key_file_swapped_to_another_owner_is_caught(tmp_path: Path) -> None:
    # The thief re-seals the log under a key of its own, keeping the peers' signed
    # records, and swaps the DID in the key file's clear header (the only field it can
    # change without the passphrase). Verify without the passphrase cannot tell, and
    # says so and whose log it checked; with the passphrase, or heads peers kept, it fails.
    home, passphrase = tmp_path / "home", tmp_path / "pp"
    passphrase.write_text("correct horse battery\n")
    assert talosd("init", "--home", str(home), "--passphrase-file", str(passphrase)).returncode == 0
    node = unlock(home / "identity.key", passphrase_file=str(passphrase))
    with Store(home / "store") as store:
        log = BlockLog(store, node, max_records=4)
        for i in range(6):
            log.append(dataclasses.replace(_message(i), recipient=node.did))
        log.seal()
        heads = tmp_path / "peer-heads.json"
        heads.write_text(json.dumps({node.did: log.heads().statement}))  # type: ignore[union-attr]
    genuine = talosd("chain", "verify", "--home", str(home))
    assert genuine.returncode == 0 and f"node: {node.did}" in genuine.stdout
    assert "NOTE: the node's DID was read from the key file's clear header" in genuine.stderr

    thief = Wallet.from_seed(b"\x02" * 32)
    with Store(home / "store") as store, store.read() as txn:
        records = [Record.from_bytes(v) for _, v in txn.items("block_records")]
    shutil.rmtree(home / "store")
    (home / "store").mkdir(mode=0o700)
    with Store(home / "store") as store:
        log = BlockLog(store, thief, max_records=4)
        for record in records[1:]:  # one message dropped
            log.append(dataclasses.replace(record, recipient=thief.did))
        log.seal()
    key = json.loads((home / "identity.key").read_text())
    (home / "identity.key").write_text(json.dumps({**key, "did": thief.did}))

    blind = talosd("chain", "verify", "--home", str(home))
    assert blind.returncode == 0 and f"node: {thief.did}" in blind.stdout
    assert "NOTE" in blind.stderr and "--passphrase-file" in blind.stderr
    unlocked = talosd("chain", "verify", "--home", str(home), "--passphrase-file", str(passphrase))
    assert unlocked.returncode != 0 and "header was modified" in unlocked.stderr
    assert "Traceback" not in unlocked.stderr
    witnessed = talosd("chain", "verify", "--home", str(home), "--heads", str(heads))
    assert witnessed.returncode == 1
    assert "DEFECT no_head" in witnessed.stderr and node.did[:32] in witnessed.stderr
