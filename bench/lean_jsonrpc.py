"""A lean newline-delimited JSON-RPC 2.0 client for throughput benches (docs/DESIGN.md, "Notes").

The official MCP SDK client tops out near 2,000 requests/s by itself, so the
tunnel benches drive servers with this instead: one reader task matches
responses to futures by id, writes are not awaited per message, and
``pipelined`` keeps N requests in flight. Works over a subprocess's stdio
(``LeanClient.spawn``) or any asyncio ``(StreamReader, StreamWriter)`` pair.
Server-to-client requests are answered with -32601 unless a handler is given.

Run as a script for a quick figure::

    python bench/lean_jsonrpc.py [--count N] [--in-flight K] -- CMD [ARGS...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import orjson

__all__ = ["LeanClient", "LeanError"]

RequestHandler = Callable[[str, Any], Awaitable[Any]]


class LeanError(Exception):
    """The server answered with a JSON-RPC error (or the connection ended first)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.data = data


class LeanClient:
    """Pipelined JSON-RPC over a byte stream pair."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        on_request: RequestHandler | None = None,
        process: asyncio.subprocess.Process | None = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.process = process
        self.on_request = on_request
        self.notifications: list[dict[str, Any]] = []
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        self._answering: set[asyncio.Task[None]] = set()
        self._reader_task = asyncio.create_task(self._read())

    @classmethod
    async def spawn(
        cls, argv: Sequence[str], *, env: dict[str, str] | None = None, **kwargs: Any
    ) -> LeanClient:
        """Start ``argv`` with piped stdin/stdout (stderr inherited) and talk to it."""
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=16 * 1024 * 1024,
        )
        assert proc.stdout is not None and proc.stdin is not None
        return cls(proc.stdout, proc.stdin, process=proc, **kwargs)

    def _send(self, obj: dict[str, Any]) -> None:
        self.writer.write(orjson.dumps(obj) + b"\n")

    def start(self, method: str, params: Any = None) -> asyncio.Future[Any]:
        """Send a request now; the future resolves to its result."""
        self._next_id += 1
        rid = self._next_id
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        self._send(msg)
        return fut

    async def request(self, method: str, params: Any = None) -> Any:
        fut = self.start(method, params)
        await self.writer.drain()
        return await fut

    async def notify(self, method: str, params: Any = None) -> None:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self._send(msg)
        await self.writer.drain()

    async def initialize(self, protocol_version: str = "2025-06-18") -> Any:
        """The MCP handshake: initialize, then notifications/initialized."""
        result = await self.request(
            "initialize",
            {
                "protocolVersion": protocol_version,
                "capabilities": {},
                "clientInfo": {"name": "lean-jsonrpc", "version": "1"},
            },
        )
        await self.notify("notifications/initialized")
        return result

    async def pipelined(self, method: str, params: Iterable[Any], in_flight: int = 64) -> list[Any]:
        """Send one request per params, keeping at most ``in_flight`` unanswered."""
        window = asyncio.Semaphore(in_flight)
        results: list[Any] = []

        async def one(p: Any, slot: int) -> None:
            try:
                results[slot] = await self.start(method, p)
            finally:
                window.release()

        tasks = []
        for p in params:
            await window.acquire()
            results.append(None)
            tasks.append(asyncio.create_task(one(p, len(results) - 1)))
            if len(tasks) % in_flight == 0:
                await self.writer.drain()
        await self.writer.drain()
        await asyncio.gather(*tasks)
        return results

    async def _read(self) -> None:
        try:
            while True:
                line = await self.reader.readline()
                if not line:
                    break
                try:
                    msg = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(msg, dict):
                    continue
                if "method" in msg:
                    if "id" in msg:
                        task = asyncio.create_task(self._answer(msg))
                        self._answering.add(task)
                        task.add_done_callback(self._answering.discard)
                    else:
                        self.notifications.append(msg)
                    continue
                fut = self._pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
                if fut is None or fut.done():
                    continue
                if "error" in msg:
                    err = msg["error"] if isinstance(msg["error"], dict) else {}
                    fut.set_exception(
                        LeanError(err.get("code", 0), err.get("message", ""), err.get("data"))
                    )
                else:
                    fut.set_result(msg.get("result"))
        finally:
            pending, self._pending = self._pending, {}
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(LeanError(-32000, "connection closed"))

    async def _answer(self, msg: dict[str, Any]) -> None:
        if self.on_request is None:
            reply: dict[str, Any] = {
                "jsonrpc": "2.0",
                "id": msg["id"],
                "error": {"code": -32601, "message": "Method not found"},
            }
        else:
            try:
                result = await self.on_request(msg["method"], msg.get("params"))
                reply = {"jsonrpc": "2.0", "id": msg["id"], "result": result}
            except LeanError as exc:
                reply = {
                    "jsonrpc": "2.0",
                    "id": msg["id"],
                    "error": {"code": exc.code, "message": exc.message},
                }
        self._send(reply)
        await self.writer.drain()

    async def close(self, timeout: float = 5.0) -> None:
        """Close our side; a spawned process gets ``timeout`` to exit before it is killed."""
        with contextlib.suppress(Exception):
            self.writer.close()
        if self.process is not None:
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task


async def _main(args: argparse.Namespace) -> None:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    client = await LeanClient.spawn(command)
    try:
        await client.initialize()
        start = time.perf_counter()
        for _ in range(args.count):
            await client.request("ping")
        seq = args.count / (time.perf_counter() - start)
        start = time.perf_counter()
        await client.pipelined("ping", (None for _ in range(args.count)), args.in_flight)
        par = args.count / (time.perf_counter() - start)
        print(f"sequential {seq:,.0f} req/s; {args.in_flight} in flight {par:,.0f} req/s")
    finally:
        await client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="ping an MCP stdio server with a lean client")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    asyncio.run(_main(parser.parse_args()))
    sys.exit(0)
