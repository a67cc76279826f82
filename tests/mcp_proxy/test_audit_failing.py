"""While the serve side cannot write its audit log, no call runs or is answered unrecorded
(mcp_proxy/audit.py ``Auditor.failing``, mcp_proxy/strict_replies.py): a real block log
in a real LMDB store filled to its map size, a real tool process behind a loopback link."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson

from mcp_proxy.audit import AuditMode, Auditor, BlockLogSink
from mcp_proxy.jsonrpc import AUDIT_UNAVAILABLE
from mcp_proxy.policy import Policy
from talos.chain.log import BlockLog
from talos.store import Store
from talos_sdk.errors import StorageFullError
from talos_sdk.wallet import Wallet
from tests.mcp_proxy.loopback import CLIENT_DID, EVERYTHING, Agent, Pair
from tests.mcp_proxy.test_audit import sealed_commitments
from tests.talos.nodes import until

TIMEOUT = 60
NODE = Wallet.generate()


@contextlib.contextmanager
def full(store: Store) -> Iterator[None]:
    """The store full inside the block: junk rows to its map size, and a read snapshot
    held open so that LMDB cannot reuse the pages later commits free (without it, a
    small commit can go on recycling them). Junk and snapshot go at the end."""
    snapshot = store.env.begin()
    keys: list[bytes] = []
    try:
        for size in (32 * 1024, 1024, 16):
            with contextlib.suppress(StorageFullError):
                while True:
                    key = b"junk:%d" % len(keys)
                    with store.write() as txn:
                        txn.put("meta", key, bytes(size))
                    keys.append(key)
        yield
    finally:
        snapshot.abort()
        with store.write() as txn:
            for key in keys:
                txn.delete("meta", key)


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, mode: AuditMode) -> AsyncIterator[tuple[Store, Auditor, Agent]]:
    store = Store(tmp_path / "store", map_size=2 << 20)
    log = BlockLog(store, NODE)
    auditor = Auditor(BlockLogSink(log, NODE.did), mode=mode, commit_interval=0.01)
    await auditor.start()
    pair = Pair(Policy.build(allow=[CLIENT_DID], command=EVERYTHING), auditor=auditor)
    try:
        agent = Agent(pair.client)
        await agent.initialize()
        yield store, auditor, agent
    finally:
        await pair.close()
        await auditor.stop()
        store.close()


def text(reply: dict[str, Any]) -> str:
    return str(reply["result"]["content"][0]["text"])


def error_code(reply: dict[str, Any]) -> object:
    error = reply.get("error")
    return error.get("code") if isinstance(error, dict) else None


async def test_group_mode_refuses_calls_until_a_record_is_written_again(tmp_path: Path) -> None:
    async with serving(tmp_path, AuditMode.GROUP) as (store, auditor, agent):
        with full(store):
            # Group mode forwards a call before its record is written: this one runs, and
            # its batch fails to write.
            assert text(await agent.call("echo", text="first")) == "first"
            await until(lambda: auditor.failing is not None, TIMEOUT, "the failed write")
            # From now on no call reaches the tool: 'crash' would end the session if it ran.
            refused = await agent.request("tools/call", {"name": "crash", "arguments": {}})
            assert error_code(refused) == AUDIT_UNAVAILABLE
            assert "cannot write its audit log" in str(refused["error"])
            await until(lambda: auditor.failed_batches >= 2, TIMEOUT, "its record lost too")
        # Refused again (no write has succeeded since), but its record is written: the log
        # works again, and the next call runs.
        again = await agent.request("tools/call", {"name": "echo", "arguments": {"text": "x"}})
        assert error_code(again) == AUDIT_UNAVAILABLE
        await until(lambda: auditor.failing is None, TIMEOUT, "a record written again")
        assert text(await agent.call("echo", text="after")) == "after"
        await auditor.stop()  # writes what is queued
        outcomes = [(e["tool"], e["outcome"]) for e in sealed_commitments(BlockLog(store, NODE))]
        assert ("echo", "audit-failed") in outcomes and ("echo", "ok") in outcomes


async def test_strict_mode_withholds_the_result_of_a_call_it_could_not_record(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path, AuditMode.STRICT) as (store, auditor, agent):
        with full(store):
            reply = await agent.request("tools/call", {"name": "echo", "arguments": {"text": "x"}})
            assert error_code(reply) == AUDIT_UNAVAILABLE and "result" not in reply
        again = await agent.request("tools/call", {"name": "echo", "arguments": {"text": "y"}})
        assert error_code(again) == AUDIT_UNAVAILABLE  # refused; its record is the probe
        await until(lambda: auditor.failing is None, TIMEOUT, "a record written again")
        assert text(await agent.call("echo", text="z")) == "z"


async def test_group_mode_answers_the_tools_own_requests_while_it_cannot_record(
    tmp_path: Path,
) -> None:
    """The tool's requests (sampling here) fail closed too: an answer the caller gives while
    records fail is replaced by -32006, and a new request is answered -32006 at once."""
    async with serving(tmp_path, AuditMode.GROUP) as (store, auditor, agent):
        params = {"name": "sample", "arguments": {"prompt": "p", "times": 2}}
        rid, done = agent.start_request("tools/call", params)
        call = {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}
        await agent.send_raw(orjson.dumps(call))
        ask = await asyncio.wait_for(agent.inbox.get(), TIMEOUT)
        assert ask["method"] == "sampling/createMessage"
        with full(store):
            assert text(await agent.call("echo", text="runs")) == "runs"  # its batch fails
            await until(lambda: auditor.failing is not None, TIMEOUT, "the failed write")
            answer = {"role": "assistant", "content": {"type": "text", "text": "MODEL"}}
            result = {"jsonrpc": "2.0", "id": ask["id"], "result": {**answer, "model": "m"}}
            await agent.send_raw(orjson.dumps(result))
            reply = await asyncio.wait_for(done, TIMEOUT)
        # Neither ask reached the tool's model: the first answer was withheld, the second
        # ask never left the serving proxy.
        lines = text(reply).splitlines()
        assert len(lines) == 2 and "MODEL" not in text(reply), lines
        assert all(line.startswith("error:") and "audit log" in line for line in lines), lines
        assert agent.inbox.empty()
