"""The durable message pipeline: outbox, inbox, per-peer order and acks (docs/DESIGN.md "Storage").

Sequence numbers and the LMDB row layouts; the per-peer accept and ack state
is in :mod:`talos.seq_state`, and the node (talos/node.py) does the I/O. The
rules, per ordered pair of nodes:

* a sequence number is ``epoch << 32 | n``: ``epoch`` is the node's boot
  counter, durably incremented once per start (and by every offline enqueue),
  ``n`` counts per peer within the epoch. A number is never handed out twice,
  even after a crash that lost the outbox commit of a message already on the
  wire (docs/adr/0007-epoch-sequence-numbers.md);
* each message also carries ``prev``, the sequence number assigned before it
  to the same peer, sealed inside the frame. The receiver accepts a message iff
  ``prev <= delivered < seq``; ``seq <= delivered`` is a duplicate (dropped,
  re-acked), ``prev > delivered`` a gap (dropped, not acked: the sender resends
  from its oldest unacknowledged message);
* the sender may transmit a message while its outbox commit is in flight;
  ``send`` still returns only once that commit is durable;
* accepted messages are group-committed — inbox rows, block-log records,
  ``delivered`` and the session state in one durable transaction — and only
  then acknowledged with a cumulative :class:`~talos.link.wire.Ack`;
* an ack lets the sender drop every outbox row up to it.

Row layouts (big-endian)::

    outbox  DID || 0x00 || seq u64      -> msg id (16) || ts_ms u64 || prev u64
                                           || text (UTF-8)
    inbox   n u64 (arrival order)       -> msg id (16) || ts_ms u64 || seq u64
                                           || len u16 || from DID || text (UTF-8)
    meta    b"out:" || DID              -> last assigned seq u64
    meta    b"skip:" || DID             -> seq u64 || prev u64: the message ``seq`` never
                                           goes (dropped by ``talosd outbox --drop``, or
                                           failed as too large); while it is the last
                                           assigned, the next message names ``prev``
    meta    b"in:" || DID               -> last delivered seq u64
    meta    b"epoch"                    -> current boot epoch u64
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from talos.store import Txn
from talos_sdk.errors import StorageError, TalosError, UsageError

__all__ = [
    "META_INBOX_PRUNED",
    "MSG_OVERHEAD",
    "PRUNE_CHUNK",
    "InboxEntry",
    "MessageDroppedError",
    "MessageTooLargeError",
    "OutboxEntry",
    "advance_epoch",
    "allow_row",
    "bump_epoch",
    "count_inbox_shares",
    "decode_inbox",
    "decode_outbox",
    "drop_outbox",
    "encode_inbox",
    "encode_outbox",
    "epoch_of",
    "inbox_key",
    "iter_inbox",
    "iter_outbox",
    "last_inbox_n",
    "make_seq",
    "meta_inbox_bytes",
    "next_prev",
    "next_seq",
    "note_last",
    "note_skipped",
    "outbox_key",
    "prune_inbox",
    "put_row",
    "text_limit",
]

_U64 = struct.Struct(">Q")
_OUT = struct.Struct(">16sQQ")
_SKIP = struct.Struct(">QQ")
_IN = struct.Struct(">16sQQH")
MSG_ID_LEN: Final = 16
EPOCH_SHIFT: Final = 32
MAX_N: Final = (1 << EPOCH_SHIFT) - 1
_EPOCH_KEY: Final = b"epoch"
#: Epochs skipped after restoring a backup (docs/operations.md "Backups and restore"):
#: more than the runs the original home can have had since, so no number repeats.
RESTORE_EPOCH_STEP: Final = 1 << 16


#: Bytes a sealed MSG frame adds to its text (ratchet header with ML-KEM material,
#: both DIDs, signature, AEAD tag; measured up to ~1.6 KiB), with room to spare
#: (docs/PROTOCOL.md "Link protocol", Message size).
MSG_OVERHEAD: Final = 3072


class MessageTooLargeError(UsageError):
    """A message text that cannot fit in one frame the receiver accepts (docs/PROTOCOL.md
    "Link protocol", Message size): the caller's misuse, not a peer's protocol fault, so a
    :class:`UsageError` only (the API answers 400)."""


class MessageDroppedError(TalosError):
    """A queued message the user dropped from the outbox before the peer acknowledged it
    (``talosd outbox PEER --drop``): told to a ``send --wait`` still waiting for it."""


def text_limit(max_frame: int) -> int:
    """The largest message text (UTF-8 bytes) whose MSG frame fits in ``max_frame``."""
    return max(0, max_frame - MSG_OVERHEAD)


def make_seq(epoch: int, n: int) -> int:
    """The u64 sequence number of the ``n``-th message to a peer in boot ``epoch``."""
    return (epoch << EPOCH_SHIFT) | n


def epoch_of(seq: int) -> int:
    return seq >> EPOCH_SHIFT


def next_seq(last: int, epoch: int) -> int:
    """The number after ``last`` (the peer's last assigned) in ``epoch``."""
    if epoch_of(last) == epoch:
        if last & MAX_N == MAX_N:
            raise UsageError("2**32 - 1 messages to one peer in one run: restart the node")
        return last + 1
    if epoch_of(last) > epoch:
        raise UsageError("boot epoch went backwards (store copied from another run?)")
    return make_seq(epoch, 1)


def bump_epoch(txn: Txn) -> int:
    """Start a new boot epoch inside ``txn`` (commit it durably before using it)."""
    epoch = get_u64(txn, "meta", _EPOCH_KEY) + 1
    put_u64(txn, "meta", _EPOCH_KEY, epoch)
    return epoch


def advance_epoch(txn: Txn, step: int = RESTORE_EPOCH_STEP) -> int:
    """Jump the boot epoch forward by ``step`` (a restored store's epoch went back in time).

    Peers drop numbers at or below what they delivered as duplicates, so a
    restored node must number above every epoch the original used since the
    backup (ADR 0007). Returns the new epoch; :class:`UsageError` if it would
    no longer fit the sequence number's 32 epoch bits.
    """
    if step < 1:
        raise UsageError(f"epoch step must be positive, got {step}")
    epoch = get_u64(txn, "meta", _EPOCH_KEY) + step
    if epoch >> (64 - EPOCH_SHIFT):
        raise UsageError(f"boot epoch {epoch} does not fit in {64 - EPOCH_SHIFT} bits")
    put_u64(txn, "meta", _EPOCH_KEY, epoch)
    return epoch


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """A message waiting for the peer's ack."""

    peer: str
    seq: int
    msg_id: bytes
    ts_ms: int
    text: str
    prev: int = -1  # the seq assigned before this one; -1 means ``seq - 1``
    #: ``text`` as UTF-8, encoded once: the size checks, the seal and the outbox row use it.
    data: bytes = field(default=b"", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.prev < 0:
            object.__setattr__(self, "prev", self.seq - 1)
        if not self.data and self.text:
            object.__setattr__(self, "data", self.text.encode())


@dataclass(frozen=True, slots=True)
class InboxEntry:
    """A message committed to our inbox."""

    n: int
    msg_id: bytes
    sender: str
    seq: int
    ts_ms: int
    text: str

    def to_json(self, names: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The message as ``talosd inbox --json`` and the ``inbox`` op show it, running
        or stopped alike (``names``: DID -> local peer name)."""
        return {
            "n": self.n,
            "id": self.msg_id.hex(),
            "from": self.sender,
            "from_name": names.get(self.sender) if names else None,
            "text": self.text,
            "ts": self.ts_ms,
        }


#: JSON bytes of message texts one inbox page carries at most (the local ``inbox`` op,
#: ``GET /v1/inbox``): a text may be about 1 MiB and grow sixfold escaped (control
#: characters), so 1,000 of them made a reply of gigabytes. Past it the page stops
#: early and its ``next`` says where to go on.
INBOX_PAGE_BYTES: Final = 16 << 20


def fit_page(entries: list[InboxEntry], budget: int = INBOX_PAGE_BYTES) -> list[InboxEntry]:
    """The leading ``entries`` whose texts, as JSON, fit ``budget`` bytes (at least one)."""
    size = 0
    for i, entry in enumerate(entries):
        size += len(orjson.dumps(entry.text))
        if i and size > budget:
            return entries[:i]
    return entries


def outbox_prefix(peer: str) -> bytes:
    return peer.encode() + b"\x00"


def outbox_key(peer: str, seq: int) -> bytes:
    return outbox_prefix(peer) + _U64.pack(seq)


def encode_outbox(msg_id: bytes, ts_ms: int, prev: int, text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return _OUT.pack(msg_id, ts_ms, prev) + data


def decode_outbox(key: bytes, value: bytes) -> OutboxEntry:
    # The seq is the last 8 bytes: it may itself contain 0x00 bytes.
    msg_id, ts, prev = _OUT.unpack_from(value)
    data = value[_OUT.size :]
    seq = _U64.unpack(key[-8:])[0]
    return OutboxEntry(key[:-9].decode(), seq, msg_id, ts, data.decode(), prev, data)


def iter_outbox(txn: Txn, peer: str, after_seq: int = 0) -> Iterator[OutboxEntry]:
    """Outbox rows for ``peer`` with seq > ``after_seq``, in order."""
    prefix = outbox_prefix(peer)
    for key, value in txn.items("outbox", outbox_key(peer, after_seq + 1)):
        if not key.startswith(prefix) or len(key) != len(prefix) + 8:
            return
        yield decode_outbox(key, value)


def inbox_key(n: int) -> bytes:
    """The inbox key of the ``n``-th arrival."""
    return _U64.pack(n)


def iter_inbox(txn: Txn, after: int = 0) -> Iterator[InboxEntry]:
    """Inbox entries with arrival number above ``after``, in arrival order."""
    if after >= 2**64 - 1:
        return  # no arrival number is above the largest one
    for key, value in txn.items("inbox", inbox_key(after + 1)):
        yield decode_inbox(key, value)


#: ``meta``: the n of the last message pruned, from which numbering goes on in an empty inbox.
META_INBOX_PRUNED = b"inbox-pruned"
#: Inbox messages deleted per transaction when pruning: the writer's other jobs wait for
#: one such transaction at most.
PRUNE_CHUNK = 10_000


def last_inbox_n(txn: Txn) -> int:
    """The arrival number of the newest inbox message, else of the last one pruned (0: none)."""
    last = txn.last("inbox")
    if last is not None:
        return int(_U64.unpack(last[0])[0])
    return get_u64(txn, "meta", META_INBOX_PRUNED)


def prune_inbox(txn: Txn, through: int, limit: int) -> tuple[int, dict[str, int], int]:
    """Delete at most ``limit`` of the oldest inbox messages numbered up to ``through``:
    how many, the bytes freed per sender (taken off their inbox shares) and the pruned
    mark after it (``META_INBOX_PRUNED``: a share read with a mark this high already
    has them off). A ``through`` past the last message is refused: it would delete
    unseen arrivals."""
    top = last_inbox_n(txn)
    if through > top:
        raise UsageError(
            f"'through' ({through}) is past the last message in the inbox (n={top}): "
            "pass the n of a message you have seen"
        )
    doomed: list[bytes] = []
    freed: dict[str, int] = {}
    for key, value in txn.items("inbox"):
        if _U64.unpack(key)[0] > through or len(doomed) == limit:
            break
        sender = _inbox_sender(value)
        freed[sender] = freed.get(sender, 0) + len(value)
        doomed.append(key)
    if not doomed:
        return 0, freed, get_u64(txn, "meta", META_INBOX_PRUNED)
    pruned = max(get_u64(txn, "meta", META_INBOX_PRUNED), _U64.unpack(doomed[-1])[0])
    for key in doomed:  # after the walk: LMDB cursors do not survive deletes under them
        txn.delete("inbox", key)
    for sender, size in freed.items():
        key = meta_inbox_bytes(sender)
        put_u64(txn, "meta", key, max(0, get_u64(txn, "meta", key) - size))
    put_u64(txn, "meta", META_INBOX_PRUNED, pruned)
    return len(doomed), freed, pruned


def encode_inbox(msg_id: bytes, sender: str, seq: int, ts_ms: int, text: str) -> bytes:
    did = sender.encode()
    return _IN.pack(msg_id, ts_ms, seq, len(did)) + did + text.encode()


def _inbox_sender(value: bytes) -> str:
    """The sender DID of an inbox row, without decoding its text (the share sums)."""
    try:
        n = _IN.unpack_from(value)[3]
        return value[_IN.size : _IN.size + n].decode()
    except (struct.error, UnicodeDecodeError) as exc:
        raise StorageError(f"corrupt inbox row: {exc}") from None


def decode_inbox(key: bytes, value: bytes) -> InboxEntry:
    try:
        msg_id, ts, seq, n = _IN.unpack_from(value)
        did = value[_IN.size : _IN.size + n].decode()
        text = value[_IN.size + n :].decode()
    except (struct.error, UnicodeDecodeError) as exc:
        raise StorageError(f"corrupt inbox row: {exc}") from None
    return InboxEntry(_U64.unpack(key)[0], msg_id, did, seq, ts, text)


def meta_out(peer: str) -> bytes:
    return b"out:" + peer.encode()


def allow_row(txn: Txn, did: str) -> None:
    """A ``peers`` row without an address for ``did`` (allowed to link, never dialled),
    unless the table knows it already."""
    if txn.get("peers", did.encode()) is None:
        txn.put("peers", did.encode(), b"")


def meta_in(peer: str) -> bytes:
    return b"in:" + peer.encode()


def meta_inbox_bytes(peer: str) -> bytes:
    """The bytes of the inbox rows ``peer``'s messages take (its inbox share, NodeConfig)."""
    return b"inbox-bytes:" + peer.encode()


#: Set once the per-sender counts were taken from the inbox rows themselves.
META_INBOX_COUNTED = b"inbox-bytes-counted"


def count_inbox_shares(txn: Txn) -> bool:
    """Once per store, at a node's start: each sender's inbox bytes summed from its rows;
    True if it counted. A store written before the counts were kept holds rows that no
    count covers, and their senders' shares would read emptier than they are."""
    if txn.get("meta", META_INBOX_COUNTED) is not None:
        return False
    totals: dict[str, int] = {}
    for _, value in txn.items("inbox"):
        sender = _inbox_sender(value)
        totals[sender] = totals.get(sender, 0) + len(value)
    for sender, size in totals.items():
        put_u64(txn, "meta", meta_inbox_bytes(sender), size)
    txn.put("meta", META_INBOX_COUNTED, b"\x01")
    return True


def get_u64(txn: Txn, db: str, key: bytes) -> int:
    raw = txn.get(db, key)
    return 0 if raw is None else _U64.unpack(raw)[0]


def put_u64(txn: Txn, db: str, key: bytes, value: int) -> None:
    txn.put(db, key, _U64.pack(value))


def enqueue(txn: Txn, peer: str, msg_id: bytes, ts_ms: int, text: str, epoch: int = 0) -> int:
    """Assign the next sequence number for ``peer`` in ``epoch`` and queue the message."""
    last, prev = next_prev(txn, peer)
    seq = next_seq(last, epoch)
    put_row(txn, OutboxEntry(peer, seq, msg_id, ts_ms, text, prev))
    return seq


def meta_skip(peer: str) -> bytes:
    return b"skip:" + peer.encode()


def next_prev(txn: Txn, peer: str) -> tuple[int, int]:
    """``peer``'s last assigned seq, and the ``prev`` the next message names: the
    last assigned, unless dropped messages end the queue (then what came before them)."""
    last = get_u64(txn, "meta", meta_out(peer))
    skip = _skip_entry(txn, peer)
    if skip is not None and skip[0] == last:
        return last, skip[1]
    return last, last


def _skip_entry(txn: Txn, peer: str) -> tuple[int, int] | None:
    raw = txn.get("meta", meta_skip(peer))
    if raw is None or len(raw) != _SKIP.size:
        return None
    seq, prev = _SKIP.unpack(raw)
    return seq, prev


def drop_outbox(txn: Txn, peer: str, last: int, prev: int) -> list[int]:
    """Delete the outbox rows of ``peer`` up to ``last``, the last assigned seq (the user
    dropped them, ``talosd outbox --drop``); the next message names ``prev`` (a seq the
    peer holds) instead of ``last``. Returns the dropped rows' seqs.

    The numbers stay used (``out`` keeps ``last``): a dropped message may have
    reached the peer, and its number again would read there as a duplicate
    (docs/adr/0007-epoch-sequence-numbers.md, "Dropping queued messages").
    """
    dropped = _delete_through(txn, peer, last)
    note_last(txn, peer, last, prev)
    return dropped


def note_last(txn: Txn, peer: str, last: int, follows: int) -> None:
    """``peer``'s last assigned seq is at least ``last``, and the next message names
    ``follows`` (a drop, or numbers kept only in memory until now: ``peers remove``)."""
    note_assigned(txn, peer, last)
    if follows != last:
        note_skipped(txn, peer, last, follows)


def note_skipped(txn: Txn, peer: str, seq: int, prev: int) -> None:
    """The message ``seq`` will never reach ``peer`` (dropped, or failed as too large):
    if no message is assigned after it, the next one names ``prev`` (:func:`next_prev`).

    Only the newest such number matters, and for one noted twice (a drop, and a
    failure found as it was sent) the lower ``prev``: any number at or below what
    the peer holds is a ``prev`` it accepts.
    """
    skip = _skip_entry(txn, peer)
    if skip is not None and (skip[0] > seq or (skip[0] == seq and skip[1] <= prev)):
        return
    txn.put("meta", meta_skip(peer), _SKIP.pack(seq, prev))


def put_row(txn: Txn, row: OutboxEntry) -> None:
    """Write an outbox row whose seq the caller assigned, and remember it as the last.

    A ``prev`` naming a message that never goes (``skip:DID``) is written as what that
    one said instead, whatever the caller's memory knew when it built the row.
    """
    prev = row.prev
    skip = _skip_entry(txn, row.peer)
    if skip is not None and skip[0] == prev:
        prev = skip[1]
    value = encode_outbox(row.msg_id, row.ts_ms, prev, row.data)
    txn.put("outbox", outbox_key(row.peer, row.seq), value)
    note_assigned(txn, row.peer, row.seq)


def note_assigned(txn: Txn, peer: str, seq: int) -> None:
    """Raise the peer's last assigned seq to ``seq`` (the next run's ``prev``)."""
    if seq > get_u64(txn, "meta", meta_out(peer)):
        put_u64(txn, "meta", meta_out(peer), seq)


def drop_acked(txn: Txn, peer: str, upto: int) -> int:
    """Delete outbox rows of ``peer`` up to ``upto``; returns how many."""
    return len(_delete_through(txn, peer, upto))


def _delete_through(txn: Txn, peer: str, upto: int) -> list[int]:
    """Delete outbox rows of ``peer`` up to ``upto``; returns their seqs."""
    # Keys only, stopping at the first row above ``upto``: decoding every row of the
    # outbox per ack made an ack cost O(messages in flight).
    prefix = outbox_prefix(peer)
    end = outbox_key(peer, upto)
    keys = []
    for key, _ in txn.items("outbox", prefix):
        if key > end or not key.startswith(prefix) or len(key) != len(prefix) + 8:
            break
        keys.append(key)
    for k in keys:
        txn.delete("outbox", k)
    return [_U64.unpack_from(key, len(prefix))[0] for key in keys]
