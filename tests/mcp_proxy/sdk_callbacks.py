"""What the tests' MCP SDK clients answer when a tool asks them, and how they read results.

The tools ask for sampling, elicitation and roots (tests/tools/everything_server.py,
tests/tools/modern_server.py); these canned answers let a test check that the
question crossed the tunnel and the answer came back.
"""

from __future__ import annotations

from typing import Any

import pytest
from mcp.types import (
    CreateMessageResult,
    ElicitResult,
    ListRootsResult,
    Root,
    TextContent,
)

# Sampling, elicitation and logging are deprecated in the SDK's newest protocol but
# are what a handshake-era agent uses, and the tunnel must carry them: a module
# exercising them sets ``pytestmark = SDK_DEPRECATIONS_ALLOWED``.
SDK_DEPRECATIONS_ALLOWED = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning"),
]


async def sampling(_ctx: Any, params: Any) -> CreateMessageResult:
    """The "model" answers ``model saw <prompt>``."""
    prompt = params.messages[0].content.text
    return CreateMessageResult(
        role="assistant", content=TextContent(type="text", text=f"model saw {prompt}"), model="m"
    )


async def elicitation(_ctx: Any, _params: Any) -> ElicitResult:
    """The "user" accepts and gives the name ``ada``."""
    return ElicitResult(action="accept", content={"name": "ada"})


async def list_roots(_ctx: Any) -> ListRootsResult:
    """Two roots, file:///work/a and file:///work/b."""
    return ListRootsResult(roots=[Root(uri="file:///work/a"), Root(uri="file:///work/b")])


def text(result: Any) -> str:
    """The text of a tool result's first content block."""
    return str(result.content[0].text)
