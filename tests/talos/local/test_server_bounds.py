"""Bounds of the node's local socket (talos/local/server.py) that clients and strangers
must not get round: unread events, a frame cut by the node's own pause, a channel's key
layout, files a client offers. Real nodes, sockets and LMDB."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest

from talos.local import conn as local_conn
from talos.local import log_ops, wire
from talos.local.call import LocalUsageError
from talos.local.client import LocalClient
from talos.local.server import SOCKET_NAME
from talos.store import Txn
from tests.talos.nodes import link, make_home, until

from .running import pair, raw_client, started

#: Seconds each test may take; each stops by itself well before.
LIMIT = 60


async def test_a_watcher_that_reads_nothing_keeps_the_latest_event_per_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Link events are caused by anyone who dials the node (a refused handshake is one).
    # A watching client that reads nothing (a paused attached proxy does so on purpose)
    # had them buffered without bound; it is not cut off, its buffer does not grow, and
    # once it reads it gets the latest event of each of the last MAX_HELD_EVENTS links.
    monkeypatch.setattr(local_conn, "MAX_HELD_EVENTS", 16)
    a = await started(*make_home(tmp_path, "a"))
    try:
        local = a.daemon.local
        assert local is not None
        hello = wire.encode_json(wire.Kind.CALL, {"id": 0, "op": "hello", "args": {"watch": True}})
        calls = wire.encode_json(wire.Kind.CALL, {"id": 1, "op": "id", "args": {}}) * 100_000
        async with asyncio.timeout(LIMIT):
            # ~20 MB of replies it does not read yet
            reader, writer, conn = await raw_client(a, hello + calls)
            await until(lambda: conn.drained is not None, 10, "its replies piling up")
            size = conn.transport.get_write_buffer_size()
            dids = [f"did:example:stranger{i}" for i in range(5_000)]
            for did in dids:
                local._on_link(did, False)
            assert conn in local.conns and conn.transport.get_write_buffer_size() == size
            frames, seen = wire.FrameReader(), []
            while len(seen) < 16:
                data = await reader.read(1 << 20)
                assert data, "the node closed the connection"
                seen += [
                    f.body["did"]
                    for f in frames.feed(data)
                    if f.kind is wire.Kind.EVENT and f.body.get("event") == "link"
                ]
        assert seen == dids[-16:]
        writer.transport.abort()  # ~20 MB of replies still unread
        await writer.wait_closed()
    finally:
        await a.stop()


@pytest.mark.parametrize("stall", ["replies unread", "trickled"])
async def test_a_half_sent_frame_is_cut_whatever_its_client_does_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stall: str
) -> None:
    # Only the node's own holds stop the partial-frame timer, and it runs from the
    # frame's first byte: a client could otherwise keep a frame (up to MAX_FRAME) half
    # sent for ever by leaving its replies unread, or by sending a byte now and then.
    monkeypatch.setattr(local_conn, "PARTIAL_FRAME_TIMEOUT", 0.5)
    a = await started(*make_home(tmp_path, "a"))
    try:
        local = a.daemon.local
        assert local is not None
        frame = wire.encode_json(wire.Kind.CALL, {"id": 7, "op": "id", "args": {"pad": "x" * 64}})
        async with asyncio.timeout(LIMIT):
            _, writer, conn = await raw_client(a, frame[:5])
            if stall == "replies unread":
                await until(lambda: conn._partial is not None, 10, "the frame timed")
                conn._hold("replies")  # what the transport does once its replies pile up
            else:
                for i in range(5, 45):  # 40 bytes, one each 0.1 s: 8 timeouts' worth
                    if conn not in local.conns:
                        break
                    writer.write(frame[i : i + 1])
                    await asyncio.sleep(0.1)
            await until(lambda: conn not in local.conns, 10, "the connection cut")
        writer.close()
        await writer.wait_closed()
    finally:
        await a.stop()


async def test_a_frame_cut_by_the_nodes_own_pause_is_not_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node stops reading a client with MAX_PENDING_CALLS in progress; the rest of a
    # frame that pause cut waits unread in the kernel, which is not the client's delay.
    monkeypatch.setattr(local_conn, "PARTIAL_FRAME_TIMEOUT", 0.5)
    monkeypatch.setattr(local_conn, "MAX_PENDING_CALLS", 4)
    a, b = await pair(tmp_path)
    try:
        await link(a.node, b.node)
        reader, writer = await asyncio.open_unix_connection(str(a.home.path / SOCKET_NAME))
        polls = b"".join(
            wire.encode_json(
                wire.Kind.CALL, {"id": i, "op": "inbox", "args": {"after": 0, "wait": 30}}
            )
            for i in range(4)
        )
        last = wire.encode_json(wire.Kind.CALL, {"id": 9, "op": "id", "args": {}})
        writer.write(polls + last[:5])
        await asyncio.sleep(1.5)  # three timeouts' worth while the node holds the client
        writer.write(last[5:])
        await b.send_message(a.did, "wakes the long-polls", wait=True)
        frames, ids = wire.FrameReader(), set()
        async with asyncio.timeout(LIMIT):
            while 9 not in ids:
                data = await reader.read(1 << 16)
                assert data, "the node cut the connection"
                ids |= {f.body["id"] for f in frames.feed(data) if f.kind is wire.Kind.REPLY}
        assert ids == {0, 1, 2, 3, 9}
        writer.close()
    finally:
        await a.stop()
        await b.stop()


async def test_a_channels_key_layout_goes_with_its_last_keyed_claim(tmp_path: Path) -> None:
    a, b = await pair(tmp_path)
    try:
        async with asyncio.timeout(LIMIT):
            first = await LocalClient.connect(a.home.path)
            await first.call("app.claim", channel="t", peer=b.did, key_offset=7)
            await first.close()
            local = a.daemon.local
            assert local is not None
            await until(lambda: not local.conns, 10, "the claimer gone")
            later = await LocalClient.connect(a.home.path)
            claim = await later.call("app.claim", channel="t", peer=b.did, key_offset=2)
            assert claim["hi"] > claim["lo"]
            await later.close()
    finally:
        await a.stop()
        await b.stop()


async def test_a_file_offer_that_could_never_be_sent_stores_nothing(tmp_path: Path) -> None:
    a, b = await pair(tmp_path)
    try:
        src = tmp_path / "data.bin"
        src.write_bytes(b"x" * 100)
        async with asyncio.timeout(LIMIT):
            client = await LocalClient.connect(a.home.path)
            cases = [
                ({"to": b.did, "path": str(src), "name": 7}, "'name'"),
                ({"to": b.did, "path": str(src), "name": ""}, "'name'"),
                ({"to": a.did, "path": str(src)}, "to itself"),
            ]
            for args, expected in cases:
                with pytest.raises(LocalUsageError, match=expected):
                    await client.call("files.send", **args)
            assert await client.call("files.list") == []
            await client.close()
    finally:
        await a.stop()
        await b.stop()


async def test_log_records_looks_at_a_bounded_number_per_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scan for one kind runs on the node's loop: a kind that is rare among many
    # records held it for seconds. Now a page ends after MAX_SCAN records, perhaps
    # empty, and the reader goes on from its "next".
    monkeypatch.setattr(log_ops, "MAX_SCAN", 4)
    a = await started(*make_home(tmp_path, "a"))
    try:
        async with asyncio.timeout(LIMIT):
            client = await LocalClient.connect(a.home.path)
            rec = {"recipient": a.did, "commitment": base64.b64encode(b"{}").decode(),
                   "timestamp_ms": 5}  # fmt: skip
            await client.call("log.append", kind="other", records=[rec] * 10)
            await client.call("log.append", kind="app", records=[rec] * 3)
            await client.call("log.append", kind="other", records=[rec] * 10, durable=True)
            sizes, ids, after = [], set(), None
            while True:
                page = await client.call("log.records", kind="app", after=after)
                sizes.append(len(page["records"]))
                ids |= {r["record_id"] for r in page["records"]}
                if page["next"] is None:
                    break
                after = page["next"]
            assert len(ids) == 3
            assert 0 in sizes[:-1]  # a page of nothing that still said where to go on
            await client.close()
    finally:
        await a.stop()


async def test_log_records_names_a_record_that_does_not_decode_and_goes_on(
    tmp_path: Path,
) -> None:
    # A damaged or edited pending row ended every log.records call with an error, so
    # talos-proxy audit of an attached serve showed nothing at all.
    a = await started(*make_home(tmp_path, "a", seal_interval=600))  # the rows stay pending
    try:
        async with asyncio.timeout(LIMIT):
            client = await LocalClient.connect(a.home.path)
            rec = {"recipient": a.did, "commitment": base64.b64encode(b"{}").decode(),
                   "timestamp_ms": 5}  # fmt: skip
            await client.call("log.append", kind="app", records=[rec] * 3, durable=True)

            def damage(txn: Txn) -> bytes:
                key, _ = list(txn.items("pending"))[1]
                txn.put("pending", key, b"\x00\x01")
                return key

            key = await a.node.writer.write(damage)
            page = await client.call("log.records", kind="app")
            assert len(page["records"]) == 2
            assert [(u["height"], u["key"]) for u in page["unreadable"]] == [(None, key.hex())]
            await client.close()
    finally:
        await a.stop()


async def test_a_call_its_caller_gave_up_ends_at_the_node(tmp_path: Path) -> None:
    # An agent cancelled its long-polls (an MCP client's notifications/cancelled): the
    # node ran each on for its whole wait, and past MAX_PENDING_CALLS stopped reading
    # the connection that carries the agent's other calls and its events.
    a, b = await pair(tmp_path)
    try:
        await link(a.node, b.node)
        local = a.daemon.local
        assert local is not None
        async with asyncio.timeout(LIMIT):
            client = await LocalClient.connect(a.home.path)
            (conn,) = local.conns
            polls = [
                asyncio.ensure_future(client.call("inbox", after=2**63, wait=300)) for _ in range(5)
            ]
            await until(lambda: len(conn.tasks) == 5, 10, "the long-polls running")
            for poll in polls:
                poll.cancel()
            await until(lambda: not conn.tasks and not conn._by_id, 10, "the polls ended")
            # The connection serves on, and a call nobody cancelled is answered.
            assert (await client.call("id"))["did"] == a.did
            waiting = asyncio.ensure_future(client.call("inbox", after=0, wait=30))
            await b.send_message(a.did, "after the cancels", wait=True)
            assert [m["text"] for m in (await waiting)["messages"]] == ["after the cancels"]
            await client.close()
    finally:
        await a.stop()
        await b.stop()
