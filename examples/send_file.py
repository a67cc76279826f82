"""Send a file between two talosd nodes, with progress, and check what arrived.

Shows (docs/adr/0004-bulk-transfer-path.md, docs/PROTOCOL.md "File transfer"):

1. Two ``talosd run`` nodes on 127.0.0.1; bob allows alice, alice dials bob.
2. ``talosd send-file --wait DID PATH`` streams a 16 MiB file, encrypted.
3. bob did not pre-authorise alice's files, so the offer waits as *pending*
   until bob runs ``talosd files accept ID`` (``"transfer": {"auto_accept":
   [DID]}`` in bob's config.json would skip this step).
4. Progress is read from alice's node over its local socket (the ``files.get``
   op, docs/adr/0012-local-clients.md), the same data ``talosd files --json``
   prints; on a terminal ``send-file`` draws a bar.
5. The received file in ``<bob home>/files/`` has the same SHA-256.

Runs in a temporary folder removed at the end.
Run: ``python examples/send_file.py``
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from talos.local.call import call

TALOSD = str(Path(sys.executable).parent / "talosd")
TIMEOUT = 30.0
SIZE = 16 << 20


def talosd(*args: str) -> str:
    print("$ talosd " + " ".join(a if len(a) < 40 else a[:20] + "…" for a in args))
    done = subprocess.run([TALOSD, *args], capture_output=True, text=True, timeout=TIMEOUT)
    if done.returncode != 0:
        raise SystemExit(f"talosd {args[0]} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def run_node(home: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``talosd run`` and return it with its ``ws://`` listen URL."""
    proc = subprocess.Popen(
        [TALOSD, "run", "--home", str(home), "--listen", "127.0.0.1:0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the first line says where it listens
    found = re.search(r"listening on (ws://\S+)", line)
    if not found:
        proc.kill()
        raise SystemExit(f"node on {home} did not start: {line!r}")
    return proc, found.group(1)


def poll(what: str, fn: Any) -> Any:
    """Call ``fn`` until it returns something truthy, within TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="talos-send-file-") as tmp:
        root = Path(tmp)
        alice, bob = root / "alice", root / "bob"
        did_a, did_b = (
            talosd("init", "--home", str(alice), "--no-passphrase"),
            talosd("init", "--home", str(bob), "--no-passphrase"),
        )
        src = root / "dataset.bin"
        src.write_bytes(os.urandom(SIZE))
        print(f"source {src.name}: {SIZE >> 20} MiB, sha256 {sha256(src)}")

        procs: list[subprocess.Popen[str]] = []
        try:
            proc_b, url_b = run_node(bob, "--allow", did_a)
            procs.append(proc_b)
            proc_a, _ = run_node(alice, "--peer", f"{url_b}#{did_b}")
            procs.append(proc_a)
            # The running nodes answer over their local sockets (docs/adr/0012-local-clients.md).
            poll(
                "the link",
                lambda: any(link["ready"] for link in call(alice, "status")["links"]),
            )
            print("link alice <-> bob is up")

            cmd = [TALOSD, "send-file", "--home", str(alice), "--wait", did_b, str(src)]
            print(f"$ talosd send-file --wait {did_b[:20]}… {src.name} &")
            sender = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            procs.append(sender)

            offer = poll(
                "bob to see the offer",
                lambda: [r for r in call(bob, "files.list") if r["state"] == "pending"],
            )[0]
            print(f"bob: pending offer {offer['tid']} {offer['name']} ({offer['size']} B)")
            print(talosd("files", "--home", str(bob), "accept", offer["tid"]))

            last = -1
            while last < 100:
                running = sender.poll() is None
                row = call(alice, "files.get", {"id": offer["tid"]})
                # "transferred" counts bytes on the wire (framing included): cap it.
                done = min(row["transferred"], row["size"])
                pct = 100 * done // max(row["size"], 1)
                if pct != last:
                    print(f"  progress {done:>9} / {row['size']} B ({pct}%)")
                    last = pct
                if not running:
                    break
                time.sleep(0.05)
            out, err = sender.communicate(timeout=TIMEOUT)
            if sender.returncode != 0:
                raise SystemExit(f"send-file failed: {err.strip()}")
            print(f"send-file --wait returned {out.strip()}: bob verified the whole file")

            listing = json.loads(talosd("files", "--home", str(bob), "--json"))
            got = Path(next(r["path"] for r in listing if r["tid"] == offer["tid"]))
            digest = sha256(got)
            print(f"bob received {got.relative_to(root)}: {got.stat().st_size} B, sha256 {digest}")
            if digest != sha256(src):
                raise SystemExit("the received file differs")
            print("sha256 matches")
        finally:
            for p in reversed(procs):
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    p.wait(timeout=TIMEOUT)


if __name__ == "__main__":
    main()
