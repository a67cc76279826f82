"""Tests for talos.transfer.manager: whole transfers between two endpoints over 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
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
    Credit,
    Done,
    TransferState,
    decode_message,
    encode_commit,
    encode_message,
)
from talos.transfer.receiver import PARTIAL_DIR
from talos.transfer.sender import OutgoingAttempt
from talos_sdk.errors import UsageError
from talos_sdk.wallet import Wallet
from tests.talos.nodes import until

from .pair import Endpoint, link

LIMIT = 30.0


@dataclass
class Net:
    tmp: Path
    a: Endpoint
    b: Endpoint
    sender: TransferManager
    receiver: TransferManager
    wallet_b: Wallet

    async def restart_receiver(self, config: TransferConfig) -> None:
        link(self.a, self.b, False)
        await self.receiver.stop()
        await self.b.close()
        self.b = Endpoint(self.tmp / "b", self.wallet_b)
        self.receiver = TransferManager(self.b, self.tmp / "b" / "files", config)
        await self.receiver.start()
        link(self.a, self.b, True)


async def _net(tmp_path: Path, receiver_config: TransferConfig) -> Net:
    wa, wb = Wallet.generate(), Wallet.generate()
    a = Endpoint(tmp_path / "a", wa)
    b = Endpoint(tmp_path / "b", wb)
    sender = TransferManager(a, tmp_path / "a" / "files")
    receiver = TransferManager(b, tmp_path / "b" / "files", receiver_config)
    await sender.start()
    await receiver.start()
    link(a, b, True)
    return Net(tmp_path, a, b, sender, receiver, wb)


@pytest.fixture
async def net(tmp_path: Path) -> AsyncIterator[Net]:
    n = await _net(tmp_path, TransferConfig())
    n.receiver.config = TransferConfig(auto_accept=(n.a.did,))
    yield n
    await n.sender.stop()
    await n.receiver.stop()
    await n.a.close()
    await n.b.close()


def _file(tmp: Path, size: int, name: str = "data.bin") -> tuple[Path, str]:
    path = tmp / name
    data = os.urandom(size)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def _visible(files: Path) -> list[str]:
    return sorted(p.name for p in files.iterdir() if p.name != PARTIAL_DIR)


@pytest.mark.parametrize("size", [0, 10, BULK_CHUNK, 2 * BULK_CHUNK + 3])
async def test_send_and_receive(net: Net, size: int) -> None:
    src, digest = _file(net.tmp, size)
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


async def test_64_mib_over_bulk(net: Net) -> None:
    src, _ = _file(net.tmp, 64 << 20)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
        await net.sender.wait(tid)
    assert inc.state is TransferState.COMPLETE
    assert hashlib.sha256(Path(inc.path).read_bytes()).hexdigest() == inc.sha256
    assert net.sender.bytes_sent[bytes.fromhex(tid)] > 64 << 20  # bulk path, sealed overhead


async def test_fallback_over_app_channel(net: Net) -> None:
    assert net.receiver.listener is not None
    await net.receiver.listener.close()
    net.receiver.listener = None  # this receiver offers no bulk port
    src, _ = _file(net.tmp, 3 * BULK_CHUNK + 5)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
    assert inc.state is TransferState.COMPLETE
    assert Path(inc.path).read_bytes() == src.read_bytes()


def _count_app_chunks(net: Net, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the CHUNK messages the sender puts on the app channel (the fallback)."""
    send_app = net.a.send_app
    chunks = [0]
    chunk_type = encode_message(Chunk(bytes(16), 1, 0, b""))[:1]

    async def counting(did: str, name: str, payload: bytes) -> None:
        chunks[0] += payload[:1] == chunk_type
        await send_app(did, name, payload)

    monkeypatch.setattr(net.a, "send_app", counting)
    return chunks


async def test_the_bulk_port_is_dialled_at_the_links_address_only(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A receiver's ACCEPT may name any host: dialling it would let a hostile peer aim
    # the sender at other hosts' ports (the FTP bounce). The sender dials the bulk port
    # at its link's address, so this transfer takes the bulk path although the named
    # host does not exist.
    send_app = net.b.send_app

    async def naming_elsewhere(did: str, name: str, payload: bytes) -> None:
        msg = decode_message(payload)
        if isinstance(msg, Accept) and msg.bulk_port:
            payload = encode_message(replace(msg, bulk_host="bounce.invalid"))
        await send_app(did, name, payload)

    monkeypatch.setattr(net.b, "send_app", naming_elsewhere)
    chunks = _count_app_chunks(net, monkeypatch)
    src, _ = _file(net.tmp, 3 * BULK_CHUNK + 5)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
    assert inc.state is TransferState.COMPLETE
    assert Path(inc.path).read_bytes() == src.read_bytes()
    assert chunks[0] == 0  # the bulk path carried it


async def test_a_peer_reached_through_a_relay_gets_the_app_channel(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    net.a.host = None  # the link has no address to dial
    chunks = _count_app_chunks(net, monkeypatch)
    src, _ = _file(net.tmp, 3 * FALLBACK_CHUNK + 5)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
    assert inc.state is TransferState.COMPLETE
    assert Path(inc.path).read_bytes() == src.read_bytes()
    assert chunks[0] >= 4  # all of it on the app channel


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
    src, _ = _file(net.tmp, 4 * window * FALLBACK_CHUNK)
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
    assert _visible(net.receiver.files_dir) == []


async def test_pending_until_accepted(net: Net) -> None:
    net.receiver.config = TransferConfig()  # nobody auto-accepted
    src, _ = _file(net.tmp, 1000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        while net.sender.get(tid).state is not TransferState.PENDING:
            await asyncio.sleep(0.005)
        assert net.receiver.get(tid).state is TransferState.PENDING
        assert _visible(net.receiver.files_dir) == []
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
    src, _ = _file(net.tmp, 1000)
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
    first, _ = _file(net.tmp, 4000, "first.bin")
    second, _ = _file(net.tmp, 2000, "second.bin")
    async with asyncio.timeout(LIMIT):
        ok = await net.sender.wait(await net.sender.send_file(net.b.did, first))
        assert ok.state is TransferState.COMPLETE
        tid = await net.sender.send_file(net.b.did, second)
        out = await net.sender.wait(tid)
    assert out.state is TransferState.REJECTED
    assert "quota exceeded" in out.error
    with pytest.raises(UsageError, match="no transfer"):
        net.receiver.get(tid)  # a refusal stores no row
    assert _visible(net.receiver.files_dir) == ["first.bin"]


async def test_empty_and_tiny_files_count_against_the_quota(net: Net) -> None:
    """Each file costs at least min_file_bytes: an auto-accepted peer cannot create
    unlimited files and rows by sending empty ones."""
    net.receiver.config = TransferConfig(
        quota_bytes=3000, min_file_bytes=1000, auto_accept=(net.a.did,)
    )
    empty, _ = _file(net.tmp, 0, "empty.bin")
    tiny, _ = _file(net.tmp, 1, "tiny.bin")
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
    src, _ = _file(net.tmp, 10)
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
    src, _ = _file(net.tmp, 10)
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
    src, _ = _file(net.tmp, 1000)
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
    src, _ = _file(net.tmp, 100)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src, name=name)
        inc = await net.receiver.wait(tid)
    assert inc.state is TransferState.COMPLETE
    path = Path(inc.path)
    assert path.parent == net.receiver.files_dir
    assert path.name == lands_as
    assert path.read_bytes() == src.read_bytes()


async def test_same_name_twice_never_overwrites(net: Net) -> None:
    first, _ = _file(net.tmp, 100, "one.txt")
    async with asyncio.timeout(LIMIT):
        t1 = await net.sender.send_file(net.b.did, first, name="report.txt")
        p1 = Path((await net.receiver.wait(t1)).path)
        second, _ = _file(net.tmp, 120, "two.txt")
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
    src, _ = _file(net.tmp, 3 * BULK_CHUNK)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
        out = await net.sender.wait(tid)
    assert inc.state is out.state is TransferState.FAILED
    assert "SHA-256" in inc.error and "SHA-256" in out.error
    assert _visible(net.receiver.files_dir) == []
    assert list((net.receiver.files_dir / PARTIAL_DIR).iterdir()) == []


async def test_forged_commit_signature_fails(net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    def forged(self: TransferManager, info: object) -> Callable[[bytes], bytes]:
        return lambda digest: bytes(64)

    monkeypatch.setattr(TransferManager, "_signer", forged)
    src, _ = _file(net.tmp, 1000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
    assert inc.state is TransferState.FAILED
    assert "signature does not verify" in inc.error
    assert _visible(net.receiver.files_dir) == []


async def test_source_changing_size_cancels(net: Net) -> None:
    net.receiver.config = TransferConfig()  # nobody auto-accepted
    src, _ = _file(net.tmp, 1000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        while net.receiver.list() == [] or net.receiver.get(tid).state is not TransferState.PENDING:
            await asyncio.sleep(0.005)
        src.write_bytes(os.urandom(2000))
        await net.receiver.accept(tid)
        out = await net.sender.wait(tid)
        inc = await net.receiver.wait(tid)
    assert out.state is TransferState.FAILED
    assert "changed size" in out.error
    assert inc.state is TransferState.CANCELLED
    assert _visible(net.receiver.files_dir) == []


async def test_receiver_restart_resumes_from_checkpoint(net: Net) -> None:
    config = TransferConfig(auto_accept=(net.a.did,), checkpoint_bytes=1 << 20, window=2)
    net.receiver.config = config
    size = 64 << 20
    src, _ = _file(net.tmp, size)
    reached = asyncio.Event()

    def on_progress(tid: bytes, offset: int) -> None:
        if offset >= 8 << 20:
            reached.set()

    net.receiver.on_progress = on_progress
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        await reached.wait()
        await net.restart_receiver(config)
        committed = net.receiver.get(tid).offset
        assert 8 << 20 <= committed < size
        sent_before = net.sender.bytes_sent[bytes.fromhex(tid)]
        inc = await net.receiver.wait(tid)
        await net.sender.wait(tid)
    assert inc.state is TransferState.COMPLETE
    assert inc.epoch >= 2
    assert Path(inc.path).read_bytes() == src.read_bytes()
    sent_after = net.sender.bytes_sent[bytes.fromhex(tid)] - sent_before
    assert 0 < sent_after < size


async def _no_bulk(net: Net, **config: Any) -> None:
    """The receiver offers no bulk port: the bytes take the app channel (fallback)."""
    assert net.receiver.listener is not None
    await net.receiver.listener.close()
    net.receiver.listener = None
    net.receiver.config = TransferConfig(auto_accept=(net.a.did,), **config)


async def test_a_link_drop_on_the_app_channel_path_is_resumed(net: Net) -> None:
    # The lost link is a NotConnectedError, a TalosError as well as a ConnectionError:
    # the attempt is broken and retried from the checkpoint, not the transfer failed.
    await _no_bulk(net, checkpoint_bytes=1 << 20, window=2)
    size = 8 << 20
    src, _ = _file(net.tmp, size)
    reached = asyncio.Event()
    net.receiver.on_progress = lambda tid, offset: reached.set() if offset >= 2 << 20 else None
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        await reached.wait()
        link(net.a, net.b, False)
        await asyncio.sleep(0.2)  # the sender meets the dead link
        assert net.sender.get(tid).state is TransferState.ACTIVE
        link(net.a, net.b, True)
        inc = await net.receiver.wait(tid)
        out = await net.sender.wait(tid)
    assert inc.state is out.state is TransferState.COMPLETE, out.error
    assert Path(inc.path).read_bytes() == src.read_bytes()


async def test_a_chunk_lost_on_the_app_channel_path_is_sent_again(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One chunk vanishes (a link that died with it in flight): the receiver's attempt
    # ends at the gap and grants no more credit; past CREDIT_WAIT the sender takes the
    # attempt for broken and offers again, and the transfer completes.
    from talos.transfer import outgoing

    monkeypatch.setattr(outgoing, "CREDIT_WAIT", 0.5)
    await _no_bulk(net, window=2)
    send_app = net.a.send_app
    chunks = 0

    async def lossy(did: str, name: str, payload: bytes) -> None:
        nonlocal chunks
        if payload[:1] == encode_message(Chunk(bytes(16), 1, 0, b""))[:1]:
            chunks += 1
            if chunks == 3:
                return  # lost
        await send_app(did, name, payload)

    monkeypatch.setattr(net.a, "send_app", lossy)
    src, _ = _file(net.tmp, 6 * FALLBACK_CHUNK + 1)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        inc = await net.receiver.wait(tid)
        out = await net.sender.wait(tid)
    assert inc.state is out.state is TransferState.COMPLETE
    assert inc.attempts >= 2 and Path(inc.path).read_bytes() == src.read_bytes()


async def test_done_before_the_commit_is_ignored(net: Net) -> None:
    # A receiver that says DONE before it could have the file (no commit was sent yet)
    # must not make the sender log a delivery without a hash.
    await _no_bulk(net, window=2)  # the app-channel path: a while from ACCEPT to commit
    src, digest = _file(net.tmp, 16 * FALLBACK_CHUNK)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        await until(lambda: net.sender.get(tid).state is TransferState.ACTIVE, what="accepted")
        assert not net.sender.get(tid).signature
        await net.b.send_app(net.a.did, APP_NAME, encode_message(Done(bytes.fromhex(tid))))
        out = await net.sender.wait(tid)
    assert out.state is TransferState.COMPLETE and out.sha256 == digest and out.signature
    await asyncio.to_thread(net.a.log.seal)
    records = [r for b in net.a.log.iter_blocks() for r in net.a.log.block_records(b.height)]
    (record,) = [r for r in records if r.kind == "file"]
    assert bytes.fromhex(digest) in record.commitment


async def test_an_offer_must_leave_disk_free(net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    # The file is preallocated whole when accepted: an offer that would leave less than
    # DISK_RESERVE free is refused (the store and the block log share that disk).
    import shutil

    from talos.transfer import incoming

    files = net.receiver.files_dir
    monkeypatch.setattr(incoming, "DISK_RESERVE", shutil.disk_usage(files).free - 1000)
    src, _ = _file(net.tmp, 10_000)
    async with asyncio.timeout(LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        out = await net.sender.wait(tid)
    assert out.state is TransferState.REJECTED and "kept free" in out.error


async def test_an_offer_decodes_no_stored_rows_once_they_are_kept(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each offer checks every row (open offers, quota, the per-peer bound); they are read
    # from the store once, then kept as they change: a peer's flood of offers over
    # thousands of ended rows decoded them all each time (115 ms an offer at 10,000).
    async with asyncio.timeout(LIMIT):
        src = await _offer_pending(net, 10)
        decoded = 0
        decode = TransferInfo.decode

        def counting(raw: bytes) -> TransferInfo:
            nonlocal decoded
            decoded += 1
            return decode(raw)

        monkeypatch.setattr(TransferInfo, "decode", staticmethod(counting))
        tids = [await net.sender.send_file(net.b.did, src) for _ in range(5)]
        await until(lambda: all(_pending(net, t) for t in tids), what="the offers")
    assert decoded == 0
    assert set(tids) <= {i.tid for i in net.receiver.list()}


async def _offer_pending(net: Net, size: int) -> Path:
    """Offer a file of ``size`` bytes that nobody auto-accepts; returns it once the
    receiver holds the offer pending."""
    net.receiver.config = TransferConfig()
    src, _ = _file(net.tmp, size)
    tid = await net.sender.send_file(net.b.did, src)
    await until(lambda: _pending(net, tid), what="the offer")
    return src


def _pending(net: Net, tid: str) -> bool:
    try:
        return net.receiver.get(tid).state is TransferState.PENDING
    except UsageError:
        return False


async def test_a_row_the_store_refused_is_not_kept(net: Net) -> None:
    # send_file's row fails to commit (a full store): the caller hears so, and the kept
    # rows are read again, so no transfer the caller was told failed is offered later.
    from talos_sdk.errors import StorageFullError

    src, _ = _file(net.tmp, 1000)
    net.sender.list()  # the rows are kept from here on

    def full(kind: str, size: int) -> None:
        raise StorageFullError("map full")

    undo = net.a.writer.before("transfer", full)
    with pytest.raises(StorageFullError):
        await net.sender.send_file(net.b.did, src)
    undo()
    assert net.sender.list() == []


async def test_an_offer_accepted_by_hand_checks_the_disk_again(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Offers wait for a hand to accept them; meanwhile others may have taken the disk.
    import shutil

    from talos.transfer import incoming

    async with asyncio.timeout(LIMIT):
        await _offer_pending(net, 10_000)
        (tid,) = [i.tid for i in net.receiver.list()]
        free = shutil.disk_usage(net.receiver.files_dir).free
        monkeypatch.setattr(incoming, "DISK_RESERVE", free)
        await net.receiver.accept(tid)
        out = await net.sender.wait(tid)
    assert net.receiver.get(tid).state is TransferState.FAILED
    assert out.state is TransferState.FAILED and "not enough disk space" in out.error


async def test_a_closing_attempt_leaves_the_next_attempts_credit_alone(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A link drop cancels the app-channel attempt, whose file closes in a thread; the
    # next link re-offers at once, and the new attempt starts before the old one has
    # closed. The old attempt, finishing, must not take the new one's credit away (it
    # did: the new attempt died on a KeyError and the transfer stood still).
    await _no_bulk(net, window=2)
    close = OutgoingAttempt.close
    closes = 0
    released = threading.Event()

    def slow_first_close(self: OutgoingAttempt) -> None:
        nonlocal closes
        closes += 1
        if closes == 1:  # the cancelled attempt's close, in its thread
            released.wait(LIMIT)
        close(self)

    monkeypatch.setattr(OutgoingAttempt, "close", slow_first_close)
    on_credit = net.sender._on_credit
    epochs: set[int] = set()

    def credit(msg: Credit) -> None:
        epochs.add(msg.epoch)
        if msg.epoch > min(epochs) and msg.upto >= 6 and closes == 1:
            released.set()  # the new attempt is under way, with most of the file to go
        on_credit(msg)

    monkeypatch.setattr(net.sender, "_on_credit", credit)
    chunks = _count_app_chunks(net, monkeypatch)
    size = 16 << 20  # 64 chunks: the drop comes early in the file, even on a loaded machine
    src, _ = _file(net.tmp, size)
    try:
        async with asyncio.timeout(LIMIT):
            tid = await net.sender.send_file(net.b.did, src)
            await until(lambda: chunks[0] >= 4, what="the first chunks")
            link(net.a, net.b, False)
            link(net.a, net.b, True)
            await until(released.is_set, what="the next attempt under way")
            inc = await net.receiver.wait(tid)
            out = await net.sender.wait(tid)
    finally:
        released.set()
    assert inc.state is out.state is TransferState.COMPLETE, out.error
    assert Path(inc.path).read_bytes() == src.read_bytes()


async def test_more_drops_than_attempts_are_fine_while_each_commits_progress(net: Net) -> None:
    # MAX_ATTEMPTS counts attempts in a row that commit nothing: a long transfer over a
    # link that drops more often than that, but moves on between drops, completes.
    from talos.transfer.records import MAX_ATTEMPTS

    await _no_bulk(net, checkpoint_bytes=1 << 20, window=2)
    size = 12 << 20
    src, _ = _file(net.tmp, size)
    committed = [0]
    net.receiver.on_progress = lambda tid, offset: committed.__setitem__(0, offset)
    async with asyncio.timeout(3 * LIMIT):
        tid = await net.sender.send_file(net.b.did, src)
        for drop in range(MAX_ATTEMPTS + 1):
            await until(lambda d=drop: committed[0] >= (d + 1) << 20, what=f"progress {drop}")
            link(net.a, net.b, False)
            await asyncio.sleep(0.05)
            link(net.a, net.b, True)
        inc = await net.receiver.wait(tid)
    assert inc.state is TransferState.COMPLETE, inc.error
    assert Path(inc.path).read_bytes() == src.read_bytes()
