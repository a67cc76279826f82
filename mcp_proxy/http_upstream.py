"""``serve --url``: a Streamable HTTP MCP server in the place of a stdio tool process.

One :class:`HttpUpstream` per tunnel session, with the surface ``server.py``
drives a :class:`~mcp_proxy.toolproc.ToolProcess` through (``start``,
``send``, ``settle``, ``pending``, ``terminate``, ...), so policy, audit and
per-caller isolation are the same as for a stdio tool (docs/adr/0008-http-front-eras.md).

Each message is POSTed in the era it belongs to (MCP "Streamable HTTP",
2025-11-25 and 2026-07-28): a request whose ``_meta`` names a stateless
version goes alone with ``MCP-Protocol-Version``, ``Mcp-Method`` and
``Mcp-Name``; anything else rides the upstream session (``Mcp-Session-Id``
from the ``initialize`` response, the negotiated ``MCP-Protocol-Version``
after it, a GET stream for server-initiated messages once ``initialized``
was sent, DELETE at the end). Requests run concurrently, up to
:data:`MAX_OPEN_REQUESTS` (later ones wait for a place, in order, and a
cancellation of one still waiting drops it); notifications and responses are
sent in order, each after the one before was accepted, and never wait for a
request's place (a response may be what an open request waits for).
Messages not sent yet count as the tool's unread input (``writable``,
``backlog``, ``drain``), so a caller faster than the upstream is paused like
one faster than a stdio tool. A
stateless request is cancelled by closing its stream. Replies come back as
JSON or SSE; each message is handed on as one line.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from mcp_proxy.http_rules import META_VERSION, MODERN_VERSIONS, NAME_FIELDS
from mcp_proxy.jsonrpc import (
    INTERNAL_ERROR,
    JsonRpcError,
    Kind,
    RequestId,
    Sniffed,
    meta_of,
    sniff,
)
from mcp_proxy.jsonrpc import error_reply as _error_reply
from mcp_proxy.sse_reader import EventDataReader
from mcp_proxy.tunnel_wire import MAX_MESSAGE_BYTES
from talos.logging import event

__all__ = ["HttpUpstream"]

log = logging.getLogger(__name__)

ACCEPT = "application/json, text/event-stream"
#: Requests POSTed and not answered yet; later messages wait in order.
MAX_OPEN_REQUESTS = 64
#: Bytes of messages waiting to be POSTed above which the upstream is not ``writable``
#: (a stdio tool's pipe stops at 64 KiB; a request body is sent whole).
HIGH_WATER = 256 * 1024


def _header_value(value: str) -> str:
    """A value as an HTTP header carries it: base64-wrapped unless plain printable ASCII."""
    if value.isascii() and value.isprintable() and value == value.strip():
        return value
    return "=?base64?" + base64.b64encode(value.encode()).decode() + "?="


def _one_line(data: bytes) -> bytes:
    if b"\n" in data or b"\r" in data:
        return orjson.dumps(orjson.loads(data))
    return data


class HttpUpstream:
    """The upstream server of one tunnel session, driven like a tool process."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        on_line: Callable[[bytes], None],
        on_exit: Callable[[int], None],
        *,
        label: str = "upstream",
        log_fields: Mapping[str, object] | None = None,
        on_batch: Callable[[], None] | None = None,
    ) -> None:
        self.url = url
        self.headers = headers
        self.label = label
        self.log_fields = dict(log_fields) if log_fields is not None else {"tool": label}
        self._on_line = on_line
        self._on_exit = on_exit
        self._on_batch = on_batch
        self.pending: set[RequestId] = set()
        self.exit_code: int | None = None
        self.pid: int | None = None
        self._http: aiohttp.ClientSession | None = None
        self._session_id: str | None = None
        self._version: str | None = None
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._queued = 0  # bytes handed to send() and not sent yet (_outbox and _waiting)
        self._room = asyncio.Event()  # set while _queued is below HIGH_WATER
        self._room.set()
        # Requests waiting for one of the MAX_OPEN_REQUESTS places: (line, message, era).
        self._waiting: deque[tuple[bytes, Sniffed, str | None]] = deque()
        self._requests: dict[RequestId, tuple[asyncio.Task[None], bool]] = {}
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._why = ""
        self._output = asyncio.Event()  # cleared: the caller is not taking our output
        self._output.set()

    @property
    def alive(self) -> bool:
        return self._http is not None and self.exit_code is None

    @property
    def writable(self) -> bool:
        """False while more than :data:`HIGH_WATER` bytes wait to be POSTed (then ``drain``)."""
        return self._room.is_set()

    @property
    def backlog(self) -> int:
        """Bytes of messages handed to :meth:`send` and not POSTed yet."""
        return self._queued

    def pause_output(self) -> None:
        """Stop reading the upstream's responses (aiohttp then stops reading the socket)."""
        self._output.clear()

    def resume_output(self) -> None:
        self._output.set()

    def discard_input(self) -> None:
        """Drop every message not sent yet (the session failed)."""
        while not self._outbox.empty():
            self._outbox.get_nowait()
        self._waiting.clear()
        self._sent(self._queued)

    async def drain(self) -> None:
        """Wait until what waits to be POSTed is below :data:`HIGH_WATER` (or the end)."""
        if self.exit_code is None:
            await self._room.wait()

    @property
    def exit_reason(self) -> str:
        return self._why or f"upstream session ended (code {self.exit_code})"

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=None)
        self._http = aiohttp.ClientSession(timeout=timeout, headers=self.headers)
        self._spawn(self._pump())
        # Scheme, host and path only: a query string may hold a credential.
        where = urlsplit(self.url)._replace(query="", fragment="").geturl()
        event(log, "upstream_bridging", **self.log_fields, url=where)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def send(self, line: bytes, request_id: RequestId | None = None) -> None:
        """Queue one message for the upstream; a request id is remembered until settled."""
        if request_id is not None:
            self.pending.add(request_id)
        if self.exit_code is not None:
            self._fail_pending()
            return
        self._outbox.put_nowait(line)
        self._sent(-len(line))

    def hold(self) -> None:
        """Like ``ToolProcess.hold``; nothing to do: each message is its own HTTP request."""

    def release(self) -> None:
        """Like ``ToolProcess.release``; nothing to do."""

    def settle(self, request_id: RequestId) -> bool:
        try:
            self.pending.remove(request_id)
        except KeyError:
            return False
        return True

    async def wait(self) -> int:
        while self.exit_code is None:
            await asyncio.sleep(0.05)
        return self.exit_code

    async def terminate(self) -> int:
        self._stopping = True  # no waiting request starts any more
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        http, self._http = self._http, None
        if http is not None:
            if self._session_id is not None:
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with asyncio.timeout(5):
                        await http.delete(self.url, headers=self._session_headers())
            await http.close()
        self._finish(0)
        return 0

    def _finish(self, code: int) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        self._room.set()  # nothing waits for room any more
        self._on_exit(code)
        self._fail_pending()

    def _fail_pending(self) -> None:
        pending, self.pending = self.pending, set()
        for request_id in pending:
            self._on_line(_error_reply(request_id, INTERNAL_ERROR, self.exit_reason))

    # --- outbound ---------------------------------------------------------------------------

    def _session_headers(self) -> dict[str, str]:
        headers = {"Accept": ACCEPT}
        if self._session_id is not None:
            headers["Mcp-Session-Id"] = self._session_id
        if self._version is not None:
            headers["MCP-Protocol-Version"] = self._version
        return headers

    def _sent(self, size: int) -> None:
        """``size`` bytes left the queue (negative: joined it)."""
        self._queued -= size
        self._room.set() if self._queued < HIGH_WATER else self._room.clear()

    async def _pump(self) -> None:
        """Send queued messages in order; requests are not waited for, other messages are."""
        while True:
            line = await self._outbox.get()
            try:
                msg = sniff(line)
            except JsonRpcError:
                self._sent(len(line))
                continue  # the serve side judged every line before; nothing else arrives
            if msg.kind is Kind.REQUEST:
                assert msg.id is not None
                self._waiting.append((line, msg, self._modern_version(msg)))
                self._start_waiting()
                continue
            self._sent(len(line))
            if msg.method == "notifications/cancelled" and isinstance(msg.params, dict):
                rid = msg.params.get("requestId")
                if self._drop_waiting(rid):
                    continue  # never sent: the upstream has nothing to cancel
                held = self._requests.get(rid)  # type: ignore[arg-type]
                if held is not None and held[1]:
                    held[0].cancel()  # a stateless request is cancelled by closing its stream
                    continue
            with contextlib.suppress(aiohttp.ClientError, OSError):
                await self._post_message(line, msg)

    def _start_waiting(self) -> None:
        """POST waiting requests, in order, while fewer than MAX_OPEN_REQUESTS are open."""
        while self._waiting and len(self._requests) < MAX_OPEN_REQUESTS and not self._stopping:
            line, msg, modern = self._waiting.popleft()
            assert msg.id is not None
            self._sent(len(line))
            task = self._spawn(self._request(line, msg, modern))
            self._requests[msg.id] = (task, modern is not None)
            # A callback, not a finally: it also runs for a task cancelled before it started.
            task.add_done_callback(functools.partial(self._request_done, msg.id))

    def _request_done(self, request_id: RequestId, task: asyncio.Task[None]) -> None:
        held = self._requests.get(request_id)
        if held is not None and held[0] is task:
            del self._requests[request_id]
        self._start_waiting()

    def _drop_waiting(self, request_id: object) -> bool:
        for entry in self._waiting:
            if entry[1].id == request_id:
                self._waiting.remove(entry)
                self._sent(len(entry[0]))
                return True
        return False

    @staticmethod
    def _modern_version(msg: Sniffed) -> str | None:
        version = meta_of(msg).get(META_VERSION)
        return version if version in MODERN_VERSIONS else None

    async def _post_message(self, line: bytes, msg: Sniffed) -> None:
        assert self._http is not None
        headers = {**self._session_headers(), "Content-Type": "application/json"}
        async with self._http.post(self.url, data=line, headers=headers) as resp:
            if resp.status >= 400:
                event(
                    log,
                    "upstream_refused",
                    logging.WARNING,
                    **self.log_fields,
                    kind=msg.kind.value,
                    status=resp.status,
                )
        if msg.method == "notifications/initialized" and self._session_id is not None:
            self._spawn(self._listen())

    async def _request(self, line: bytes, msg: Sniffed, modern: str | None) -> None:
        assert self._http is not None and msg.id is not None
        headers = {"Content-Type": "application/json", "Accept": ACCEPT}
        if modern is not None:
            headers["MCP-Protocol-Version"] = modern
            headers["Mcp-Method"] = msg.method or ""
            field = NAME_FIELDS.get(msg.method or "")
            value = msg.params.get(field) if field and isinstance(msg.params, dict) else None
            if isinstance(value, str):
                headers["Mcp-Name"] = _header_value(value)
        else:
            headers.update(self._session_headers())
        try:
            async with self._http.post(self.url, data=line, headers=headers) as resp:
                if msg.method == "initialize" and "Mcp-Session-Id" in resp.headers:
                    self._session_id = resp.headers["Mcp-Session-Id"]
                await self._read_reply(resp, msg)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            self._answer(msg.id, f"upstream request failed: {exc}")

    async def _read_reply(self, resp: aiohttp.ClientResponse, msg: Sniffed) -> None:
        assert msg.id is not None
        kind = resp.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if kind == "application/json":
            parts: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_any():
                await self._output.wait()  # held while the caller's link is not taking output
                size += len(chunk)
                if size > MAX_MESSAGE_BYTES:
                    self._answer(msg.id, f"upstream reply above {MAX_MESSAGE_BYTES} bytes")
                    return
                parts.append(chunk)
            self._deliver(b"".join(parts), msg)
        elif kind == "text/event-stream":
            await self._read_events(resp, msg)
        if msg.id in self.pending:
            self._answer(msg.id, f"upstream answered HTTP {resp.status} without a response")

    async def _listen(self) -> None:
        """The session's GET stream: messages the upstream sends on its own."""
        assert self._http is not None
        headers = {**self._session_headers(), "Accept": "text/event-stream"}
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with self._http.get(self.url, headers=headers) as resp:
                if resp.status == 200:
                    await self._read_events(resp, None)

    async def _read_events(self, resp: aiohttp.ClientResponse, msg: Sniffed | None) -> None:
        reader = EventDataReader(MAX_MESSAGE_BYTES)
        async for chunk in resp.content.iter_any():
            await self._output.wait()  # held while the caller's link is not taking output
            for data in reader.feed(chunk):
                self._deliver(data, msg)
            if reader.too_big:
                raise ValueError(f"upstream event above {MAX_MESSAGE_BYTES} bytes")

    def _deliver(self, data: bytes, msg: Sniffed | None) -> None:
        try:
            line = _one_line(data)
            reply = sniff(line)
        except (orjson.JSONDecodeError, JsonRpcError):
            event(log, "upstream_malformed_dropped", logging.WARNING, **self.log_fields)
            return
        if msg is not None and msg.method == "initialize" and reply.kind is Kind.RESPONSE:
            result = reply.result if isinstance(reply.result, dict) else {}
            version = result.get("protocolVersion")
            self._version = version if isinstance(version, str) else None
        self._on_line(line)
        if self._on_batch is not None:
            self._on_batch()

    def _answer(self, request_id: RequestId, reason: str) -> None:
        if request_id in self.pending:
            event(log, "upstream_request_failed", logging.WARNING, **self.log_fields, reason=reason)
            self._on_line(_error_reply(request_id, INTERNAL_ERROR, reason))
