"""Tests for talos.aio: a step run ``uncancelled`` ends before its caller does."""

from __future__ import annotations

import asyncio

import pytest

from talos.aio import uncancelled


async def test_the_result_comes_back_when_nothing_cancels() -> None:
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await uncancelled(work()) == 7


async def test_an_error_of_the_work_reaches_the_caller() -> None:
    async def work() -> None:
        raise ValueError("disk full")

    with pytest.raises(ValueError, match="disk full"):
        await uncancelled(work())


async def test_repeated_cancels_wait_for_the_work_and_on_cancel_runs_once() -> None:
    gate = asyncio.Event()
    finished: list[str] = []
    calls: list[str] = []

    async def work() -> None:
        await gate.wait()
        finished.append("work")

    caller = asyncio.create_task(uncancelled(work(), on_cancel=lambda: calls.append("abort")))
    await asyncio.sleep(0)
    for _ in range(3):
        caller.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not caller.done(), "a cancel ended the wait while the work still ran"
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert finished == ["work"]
    assert calls == ["abort"]
