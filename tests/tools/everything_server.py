"""A stdio MCP server exercising every feature the tunnel must carry.

Tools (echo, add, slow with progress, crash, sample, elicit, log, change_tools,
pid), a static resource, a template and a sized one (res://big/N), a prompt. Run: ``python -m
tests.tools.everything_server`` or ``python tests/tools/everything_server.py``.
"""

from __future__ import annotations

import asyncio
import os
import warnings

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import SamplingMessage, TextContent
from pydantic import BaseModel

# Sampling / logging are "deprecated" in the newest protocol but still part of the
# handshake-era protocol the tunnel must forward; the warnings are noise here.
warnings.simplefilter("ignore")

server = MCPServer("everything", version="1.0")


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def pid() -> int:
    """The tool process id (tests check that a session gets a fresh process)."""
    return os.getpid()


@server.tool()
async def slow(steps: int, delay: float, ctx: Context) -> str:
    """Sleep ``steps`` times ``delay`` seconds, reporting progress after each step."""
    for i in range(steps):
        await asyncio.sleep(delay)
        await ctx.report_progress(i + 1, steps, f"step {i + 1}")
    return f"done {steps}"


@server.tool()
def crash(code: int = 3) -> str:
    """Exit the process at once, mid-request."""
    os._exit(code)


async def _ask_model(prompt: str, ctx: Context) -> str:
    result = await ctx.session.create_message(
        [SamplingMessage(role="user", content=TextContent(type="text", text=prompt))],
        max_tokens=32,
        related_request_id=ctx.request_id,
    )
    content = result.content
    return content.text if isinstance(content, TextContent) else str(content)


@server.tool()
async def sample(prompt: str, ctx: Context, times: int = 1) -> str:
    """Ask the client's model (sampling/createMessage) and return its text. With
    ``times`` > 1, ask that many times in turn, whatever each answer, and return
    every answer or error, one per line."""
    if times == 1:
        return await _ask_model(prompt, ctx)
    answers = []
    for _ in range(times):
        try:
            answers.append(await _ask_model(prompt, ctx))
        except Exception as exc:  # the next ask goes on whatever this one met
            answers.append(f"error: {exc}")
    return "\n".join(answers)


class Answer(BaseModel):
    name: str


@server.tool()
async def elicit(question: str, ctx: Context) -> str:
    """Ask the user (elicitation/create) for a name."""
    result = await ctx.elicit(question, Answer)
    if result.action == "accept":
        return f"hello {result.data.name}"
    return result.action


@server.tool()
async def log(message: str, ctx: Context) -> str:
    """Send a notifications/message log entry before answering."""
    await ctx.log("info", message, logger_name="everything")
    return "logged"


@server.tool()
async def change_tools(ctx: Context) -> str:
    """Emit notifications/tools/list_changed."""
    await ctx.session.send_tool_list_changed()
    return "changed"


@server.resource("res://greeting")
def greeting() -> str:
    """A static text resource."""
    return "hello from a resource"


@server.resource("res://item/{key}")
def item(key: str) -> str:
    """A templated resource."""
    return f"item {key}"


@server.resource("res://big/{size}")
def big(size: str) -> str:
    """A resource of ``size`` bytes (tests of messages larger than one link frame)."""
    return "x" * int(size)


@server.prompt()
def review(code: str) -> str:
    """A prompt with one argument."""
    return f"Please review: {code}"


if __name__ == "__main__":
    server.run("stdio")
