"""``talosd status`` / ``outbox`` for people (talos/status_text.py)."""

from __future__ import annotations

from talos import pipeline as pl
from talos.status_text import EPOCH_SHIFT, outbox_lines, seq_text, status_lines

DID = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"


def test_sequence_numbers_read_as_epoch_dot_n() -> None:
    assert EPOCH_SHIFT == pl.EPOCH_SHIFT
    assert seq_text(pl.make_seq(1, 1)) == "1.1"
    assert seq_text(4294967297) == "1.1"
    assert seq_text(pl.make_seq(7, 65536)) == "7.65536"
    assert seq_text(0) == "0.0"


def _status(**link: object) -> dict[str, object]:
    row = {"did": DID, "name": "bob", "state": "ready", "outbox": 0, **link}
    return {
        "did": "did:key:me",
        "listen": None,
        "auth_suite": "ed25519",
        "require_pq": True,
        "chain_height": 4,
        "queues": {"outbox": 3, "inbox": 1, "log_pending": 0},
        "sessions": [{}],
        "links": [row],
    }


def test_a_log_with_no_block_says_so_rather_than_height_minus_one() -> None:
    text = "\n".join(status_lines({**_status(), "chain_height": -1}))
    assert "chain     no block sealed yet," in text and "-1" not in text


def test_status_summary_shows_state_refusal_queues_and_epoch_n() -> None:
    refused = {
        "kind": "refused_by_peer",
        "code": 4003,
        "at_ms": 0,
        "message": f"{DID} refused the link: this node is not on its allow list",
    }
    seqs = {"sent": pl.make_seq(2, 5), "delivered": pl.make_seq(1, 9)}
    lines = status_lines(_status(state="refused_by_peer", outbox=3, last_refusal=refused, **seqs))
    text = "\n".join(lines)
    assert "post-quantum links: required" in text
    assert "chain     height 4" in text and "outbox 3, inbox 1" in text
    assert f"  {DID} (bob)" in lines
    assert "    link      refused by peer" in lines
    assert f"{DID} refused the link: this node is not on its allow list" in text
    assert "    outbox    3  (sent 2.5)" in lines
    assert "    received  up to 1.9 from it, in order" in lines  # its messages, not ours


def test_peer_chosen_words_cannot_drive_the_terminal() -> None:
    lines = status_lines(_status(state="idle", why="bad\x1b[2Jwords"))
    assert all("\x1b" not in line for line in lines)
    assert "    why       bad\\x1b[2Jwords" in lines


def test_outbox_lines_say_why_nothing_moves() -> None:
    assert outbox_lines([]) == ["outbox empty"]
    message = {"id": "ab" * 16, "seq_text": "3.1", "ts": 0, "state": "queued", "text": "x" * 90}
    lines = outbox_lines(
        [
            {
                "did": DID,
                "name": None,
                "state": "unreachable",
                "why": "peer unreachable: connection refused",
                "count": 5,
                "messages": [message],
            }
        ]
    )
    assert lines[0] == f"{DID}: 5 queued, link unreachable"
    assert lines[1] == "  not moving: peer unreachable: connection refused"
    assert "3.1" in lines[2] and "queued" in lines[2] and "…" in lines[2]
    assert lines[3] == "  ... and 4 more"


def test_the_relay_line_reads_as_words_with_its_counters() -> None:
    status = _status()
    status["relay"] = {
        "servers": ["nats://127.0.0.1:4222"],
        "connected": True,
        "token": "t",
        "streams": 2,
        "relay_packets_rejected": 0,
        "relay_packets_dropped": 1,
        "relay_packets_forged": 3,
    }
    assert (
        "relay     connected to nats://127.0.0.1:4222, 2 stream(s),"
        " relay_packets_rejected 0, relay_packets_dropped 1, relay_packets_forged 3"
    ) in status_lines(status)
