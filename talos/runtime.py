"""The event loop the node's processes run on (docs/DESIGN.md "Performance targets").

``talosd run`` and ``talos-proxy`` spend most of a tunnel round trip or a
durable ack in event-loop passes and transport writes; uvloop makes both
cheaper, so it is used whenever it is installed. ``TALOS_NO_UVLOOP=1`` forces
the standard asyncio loop (to compare, or to rule uvloop out when debugging).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["NO_UVLOOP_ENV", "loop_factory", "run"]

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
