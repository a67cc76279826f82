"""talos.runtime: uvloop when installed, the standard loop when TALOS_NO_UVLOOP is set."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys

import pytest

from talos import runtime

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_run_returns_the_result_of_main(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.NO_UVLOOP_ENV, raising=False)

    async def main() -> int:
        await asyncio.sleep(0)
        return 42

    assert runtime.run(main()) == 42


@pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop not installed")
def test_uvloop_is_used_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.NO_UVLOOP_ENV, raising=False)
    assert runtime.run(_loop_module()).startswith("uvloop")


@pytest.mark.parametrize("value", ["1", "yes"])
def test_env_var_forces_the_standard_loop(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(runtime.NO_UVLOOP_ENV, value)
    assert runtime.loop_factory() is None
    assert runtime.run(_loop_module()).startswith("asyncio")


def test_zero_does_not_disable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(runtime.NO_UVLOOP_ENV, "0")
    assert (runtime.loop_factory() is not None) is HAVE_UVLOOP


def test_exceptions_from_main_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.NO_UVLOOP_ENV, raising=False)

    async def main() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        runtime.run(main())


_SETTLE = """
import gc, weakref
from talos import runtime

class Node:
    pass

kept = Node()
kept.me = kept  # a start-up cycle the daemon keeps
runtime.settle_heap()
frozen = gc.get_freeze_count()
later = Node()
later.me = later  # a cycle made after start-up, then dropped
gone = weakref.ref(later)
del later
gc.collect()
walked = any(o is kept for g in range(3) for o in gc.get_objects(g))
print(frozen, gone() is None, walked)
"""


def test_settle_heap_freezes_start_up_and_leaves_later_cycles_collectable() -> None:
    """What is alive at settle_heap leaves the collector's walks; newer cycles are still freed."""
    out = subprocess.run(
        [sys.executable, "-c", _SETTLE], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert int(out[0]) > 1000  # modules, classes and functions of the imports, at least
    assert out[1:] == ["True", "False"]  # the later cycle freed; the kept one in no generation
