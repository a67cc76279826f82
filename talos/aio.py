"""asyncio helpers the node's packages share.

:func:`uncancelled` runs a step that a cancel must not cut in half: a worker
thread that writes into a file its caller closes next, or a file placed under
its name whose row is not yet written (docs/adr/0015-transfer-attempts-and-cancellation.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["uncancelled"]

_T = TypeVar("_T")


async def uncancelled(work: Awaitable[_T], on_cancel: Callable[[], None] | None = None) -> _T:
    """Run ``work`` to its end: a caller cancelled meanwhile waits for it, then is cancelled.

    ``on_cancel`` runs once, at the first cancel, to make ``work`` end sooner (shut
    down the socket a worker thread blocks on). Every later cancel is absorbed
    until ``work`` is done: ending the wait early would leave the work running
    behind a caller that believes it stopped. Cancelled, the caller raises
    ``CancelledError`` whatever the work returned or raised.
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        while not task.done():
            # asyncio.wait passes no cancel on to ``task``; a second cancel of the
            # caller must not end this wait early either.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
        if not task.cancelled():
            # The caller was cancelled, so it is not told how the work ended (an
            # aborted stream's error is expected); taken here so asyncio does not
            # report it as never retrieved.
            task.exception()
        raise
