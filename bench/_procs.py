"""Child processes for the benches that need running nodes (bench/README.md).

Every child runs in its own session (process group), so stopping it also stops
whatever it spawned (``talos-proxy serve`` starts the tool process); a bench
that fails half way still leaves nothing behind because :func:`child` stops the
group in a ``finally``, :func:`run` turns SIGTERM into that same clean exit,
and each child gets SIGTERM from the kernel if the bench dies even by SIGKILL
(``PR_SET_PDEATHSIG``: its own session puts it out of reach of a group kill).
Everything listens on 127.0.0.1 with port 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn

from _common import REPO_ROOT

PYTHON = sys.executable
TALOSD = [PYTHON, "-m", "talos.cli"]
PROXY = [PYTHON, "-m", "mcp_proxy.cli"]
# Children import talos/mcp_proxy from this checkout even without an editable install.
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    "PYTHONUNBUFFERED": "1",
}
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the forked child: have the kernel SIGTERM us when the bench process ends."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _terminated(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def run(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run`` where SIGTERM (run_all's timeout, a CI kill) still runs every finally."""
    signal.signal(signal.SIGTERM, _terminated)
    asyncio.run(main)


class Child:
    """One subprocess; :meth:`wait_line` finds its readiness line, the rest is drained."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []
        self._seen = asyncio.Condition()
        self._drains = [
            asyncio.create_task(self._drain(s)) for s in (proc.stdout, proc.stderr) if s
        ]

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _drain(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            async with self._seen:
                self.lines.append(line.decode("utf-8", "replace").rstrip())
                self._seen.notify_all()
        async with self._seen:
            self._seen.notify_all()

    async def wait_line(self, pattern: str, timeout: float = READY_TIMEOUT) -> re.Match[str]:
        """The first output line matching ``pattern``; fails if the child exits first."""
        regex = re.compile(pattern)

        async def find() -> re.Match[str]:
            async with self._seen:
                while True:
                    for text in self.lines:
                        if m := regex.search(text):
                            return m
                    if self.proc.returncode is not None or all(d.done() for d in self._drains):
                        raise RuntimeError(f"{self.name} exited:\n" + "\n".join(self.lines))
                    await self._seen.wait()

        try:
            return await asyncio.wait_for(find(), timeout)
        except TimeoutError:
            raise RuntimeError(f"{self.name} not ready:\n" + "\n".join(self.lines)) from None

    async def stop(self) -> int:
        """SIGTERM the whole group; SIGKILL it if it has not exited in time."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT)
        # Grandchildren (a tool under talos-proxy serve) may outlive their parent.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        code = await self.proc.wait()
        for d in self._drains:
            d.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await d
        return code


@contextlib.asynccontextmanager
async def child(
    argv: Sequence[str], name: str, *, stdin: int | None = None
) -> AsyncIterator[Child]:
    """Run ``argv`` (stdout and stderr captured) and stop its group on exit."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else stdin,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ENV,
        cwd=REPO_ROOT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    c = Child(proc, name)
    try:
        yield c
    finally:
        await c.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of live process ``pid`` so far, its ended threads included
    (``/proc/PID/stat``; clock ticks, 10 ms here: for runs of seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int | None) -> float:
    """CPU time of the live threads of ``pid`` to the nanosecond; 0 if None.

    The sum of each thread's ``/proc/PID/task/TID/schedstat`` run time: the
    ticks of :func:`cpu_seconds` are too coarse for a --fast run, but a thread
    that ended takes its time with it, so this is for processes whose threads
    live as long as the measurement (a node: its loop, writer and uvloop threads).
    """
    if pid is None:
        return 0.0
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def peak_rss(pid: int) -> int:
    """Peak resident set size of a live process in bytes (``VmHWM``, Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


async def run_quiet(argv: Sequence[str], timeout: float = 60.0) -> str:
    """Run a short command to completion; its stdout, or an error with its stderr."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ENV,
        cwd=REPO_ROOT,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {err.decode(errors='replace')}")
    return out.decode().strip()
