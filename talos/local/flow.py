"""Write flow control shared by both ends of the local socket (docs/PROTOCOL.md "Local clients").

asyncio tells a protocol when its transport's write buffer passes the high
water mark (``pause_writing``) and when it drained again (``resume_writing``);
:class:`FlowControlled` turns that into one future, :attr:`drained`, that a
writer awaits while it is set. The node's per-client connection and the
client's protocol both use it.
"""

from __future__ import annotations

import asyncio
from typing import cast

__all__ = ["HIGH_WATER", "FlowControlled"]

#: Bytes buffered for the other end before writers are told to wait.
HIGH_WATER = 1 << 20


class FlowControlled(asyncio.Protocol):
    """A protocol whose :attr:`drained` future is set while its transport is above high water."""

    transport: asyncio.Transport | None
    #: Set while the other end reads slower than we write; done (and cleared) once it caught up.
    drained: asyncio.Future[None] | None

    def __init__(self) -> None:
        self.transport = None
        self.drained = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=HIGH_WATER)

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self.wake_writers()

    def wake_writers(self) -> None:
        """Release whoever awaits :attr:`drained` (the buffer drained, or the connection ended)."""
        fut, self.drained = self.drained, None
        if fut is not None and not fut.done():
            fut.set_result(None)
