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
  client that does not read stdout), later requests are held, and past as many
  again (or 16 MiB of them) stdin waits, so what the server holds stays
  bounded; the rest still passes (:class:`_Flow`); a request whose id is in use
  is answered -32600; requests held when stdin ends are answered -32000.

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


class _Flow:
    """Which of the client's messages go to the server now, and which wait.

    Request ids as the SDK correlates them ("7" and 7 are one id). A request is
    passed on while fewer than :data:`MAX_IN_FLIGHT` wait for their answers, else
    held, in order (at most :data:`MAX_IN_FLIGHT` held, :data:`MAX_LINE` bytes of
    them: past that stdin waits). Everything else passes at once, so the client
    can still cancel (a held request cancelled is dropped, never sent: the SDK
    never answers a cancelled request either), answer the server's own requests,
    and close stdin.
    """

    SEND, HELD, DROP, DUPLICATE = range(4)

    def __init__(self) -> None:
        self.pending: set[Any] = set()
        self.held: dict[Any, tuple[Any, int]] = {}  # in arrival order: key -> (message, size)
        self.held_bytes = 0
        self.can_read = asyncio.Event()
        self.can_release = asyncio.Event()
        self._update()

    def take(self, message: Any, size: int) -> int:
        """The verdict on one message of the client: SEND, HELD, DROP or DUPLICATE."""
        from mcp import types

        verdict = self.SEND
        if isinstance(message, types.JSONRPCRequest):
            key = _key(message.id)
            if key in self.pending or key in self.held:
                return self.DUPLICATE  # its answer could not be told from the first one's
            if self.held or len(self.pending) >= MAX_IN_FLIGHT:
                self.held[key] = (message, size)
                self.held_bytes += size
                verdict = self.HELD
            else:
                self.pending.add(key)
        elif isinstance(message, types.JSONRPCNotification):
            params = message.params if isinstance(message.params, dict) else {}
            if message.method == "notifications/cancelled":
                key = _key(params.get("requestId"))
                if key in self.held:
                    self.held_bytes -= self.held.pop(key)[1]
                    verdict = self.DROP
                self.pending.discard(key)  # the SDK never answers a cancelled request
        self._update()
        return verdict

    def release(self) -> Any:
        """The oldest held request, now counted as in flight (when ``can_release``)."""
        key = next(iter(self.held))
        message, size = self.held.pop(key)
        self.held_bytes -= size
        self.pending.add(key)
        self._update()
        return message

    def drop_held(self) -> list[Any]:
        """Every held request, no longer held (the client is gone)."""
        dropped = [message for message, _ in self.held.values()]
        self.held.clear()
        self.held_bytes = 0
        self._update()
        return dropped

    def answered(self, message: Any) -> None:
        from mcp import types

        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError):
            self.pending.discard(_key(message.id))
            self._update()

    def _update(self) -> None:
        full = len(self.held) >= MAX_IN_FLIGHT or self.held_bytes >= MAX_LINE
        self.can_read.clear() if full else self.can_read.set()
        ready = self.held and len(self.pending) < MAX_IN_FLIGHT
        self.can_release.set() if ready else self.can_release.clear()


def _key(request_id: Any) -> Any:
    """A request id as the SDK correlates it ("7" is 7)."""
    from mcp.shared.dispatcher import coerce_request_id

    return coerce_request_id(request_id)


class _Answers:
    """The server's write stream, telling :class:`_Flow` of each answer written."""

    def __init__(self, stream: Any, flight: _Flow) -> None:
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

    def error(code: int, message: str, request_id: Any = None) -> SessionMessage:
        data = types.ErrorData(code=code, message=message)
        return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=data))

    flow = _Flow()
    no_input = _NoInput()
    async with stdio_server(stdin=no_input) as (_, write_stream):  # type: ignore[arg-type]
        answers = _Answers(write_stream, flow)
        writer, reader = anyio.create_memory_object_stream[Any](0)

        async def take(line: bytes) -> None:
            if not line.strip():
                return
            try:
                # As the SDK's reader decoded it: bytes that are not UTF-8 replaced.
                text = line.decode("utf-8", "replace")
                message = types.jsonrpc_message_adapter.validate_json(text, by_name=False)
            except ValueError:
                await write_stream.send(error(*_invalid(line)))
                return
            if isinstance(message, types.JSONRPCNotification) and _has_id(line):
                why = "Invalid Request: a request id is a string or an integer"
                await write_stream.send(error(types.INVALID_REQUEST, why))
                return
            verdict = flow.take(message, len(line))
            if verdict == flow.SEND:
                await writer.send(SessionMessage(message))
            elif verdict == flow.DUPLICATE:
                assert isinstance(message, types.JSONRPCRequest)
                why = "Invalid Request: id already in use"
                await write_stream.send(error(types.INVALID_REQUEST, why, message.id))

        async def pump() -> None:
            async with writer:
                while True:
                    await flow.can_read.wait()  # held requests past their bound: stdin waits
                    read = await _read_line(stdin)
                    if read is None:
                        break
                    line, oversize = read
                    if oversize:
                        why = f"message above {MAX_LINE} bytes"
                        await write_stream.send(error(types.INVALID_REQUEST, why))
                        continue
                    # A bare CR ends a line too, as it did for the SDK's reader.
                    for part in line.replace(b"\r\n", b"\n").split(b"\r"):
                        await take(part)
                # The client is gone: requests it never saw sent are answered, not kept.
                for message in flow.drop_held():
                    closed = (types.CONNECTION_CLOSED, "Connection closed", message.id)
                    await write_stream.send(error(*closed))

        async def release() -> None:
            while True:
                await flow.can_release.wait()
                try:
                    await writer.send(SessionMessage(flow.release()))
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return  # stdin ended meanwhile: the server reads no more

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pump)
                tg.start_soon(release)
                await low.run(reader, answers, low.create_initialization_options())
                tg.cancel_scope.cancel()
        finally:
            no_input.end()
