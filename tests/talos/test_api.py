"""The control API against real nodes on 127.0.0.1 (talos/api.py), each built by the
composition root (talos/daemon.py) as ``talosd run`` builds it."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from talos import pipeline as pl
from talos.daemon import Daemon
from talos.node import Node
from talos.pipeline import INBOX_PAGE_BYTES
from talos_sdk.wallet import Wallet
from tests.talos.nodes import link, make_home, until

API_URLS: dict[str, str] = {}


async def _daemon(tmp_path: Path, name: str) -> Daemon:
    daemon = Daemon(*make_home(tmp_path, name, api=True))
    await daemon.start()
    assert daemon.api_url is not None
    API_URLS[daemon.node.did] = daemon.api_url
    return daemon


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[tuple[Node, Node, aiohttp.ClientSession]]:
    da = await _daemon(tmp_path, "a")
    db = await _daemon(tmp_path, "b")
    a, b = da.node, db.node
    headers = {"Authorization": f"Bearer {a.home.api_token()}"}
    async with aiohttp.ClientSession(base_url=API_URLS[a.did], headers=headers) as http:
        yield a, b, http
    await da.stop()
    await db.stop()


async def call(http: aiohttp.ClientSession, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    async with http.request(method, path, **kw) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def test_token_is_required(nodes: tuple[Node, Node, aiohttp.ClientSession]) -> None:
    a, _, http = nodes
    async with asyncio.timeout(10), aiohttp.ClientSession(base_url=API_URLS[a.did]) as anon:
        # Health for anyone; who the node is, and its error's words, with the token only.
        assert await call(anon, "GET", "/healthz") == (200, {"ok": True})
        status, health = await call(http, "GET", "/healthz")
        assert status == 200 and health == {"ok": True, "did": a.did, "storage_error": None}
        for path in ("/v1/status", "/metrics", "/v1/inbox"):
            status, body = await call(anon, "GET", path)
            assert status == 401 and "token" in body["error"]
        bad = {"Authorization": "Bearer nope"}
        assert (await call(anon, "GET", "/v1/id", headers=bad))[0] == 401
    # A header that is not UTF-8 is a wrong token too, not a server error.
    host, port = API_URLS[a.did].removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /v1/id HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n")
    writer.write(b"Connection: close\r\n\r\n")
    async with asyncio.timeout(10):
        answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:80]


async def test_routes_end_to_end(
    nodes: tuple[Node, Node, aiohttp.ClientSession], caplog: pytest.LogCaptureFixture
) -> None:
    a, b, http = nodes
    caplog.set_level(logging.DEBUG, logger="talos")
    async with asyncio.timeout(20):
        status, ident = await call(http, "GET", "/v1/id")
        assert status == 200 and ident["did"] == a.did and len(ident["x25519"]) == 64
        await link(b, a)  # B dials A: A learns B through --allow only
        status, peers = await call(http, "GET", "/v1/peers")
        assert status == 200 and peers["peers"] == []  # B is allowed, not a dialled peer
        # A's view of B arrives through the status route.
        status, st = await call(http, "GET", "/v1/status")
        assert st["links"][0]["did"] == b.did and st["links"][0]["ready"]
        assert st["sessions"][0]["suite"] == "x25519-mlkem768"
        secret = "the plaintext that must never be logged"
        async with b_http(b) as bh:
            waiter = asyncio.create_task(call(http, "GET", "/v1/inbox?after=0&wait=10"))
            status, sent = await call(
                bh, "POST", "/v1/send", json={"to": a.did, "text": secret, "wait": True}
            )
            assert status == 200 and sent["acked"] is True
        status, inbox = await waiter
        assert status == 200
        assert inbox["messages"] == [
            {"id": sent["id"], "from": b.did, "text": secret, "ts": inbox["messages"][0]["ts"]}
        ]
        status, empty = await call(http, "GET", f"/v1/inbox?after={inbox['next']}")
        assert empty["messages"] == [] and empty["next"] == inbox["next"]
        await until(lambda: a.log.height >= 0, what="sealed block")
        status, heads = await call(http, "GET", "/v1/chain/heads")
        assert status == 200 and heads["height"] >= 0
        status, proof = await call(http, "GET", f"/v1/chain/proof/{sent['id']}")
        assert status == 200 and proof["size"] >= 1
        status, report = await call(http, "GET", "/v1/chain/verify")
        assert status == 200 and report["ok"] and report["records"] >= 1
        status, shown = await call(http, "GET", "/v1/chain/show")
        assert shown["blocks"][0]["height"] == 0
        status, metrics = await call(http, "GET", "/metrics")
        assert "talos_messages_in 1" in metrics and "talos_peers_connected 1" in metrics
    assert caplog.records, "expected node logs to inspect"
    assert all(secret not in r.getMessage() + repr(r.__dict__) for r in caplog.records)


def b_http(b: Node) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {b.home.api_token()}"}
    return aiohttp.ClientSession(base_url=API_URLS[b.did], headers=headers)


async def test_bad_requests_get_clear_errors(
    nodes: tuple[Node, Node, aiohttp.ClientSession],
) -> None:
    _, _, http = nodes
    async with asyncio.timeout(10):
        cases: list[tuple[str, str, dict[str, Any], int, str]] = [
            ("POST", "/v1/send", {"data": b"{not json"}, 400, "bad request body"),
            ("POST", "/v1/send", {"json": {"to": "x"}}, 400, "bad request body"),
            ("POST", "/v1/send", {"json": {"to": "did:key:zzz", "text": "t"}}, 400, "did"),
            ("POST", "/v1/peers", {"json": {"addr": "ws://h:1"}}, 400, "DID"),
            ("GET", "/v1/inbox?after=x", {}, 400, "integer"),
            ("GET", "/v1/inbox?after=-5", {}, 400, "after"),
            ("GET", f"/v1/inbox?after={2**70}", {}, 400, "after"),
            ("GET", "/v1/inbox?wait=nan", {}, 400, "wait"),
            ("GET", "/v1/files/zz", {}, 400, "hex"),
            ("GET", "/v1/chain/proof/zz", {}, 400, "hex"),
            ("GET", "/v1/chain/proof/" + "00" * 16, {}, 404, "no sealed record"),
            ("GET", "/v1/chain/proof/%20", {}, 404, "no sealed record"),  # hex of nothing
        ]
        for method, path, kw, want, text in cases:
            status, body = await call(http, method, path, **kw)
            assert status == want, (path, body)
            assert text.lower() in body["error"].lower(), (path, body)


async def test_an_inbox_page_is_bounded_in_bytes(
    nodes: tuple[Node, Node, aiohttp.ClientSession],
) -> None:
    # Control characters grow sixfold in JSON: five of the largest such messages came
    # back in one 30 MB response, and 1,000 would have been gigabytes. The page stops
    # early and "next" says where to go on.
    a, b, http = nodes
    async with asyncio.timeout(60):
        await link(a, b)
        text = "\x01" * pl.text_limit(b.config.max_frame)
        for _ in range(5):
            await b.send_message(a.did, text, wait=True)
        pages, after = [], 0
        while True:
            status, page = await call(http, "GET", f"/v1/inbox?after={after}")
            assert status == 200
            if not page["messages"]:
                break
            assert len(orjson.dumps([m["text"] for m in page["messages"]])) <= 2 * INBOX_PAGE_BYTES
            pages.append(len(page["messages"]))
            after = page["next"]
        assert sum(pages) == 5 and len(pages) > 1, pages


async def test_a_send_that_waits_says_why_no_ack_came(
    nodes: tuple[Node, Node, aiohttp.ClientSession],
) -> None:
    a, _, http = nodes

    async def send_waiting(did: str, timeout: float) -> tuple[int, Any]:
        body = {"to": did, "text": "t", "wait": True, "timeout": timeout}
        return await call(http, "POST", "/v1/send", json=body)

    async with asyncio.timeout(30):
        status, body = await send_waiting(a.did, 20)  # as without wait: a bad request
        assert status == 400 and "itself" in body["error"], body
        # No address, no relay, may not dial in: refused at once, nothing queued.
        status, body = await send_waiting(Wallet.generate().did, 20)
        assert status == 502 and "nothing was sent" in body["error"], body
        assert a.status()["queues"]["outbox"] == 0
        # Allowed to dial in but never did: queued, and the answer says no address is known.
        silent = Wallet.generate().did
        a.allow(silent)
        status, body = await send_waiting(silent, 0.2)
        assert status == 502 and "no address known" in body["error"], body
        assert "stays queued" in body["error"]
        # An address where nothing listens: the dial's failure, not a bare timeout.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        gone = Wallet.generate().did
        await a.add_peer(f"ws://127.0.0.1:{port}#{gone}")
        await until(lambda: a.link_state(gone)[0] == "unreachable", 10, "the dial failed")
        status, body = await send_waiting(gone, 0.5)
        assert status == 502 and "stays queued" in body["error"], body
        # A listener that takes the connection and never answers: a plain timeout.
        with socket.socket() as mute:
            mute.bind(("127.0.0.1", 0))
            mute.listen()
            slow = Wallet.generate().did
            await a.add_peer(f"ws://127.0.0.1:{mute.getsockname()[1]}#{slow}")
            status, body = await send_waiting(slow, 0.3)
        assert status == 504 and "no acknowledgement" in body["error"], body
        assert a.status()["queues"]["outbox"] == 3
