"""A serve/connect pair over an in-process LoopbackTransport, driven by raw JSON-RPC lines."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from mcp_proxy.audit import AuditRecord
from mcp_proxy.client import ClientSession, TunnelClient
from mcp_proxy.policy import Policy
from mcp_proxy.server import TunnelServer
from mcp_proxy.transport import LoopbackTransport
from talos_sdk.did import did_from_public_key

# Well-formed DIDs (a policy parses every DID it is given) of fixed keys.
CLIENT_DID = did_from_public_key(b"C" * 32)
SERVER_DID = did_from_public_key(b"S" * 32)
EVERYTHING = [sys.executable, "-m", "tests.tools.everything_server"]


def bad_tool(mode: str) -> list[str]:
    """tests/tools/bad_server.py in ``mode`` (see its docstring)."""
    return [sys.executable, "-m", "tests.tools.bad_server", mode]


class MemorySink:
    """Collects audit records (for tests of the proxy logic; LMDB is tested in test_audit)."""

    def __init__(self) -> None:
        self.records: list[AuditRecord] = []
        self.syncs = 0

    def write(self, records: Sequence[AuditRecord]) -> None:
        self.records.extend(records)

    def sync(self) -> None:
        self.syncs += 1


class Agent:
    """Plays the MCP client: writes lines into a ClientSession, reads what it delivers."""

    def __init__(self, client: TunnelClient) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.session: ClientSession = client.open_session(self._deliver)
        self._next_id = 100
        self.waiters: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self.other: list[dict[str, Any]] = []

    def _deliver(self, line: bytes) -> None:
        msg = orjson.loads(line)
        fut = self.waiters.pop(msg.get("id"), None) if "method" not in msg else None
        if fut is not None and not fut.done():
            fut.set_result(msg)
        else:
            self.other.append(msg)
            self.inbox.put_nowait(msg)

    async def send_raw(self, line: bytes) -> None:
        await self.session.from_agent(line)

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            body["params"] = params
        await self.send_raw(orjson.dumps(body))

    def start_request(
        self, method: str, params: dict[str, Any] | None = None
    ) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        self._next_id += 1
        rid = self._next_id
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiters[rid] = fut
        return rid, fut

    async def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        rid, fut = self.start_request(method, params)
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            body["params"] = params
        await self.send_raw(orjson.dumps(body))
        return await fut

    async def initialize(self) -> dict[str, Any]:
        reply = await self.request(
            "initialize",
            {
                "protocolVersion": "2025-06-18",
                "capabilities": {"sampling": {}},
                "clientInfo": {"name": "loopback-agent", "version": "0"},
            },
        )
        await self.notify("notifications/initialized")
        return reply

    async def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        return await self.request("tools/call", {"name": tool, "arguments": arguments})


class Pair:
    """A TunnelServer and a TunnelClient joined by a loopback link."""

    def __init__(
        self,
        policy: Policy,
        *,
        auditor: Any = None,
        server_name: str = "",
        link_wait: float = 5.0,
        max_payload: int | None = None,
        **server_options: Any,
    ) -> None:
        self.client_end, self.server_end = LoopbackTransport.pair(CLIENT_DID, SERVER_DID)
        if max_payload is not None:  # small link frames: messages travel in PART pieces
            self.client_end.max_payload = self.server_end.max_payload = max_payload
        self.server = TunnelServer(self.server_end, policy, auditor, grace=1.0, **server_options)
        self.client = TunnelClient(self.client_end, SERVER_DID, server_name, link_wait=link_wait)

    async def close(self) -> None:
        await self.client.close()
        await self.server.stop()
