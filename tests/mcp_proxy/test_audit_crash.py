"""The batched audit (mcp_proxy/audit.py) through real processes: what a crash can and cannot lose.

``--audit group`` commits each batch without fsync within its linger (50 ms): a
SIGKILL of ``talos-proxy serve`` after that keeps every record, because a
committed LMDB transaction survives its process (docs/PROTOCOL.md "Storage
durability"); only a power loss reaches back to the last sync. A tool that
dies in the middle of a batch loses nothing either: its call is recorded as
``tool-exited`` beside the calls before and after it.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
from mcp.shared.exceptions import MCPError

from mcp_proxy.jsonrpc import INTERNAL_ERROR
from tests.mcp_proxy.e2e import ENV, EVERYTHING, PROXY, REPO, did_of, sdk_client, start_serve
from tests.mcp_proxy.sdk_callbacks import SDK_DEPRECATIONS_ALLOWED, text

pytestmark = SDK_DEPRECATIONS_ALLOWED

TIMEOUT = 90
CALLS = 12
# Far beyond the 50 ms linger of a group commit, even on a loaded machine.
SETTLE = 3.0


def audit_json(home: Path) -> list[dict[str, Any]]:
    """``talos-proxy audit --json`` on a stopped home: one object per record."""
    out = subprocess.run(
        [*PROXY, "audit", "--home", str(home), "--json"],
        capture_output=True,
        check=True,
        timeout=60,
        cwd=REPO,
        env=ENV,
    )
    return [orjson.loads(line) for line in out.stdout.splitlines()]


async def test_answered_calls_and_a_tool_crash_mid_batch_survive_sigkill_of_serve(
    tmp_path: Path,
) -> None:
    client_did = did_of(tmp_path / "c")
    serve_home = tmp_path / "s"
    async with asyncio.timeout(TIMEOUT):
        serve = await start_serve(serve_home, "127.0.0.1:0", ["--allow", client_did], EVERYTHING)
        try:
            async with sdk_client(tmp_path / "c", serve.address) as client:
                for i in range(CALLS // 2):
                    assert text(await client.call_tool("echo", {"text": f"a{i}"})) == f"a{i}"
                with pytest.raises(MCPError) as crashed:
                    await client.call_tool("crash", {"code": 3})
                assert crashed.value.code == INTERNAL_ERROR
                for i in range(CALLS // 2):
                    assert text(await client.call_tool("echo", {"text": f"b{i}"})) == f"b{i}"
                await asyncio.sleep(SETTLE)
                # No stop, no final flush, no seal: the process is killed mid-session.
                assert await serve.stop(signal.SIGKILL) == -signal.SIGKILL
        finally:
            await serve.stop()
    records = audit_json(serve_home)
    calls = [r for r in records if r["event"] == "call" and r["method"] == "tools/call"]
    echoes = [r for r in calls if r["tool"] == "echo"]
    assert len(echoes) == CALLS and all(r["outcome"] == "ok" for r in echoes)
    assert [r["outcome"] for r in calls if r["tool"] == "crash"] == ["tool-exited"]
    assert all(r["caller"] == client_did and len(r["params_hmac"]) == 64 for r in calls)
    exits = [r for r in records if r["event"] == "session" and r["method"] == "exit"]
    assert any("code 3" in r["detail"] for r in exits)
