"""An MCP server for both protocol eras: sampling, elicitation and roots through resolvers.

Resolver-based tools (``Annotated[T, Resolve(fn)]``) ask the client in the way
the negotiated version allows: a 2026-07-28 request gets a multi-round-trip
result (``input_required`` with ``requestState``), a 2025-11-25 session gets
a server-to-client request mid-call. Also: echo, add, slow (progress), a
sized resource (res://big/N), a prompt, bump (changes res://counter and
notifies listen streams), logs (one log message). Run over stdio (``python -m
tests.tools.modern_server``) or Streamable HTTP on 127.0.0.1 (``--http``: it
binds a free port and prints ``listening on URL`` on stdout).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import warnings
from typing import Annotated

from mcp.server.mcpserver import Context, Elicit, ListRoots, MCPServer, Resolve, Sample
from mcp.types import CreateMessageResult, ListRootsResult, SamplingMessage, TextContent
from pydantic import BaseModel

warnings.simplefilter("ignore")

server = MCPServer("modern", version="1.0")


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
async def slow(steps: int, delay: float, ctx: Context) -> str:
    """Sleep ``steps`` times ``delay`` seconds, reporting progress after each step."""
    for i in range(steps):
        await asyncio.sleep(delay)
        await ctx.report_progress(i + 1, steps, f"step {i + 1}")
    return f"done {steps}"


_counter = {"n": 0}


@server.tool()
async def bump(ctx: Context) -> str:
    """Change res://counter and tell listen streams (2026-07-28) that it changed."""
    _counter["n"] += 1
    await ctx.notify_resource_updated("res://counter")
    return f"counter {_counter['n']}"


@server.resource("res://counter")
def counter() -> str:
    """A resource that bump changes."""
    return f"counter {_counter['n']}"


@server.tool()
async def logs(ctx: Context) -> str:
    """Send one info log message before answering (if the request asked for logs)."""
    await ctx.log("info", "a log line", logger_name="modern")
    return "logged"


def ask_model(prompt: str) -> Sample:
    return Sample(
        [SamplingMessage(role="user", content=TextContent(type="text", text=prompt))],
        max_tokens=32,
    )


@server.tool()
def sample(prompt: str, answer: Annotated[CreateMessageResult, Resolve(ask_model)]) -> str:
    """Ask the client's model and return its text."""
    content = answer.content
    return content.text if isinstance(content, TextContent) else str(content)


class Name(BaseModel):
    name: str


def ask_name(question: str) -> Elicit[Name]:
    return Elicit(question, Name)


@server.tool()
def elicit(question: str, who: Annotated[Name, Resolve(ask_name)]) -> str:
    """Ask the user for a name."""
    return f"hello {who.name}"


def ask_roots() -> ListRoots:
    return ListRoots()


@server.tool()
def roots(found: Annotated[ListRootsResult, Resolve(ask_roots)]) -> str:
    """List the client's roots."""
    return ",".join(str(root.uri) for root in found.roots)


@server.resource("res://big/{size}")
def big(size: str) -> str:
    """A resource of ``size`` bytes."""
    return "x" * int(size)


@server.prompt()
def review(code: str) -> str:
    """A prompt with one argument."""
    return f"Please review: {code}"


def serve_http() -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections queue until uvicorn serves: "listening" is true at once
    port = sock.getsockname()[1]
    app = server.streamable_http_app(host="127.0.0.1")
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    print(f"listening on http://127.0.0.1:{port}/mcp", flush=True)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    if "--http" in sys.argv[1:]:
        serve_http()
    else:
        server.run("stdio")
