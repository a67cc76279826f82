"""Tests for talos.transfer.protocol: messages, chunk plan, states, safe names."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from talos.transfer.protocol import (
    COMMIT_LEN,
    Accept,
    Cancel,
    Chunk,
    ChunkPlan,
    Credit,
    Done,
    Event,
    Failed,
    Offer,
    Pending,
    Reject,
    TransferProtocolError,
    TransferState,
    bulk_client_proof,
    bulk_server_proof,
    decode_commit,
    decode_message,
    encode_commit,
    encode_message,
    is_final,
    next_state,
    numbered_name,
    safe_name,
)
from talos_sdk.errors import MalformedFrameError, OversizeError, UsageError

TID = bytes(range(16))

MESSAGES = [
    Offer(TID, 123, b"\x02" * 32, "report ü.pdf"),
    Offer(TID, 0, b"\x02" * 32, ""),
    Accept(TID, 4096, 3, 8, 40123, b"\x07" * 32, "127.0.0.1"),
    Accept(TID, 0, 0, 8, 0, bytes(32), ""),
    Pending(TID),
    Reject(TID, "quota exceeded"),
    Done(TID),
    Failed(TID, "sha256 mismatch"),
    Cancel(TID, "user"),
    Chunk(TID, 2, 17, b"sealed bytes"),
    Credit(TID, 2, 99),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: object) -> None:
    assert decode_message(encode_message(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_truncated_message_is_malformed(msg: object) -> None:
    wire = encode_message(msg)  # type: ignore[arg-type]
    wire = wire[:20] if isinstance(msg, Chunk) else wire[:-1]
    with pytest.raises(MalformedFrameError):
        decode_message(wire)


def test_bad_messages() -> None:
    with pytest.raises(MalformedFrameError):
        decode_message(b"\x63" + TID)
    with pytest.raises(MalformedFrameError):
        decode_message(b"\x01")
    with pytest.raises(MalformedFrameError):
        decode_message(encode_message(Done(TID)) + b"x")
    with pytest.raises(MalformedFrameError):
        decode_message(encode_message(Reject(TID, "ab"))[:-2] + b"\xff\xfe")
    with pytest.raises(OversizeError):
        decode_message(encode_message(Chunk(TID, 0, 0, bytes(1 << 20))))
    with pytest.raises(UsageError):
        encode_message(Done(b"short"))
    with pytest.raises(UsageError):
        encode_message(Offer(TID, 1, b"x", "n"))


@given(st.binary(max_size=200))
def test_decode_never_crashes(data: bytes) -> None:
    with contextlib.suppress(MalformedFrameError):
        decode_message(data)


def test_chunk_plan_accepts_exact_stream() -> None:
    plan = ChunkPlan(size=10, offset=0)
    assert plan.accept(4, final=False) == 0
    assert plan.accept(6, final=False) == 4
    assert not plan.finished
    assert plan.accept(COMMIT_LEN, final=True) == 10
    assert plan.finished


def test_chunk_plan_empty_file_is_just_the_commit() -> None:
    plan = ChunkPlan(size=0, offset=0)
    assert plan.accept(COMMIT_LEN, final=True) == 0


def test_chunk_plan_resumes_at_offset() -> None:
    plan = ChunkPlan(size=10, offset=6)
    assert plan.accept(4, final=False) == 6
    assert plan.accept(COMMIT_LEN, final=True) == 10


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        ([(11, False)], "more than the announced size"),
        ([(4, False), (7, False)], "more than the announced size"),
        ([(4, False), (COMMIT_LEN, True)], "stream ended at 4"),
        ([(10, False), (5, True)], "commit chunk of 5 bytes"),
        ([(0, False)], "empty data chunk"),
        ([(10, False), (COMMIT_LEN, True), (0, True)], "after the final"),
        ([(10, False), (COMMIT_LEN, True), (1, False)], "after the final"),
    ],
)
def test_chunk_plan_rejects_lying_sender(chunks: list[tuple[int, bool]], match: str) -> None:
    plan = ChunkPlan(size=10, offset=0)
    with pytest.raises(TransferProtocolError, match=match):
        for length, final in chunks:
            plan.accept(length, final)


def test_commit_round_trip_and_bad_lengths() -> None:
    digest, sig = b"\x01" * 32, b"\x02" * 64
    assert decode_commit(encode_commit(digest, sig)) == (digest, sig)
    with pytest.raises(TransferProtocolError, match="commit chunk of 95 bytes"):
        decode_commit(encode_commit(digest, sig)[:-1])
    with pytest.raises(UsageError):
        encode_commit(digest[:31], sig)


def test_chunk_plan_rejects_oversize_chunk() -> None:
    with pytest.raises(OversizeError):
        ChunkPlan(size=1 << 30, offset=0).accept((1 << 20) + 1, final=False)


def test_bulk_proofs_are_role_and_token_bound() -> None:
    token, nc, ns = b"t" * 32, b"c" * 32, b"s" * 32
    server = bulk_server_proof(token, TID, nc, ns)
    client = bulk_client_proof(token, TID, nc, ns)
    assert len(server) == len(client) == 32
    assert server != client
    assert bulk_client_proof(b"u" * 32, TID, nc, ns) != client
    assert bulk_client_proof(token, bytes(16), nc, ns) != client


def test_state_table() -> None:
    s = next_state(TransferState.OFFERED, Event.HOLD)
    assert s is TransferState.PENDING
    s = next_state(s, Event.ACCEPT)
    assert s is TransferState.ACTIVE
    assert next_state(s, Event.ACCEPT) is TransferState.ACTIVE
    assert next_state(s, Event.DONE) is TransferState.COMPLETE
    assert is_final(TransferState.COMPLETE)
    assert not is_final(TransferState.ACTIVE)
    with pytest.raises(TransferProtocolError, match="not allowed"):
        next_state(TransferState.COMPLETE, Event.ACCEPT)
    with pytest.raises(TransferProtocolError):
        next_state(TransferState.REJECTED, Event.DONE)
    # A transfer fails from any open state (the manager has no other way to end one).
    for open_state in (TransferState.OFFERED, TransferState.PENDING, TransferState.ACTIVE):
        assert next_state(open_state, Event.FAIL) is TransferState.FAILED
    with pytest.raises(TransferProtocolError):
        next_state(TransferState.COMPLETE, Event.FAIL)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("report.pdf", "report.pdf"),
        ("../../etc/passwd", "passwd"),
        ("/etc/shadow", "shadow"),
        ("..", "file"),
        (".", "file"),
        ("", "file"),
        ("...", "file"),
        ("a/b/..", "b"),
        ("C:\\Windows\\system32\\evil.dll", "evil.dll"),
        (".bashrc", "bashrc"),
        ("..hidden", "hidden"),
        ("na\x00me.txt", "name.txt"),
        ("bell\x07\n\r.txt", "bell.txt"),
        ("rtl\u202etxt.exe", "rtltxt.exe"),
        ("NUL", "_NUL"),
        ("con.txt", "_con.txt"),
        ("COM1.tar.gz", "_COM1.tar.gz"),
        ("trailing. . ", "trailing"),
        ('what?<is>:"this"|*', "what__is___this___"),
        ("  spaced  ", "spaced"),
        # a dot behind a space behind a dot: no hidden file
        (". .bashrc.sh", "bashrc.sh"),
        (" . .ssh.pub", "ssh.pub"),
        ("x/. ..hidden.tar.gz", "hidden.tar.gz"),
        ("CON .x", "_CON.x"),  # Windows drops the space: still a device name
    ],
)
def test_safe_name(raw: str, expected: str) -> None:
    assert safe_name(raw) == expected


def test_safe_name_bounds_length_keeping_extension() -> None:
    name = safe_name("é" * 500 + ".txt")
    assert name.endswith(".txt")
    assert len(name.encode()) <= 200


@given(st.text(max_size=300))
def test_safe_name_is_always_a_plain_component(raw: str) -> None:
    name = safe_name(raw)
    assert name
    assert "/" not in name and "\\" not in name and "\x00" not in name
    assert not name.startswith(".") and name == name.strip()
    assert len(name.encode()) <= 200
    assert safe_name(name) == name


def test_numbered_name() -> None:
    assert numbered_name("a.txt", 0) == "a.txt"
    assert numbered_name("a.txt", 1) == "a (1).txt"
    assert numbered_name("a.tar.gz", 2) == "a.tar (2).gz"
    assert numbered_name("README", 3) == "README (3)"
