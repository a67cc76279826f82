"""bench/_procs.py: bench children are found ready, and stopped with everything they spawned."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _procs import child, peak_rss, run_quiet

# Prints a ready line, then starts a grandchild that would sleep for a minute.
PARENT = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(f'ready grandchild={g.pid}', flush=True)\n"
    "time.sleep(60)\n"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; its parent reaps it.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


async def test_child_stop_takes_the_grandchildren_along() -> None:
    async with asyncio.timeout(30):
        async with child([sys.executable, "-c", PARENT], "parent") as c:
            grandchild = int((await c.wait_line(r"grandchild=(\d+)")).group(1))
            assert peak_rss(c.pid) > 1 << 20
            assert _alive(grandchild)
        assert c.proc.returncode is not None
        while _alive(grandchild):  # killed with the group; the init process reaps it
            await asyncio.sleep(0.01)


async def test_wait_line_reports_a_child_that_exits_before_ready() -> None:
    async with asyncio.timeout(30):
        script = "import sys; print('boom', file=sys.stderr); sys.exit(3)"
        async with child([sys.executable, "-c", script], "early exit") as c:
            with pytest.raises(RuntimeError, match="early exit exited:\nboom"):
                await c.wait_line("never printed")


async def test_wait_line_times_out_on_a_silent_child() -> None:
    async with asyncio.timeout(30):
        async with child([sys.executable, "-c", "import time; time.sleep(60)"], "silent") as c:
            with pytest.raises(RuntimeError, match="silent not ready"):
                await c.wait_line("ready", timeout=0.2)


async def test_run_quiet_returns_stdout_or_raises_with_stderr() -> None:
    async with asyncio.timeout(30):
        assert await run_quiet([sys.executable, "-c", "print(' 42 ')"]) == "42"
        with pytest.raises(RuntimeError, match="nope"):
            await run_quiet([sys.executable, "-c", "import sys; sys.exit('nope')"])


def test_peak_rss_of_a_missing_process_is_an_os_error() -> None:
    with pytest.raises(OSError):
        peak_rss(2**22 + 12345)
