"""A lean Streamable HTTP client for the tunnel bench: ``tools/call echo`` in either MCP era.

Stateless (2026-07-28): each request carries ``_meta`` and the routing headers,
no session. Legacy (2025-11-25): ``initialize`` + ``initialized``, then every
request names the ``Mcp-Session-Id``. Replies are read as JSON or SSE. One
aiohttp connection pool (keep-alive, IN_FLIGHT connections) serves all requests.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import aiohttp
import orjson

MODERN = "2026-07-28"
META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientCapabilities": {},
}


class HttpMcpClient:
    """POSTs ``tools/call echo`` to one endpoint; ``stateless`` picks the era."""

    def __init__(self, url: str, token: str, *, stateless: bool, in_flight: int = 64) -> None:
        self.url = url
        self.stateless = stateless
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=in_flight),
            headers={
                "Authorization": f"Bearer {token}",
                "Accept": "application/json, text/event-stream",
                "Content-Type": "application/json",
            },
        )
        self.headers: dict[str, str] = {}
        self._ids = itertools.count(1)

    async def start(self) -> None:
        if self.stateless:
            self.headers = {
                "MCP-Protocol-Version": MODERN,
                "Mcp-Method": "tools/call",
                "Mcp-Name": "echo",
            }
            return
        init = {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "bench-http", "version": "1"},
        }
        body = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}
        async with self.http.post(self.url, data=orjson.dumps(body)) as resp:
            resp.raise_for_status()
            sid = resp.headers["Mcp-Session-Id"]
            await resp.read()
        self.headers = {"Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        async with self.http.post(self.url, data=orjson.dumps(note), headers=self.headers) as r:
            r.raise_for_status()

    async def call(self) -> Any:
        params: dict[str, Any] = {"name": "echo", "arguments": {"text": "hi"}}
        if self.stateless:
            params["_meta"] = META
        body = {"jsonrpc": "2.0", "id": next(self._ids), "method": "tools/call", "params": params}
        async with self.http.post(self.url, data=orjson.dumps(body), headers=self.headers) as resp:
            resp.raise_for_status()
            data = await resp.read()
        if resp.content_type == "text/event-stream":
            data = [ln for ln in data.split(b"\n") if ln.startswith(b"data: {")][-1][6:]
        reply = orjson.loads(data)
        if "result" not in reply:
            raise RuntimeError(f"echo failed: {reply}")
        return reply["result"]

    async def timed(self, count: int) -> list[float]:
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            await self.call()
            samples.append(time.perf_counter() - start)
        return samples

    async def throughput(self, burst: int, in_flight: int) -> float:
        window = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with window:
                await self.call()

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(burst)))
        return burst / (time.perf_counter() - start)

    async def close(self) -> None:
        if not self.stateless and "Mcp-Session-Id" in self.headers:
            async with self.http.delete(self.url, headers=self.headers):
                pass
        await self.http.close()
