"""``talosd mcp`` on stdio: the MCP SDK's server transport with the bounds a server that
lives as long as its agent needs (MCP "Transports: stdio"; JSON-RPC 2.0 §5.1).

The SDK's own stdin reader takes a line whatever its length and hands on every
request at once, a task each, whether or not the client reads the answers; and a
line that is not JSON-RPC reaches the server only as a logged exception, so its
client would wait for ever. Here stdin is read by :func:`run_stdio` instead:

- a line above :data:`MAX_LINE` bytes is read past, never held, and answered
  -32600 (as ``talos-proxy connect`` answers one);
- a line that is not JSON is answered -32700 (Parse error), and JSON that is
  not a JSON-RPC message -32600 (Invalid Request), both with id null; so is a
  request whose id is neither a string nor an integer (MCP "Requests"), which
  the SDK would take for a notification and never answer;
- while :data:`MAX_IN_FLIGHT` requests wait for their answers (a slow tool, or a
  client that does not read stdout), no more of stdin is read, so what the
  server holds stays bounded; a cancelled request no longer counts.

The SDK still writes stdout (one message per line) and keeps fd 1 away from
anything else while it serves.
"""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from typing import Any, BinaryIO

__all__ = ["MAX_IN_FLIGHT", "MAX_LINE", "run_stdio"]

#: The longest stdin line taken whole, newline excluded (talos-proxy's limit too).
MAX_LINE = 16 * 1024 * 1024
#: Requests read and not yet answered; at this many, stdin waits.
MAX_IN_FLIGHT = 256
#: What an oversize line is read past in, a piece at a time.
_SKIP = 1 << 20


class _InFlight:
    """The client's requests read and not answered (nor cancelled) yet."""

    def __init__(self) -> None:
        self.pending: set[Any] = set()
        self.room = asyncio.Event()
        self.room.set()

    def asked(self, message: Any) -> None:
        from mcp import types

        if isinstance(message, types.JSONRPCRequest):
            self.pending.add(message.id)
        elif isinstance(message, types.JSONRPCNotification):
            params = message.params if isinstance(message.params, dict) else {}
            if message.method == "notifications/cancelled":
                # The SDK never answers a request its client cancelled.
                self.pending.discard(params.get("requestId"))
        self._update()

    def answered(self, message: Any) -> None:
        from mcp import types

        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError):
            self.pending.discard(message.id)
            self._update()

    def _update(self) -> None:
        self.room.set() if len(self.pending) < MAX_IN_FLIGHT else self.room.clear()


class _Answers:
    """The server's write stream, telling :class:`_InFlight` of each answer written."""

    def __init__(self, stream: Any, flight: _InFlight) -> None:
        self.stream = stream
        self.flight = flight

    async def send(self, item: Any) -> None:
        await self.stream.send(item)
        self.flight.answered(item.message)

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def __aenter__(self) -> _Answers:
        await self.stream.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        result: bool | None = await self.stream.__aexit__(exc_type, exc, tb)
        return result


class _NoInput:
    """What the SDK's own stdin reader is given: no line, and its end once :meth:`end`
    is called (the SDK's transport waits for its reader before it returns)."""

    def __init__(self) -> None:
        self._ended = asyncio.Event()

    def end(self) -> None:
        self._ended.set()

    def __aiter__(self) -> _NoInput:
        return self

    async def __anext__(self) -> str:
        await self._ended.wait()
        raise StopAsyncIteration


async def _read_line(stdin: BinaryIO) -> tuple[bytes, bool] | None:
    """The next line and whether it was above :data:`MAX_LINE` (then not kept); None at
    the end of stdin."""
    import anyio.to_thread

    def read() -> tuple[bytes, bool] | None:
        line = stdin.readline(MAX_LINE + 1)
        if not line:
            return None
        if line.endswith(b"\n") or len(line) <= MAX_LINE:  # whole, or the last one
            return line, False
        while (more := stdin.readline(_SKIP)) and not more.endswith(b"\n"):
            pass  # read past the rest of the line, holding at most a piece of it
        return b"", True

    # Abandoned on cancel: a blocked read cannot be interrupted (the process exits).
    return await anyio.to_thread.run_sync(read, abandon_on_cancel=True)


def _has_id(line: bytes) -> bool:
    """Whether a line the SDK read as a notification has an ``id`` after all: a request
    whose id is not a string or an integer (a float, an object, null, a boolean)."""
    if b'"id"' not in line:
        return False
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and "id" in obj


def _invalid(line: bytes) -> tuple[int, str]:
    """The JSON-RPC error for a line that is not a message (JSON-RPC 2.0 §5.1)."""
    from mcp import types

    try:
        json.loads(line)
    except ValueError:
        return types.PARSE_ERROR, "Parse error: not JSON"
    return types.INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message"


async def run_stdio(low: Any, stdin: BinaryIO) -> None:
    """Run the SDK's low-level server ``low`` over ``stdin`` and the process's stdout."""
    import anyio
    from mcp import types
    from mcp.server.stdio import stdio_server
    from mcp.shared.message import SessionMessage

    def error(code: int, message: str) -> SessionMessage:
        data = types.ErrorData(code=code, message=message)
        return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=None, error=data))

    flight = _InFlight()
    no_input = _NoInput()
    async with stdio_server(stdin=no_input) as (_, write_stream):  # type: ignore[arg-type]
        answers = _Answers(write_stream, flight)
        writer, reader = anyio.create_memory_object_stream[Any](0)

        async def pump() -> None:
            async with writer:
                while True:
                    await flight.room.wait()  # before reading: nothing more is held meanwhile
                    read = await _read_line(stdin)
                    if read is None:
                        return
                    line, oversize = read
                    if oversize:
                        why = f"message above {MAX_LINE} bytes"
                        await write_stream.send(error(types.INVALID_REQUEST, why))
                        continue
                    if not line.strip():
                        continue
                    try:
                        message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                    except ValueError:
                        await write_stream.send(error(*_invalid(line)))
                        continue
                    if isinstance(message, types.JSONRPCNotification) and _has_id(line):
                        why = "Invalid Request: a request id is a string or an integer"
                        await write_stream.send(error(types.INVALID_REQUEST, why))
                        continue
                    flight.asked(message)
                    await writer.send(SessionMessage(message))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pump)
                await low.run(reader, answers, low.create_initialization_options())
                tg.cancel_scope.cancel()
        finally:
            no_input.end()
