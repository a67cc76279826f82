"""A headless Debian Chromium driven over the DevTools protocol (CDP) with ``websockets``.

Just enough CDP for tests: open a page in a fresh target, wait until it has
loaded, evaluate an async expression and return its value. The browser runs
with a fresh profile and no background traffic, and is killed at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import websockets

CHROMIUM = "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)


def available() -> bool:
    return shutil.which(CHROMIUM) is not None


class Page:
    """One CDP session attached to a page target."""

    def __init__(self, ws: Any, session: str) -> None:
        self.ws = ws
        self.session = session
        self._ids = itertools.count(1000)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        return await _call(self.ws, self._ids, method, params, self.session)

    async def evaluate(self, expression: str) -> Any:
        reply = await self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"page exception: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def loaded(self, ready: str) -> None:
        """Wait until ``ready`` (a JS expression) is true in the loaded page."""
        while not await self.evaluate(f"document.readyState === 'complete' && ({ready})"):
            await asyncio.sleep(0.05)


async def _call(
    ws: Any, ids: Any, method: str, params: dict[str, Any], session: str | None = None
) -> dict[str, Any]:
    request_id = next(ids)
    message: dict[str, Any] = {"id": request_id, "method": method, "params": params}
    if session is not None:
        message["sessionId"] = session
    await ws.send(json.dumps(message))
    while True:
        reply = json.loads(await ws.recv())
        if reply.get("id") == request_id:
            if "error" in reply:
                raise RuntimeError(f"CDP {method}: {reply['error']}")
            result: dict[str, Any] = reply["result"]
            return result


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Any]:
    """A running headless Chromium; yields a function that opens a URL as a :class:`Page`."""
    with tempfile.TemporaryDirectory(prefix="talos-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={profile}",
            "about:blank",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stderr is not None
            endpoint = ""
            while not endpoint:
                line = (await proc.stderr.readline()).decode("utf-8", "replace")
                if not line:
                    raise RuntimeError("chromium exited before its DevTools endpoint was ready")
                match = re.search(r"DevTools listening on (ws://\S+)", line)
                endpoint = match.group(1) if match else ""
            drain = asyncio.create_task(_drain(proc.stderr))
            async with websockets.connect(endpoint, max_size=None) as ws:
                ids = itertools.count(1)

                async def open_page(url: str) -> Page:
                    target = await _call(ws, ids, "Target.createTarget", {"url": url})
                    attached = await _call(
                        ws,
                        ids,
                        "Target.attachToTarget",
                        {"targetId": target["targetId"], "flatten": True},
                    )
                    return Page(ws, attached["sessionId"])

                yield open_page
            drain.cancel()
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass
