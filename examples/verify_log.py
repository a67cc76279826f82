"""Audit a node's block log and prove that one message is in it.

Shows (docs/DESIGN.md "Block log"; RFC 6962 / RFC 9162 Merkle trees):

1. alice sends bob three messages through two ``talosd run`` nodes; each one
   becomes a record (ids, parties, sender's signed commitment) in both logs.
2. ``talosd chain verify`` re-validates every block: links, Merkle roots,
   node signatures, sender signatures (here offline, on stopped nodes).
3. ``talosd chain proof ID`` exports an inclusion proof for one message, and
   this script checks it with nothing but bob's DID, twice: with
   ``talos.chain.verify_inclusion_proof`` and step by step with ``talos_sdk``
   (block signature, RFC 6962 audit path, the sender's commitment signature).
4. A forged proof fails; a record changed on disk (in a copy of bob's home)
   makes ``talosd chain verify`` exit 1 and name the defect.

Runs in a temporary folder removed at the end.
Run: ``python examples/verify_log.py``
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from talos.chain import Block, Record, verify_inclusion_proof
from talos.store import Store
from talos_sdk import verify, verify_inclusion

TALOSD = str(Path(sys.executable).parent / "talosd")
TIMEOUT = 30.0


def talosd(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    shown = " ".join(a if len(a) < 40 else "…" + a[-16:] for a in args)
    print(f"$ talosd {shown}")
    done = subprocess.run([TALOSD, *args], capture_output=True, text=True, timeout=TIMEOUT)
    if check and done.returncode != 0:
        raise SystemExit(f"talosd {args[0]} failed: {done.stderr.strip()}")
    return done


def run_node(home: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [TALOSD, "run", "--home", str(home), "--listen", "127.0.0.1:0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    found = re.search(r"listening on (ws://\S+)", proc.stdout.readline())
    if not found:
        proc.kill()
        raise SystemExit(f"node on {home} did not start")
    return proc, found.group(1)


def check_by_hand(proof: dict[str, object], node_did: str) -> None:
    """What verify_inclusion_proof does, spelled out with the SDK."""
    block = Block.from_bytes(bytes.fromhex(str(proof["block"])))
    leaf = bytes.fromhex(str(proof["leaf"]))
    path = [bytes.fromhex(p) for p in proof["proof"]]  # type: ignore[attr-defined]
    index, size = int(str(proof["index"])), int(str(proof["size"]))
    print(f"  block {block.height}: {block.record_count} records, signed by the node:", end=" ")
    print(verify(node_did, block.header_bytes(), block.signature))
    print(f"  audit path of {len(path)} hashes from leaf {index} of {size} to the root:", end=" ")
    print(verify_inclusion(leaf, index, size, path, block.merkle_root))
    record = Record.from_bytes(leaf)
    print(f"  record {record.kind}: {record.sender[:20]}… -> {record.recipient[:20]}…")
    print("  sender's signature over its commitment:", end=" ")
    print(verify(record.sender, record.commitment, record.signature))


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="talos-verify-") as tmp:
        root = Path(tmp)
        alice, bob = root / "alice", root / "bob"
        did_a = talosd("init", "--home", str(alice), "--no-passphrase").stdout.strip()
        did_b = talosd("init", "--home", str(bob), "--no-passphrase").stdout.strip()
        procs: list[subprocess.Popen[str]] = []
        try:
            proc_b, url_b = run_node(bob, "--allow", did_a)
            procs.append(proc_b)
            procs.append(run_node(alice, "--peer", f"{url_b}#{did_b}")[0])
            ids = [
                talosd("send", "--home", str(alice), "--wait", did_b, text).stdout.strip()
                for text in ("build finished", "tests green", "deploying v1.4")
            ]
        finally:
            for p in procs:  # SIGTERM: the node seals what is pending, then exits
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=TIMEOUT)

        print(talosd("chain", "verify", "--home", str(bob)).stdout.strip())
        proof = json.loads(talosd("chain", "proof", "--home", str(bob), ids[1]).stdout)
        print(f"proof for message {ids[1][:12]}…: block {proof['height']}, leaf {proof['index']}")
        ok = verify_inclusion_proof(proof, did_b)
        print(f"talos.chain.verify_inclusion_proof(proof, bob) -> {ok}")
        check_by_hand(proof, did_b)

        other = json.loads(talosd("chain", "proof", "--home", str(bob), ids[0]).stdout)
        forged = dict(proof, leaf=other["leaf"])  # another message's record, same path
        print(
            f"the proof with another record swapped in -> {verify_inclusion_proof(forged, did_b)}"
        )
        print(f"checked against alice's DID instead -> {verify_inclusion_proof(proof, did_a)}")

        # Tamper with one stored record in a copy of bob's (stopped) home.
        copy = root / "bob-copy"
        shutil.copytree(bob, copy)
        with Store(copy / "store") as store, store.write() as txn:
            key, value = next(iter(txn.items("block_records")))
            txn.put("block_records", key, value[:-3] + bytes([value[-3] ^ 1]) + value[-2:])
        bad = talosd("chain", "verify", "--home", str(copy), check=False)
        print(f"after flipping one bit of a record: exit {bad.returncode}")
        print("  " + bad.stderr.strip().replace("\n", "\n  "))
        if bad.returncode != 1:
            raise SystemExit("tampering went unnoticed")


if __name__ == "__main__":
    main()
