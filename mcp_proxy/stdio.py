"""``talos-proxy connect``'s stdin and stdout, whatever they are (MCP "Transports: stdio").

An agent host hands ``connect`` a pipe or a socket; a script may hand it a
regular file (``> out.jsonl``, ``< in.jsonl``), ``/dev/null`` or a terminal.
The event loop's pipe transports only take some of these: asyncio refuses a
regular file ("Pipe transport is only for pipes, sockets and character
devices") and cannot poll ``/dev/null``; uvloop aborts the process on both.
So the fd type picks the mechanism:

* a pipe, a socket or a terminal: the loop's pipe transport (non-blocking, with
  backpressure);
* anything else (a regular file, ``/dev/null``, another device): plain
  reads and writes, which never wait long on such an fd, done in the loop
  with a yield between input chunks.

Both writers write each message whole and in order; :meth:`StdoutWriter.aclose`
returns once what was written has left the process (or the reader is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Awaitable
from typing import Protocol

from talos.local.flow import FlowControlled
from talos.logging import event
from talos_sdk.errors import UsageError

__all__ = ["StdoutWriter", "is_pollable", "open_stdin", "open_stdout"]

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 16
#: How long a closing pipe writer waits for a reader that stopped reading.
CLOSE_DRAIN_TIMEOUT = 10.0


def is_pollable(fd: int) -> bool:
    """Whether the loop's pipe transports can drive ``fd``: a pipe, a socket or a terminal."""
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd)


class StdoutWriter(Protocol):
    """Where ``connect`` writes the agent's messages."""

    def write(self, data: bytes) -> None: ...

    def backpressure(self) -> Awaitable[None] | None:
        """An awaitable while the agent is not reading what was written, else None."""
        ...

    def buffered(self) -> int:
        """Bytes written and held in this process, not yet taken by the agent."""
        ...

    async def aclose(self) -> None: ...


class _Drained(FlowControlled):
    """The pipe's protocol: ``drained`` while the agent is behind, ``lost`` once closed."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        self.wake_writers()  # nobody to wait for any more
        if not self.lost.done():
            self.lost.set_result(None)


class _PipeWriter:
    """A pipe, socket or terminal: the loop's write transport, which buffers when full."""

    def __init__(self, transport: asyncio.WriteTransport, protocol: _Drained) -> None:
        self._transport = transport
        self._protocol = protocol

    def write(self, data: bytes) -> None:
        if not self._transport.is_closing():
            self._transport.write(data)

    def backpressure(self) -> Awaitable[None] | None:
        # Past the transport's high-water mark: connect asks serve to pause the session.
        return self._protocol.drained

    def buffered(self) -> int:
        return self._transport.get_write_buffer_size()

    async def aclose(self) -> None:
        self._transport.close()  # flushes what is buffered, then closes
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_DRAIN_TIMEOUT):
                await asyncio.shield(self._protocol.lost)


class _FileWriter:
    """A regular file or a device: each message written whole before ``write`` returns."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._failed = False

    def write(self, data: bytes) -> None:
        if self._failed:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:  # a full disk, a revoked device: say so once, drop the rest
            self._failed = True
            event(log, "stdout_write_failed", logging.ERROR, error=exc.strerror or str(exc))

    def backpressure(self) -> Awaitable[None] | None:
        return None  # each write returned once written: nothing waits in this process

    def buffered(self) -> int:
        return 0

    async def aclose(self) -> None:
        return None  # nothing is buffered in this process


async def open_stdout(fd: int = 1) -> StdoutWriter:
    """A writer for ``fd`` fitting its type (module docstring)."""
    try:
        pollable = is_pollable(fd)
    except OSError:
        raise UsageError(
            "standard output is closed: connect writes the agent's replies there"
        ) from None
    if not pollable:
        return _FileWriter(fd)
    loop = asyncio.get_running_loop()
    # A duplicate: the transport closes its own fd, never the process's stdout.
    pipe = os.fdopen(os.dup(fd), "wb", buffering=0)
    transport, protocol = await loop.connect_write_pipe(_Drained, pipe)
    return _PipeWriter(transport, protocol)


class _FileReader:
    """A read transport over a regular file or a device: chunks until end of file."""

    def __init__(self, fd: int, protocol: asyncio.Protocol) -> None:
        self._fd = fd
        self._protocol = protocol
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._closing = False
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        self._protocol.connection_made(self)  # type: ignore[arg-type]
        error: Exception | None = None
        try:
            while not self._closing:
                await self._resumed.wait()
                if self._closing:
                    break
                chunk = os.read(self._fd, READ_CHUNK)
                if not chunk:
                    self._protocol.eof_received()
                    break
                self._protocol.data_received(chunk)
                await asyncio.sleep(0)  # let the link and the replies move between chunks
        except OSError as exc:
            error = exc
            event(log, "stdin_read_failed", logging.ERROR, error=exc.strerror or str(exc))
        self._closing = True
        self._protocol.connection_lost(error)

    def pause_reading(self) -> None:
        self._resumed.clear()

    def resume_reading(self) -> None:
        self._resumed.set()

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._resumed.set()


class _Closable(Protocol):
    def close(self) -> None: ...


async def open_stdin(protocol: asyncio.Protocol, fd: int = 0) -> _Closable:
    """Feed ``fd`` to ``protocol`` by a means fitting its type; a closed fd reads as empty."""
    try:
        pollable = is_pollable(fd)
    except OSError:  # no stdin at all: the agent sends nothing
        fd, pollable = os.open(os.devnull, os.O_RDONLY), False
    if not pollable:
        return _FileReader(fd, protocol)
    loop = asyncio.get_running_loop()
    pipe = os.fdopen(os.dup(fd), "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: protocol, pipe)
    return transport
