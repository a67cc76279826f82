"""Two agents message each other through ``talosd mcp``, with the official MCP SDK client.

Shows (DESIGN.md "Agents on a node", docs/adr/0012-local-clients.md):

1. Two ``talosd run`` nodes on 127.0.0.1 that know each other by local names
   (``talosd peers add ADDR --name bob``).
2. Each agent launches ``talosd mcp --home H`` as its stdio MCP server, exactly
   what an agent's MCP config does; it attaches to the running node.
3. Bob's agent long-polls ``read_inbox``; alice's agent calls
   ``send_message(to="bob", ..., wait=true)`` and gets the acknowledgement.
4. Alice subscribes to ``talos://inbox`` and hears bob's reply arrive as
   ``notifications/resources/updated``; bob's agent speaks the stateless
   2026-07-28 revision, alice's the 2025-11-25 session protocol.

Runs in a temporary folder removed at the end.
Run: ``python examples/agents_mcp.py``
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters, types

TALOSD = str(Path(sys.executable).parent / "talosd")
TIMEOUT = 30.0


def talosd(*args: str) -> str:
    done = subprocess.run([TALOSD, *args], capture_output=True, text=True, timeout=TIMEOUT)
    if done.returncode != 0:
        raise SystemExit(f"talosd {args[0]} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def run_node(home: Path) -> tuple[subprocess.Popen[str], str]:
    talosd("init", "--home", str(home), "--no-passphrase")
    proc = subprocess.Popen(
        [TALOSD, "run", "--home", str(home), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    found = re.search(r"listening on (ws://\S+) did=(\S+)", proc.stdout.readline())
    if not found:
        proc.kill()
        raise SystemExit(f"node on {home} did not start")
    return proc, f"{found.group(1)}#{found.group(2)}"


def agent(home: Path, mode: str, **kwargs: Any) -> Client:
    """What an agent's MCP config says: command `talosd`, args `mcp --home H`."""
    return Client(
        StdioServerParameters(command=TALOSD, args=["mcp", "--home", str(home)]),
        mode=mode,
        **kwargs,
    )


def structured(result: types.CallToolResult) -> dict[str, Any]:
    if result.is_error:
        raise SystemExit(f"tool error: {result.content}")
    assert result.structured_content is not None
    return result.structured_content


async def converse(alice_home: Path, bob_home: Path) -> None:
    updated = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ResourceUpdatedNotification):
            print(f"alice: notifications/resources/updated {message.params.uri}")
            updated.set()

    async with (
        agent(alice_home, "legacy", message_handler=on_message) as alice,
        agent(bob_home, "2026-07-28") as bob,
    ):
        tools = sorted(t.name for t in (await alice.list_tools()).tools)
        print(f"alice's agent sees tools {tools}")
        poll = asyncio.ensure_future(bob.call_tool("read_inbox", {"wait_seconds": TIMEOUT}))
        sent = structured(
            await alice.call_tool(
                "send_message", {"to": "bob", "text": "hello bob, lunch at noon?", "wait": True}
            )
        )
        print(f"alice: send_message -> id {sent['id']} acked={sent['acked']}")
        inbox = structured(await poll)
        for m in inbox["messages"]:
            print(f"bob: read_inbox -> from {m['from_name']}: {m['text']!r}")
        with warnings.catch_warnings():  # resources/subscribe is the 2025-11-25 mechanism
            warnings.simplefilter("ignore")
            await alice.subscribe_resource("talos://inbox")
        await bob.call_tool("send_message", {"to": "alice", "text": "yes, see you there"})
        async with asyncio.timeout(TIMEOUT):
            await updated.wait()
        got = await alice.read_resource("talos://inbox")
        text = got.contents[0].text  # type: ignore[union-attr]
        print(f"alice: talos://inbox -> {[m['text'] for m in json.loads(text)['messages']]}")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="talos-agents-") as tmp:
        alice_home, bob_home = Path(tmp) / "alice", Path(tmp) / "bob"
        alice, alice_addr = run_node(alice_home)
        bob, bob_addr = run_node(bob_home)
        try:
            talosd("peers", "add", bob_addr, "--name", "bob", "--home", str(alice_home))
            talosd("peers", "add", alice_addr, "--name", "alice", "--home", str(bob_home))
            asyncio.run(converse(alice_home, bob_home))
        finally:
            for proc in (alice, bob):
                proc.send_signal(signal.SIGTERM)
                proc.wait(TIMEOUT)
                if proc.stdout is not None:
                    proc.stdout.close()
    print("Done: nodes stopped cleanly")


if __name__ == "__main__":
    main()
