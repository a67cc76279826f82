"""The node's local socket (talos/local/server.py) with real nodes, sockets and processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from talos import pipeline as pl
from talos.local import conn as local_conn
from talos.local import wire
from talos.local.call import LocalUsageError, NodeGoneError, NoNodeError, call
from talos.local.client import LocalClient
from talos.local.peercred import peer_allowed, peer_uid
from talos.local.server import SOCKET_NAME
from tests.talos.nodes import addr, link, make_home, until

from .running import Running, raw_client, started
from .running import pair as _pair


async def test_socket_is_owner_only_in_an_owner_only_home(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    try:
        sock = a.home.path / SOCKET_NAME
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(a.home.path).st_mode) == 0o700
        assert a.home.read_node_info()["socket"] == str(sock)  # type: ignore[index]
    finally:
        await a.stop()
    assert not (a.home.path / SOCKET_NAME).exists()


def test_peer_credential_rule() -> None:
    assert peer_allowed(os.getuid(), os.getuid())
    assert not peer_allowed(os.getuid() + 1, os.getuid())
    assert not peer_allowed(None, os.getuid())
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        assert peer_uid(left) == os.getuid()


async def test_other_user_cannot_open_the_socket() -> None:
    if os.getuid() != 0:
        pytest.skip("switching to another uid needs root")
    # Outside pytest's 0700 tmp root, so the home's own mode is what stops a stranger.
    root = Path(tempfile.mkdtemp(prefix="talos-uid-"))
    os.chmod(root, 0o755)
    a = await started(*make_home(root, "a"))
    try:
        path = str(a.home.path / SOCKET_NAME)
        # nobody (65534): the 0700 home and 0600 socket refuse it before any byte is read.
        code = (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1])\n"
            "except PermissionError:\n    sys.exit(13)\n"
            "sys.exit(0)\n"
        )
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, path)
        assert await proc.wait() == 13
        # With the modes loosened, the peer-credential check still refuses the stranger.
        os.chmod(a.home.path, 0o755)
        os.chmod(path, 0o666)
        code = (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "data = s.recv(4096)\n"
            "sys.exit(0 if b'refused' in data and b'another user' in data else 1)\n"
        )
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, path)
        assert await proc.wait() == 0
        assert "local_clients_refused 1" in a.metrics.render()
        # ... and the node serves its owner as before.
        assert (await asyncio.to_thread(call, a.home.path, "id"))["did"] == a.did
    finally:
        os.chmod(a.home.path, 0o700)
        await a.stop()
        shutil.rmtree(root)


async def test_names_send_long_poll_and_bad_input(tmp_path: Path) -> None:
    a, b = await _pair(tmp_path)
    try:
        ca = await LocalClient.connect(a.home.path)
        cb = await LocalClient.connect(b.home.path)
        added = await ca.call("peers.add", addr=addr(b.node), name="bob")
        assert added["did"] == b.did and added["name"] == "bob"
        await a.wait_connected(b.did, 10)
        poll = asyncio.ensure_future(cb.call("inbox", wait=30))
        sent = await ca.call("send", to="bob", text="hi bob", wait=True)
        assert sent["acked"] and sent["to"] == b.did
        got = await poll
        assert [m["text"] for m in got["messages"]] == ["hi bob"]
        assert got["messages"][0]["id"] == sent["id"]
        # read cursor: read_inbox without `after` starts after what was marked read
        n = got["messages"][0]["n"]
        assert (await cb.call("inbox.mark_read", through=n))["read"] == n
        assert (await cb.call("inbox"))["messages"] == []
        assert len((await cb.call("inbox", after=0))["messages"]) == 1
        # bad input: each a clear error, the node keeps running
        with pytest.raises(LocalUsageError, match="unknown peer name 'carol'"):
            await ca.call("send", to="carol", text="x")
        with pytest.raises(LocalUsageError, match=r"multicodec|base58|did"):
            await ca.call("send", to="did:key:z1111", text="x")
        with pytest.raises(LocalUsageError, match="above the"):
            await ca.call("send", to="bob", text="x" * (2 << 20))
        with pytest.raises(LocalUsageError, match="unknown local op"):
            await ca.call("no.such.op")
        with pytest.raises(LocalUsageError, match="peer name must be"):
            await ca.call("peers.name", peer=b.did, name="has space")
        # names are local: B never heard "bob"
        with pytest.raises(LocalUsageError, match="unknown peer name 'bob'"):
            await cb.call("resolve", peer="bob")
        assert (await ca.call("send", to=b.did, text="still up"))["acked"] is False
        await ca.close()
        await cb.close()
    finally:
        await a.stop()
        await b.stop()


async def test_an_inbox_page_above_one_local_frame_comes_in_parts(tmp_path: Path) -> None:
    # Control characters grow sixfold in JSON: six of the largest such messages are a
    # reply above the 32 MiB local frame. It stops early and says where to go on, where
    # the node used to send no reply at all (the caller waited for good).
    a, b = await _pair(tmp_path)
    try:
        await link(a.node, b.node)
        text = "\x01" * pl.text_limit(a.config.max_frame)
        for _ in range(6):
            await a.send_message(b.did, text, wait=True)
        cb = await LocalClient.connect(b.home.path)
        pages, after = [], 0
        while page := (await asyncio.wait_for(cb.call("inbox", after=after), 30))["messages"]:
            pages.append(len(page))
            after = page[-1]["n"]
            assert all(m["text"] == text for m in page)
        assert sum(pages) == 6 and len(pages) > 1, pages
        assert (await cb.call("inbox", after=2**64 - 1))["messages"] == []  # the largest n
        await cb.close()
    finally:
        await a.stop()
        await b.stop()


async def test_a_client_that_reads_no_replies_costs_the_node_bounded_memory(
    tmp_path: Path,
) -> None:
    # 100,000 calls whose replies (~20 MB) nobody reads: the node stops reading the
    # client once a megabyte of replies waits, keeps serving others, and answers every
    # call once the client reads. Before, it read on and buffered every reply.
    a = await started(*make_home(tmp_path, "a"))
    try:
        calls = 100_000
        reader, writer, conn = await _unread_calls(a, {"op": "id", "args": {}}, calls)
        await until(lambda: conn.transport.is_reading() is False, 10, "the node stops reading")
        await asyncio.sleep(0.3)
        assert conn.transport.get_write_buffer_size() < 4 << 20
        other = await LocalClient.connect(a.home.path)
        assert (await other.call("id"))["did"] == a.did
        await other.close()
        await _read_replies(reader, calls)
        writer.close()
    finally:
        await a.stop()


async def _unread_calls(
    node: Running, body: dict[str, object], times: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
    """A raw client that sends the CALL ``body`` ``times`` times at once and reads nothing
    yet; with the node's connection object for it."""
    return await raw_client(node, wire.encode_json(wire.Kind.CALL, {"id": 1, **body}) * times)


async def _read_replies(reader: asyncio.StreamReader, count: int) -> None:
    """Read until ``count`` REPLY frames came (the node must not close the connection)."""
    frames, answered = wire.FrameReader(), 0
    while answered < count:
        data = await asyncio.wait_for(reader.read(1 << 20), 30)
        assert data, "the node closed the connection"
        answered += sum(f.kind is wire.Kind.REPLY for f in frames.feed(data))


async def test_calls_read_before_the_client_stopped_reading_wait_for_it(tmp_path: Path) -> None:
    # 30 inbox calls of 8 MB replies each, sent at once (a few hundred bytes) and never
    # read: they run one after another as the client reads, not all at once (240 MB).
    a, b = await _pair(tmp_path)
    try:
        await link(a.node, b.node)
        for _ in range(40):
            await a.send_message(b.did, "x" * 200_000, wait=True)
        ask = {"op": "inbox", "args": {"after": 0, "limit": 1000}}
        reader, writer, conn = await _unread_calls(b, ask, 30)
        await asyncio.sleep(1.0)
        assert conn.transport.get_write_buffer_size() < 20 << 20
        await _read_replies(reader, 30)
        writer.close()
    finally:
        await a.stop()
        await b.stop()


async def test_a_frame_left_unfinished_ends_its_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client may sit idle for good, or send a frame in pieces; one that stops in the
    # middle of a frame is cut off, and what it had sent of it is freed.
    monkeypatch.setattr(local_conn, "PARTIAL_FRAME_TIMEOUT", 0.5)
    a = await started(*make_home(tmp_path, "a"))
    try:
        path = str(a.home.path / SOCKET_NAME)
        frame = wire.encode_json(wire.Kind.CALL, {"id": 7, "op": "id", "args": {}})
        idle_r, idle_w = await asyncio.open_unix_connection(path)
        slow_r, slow_w = await asyncio.open_unix_connection(path)
        stuck_r, stuck_w = await asyncio.open_unix_connection(path)
        slow_w.write(frame[:5])
        stuck_w.write(frame[:5])
        await asyncio.sleep(0.3)
        slow_w.write(frame[5:])  # the rest in time: answered
        assert await asyncio.wait_for(stuck_r.read(), 10) == b""  # the node closed it
        await asyncio.sleep(0.5)
        for reader, writer in ((slow_r, slow_w), (idle_r, idle_w)):
            if writer is idle_w:
                writer.write(frame)
            got = wire.FrameReader().feed(await asyncio.wait_for(reader.read(1 << 16), 10))
            assert got[0].kind is wire.Kind.REPLY and got[0].body["id"] == 7
        for writer in (idle_w, slow_w, stuck_w):
            writer.close()
    finally:
        await a.stop()


async def test_four_hundred_clients_connecting_at_once_are_all_served(tmp_path: Path) -> None:
    # asyncio's default listen backlog (100) turned most of them away with EAGAIN.
    a = await started(*make_home(tmp_path, "a"))
    try:

        async def one() -> str:
            client = await LocalClient.connect(a.home.path)
            try:
                return str((await client.call("id"))["did"])
            finally:
                await client.close()

        dids = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(400))), 60)
        assert set(dids) == {a.did}
    finally:
        await a.stop()


async def test_a_full_listen_queue_is_waited_out_then_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A listener that accepts nothing, its queue full: connects get EAGAIN. Both clients
    # retry for BUSY_RETRY and then say so; asyncio's own connect took EAGAIN for "in
    # progress" and handed back a socket that had never connected.
    from talos.local import call as call_module
    from talos.local import client as client_module

    for module in (call_module, client_module):
        monkeypatch.setattr(module, "BUSY_RETRY", 0.5)
    home = tmp_path / "busy"
    home.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(home / SOCKET_NAME))
    listener.listen(1)
    queued = []
    while len(queued) < 16:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(home / SOCKET_NAME))
        except BlockingIOError:
            s.close()
            break
        queued.append(s)
    try:
        with pytest.raises(NoNodeError, match="queue stayed full"):
            call(home, "id", timeout=5)
        with pytest.raises(NoNodeError, match="queue stayed full"):
            await LocalClient.connect(home)

        async def take_them() -> None:  # the queue frees up: the next try connects
            await asyncio.sleep(0.2)
            listener.setblocking(False)
            while True:  # each connection taken is closed at once
                with contextlib.suppress(BlockingIOError):
                    listener.accept()[0].close()
                await asyncio.sleep(0.01)

        freeing = asyncio.ensure_future(take_them())
        with pytest.raises(NodeGoneError):  # connected; this listener answers nothing
            await asyncio.wait_for(LocalClient.connect(home), 10)
        freeing.cancel()
    finally:
        for s in queued:
            s.close()
        listener.close()


async def test_a_claimer_that_stops_reading_does_not_stall_the_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What arrives on a claimed app channel is handed to the claimer in link order, so the
    # link's read loop waits while the claimer's buffer is full. A claimer that stops
    # reading is disconnected after APP_STALL_LIMIT; the peer's messages flow again.
    monkeypatch.setattr(local_conn, "APP_STALL_LIMIT", 1.0)
    a, b = await _pair(tmp_path)
    flood: asyncio.Task[None] | None = None
    try:
        await link(a.node, b.node)
        reader, writer = await asyncio.open_unix_connection(str(a.home.path / SOCKET_NAME))
        claim = {"id": 1, "op": "app.claim", "args": {"channel": "t", "peer": b.did}}
        writer.write(wire.encode_json(wire.Kind.CALL, claim))
        frames = wire.FrameReader()
        while not any(f.kind is wire.Kind.REPLY for f in frames.feed(await reader.read(4096))):
            pass  # the claim is in; from here on this client reads nothing

        async def send_apps() -> None:
            for _ in range(100):
                await b.send_app(a.did, "t", b"\x00" * 60_000)

        flood = asyncio.ensure_future(send_apps())
        await until(lambda: a.metrics.counters.get("app_frames_in", 0) >= 5, 10, "frames in")
        await asyncio.wait_for(b.send_message(a.did, "through", wait=True), 20)
        assert a.metrics.counters.get("local_clients_too_slow") == 1
        await asyncio.wait_for(flood, 20)
        while await asyncio.wait_for(reader.read(1 << 20), 10):
            pass  # the node closed it: what was buffered, then the end
        writer.close()
    finally:
        if flood is not None:
            flood.cancel()
        await a.stop()
        await b.stop()


async def test_client_gone_mid_long_poll_loses_nothing(tmp_path: Path) -> None:
    a, b = await _pair(tmp_path)
    try:
        await a.add_peer(addr(b.node))
        await a.wait_connected(b.did, 10)
        cb = await LocalClient.connect(b.home.path)
        poll = asyncio.ensure_future(cb.call("inbox", wait=60))
        await asyncio.sleep(0.05)
        await cb.close()  # the agent went away while its long-poll was parked
        with pytest.raises(NodeGoneError):
            await poll
        await a.send_message(b.did, "after the disconnect", wait=True)
        again = await LocalClient.connect(b.home.path)
        got = await again.call("inbox")
        assert [m["text"] for m in got["messages"]] == ["after the disconnect"]
        await again.close()
    finally:
        await a.stop()
        await b.stop()


async def test_client_gone_mid_send_wait_syncs_the_row(tmp_path: Path) -> None:
    # The socket's send runs on callbacks, not a task (talos/node_send.py): a client
    # that leaves while its send --wait is unacked still gets the row synced, as a
    # timeout does, and the other calls on the socket go on meanwhile.
    a, b = await _pair(tmp_path)
    try:
        await a.add_peer(addr(b.node))
        await a.wait_connected(b.did, 10)
        await b.stop()  # no ack will come
        order: list[str] = []
        a.writer.before("outbox", lambda kind, size: order.append(kind))
        a.writer.before("sync", lambda kind, size: order.append(kind))
        client = await LocalClient.connect(a.home.path)
        pending = [
            asyncio.ensure_future(client.call("send", to=b.did, text=f"left {i}", wait=True))
            for i in range(3)
        ]
        await until(lambda: "outbox" in order, what="the outbox commit")
        assert (await client.call("status"))["did"] == a.did  # the socket still answers
        assert not any(p.done() for p in pending)
        await client.close()
        for p in pending:
            with pytest.raises(NodeGoneError):
                await p
        await until(lambda: "sync" in order, timeout=30, what="the sync after the client left")
        assert order.index("sync") > order.index("outbox")
        with a.store.read() as txn:
            texts = [r.text for r in pl.iter_outbox(txn, b.did)]
        assert texts == ["left 0", "left 1", "left 2"]
    finally:
        await a.stop()
        await b.stop()


async def test_send_bad_input_through_the_socket_queues_nothing(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    try:
        client = await LocalClient.connect(a.home.path)
        for args, match in [
            ({"text": "x"}, "'to' must be"),
            ({"to": a.did, "text": "x"}, "this node itself"),
            ({"to": a.did, "text": 5}, "'text' must be a string"),
            ({"to": "nobody", "text": "x"}, "unknown peer name"),
            ({"to": a.did, "text": "x", "wait": True, "timeout": -1}, "'timeout' must be"),
        ]:
            with pytest.raises(LocalUsageError, match=match):
                await client.call("send", **args)
        with a.store.read() as txn:
            assert list(txn.items("outbox")) == []
        await client.close()
    finally:
        await a.stop()


async def test_stopping_node_tells_attached_clients(tmp_path: Path) -> None:
    a = await started(*make_home(tmp_path, "a"))
    client = await LocalClient.connect(a.home.path, watch=True)
    events: list[dict[str, object]] = []
    client.on_event(events.append)
    poll = asyncio.ensure_future(client.call("inbox", wait=60))
    await a.stop()
    with pytest.raises(NodeGoneError, match="stopped"):
        await poll
    assert "shutting down" in await client.gone
    await until(lambda: any(e.get("event") == "stopping" for e in events), what="stop event")
    with pytest.raises(NoNodeError):
        await LocalClient.connect(a.home.path)
    with pytest.raises(NoNodeError):
        await asyncio.to_thread(call, a.home.path, "status")


async def test_hello_lists_a_peer_that_dialled_in(tmp_path: Path) -> None:
    """An attached proxy learns of every ready link, not only of peers with an address."""
    a, b = await _pair(tmp_path)
    try:
        await link(a.node, b.node)  # A dials; B has no address for A
        client = await LocalClient.connect(b.home.path, watch=True)
        try:
            assert client.hello["up"] == [a.did] and a.did in client.hello["max_payload"]
        finally:
            await client.close()
    finally:
        await a.stop()
        await b.stop()


def test_cli_names_work_where_dids_do(tmp_path: Path) -> None:
    from tests.talos.daemons import talosd

    home, other = tmp_path / "h", tmp_path / "o"
    for h in (home, other):
        assert talosd("init", "--home", str(h), "--no-passphrase").returncode == 0
    other_did = talosd("id", "--home", str(other)).stdout.strip()
    bob = f"ws://127.0.0.1:9#{other_did}"
    res = talosd("peers", "add", bob, "--name", "bob", "--home", str(home))
    assert res.returncode == 0, res.stderr
    listing = talosd("peers", "list", "--home", str(home)).stdout
    assert f"{other_did} (bob)" in listing
    assert talosd("send", "bob", "queued for bob", "--home", str(home)).returncode == 0
    res = talosd("send", "carol", "x", "--home", str(home))
    assert res.returncode == 2 and "unknown peer name 'carol'" in res.stderr
    res = talosd("peers", "name", other_did, "robert", "--home", str(home))
    assert res.returncode == 0, res.stderr
    assert f"{other_did} (robert)" in talosd("peers", "list", "--home", str(home)).stdout
    res = talosd("send", "did:key:zBAD", "x", "--home", str(home))
    assert res.returncode == 2 and "multicodec" in res.stderr


def test_client_commands_do_not_import_the_node() -> None:
    code = (
        "import sys, talos.cli\n"
        "heavy = [m for m in ('aiohttp', 'pydantic', 'talos.node', 'lmdb') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_keyed_ranges_of_the_two_ends_of_a_link_never_overlap() -> None:
    from talos.local.server import KEY_RANGE, key_half

    low, high = "did:key:zA", "did:key:zB"
    first_a, end_a = key_half(low, high)
    first_b, end_b = key_half(high, low)
    assert first_a * KEY_RANGE == KEY_RANGE  # range 0 stays for embedded callers
    assert end_a == first_b and end_b * KEY_RANGE == 1 << 32


async def test_app_claims_ranges_lending_and_log_records(tmp_path: Path) -> None:
    import base64

    a, b = await _pair(tmp_path)
    try:
        one = await LocalClient.connect(a.home.path)
        two = await LocalClient.connect(a.home.path)
        ka = await one.call("app.claim", channel="t", peer=b.did, key_offset=2)
        kb = await two.call("app.claim", channel="t", peer=b.did, key_offset=2)
        assert ka["hi"] - ka["lo"] == kb["hi"] - kb["lo"] and ka["lo"] != kb["lo"]
        with pytest.raises(LocalUsageError, match="names its 'peer'"):
            await one.call("app.claim", channel="t", key_offset=2)
        with pytest.raises(LocalUsageError, match="offset 2"):
            await one.call("app.claim", channel="t", peer=b.did, key_offset=3)
        # an unkeyed claim lends its allow list the right to link, while it lives
        stranger = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
        assert not a.authorizer(stranger)
        await two.call("app.claim", channel="u", allow=[stranger])
        assert a.authorizer(stranger)
        await two.close()
        await until(lambda: not a.authorizer(stranger), what="the lent allow to end")
        # app records: appended through the node's writer, read back a page at a time
        rec = {
            "recipient": b.did,
            "commitment": base64.b64encode(b'{"x":1}').decode(),
            "timestamp_ms": 5,
        }
        assert (await one.call("log.append", kind="app", records=[rec] * 3))["appended"] == 3
        await one.call("log.append", kind="app", records=[], durable=True)
        page = await one.call("log.records", kind="app")
        rows = page["records"]
        while page["next"] is not None:
            page = await one.call("log.records", kind="app", after=page["next"])
            rows += page["records"]
        assert len({r["record_id"] for r in rows}) == 3
        assert base64.b64decode(rows[0]["commitment"]) == b'{"x":1}'
        bad = [
            ({"kind": "msg", "records": [rec]}, "the node's own"),
            ({"kind": "app", "records": [{**rec, "commitment": "%%"}]}, "base64"),
            ({"kind": "app", "records": [{**rec, "timestamp_ms": -1}]}, "timestamp_ms"),
            ({"kind": "app", "records": [rec] * 1001}, "at most"),
            ({"kind": "x" * 33, "records": [rec]}, "kind"),
        ]
        for args, expected in bad:
            with pytest.raises(LocalUsageError, match=expected):
                await one.call("log.append", **args)
        with pytest.raises(LocalUsageError, match="'after'"):
            await one.call("log.records", kind="app", after="zz")
        await one.close()
    finally:
        await a.stop()
        await b.stop()
