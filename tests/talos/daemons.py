"""Real ``talosd`` subprocesses for CLI tests: run, wait for readiness, stop or kill."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from talos.config import Home
from tests.talos.api_client import ApiClient

TALOSD = [sys.executable, "-m", "talos.cli"]
# Without the caller's passphrase variables: each test says how its key is kept.
ENV = {
    **{k: v for k, v in os.environ.items() if "PASSPHRASE" not in k},
    "PYTHONUNBUFFERED": "1",
}


def talosd(
    *args: str, timeout: float = 60, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run one ``talosd`` command to completion, ``stdin`` (if any) as its standard input."""
    # Never a terminal: talosd must not wait for a prompt.
    feed: dict[str, object] = {"stdin": subprocess.DEVNULL} if stdin is None else {"input": stdin}
    return subprocess.run(
        [*TALOSD, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        check=False,
        **feed,  # type: ignore[arg-type]
    )


def fast_config(home: Path, **extra: Any) -> None:
    """Shorten the node's timers for tests (keeps what `init` wrote)."""
    path = home / "config.json"
    data = json.loads(path.read_text())
    data.update(
        {
            "seal_interval": 0.05,
            "retry_interval": 0.5,
            "reconnect_initial": 0.05,
            "reconnect_max": 0.5,
            "one_time_prekeys": 2,
            **extra,
        }
    )
    path.write_text(json.dumps(data))


class Daemon:
    """``talosd run`` in the background; ``line`` is its "listening on" line."""

    def __init__(self, home: Path, *args: str, timeout: float = 30) -> None:
        self.home = home
        self.proc = subprocess.Popen(
            [*TALOSD, "run", "--home", str(home), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=ENV,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self._threads:
            t.start()
        try:
            self.line = self._lines.get(timeout=timeout)
            self.listen = self.line.split()[2]
            self.did = self.line.split("did=")[1].strip()
            self.api = ApiClient.for_home(Home(home))
        except Exception as exc:
            self.kill()
            err = "".join(self.stderr)
            raise AssertionError(f"talosd run did not get ready ({exc!r}): {err}") from None

    def _pump(self, stream: Any, is_stdout: bool) -> None:
        for line in stream:
            if is_stdout:
                self._lines.put(line)
            else:
                self.stderr.append(line)

    @property
    def addr(self) -> str:
        return f"{self.listen}#{self.did}"

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._reap()
        return code

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._reap()

    def _reap(self) -> None:
        for t in self._threads:
            t.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def wait_for(cond: Any, timeout: float = 20, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
