"""Tests for talos.transfer.manager: whole transfers between two endpoints over 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from talos.transfer.manager import (
    MAX_OPEN_OFFERS,
    TransferConfig,
    TransferInfo,
    TransferManager,
)
from talos.transfer.protocol import (
    APP_NAME,
    BULK_CHUNK,
    FALLBACK_CHUNK,
    Accept,
    Chunk,
    TransferState,
    decode_message,
    encode_commit,
    encode_message,
)
from talos.transfer.receiver import PARTIAL_DIR
from talos.transfer.routes import view
from talos.transfer.sender import OutgoingAttempt
from talos_sdk.errors import UsageError
from tests.talos.nodes import until

from .net import (
    LIMIT,
    Net,
    bulk_offsets,
    count_app_chunks,
    is_pending,
    offer_pending,
    send_whole,
    source_file,
    visible,
)


@pytest.mark.parametrize("size", [0, 10, BULK_CHUNK, 2 * BULK_CHUNK + 3])
async def test_send_and_receive(net: Net, size: int) -> None:
    src, digest = source_file(net.tmp, size)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        out = await net.sender.wait(tid)
        inc = await net.receiver.wait(tid)
    assert out.state is inc.state is TransferState.COMPLETE
    assert Path(inc.path) == net.receiver.files_dir / "data.bin"
    assert Path(inc.path).read_bytes() == src.read_bytes()
    public = inc.to_public()
    assert public["name"] == "data.bin"
    assert public["size"] == size
    assert public["sha256"] == digest
    assert public["from"] == net.a.did
    assert public["status"] == "complete"
    assert "key" not in public
    for endpoint in (net.a, net.b):
        await asyncio.to_thread(endpoint.log.seal)
        blocks = list(endpoint.log.iter_blocks())
        records = [r for blk in blocks for r in endpoint.log.block_records(blk.height)]
        files = [r for r in records if r.kind == "file"]
        assert len(files) == 1
        assert bytes.fromhex(digest) in files[0].commitment
        assert (files[0].sender, files[0].recipient) == (net.a.did, net.b.did)


async def test_64_mib_over_bulk(net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = source_file(net.tmp, 64 << 20)
    app_chunks = count_app_chunks(net, monkeypatch)
    offsets = bulk_offsets(net.sender, monkeypatch)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
        await net.sender.wait(tid)
    assert inc.state is TransferState.COMPLETE
    assert hashlib.sha256(Path(inc.path).read_bytes()).hexdigest() == inc.sha256
    assert app_chunks == [0]  # the bulk path carried it
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] == 64 << 20
    # The sender's progress is kept only while the transfer runs; then the row says it.
    assert bytes.fromhex(tid) not in net.sender.bytes_sent
    assert (
        view(net.sender, tid)["transferred"] == view(net.receiver, tid)["transferred"] == 64 << 20
    )


async def test_fallback_over_app_channel(net: Net) -> None:
    assert net.receiver.listener is not None
    await net.receiver.listener.close()
    net.receiver.listener = None  # this receiver offers no bulk port
    await send_whole(net, 3 * BULK_CHUNK + 5)


def _accepts(
    net: Net, monkeypatch: pytest.MonkeyPatch, rewrite: Callable[[Accept], Accept] | None = None
) -> list[Accept]:
    """The ACCEPTs the receiver sends, each changed by ``rewrite`` first if given."""
    send_app = net.b.send_app
    seen: list[Accept] = []

    async def spying(did: str, name: str, payload: bytes) -> None:
        msg = decode_message(payload)
        if isinstance(msg, Accept):
            if rewrite is not None:
                msg = rewrite(msg)
                payload = encode_message(msg)
            seen.append(msg)
        await send_app(did, name, payload)

    monkeypatch.setattr(net.b, "send_app", spying)
    return seen


async def test_the_bulk_port_is_dialled_at_the_links_address_only(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A receiver's ACCEPT may name any host: dialling it would let a hostile peer aim
    # the sender at other hosts' ports (the FTP bounce). The sender dials the bulk port
    # at its link's address, so this transfer takes the bulk path although the named
    # host does not exist.
    _accepts(net, monkeypatch, lambda msg: replace(msg, bulk_host="bounce.invalid"))
    chunks = count_app_chunks(net, monkeypatch)
    await send_whole(net, 3 * BULK_CHUNK + 5)
    assert chunks[0] == 0  # the bulk path carried it


async def test_a_peer_reached_through_a_relay_gets_the_app_channel(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    net.a.host = net.b.host = None  # the link has no address to dial
    accepts = _accepts(net, monkeypatch)
    chunks = count_app_chunks(net, monkeypatch)
    await send_whole(net, 3 * FALLBACK_CHUNK + 5)
    assert chunks[0] >= 4  # all of it on the app channel
    assert [a.bulk_port for a in accepts] == [0]  # no bulk port offered that nobody dials


async def test_bulk_receives_at_once_are_capped(net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each bulk stream runs five threads; past MAX_BULK_RECEIVES, attempts get the app
    # channel. A sender that falls back frees its place (its first chunk says so).
    from talos.transfer import incoming

    monkeypatch.setattr(incoming, "MAX_BULK_RECEIVES", 1)
    accepts = _accepts(net, monkeypatch)
    chunks = count_app_chunks(net, monkeypatch)
    one, _ = source_file(net.tmp, 3 * BULK_CHUNK, "one.bin")
    two, _ = source_file(net.tmp, 3 * BULK_CHUNK, "two.bin")
    async with asyncio.timeout(LIMIT):
        tids = [await net.sender.send_file(net.b.did, p) for p in (one, two)]
        done = [await net.receiver.wait(t) for t in tids]
        three, _ = source_file(net.tmp, 1000, "three.bin")
        last = await net.receiver.wait(await net.sender.send_file(net.b.did, three))
    assert [i.state for i in [*done, last]] == [TransferState.COMPLETE] * 3
    assert sorted(bool(a.bulk_port) for a in accepts[:2]) == [False, True]
    assert accepts[2].bulk_port != 0  # the cap counts live attempts only
    assert chunks[0] > 0


async def test_a_bulk_place_its_sender_never_claims_goes_to_others(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sender that neither dials the bulk port nor sends a chunk held its place for the
    # attempt's whole life; past BULK_DIAL_WAIT the place is free again.
    from talos.transfer import incoming

    monkeypatch.setattr(incoming, "MAX_BULK_RECEIVES", 1)
    monkeypatch.setattr(incoming, "BULK_DIAL_WAIT", 0.2)
    accepts = _accepts(net, monkeypatch)
    run_send = net.sender._run_send
    idle: list[bytes] = []

    async def first_never_comes(info: TransferInfo, msg: Accept) -> None:
        if not idle:
            idle.append(msg.tid)  # accepted, then nothing: no dial, no chunk
            return
        await run_send(info, msg)

    monkeypatch.setattr(net.sender, "_run_send", first_never_comes)
    one, _ = source_file(net.tmp, 1000, "one.bin")
    two, _ = source_file(net.tmp, 1000, "two.bin")
    async with asyncio.timeout(LIMIT):
        await net.sender.send_file(net.b.did, one)
        await until(lambda: bool(idle), what="the first attempt accepted")
        assert net.receiver._incoming[idle[0]].bulk
        await until(lambda: not net.receiver._incoming[idle[0]].bulk, what="its place freed")
        done = await net.receiver.wait(await net.sender.send_file(net.b.did, two))
    assert done.state is TransferState.COMPLETE
    assert accepts[1].bulk_port != 0


async def test_sender_ignoring_credit_fails_the_transfer(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fallback sender that ignores Credit cannot grow the receiver's queue (ADR 0004)."""
    assert net.receiver.listener is not None
    await net.receiver.listener.close()
    net.receiver.listener = None
    window = 2
    net.receiver.config = TransferConfig(auto_accept=(net.a.did,), window=window)
    queues: list[asyncio.Queue[object]] = []
    start = TransferManager._start_attempt

    async def spy(self: TransferManager, info: TransferInfo) -> None:
        await start(self, info)
        queues.extend(i.queue for i in self._incoming.values())  # type: ignore[misc]

    monkeypatch.setattr(TransferManager, "_start_attempt", spy)

    async def greedy(self: TransferManager, info: TransferInfo, msg: Accept) -> None:
        out = OutgoingAttempt(
            Path(info.path), info.size, bytes.fromhex(info.key), msg.tid, msg.epoch, 0,
            FALLBACK_CHUNK, lambda digest: bytes(64),
        )  # fmt: skip
        sealed = [(out.index, out.next_sealed()) for _ in range(3 * window)]
        out.close()
        # All at once, no await between them: nothing the receiver does can raise the credit.
        for index, chunk in sealed:
            await self.node.send_app(
                info.peer, APP_NAME, encode_message(Chunk(msg.tid, msg.epoch, index, chunk))
            )

    monkeypatch.setattr(TransferManager, "_send_fallback", greedy)
    src, _ = source_file(net.tmp, 4 * window * FALLBACK_CHUNK)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
        out = await net.sender.wait(tid)
    assert inc.state is TransferState.FAILED
    assert (
        inc.error
        == f"sender exceeded its credit: chunk {window} sent with credit for {window} chunks"
    )
    assert out.state is TransferState.FAILED and out.error == inc.error
    assert [q.maxsize for q in queues] == [window + 1]
    assert visible(net.receiver.files_dir) == []


async def test_pending_until_accepted(net: Net) -> None:
    net.receiver.config = TransferConfig()  # nobody auto-accepted
    src, _ = source_file(net.tmp, 1000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        while net.sender.get(tid).state is not TransferState.PENDING:
            await asyncio.sleep(0.005)
        assert net.receiver.get(tid).state is TransferState.PENDING
        assert visible(net.receiver.files_dir) == []
        with pytest.raises(UsageError, match="not a pending incoming"):
            await net.sender.accept(tid)
        await net.receiver.accept(tid)
        inc = await net.receiver.wait(tid)
        out = await net.sender.wait(tid)
    assert inc.state is out.state is TransferState.COMPLETE
    with pytest.raises(UsageError, match="no transfer"):
        net.receiver.get("00" * 16)


async def test_pending_rejected(net: Net) -> None:
    net.receiver.config = TransferConfig()  # nobody auto-accepted
    src, _ = source_file(net.tmp, 1000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        while net.receiver.list() == [] or net.receiver.get(tid).state is not TransferState.PENDING:
            await asyncio.sleep(0.005)
        await net.receiver.reject(tid, "not today")
        out = await net.sender.wait(tid)
    assert out.state is TransferState.REJECTED
    assert out.error == "not today"


async def test_quota_exceeded(net: Net) -> None:
    net.receiver.config = TransferConfig(
        quota_bytes=5000, min_file_bytes=1, auto_accept=(net.a.did,)
    )
    first, _ = source_file(net.tmp, 4000, "first.bin")
    second, _ = source_file(net.tmp, 2000, "second.bin")
    async with asyncio.timeout(LIMIT):
        ok = await net.sender.wait(await net.sender.send_file(net.b.did, first))
        assert ok.state is TransferState.COMPLETE
        tid = await net.sender.send_file(net.b.did, second)
        out = await net.sender.wait(tid)
    assert out.state is TransferState.REJECTED
    assert "quota exceeded" in out.error
    with pytest.raises(UsageError, match="no transfer"):
        net.receiver.get(tid)  # a refusal stores no row
    assert visible(net.receiver.files_dir) == ["first.bin"]


async def test_pending_offers_are_charged_to_the_quota_when_accepted(net: Net) -> None:
    """An offer nobody accepted takes no disk: counted as it came, one peer's pending
    offers refused every other offer. It is charged when accepted, and refused then."""
    net.receiver.config = TransferConfig(quota_bytes=5000, min_file_bytes=1)  # none auto
    big, _ = source_file(net.tmp, 4000, "big.bin")
    other, _ = source_file(net.tmp, 3000, "other.bin")
    async with asyncio.timeout(LIMIT):
        held = await net.sender.send_file(net.b.did, big)
        await until(lambda: is_pending(net, held), what="the big offer pending")
        tid = await net.sender.send_file(net.b.did, other)  # not refused for the big one
        await until(lambda: is_pending(net, tid), what="the other offer pending")
        await net.receiver.accept(tid)
        assert (await net.receiver.wait(tid)).state is TransferState.COMPLETE
        with pytest.raises(UsageError, match=r"quota exceeded: 4000 bytes.*stays pending"):
            await net.receiver.accept(held)
    assert net.receiver.get(held).state is TransferState.PENDING


async def test_empty_and_tiny_files_count_against_the_quota(net: Net) -> None:
    """Each file costs at least min_file_bytes: an auto-accepted peer cannot create
    unlimited files and rows by sending empty ones."""
    net.receiver.config = TransferConfig(
        quota_bytes=3000, min_file_bytes=1000, auto_accept=(net.a.did,)
    )
    empty, _ = source_file(net.tmp, 0, "empty.bin")
    tiny, _ = source_file(net.tmp, 1, "tiny.bin")
    async with asyncio.timeout(LIMIT):
        for src in (empty, tiny, empty):
            done = await net.sender.wait(await net.sender.send_file(net.b.did, src))
            assert done.state is TransferState.COMPLETE
        out = await net.sender.wait(await net.sender.send_file(net.b.did, empty))
    assert out.state is TransferState.REJECTED
    assert "quota exceeded: 0 bytes offered (counts as 1000)" in out.error
    assert len(net.receiver.list()) == 3


async def test_transfer_rows_per_peer_are_bounded(net: Net) -> None:
    """At max_rows_per_peer the oldest ended rows (no file held) make room; when
    none has ended, the offer is refused and no row is written."""
    net.receiver.config = TransferConfig(max_rows_per_peer=3)  # offers stay pending
    src, _ = source_file(net.tmp, 10)
    async with asyncio.timeout(LIMIT):
        tids = [await net.sender.send_file(net.b.did, src) for _ in range(4)]
        refused = await net.sender.wait(tids[-1])
        while len(net.receiver.list()) < 3 or any(
            i.state is not TransferState.PENDING for i in net.receiver.list()
        ):
            await asyncio.sleep(0.005)
    assert refused.state is TransferState.REJECTED
    assert refused.error.startswith("too many transfers kept from this peer (limit 3")
    assert len(net.receiver.list()) == 3
    await net.receiver.reject(tids[0])  # an ended row, holding no file
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        while tid not in [i.tid for i in net.receiver.list()]:
            await asyncio.sleep(0.005)
    assert sorted(i.tid for i in net.receiver.list()) == sorted([*tids[1:3], tid])


async def test_open_offers_per_peer_are_capped(net: Net) -> None:
    net.receiver.config = TransferConfig()  # nobody auto-accepted: offers stay pending
    src, _ = source_file(net.tmp, 10)
    async with asyncio.timeout(LIMIT):
        tids = [await net.sender.send_file(net.b.did, src) for _ in range(MAX_OPEN_OFFERS + 1)]
        refused = await net.sender.wait(tids[-1])
        while len(net.receiver.list()) < MAX_OPEN_OFFERS or any(
            i.state is not TransferState.PENDING for i in net.receiver.list()
        ):
            await asyncio.sleep(0.005)
    assert refused.state is TransferState.REJECTED
    assert refused.error == f"too many open offers from this peer (limit {MAX_OPEN_OFFERS})"
    assert sorted(i.tid for i in net.receiver.list()) == sorted(tids[:-1])
    # Declining one frees a place for the next offer.
    await net.receiver.reject(tids[0])
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        # The row appears as OFFERED and moves to PENDING a moment later: wait for that.
        while net.receiver.list()[-1].tid != tid or (
            net.receiver.get(tid).state is TransferState.OFFERED
        ):
            await asyncio.sleep(0.005)
    assert net.receiver.get(tid).state is TransferState.PENDING


async def test_rows_are_written_off_the_event_loop(net: Net) -> None:
    loop_thread = threading.get_ident()
    writers: set[int] = set()
    store = net.a.store
    original = store.write

    def spy(durable: bool = True) -> Any:
        writers.add(threading.get_ident())
        return original(durable)

    store.write = spy  # type: ignore[method-assign]
    src, _ = source_file(net.tmp, 1000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        out = await net.sender.wait(tid)
    assert out.state is TransferState.COMPLETE
    assert writers and loop_thread not in writers


@pytest.mark.parametrize(
    ("name", "lands_as"),
    [
        ("../../etc/passwd", "passwd"),
        ("/etc/passwd", "passwd"),
        ("..", "file"),
        ("a\x00b.txt", "ab.txt"),
        ("NUL", "_NUL"),
        ("CON.txt", "_CON.txt"),
        (".ssh", "ssh"),
        ("..\\..\\win.ini", "win.ini"),
    ],
)
async def test_hostile_names_land_inside_files_dir(net: Net, name: str, lands_as: str) -> None:
    src, _ = source_file(net.tmp, 100)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src, name=name)
        inc = await net.receiver.wait(tid)
    assert inc.state is TransferState.COMPLETE
    path = Path(inc.path)
    assert path.parent == net.receiver.files_dir
    assert path.name == lands_as
    assert path.read_bytes() == src.read_bytes()


async def test_same_name_twice_never_overwrites(net: Net) -> None:
    first, _ = source_file(net.tmp, 100, "one.txt")
    async with asyncio.timeout(LIMIT):
        t1 = await net.sender.send_file(net.b.did, first, name="report.txt")
        p1 = Path((await net.receiver.wait(t1)).path)
        second, _ = source_file(net.tmp, 120, "two.txt")
        t2 = await net.sender.send_file(net.b.did, second, name="report.txt")
        p2 = Path((await net.receiver.wait(t2)).path)
    assert (p1.name, p2.name) == ("report.txt", "report (1).txt")
    assert p1.read_bytes() == first.read_bytes()
    assert p2.read_bytes() == second.read_bytes()


def _lying_commit(self: OutgoingAttempt) -> bytes:
    """A sender that signs and commits to a SHA-256 other than the bytes it streamed."""
    wrong = hashlib.sha256(b"not the file").digest()
    return encode_commit(wrong, self._sign(wrong))


async def test_wrong_total_hash_fails_with_nothing_visible(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(OutgoingAttempt, "_commit", _lying_commit)
    src, _ = source_file(net.tmp, 3 * BULK_CHUNK)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
        out = await net.sender.wait(tid)
    assert inc.state is out.state is TransferState.FAILED
    assert "SHA-256" in inc.error and "SHA-256" in out.error
    assert visible(net.receiver.files_dir) == []
    assert list((net.receiver.files_dir / PARTIAL_DIR).iterdir()) == []


async def test_forged_commit_signature_fails(net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    def forged(self: TransferManager, info: object) -> Callable[[bytes], bytes]:
        return lambda digest: bytes(64)

    monkeypatch.setattr(TransferManager, "_signer", forged)
    src, _ = source_file(net.tmp, 1000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
    assert inc.state is TransferState.FAILED
    assert "signature does not verify" in inc.error
    assert visible(net.receiver.files_dir) == []


async def test_source_changing_size_cancels(net: Net) -> None:
    net.receiver.config = TransferConfig()  # nobody auto-accepted
    src, _ = source_file(net.tmp, 1000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        while net.receiver.list() == [] or net.receiver.get(tid).state is not TransferState.PENDING:
            await asyncio.sleep(0.005)
        src.write_bytes(os.urandom(2000))
        await net.receiver.accept(tid)
        out = await net.sender.wait(tid)
        inc = await net.receiver.wait(tid)
    assert out.state is TransferState.FAILED
    assert "changed since it was offered (size or type)" in out.error
    assert inc.state is TransferState.CANCELLED
    assert visible(net.receiver.files_dir) == []


async def test_an_offer_decodes_no_stored_rows_once_they_are_kept(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each offer checks every row (open offers, quota, the per-peer bound); they are read
    # from the store once, then kept as they change: a peer's flood of offers over
    # thousands of ended rows decoded them all each time (115 ms an offer at 10,000).
    async with asyncio.timeout(LIMIT):
        src = await offer_pending(net, 10)
        decoded = 0
        decode = TransferInfo.decode

        def counting(raw: bytes) -> TransferInfo:
            nonlocal decoded
            decoded += 1
            return decode(raw)

        monkeypatch.setattr(TransferInfo, "decode", staticmethod(counting))
        tids = [await net.sender.send_file(net.b.did, src) for _ in range(5)]
        await until(lambda: all(is_pending(net, t) for t in tids), what="the offers")
    assert decoded == 0
    assert set(tids) <= {i.tid for i in net.receiver.list()}


async def test_a_row_the_store_refused_is_not_kept(net: Net) -> None:
    # send_file's row fails to commit (a full store): the caller hears so, and the kept
    # rows are read again, so no transfer the caller was told failed is offered later.
    from talos_sdk.errors import StorageFullError

    src, _ = source_file(net.tmp, 1000)
    net.sender.list()  # the rows are kept from here on

    def full(kind: str, size: int) -> None:
        raise StorageFullError("map full")

    undo = net.a.writer.before("transfer", full)
    with pytest.raises(StorageFullError):
        await net.sender.send_file(net.b.did, src)
    undo()
    assert net.sender.list() == []
