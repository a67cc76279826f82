"""A real browser (headless Debian Chromium) using the HTTP front with fetch: CORS preflight and
calls succeed from an allowed origin and fail from another (both pages on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from mcp_proxy.http_front import HttpFront
from mcp_proxy.policy import Policy
from tests.mcp_proxy import browser
from tests.mcp_proxy.loopback import CLIENT_DID, Pair
from tests.mcp_proxy.test_http_eras import MODERN

TOKEN = "browser-token-0123456789"
TIMEOUT = 90

PAGE = """<!doctype html><meta charset="utf-8"><title>mcp page</title>
<script>
const META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
              "io.modelcontextprotocol/clientCapabilities": {}};
async function post(front, headers, body) {
  try {
    const r = await fetch(front, {method: "POST", body: JSON.stringify(body), headers: {
      "Authorization": "Bearer " + TOKEN, "Content-Type": "application/json",
      "Accept": "application/json, text/event-stream", ...headers}});
    return {status: r.status, session: r.headers.get("Mcp-Session-Id"), body: await r.json()};
  } catch (e) {
    return {error: String(e)};
  }
}
async function run(front) {
  const call = await post(front,
    {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": "add"},
    {jsonrpc: "2.0", id: 1, method: "tools/call",
     params: {name: "add", arguments: {a: 2, b: 3}, _meta: META}});
  const init = await post(front, {},
    {jsonrpc: "2.0", id: 2, method: "initialize", params: {protocolVersion: "2025-11-25",
     capabilities: {}, clientInfo: {name: "browser", version: "0"}}});
  return JSON.stringify({call, init});
}
</script>"""


@contextlib.asynccontextmanager
async def page_server() -> AsyncIterator[str]:
    """A page on its own 127.0.0.1 port (its own origin); yields the origin."""

    async def page(_request: web.Request) -> web.Response:
        script = f"const TOKEN = {json.dumps(TOKEN)};"
        html = PAGE.replace("<script>", "<script>" + script, 1)
        return web.Response(text=html, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.skipif(not browser.available(), reason="needs /usr/bin/chromium (.ci/run installs it)")
async def test_browser_fetch_from_allowed_and_other_origin() -> None:
    async with (
        asyncio.timeout(TIMEOUT),
        page_server() as allowed,
        page_server() as other,
    ):
        pair = Pair(Policy.build(allow=[CLIENT_DID], command=MODERN))
        front = HttpFront(pair.client, TOKEN, "127.0.0.1:0", allow_origins=[allowed])
        preflights: list[str] = []

        @web.middleware
        async def count(request: web.Request, handler: object) -> web.StreamResponse:
            if request.method == "OPTIONS":
                preflights.append(request.headers.get("Origin", ""))
            result: web.StreamResponse = await handler(request)  # type: ignore[operator]
            return result

        front.app.middlewares.insert(0, count)
        await front.start()
        try:
            async with browser.chromium() as open_page:
                good = await open_page(allowed + "/")
                await good.loaded("typeof run === 'function'")
                result = json.loads(await good.evaluate(f"run({json.dumps(front.url)})"))
                assert result["call"]["status"] == 200
                assert result["call"]["body"]["result"]["content"][0]["text"] == "5"
                # CORS exposes the session id to the page.
                assert result["init"]["status"] == 200 and result["init"]["session"]
                bad = await open_page(other + "/")
                await bad.loaded("typeof run === 'function'")
                refused = json.loads(await bad.evaluate(f"run({json.dumps(front.url)})"))
                assert "Failed to fetch" in refused["call"]["error"]
                assert "Failed to fetch" in refused["init"]["error"]
            # Both pages sent preflights; only the allowed one's calls reached the tool.
            assert allowed in preflights and other in preflights
            assert len(front.sessions) == 1 and len(front.pool) == 1
        finally:
            await front.stop()
            await pair.close()
