"""The event loop the node's processes run on (docs/DESIGN.md "Performance targets").

``talosd run`` and ``talos-proxy`` spend most of a tunnel round trip or a
durable ack in event-loop passes and transport writes; uvloop makes both
cheaper, so it is used whenever it is installed. ``TALOS_NO_UVLOOP=1`` forces
the standard asyncio loop (to compare, or to rule uvloop out when debugging).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["NO_UVLOOP_ENV", "loop_factory", "run", "settle_heap", "stop_on_signals"]

_T = TypeVar("_T")

NO_UVLOOP_ENV = "TALOS_NO_UVLOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor when usable and not disabled; None means asyncio's default."""
    if os.environ.get(NO_UVLOOP_ENV, "") not in ("", "0"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, _T], *, debug: bool | None = None) -> _T:
    """``asyncio.run(main)`` on the loop :func:`loop_factory` picks."""
    with asyncio.Runner(debug=debug, loop_factory=loop_factory()) as runner:
        return runner.run(main)


def stop_on_signals() -> asyncio.Event:
    """An event SIGINT and SIGTERM set from now on (a daemon's stop request).

    Install it before the start-up work: a signal that comes while the node
    starts (a container stopped as soon as its port answered) then stops it
    cleanly once started, instead of killing the process half-way.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def settle_heap() -> None:
    """Exempt what a daemon built while starting from the cyclic collector (``gc.freeze``).

    Call once the process is up (``talosd run``, ``talos-proxy serve`` and
    ``connect``, ``talosd mcp``). Start-up leaves ~57,000 container objects the
    process keeps for its life (modules, classes, functions, configuration),
    and every full collection walked them all, holding the event loop: in
    ``talos-proxy serve`` with 256 ``tools/call`` in flight, 5 full collections
    in 12 s took 17-38 ms each, and every call in flight waited; with them
    frozen the same collections take 0.3-1.2 ms. Frozen objects are still
    freed by reference counting; the ``collect`` first clears the cycles that
    start-up itself left behind.
    """
    gc.collect()
    gc.freeze()
