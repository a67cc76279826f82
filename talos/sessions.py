"""Double Ratchet sessions with linked peers: prekeys, X3DH over the link, persistence.

Setup (docs/PROTOCOL.md "Link protocol", after the handshake): both sides send
a :class:`~talos.link.wire.SessionOffer` (own prekey bundle + the id of the
session it holds with the other side). Equal non-empty ids: the stored session
is resumed. Otherwise the side with the smaller DID runs X3DH (hybrid
``x25519-mlkem768`` when both support it) against the peer's bundle and sends
the first ratchet message in a :class:`~talos.link.wire.SessionInit`; the peer
accepts it in place of any older session and answers with a
:class:`~talos.link.wire.SessionAck` so the initiator stops attaching the X3DH
initial data. Session id = SHA-256(initial message)[:16] on both sides.

Persistence rules are in docs/adr/0001-session-persistence.md: the node writes
:meth:`SessionManager.snapshot` bytes in the same transaction as the durable
message commit, flushes dirty sessions periodically without sync, and throws
every session away after an unclean stop.

Message frames are sealed with :class:`talos_sdk.frames.RatchetFrameCrypto`
(signed commitment inside the ciphertext); their payload is
``msg id (16) || prev seq u64 || text`` so the ``prev`` link the receiver
orders by (talos/pipeline.py) is authenticated and committed to. Sealing also
returns the sender's own audit record (same commitment bytes and signature the
receiver logs; docs/DESIGN.md "Block log"). App-channel frames are sealed with
the session alone, unsigned: the link is authenticated and the AEAD
authenticates the sender, and a per-frame Ed25519 signature would cost more
than the frame (docs/DESIGN.md performance targets).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from talos.chain.block import Record
from talos.link import wire
from talos.pipeline import OutboxEntry
from talos.store import Txn
from talos_sdk.budget import TokenBucket
from talos_sdk.bundle import (
    MAX_ONE_TIME,
    SUITE_HYBRID,
    SUITE_X25519,
    PrekeyBundle,
)
from talos_sdk.errors import BundleError, MalformedFrameError, ProtocolError, UsageError
from talos_sdk.frames import Frame, RatchetFrameCrypto
from talos_sdk.prekeys import MAX_PQ_ONE_TIME, PrekeySecrets
from talos_sdk.ratchet import MAX_SKIP, Session
from talos_sdk.wallet import Wallet, verify_with_public_key

__all__ = [
    "BadMessageSignatureError",
    "MessageSignatureError",
    "Opened",
    "SessionManager",
    "UnknownSessionError",
    "UnsignedMessageError",
    "load_secrets",
]

_SECRETS_KEY = b"secrets"
_APP_AD = b"talos/app/v1"
_SID_LEN = 16
_U16 = struct.Struct(">H")
#: Skipped-key derivations a peer's headers may make this node do: a burst of two
#: whole chains' MAX_SKIP (messages lost on both, the worst honest case), refilled
#: at 200 a second. Forged headers cost ~1 us of HMAC per key before failing: a
#: peer sending them is held to ~0.2 ms of CPU a second, where it had 2.4 ms a frame.
#: Each peer has two such budgets: its links' frames (the link proved who sent them)
#: and mail that names it (a relay mailbox envelope does not: anyone on the relay can
#: claim any sender, and must not spend what the peer's own frames need).
SKIP_BURST = 2 * MAX_SKIP
SKIP_RATE = 200.0
#: Peers whose budgets are kept (a re-keyed session keeps its peer's): the oldest go.
_MAX_BUDGETS = 4096
_U64 = struct.Struct(">Q")
_MSG_HEAD = 16 + _U64.size
MSG_FRAME_TYPE = 1  # talos_sdk.frames Frame.type of a durable text message


class UnknownSessionError(ProtocolError):
    """A frame arrived for a peer we hold no session with."""


class MessageSignatureError(ProtocolError):
    """A MSG frame whose commitment is not signed by its sender: refused at open."""


class UnsignedMessageError(MessageSignatureError):
    """A MSG frame without the sender's signature over its commitment."""


class BadMessageSignatureError(MessageSignatureError):
    """A MSG frame flagged as signed whose signature does not verify for the sender."""


@dataclass(frozen=True, slots=True)
class Opened:
    """A decrypted durable message and the audit record to commit with it."""

    msg_id: bytes
    seq: int
    ts_ms: int
    text: str
    record: Record
    prev: int


@dataclass(slots=True)
class _Entry:
    sid: bytes
    session: Session
    crypto: RatchetFrameCrypto | None = None


class _KeepingSigner:
    """The wallet as RatchetFrameCrypto sees it, keeping the last signature it made.

    The frame sealer signs the commitment internally; the sender's audit record
    needs exactly those bytes and that signature, and Ed25519 twice per
    message would double the hot path's costliest step.
    """

    __slots__ = ("_wallet", "did", "last")

    def __init__(self, wallet: Wallet) -> None:
        self._wallet = wallet
        self.did = wallet.did
        self.last: tuple[bytes, bytes] = (b"", b"")

    def sign(self, data: bytes) -> bytes:
        sig = self._wallet.sign(data)
        self.last = (data, sig)
        return sig


def _sid(initial_message: bytes) -> bytes:
    return hashlib.sha256(initial_message).digest()[:_SID_LEN]


def load_secrets(txn: Txn) -> PrekeySecrets | None:
    """Our stored prekey secrets, if any."""
    raw = txn.get("prekeys", _SECRETS_KEY)
    return None if raw is None else PrekeySecrets.from_bytes(raw)


class SessionManager:
    """Our prekey secrets and one ratchet session per peer, in memory; LMDB via the node."""

    def __init__(
        self,
        store: Any,
        wallet: Wallet,
        *,
        pq: bool,
        one_time: int,
        ratchet_every: int,
        ratchet_max_age: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        pq_one_time: int = 0,
        prekey_rotation: float | None = None,
        prekey_grace: float = 0.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._wallet = wallet
        self._pq = pq
        self._one_time = one_time
        self._pq_one_time = pq_one_time if pq else 0
        # Signed prekey rotation (talos_sdk/prekeys.py): seconds of wall time, which
        # survives restarts, unlike the monotonic clock of the ratchet policy.
        self._rotation = prekey_rotation
        self._grace = prekey_grace
        self._wall = wall_clock
        # ADR 0002: 1 = a DH step every turn; > 1 = lazy, bounded by count and age.
        self._ratchet_every = ratchet_every
        self._ratchet_max_age = ratchet_max_age if ratchet_every > 1 else None
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._dirty: set[str] = set()
        self._secrets: PrekeySecrets | None = None
        #: peer DID -> the one-time prekey id (X25519, ML-KEM) offered to that peer only.
        self._reserved: dict[str, int] = {}
        self._reserved_pq: dict[str, int] = {}
        self._signer = _KeepingSigner(wallet)
        self._skip_budgets: dict[str, tuple[TokenBucket, TokenBucket]] = {}  # link, mail
        self._opening_mail = False

    # --- persistence ---------------------------------------------------------------------------

    def load(self, txn: Txn, *, discard: bool) -> int:
        """Load prekeys (creating them once) and sessions; ``discard`` drops every session."""
        raw = txn.get("prekeys", _SECRETS_KEY)
        if raw is None:
            self._secrets = PrekeySecrets.generate(
                self._wallet,
                one_time=self._one_time,
                pq=self._pq,
                now=int(self._wall()),
                pq_one_time=self._pq_one_time,
            )
            txn.put("prekeys", _SECRETS_KEY, self._secrets.to_bytes())
        else:
            self._secrets = PrekeySecrets.from_bytes(raw)
            self.maintain_prekeys(txn)
        if discard:
            n = txn.count("sessions")
            txn.clear("sessions")
            return n
        for key, value in txn.items("sessions"):
            (n,) = _U16.unpack_from(value)
            sid = value[2 : 2 + n]
            session = Session.from_bytes(value[2 + n :])
            self._apply_policy(session)
            self._install(key.decode(), sid, session)
        self._dirty.clear()
        return len(self._entries)

    def snapshot(self, peers: set[str] | list[str]) -> dict[str, bytes]:
        """Serialised state of ``peers`` (for the commit txn); they stop being dirty."""
        out: dict[str, bytes] = {}
        for did in peers:
            entry = self._entries.get(did)
            if entry is not None:
                out[did] = _U16.pack(len(entry.sid)) + entry.sid + entry.session.to_bytes()
            self._dirty.discard(did)
        return out

    def snapshot_dirty(self) -> dict[str, bytes]:
        return self.snapshot(list(self._dirty))

    def snapshot_all(self) -> dict[str, bytes]:
        return self.snapshot(list(self._entries))

    def persist(self, txn: Txn, snaps: dict[str, bytes]) -> None:
        """Write snapshots inside the caller's transaction."""
        for did, blob in snaps.items():
            txn.put("sessions", did.encode(), blob)

    def persist_establish(self, txn: Txn, peer: str) -> None:
        """A new session (and possibly a consumed one-time prekey) is written durably."""
        self.persist(txn, self.snapshot([peer]))
        if self._entries.get(peer) is None:
            txn.delete("sessions", peer.encode())
        assert self._secrets is not None
        txn.put("prekeys", _SECRETS_KEY, self._secrets.to_bytes())

    def prekeys_due(self) -> bool:
        """Whether :meth:`maintain_prekeys` has something to do (cheap; no write)."""
        secrets, now = self.secrets, int(self._wall())
        rotate = self._rotation is not None and secrets.rotation_due(now, int(self._rotation))
        return rotate or secrets.expire_due(now)

    def maintain_prekeys(self, txn: Txn) -> bool:
        """Rotate the signed (and last-resort ML-KEM) prekey when due, delete retired
        ones past their grace period; written in ``txn`` if anything changed."""
        secrets, now = self.secrets, int(self._wall())
        changed = secrets.expire(now)
        if self._rotation is not None and secrets.rotation_due(now, int(self._rotation)):
            secrets.rotate(self._wallet, now=now, grace=int(self._grace))
            changed = True
        if changed:
            txn.put("prekeys", _SECRETS_KEY, secrets.to_bytes())
        return changed

    # --- setup over the link -------------------------------------------------------------------

    @property
    def secrets(self) -> PrekeySecrets:
        if self._secrets is None:
            raise UsageError("SessionManager.load() has not run")
        return self._secrets

    def offer(self, peer: str) -> wire.SessionOffer:
        """Our bundle for ``peer``, carrying the one OPK reserved for it (none if ``one_time=0``).

        Every peer sees a different OPK: two peers setting up sessions at once
        must never both pick the same one. The OPKs are outside the
        bundle signature (talos_sdk/bundle.py), so the subset needs no new one.
        """
        secrets = self.secrets
        # Reserving may mint one-time keys: take the bundle after it.
        opk = _reserve(
            self._reserved,
            peer,
            self._one_time,
            secrets.one_time_ids,
            MAX_ONE_TIME,
            secrets.add_one_time,
        )
        pq_opk = _reserve(
            self._reserved_pq,
            peer,
            self._pq_one_time,
            secrets.pq_one_time_ids,
            MAX_PQ_ONE_TIME,
            functools.partial(secrets.add_pq_one_time, self._wallet),
        )
        bundle = secrets.bundle()
        entry = self._entries.get(peer)
        sid = entry.sid if entry else b""
        keys = dict(bundle.one_time)
        pq_keys = {i: (k, sig) for i, k, sig in bundle.pq_one_time}
        bundle = dataclasses.replace(
            bundle,
            one_time=() if opk is None else ((opk, keys[opk]),),
            pq_one_time=() if pq_opk is None else ((pq_opk, *pq_keys[pq_opk]),),
        )
        return wire.SessionOffer(bundle.to_bytes(), sid)

    def on_offer(
        self,
        peer: str,
        offer: wire.SessionOffer,
        suites: tuple[str, ...],
        binding: bytes = b"",
    ) -> wire.SessionInit | None:
        """Resume, initiate (returns the SessionInit to send), or wait for the peer's init.

        ``binding`` is the link's handshake hash (docs/PROTOCOL.md "Link
        handshake"): it is the associated data of the init's and the ack's
        ratchet messages, so a session setup only completes on the link it began on.
        """
        bundle = PrekeyBundle.from_bytes(offer.bundle)
        bundle.verify()
        if bundle.did != peer:
            raise BundleError("prekey bundle belongs to another DID than the link peer")
        entry = self._entries.get(peer)
        if entry is not None and offer.session_id == entry.sid:
            return None
        self.drop(peer)
        if self._wallet.did > peer:
            return None  # the peer initiates
        suite = SUITE_X25519
        if self._pq and SUITE_HYBRID in suites and SUITE_HYBRID in bundle.suites:
            suite = SUITE_HYBRID
        session = Session.initiate(
            self._wallet,
            self.secrets,
            bundle,
            suite=suite,
            ratchet_every=self._ratchet_every,
            ratchet_max_age=self._ratchet_max_age,
            clock=self._clock,
        )
        first = session.encrypt(b"", binding)
        sid = _sid(first)
        self._install(peer, sid, session)
        return wire.SessionInit(sid, first)

    def on_init(self, peer: str, init: wire.SessionInit, binding: bytes = b"") -> wire.SessionAck:
        """Accept the peer's X3DH initial message, replacing any session we hold."""
        if _sid(init.payload) != init.session_id:
            raise MalformedFrameError("session id does not match the initial message")
        if self._wallet.did < peer:
            raise ProtocolError("session init from the side that must respond")
        session, _ = Session.respond(
            self._wallet,
            self.secrets,
            init.payload,
            ad=binding,
            ratchet_every=self._ratchet_every,
            ratchet_max_age=self._ratchet_max_age,
            clock=self._clock,
        )
        if session.peer_did != peer:
            raise ProtocolError("X3DH initiator is not the link peer")
        self._install(peer, init.session_id, session)
        return wire.SessionAck(session.encrypt(b"", binding))

    def on_ack(self, peer: str, ack: wire.SessionAck, binding: bytes = b"") -> None:
        self._get(peer).session.decrypt(ack.body, binding)
        self._dirty.add(peer)

    def _apply_policy(self, session: Session) -> None:
        session.ratchet_every = self._ratchet_every
        session.ratchet_max_age = self._ratchet_max_age
        session.clock = self._clock
        session.check_policy()

    def _install(self, peer: str, sid: bytes, session: Session) -> None:
        budgets = self._skip_budgets.get(peer)
        if budgets is None:
            if len(self._skip_budgets) >= _MAX_BUDGETS:
                del self._skip_budgets[next(iter(self._skip_budgets))]
            budgets = self._skip_budgets[peer] = (
                TokenBucket(SKIP_RATE, SKIP_BURST, self._clock),
                TokenBucket(SKIP_RATE, SKIP_BURST, self._clock),
            )
        link, mail = budgets
        session.skip_budget = lambda n: (mail if self._opening_mail else link).take(n)
        self._entries[peer] = _Entry(sid, session)
        self._dirty.add(peer)

    @contextlib.contextmanager
    def opening_mail(self) -> Iterator[None]:
        """Messages opened inside are mail whose sender nothing proved (a relay mailbox
        envelope): their skipped keys come out of the peer's mail budget."""
        self._opening_mail = True
        try:
            yield
        finally:
            self._opening_mail = False

    def drop(self, peer: str) -> None:
        self._entries.pop(peer, None)
        self._dirty.discard(peer)

    def has(self, peer: str) -> bool:
        return peer in self._entries

    def suite(self, peer: str) -> str | None:
        entry = self._entries.get(peer)
        return entry.session.suite if entry else None

    def info(self) -> list[dict[str, object]]:
        return [
            {"did": did, "suite": e.session.suite, "id": e.sid.hex()}
            for did, e in sorted(self._entries.items())
        ]

    def _get(self, peer: str) -> _Entry:
        entry = self._entries.get(peer)
        if entry is None:
            raise UnknownSessionError(f"no session with {peer}")
        return entry

    def _crypto(self, entry: _Entry) -> RatchetFrameCrypto:
        if entry.crypto is None:
            # Duck-typed: RatchetFrameCrypto only uses .did and .sign of its wallet.
            entry.crypto = RatchetFrameCrypto(cast(Wallet, self._signer), entry.session)
        return entry.crypto

    # --- sealing -------------------------------------------------------------------------------

    def seal_message(self, peer: str, row: OutboxEntry) -> tuple[bytes, Record]:
        """The sealed MSG body and the sender's record of it (kind ``msg``)."""
        entry = self._get(peer)
        frame = Frame(
            type=MSG_FRAME_TYPE,
            sender=self._wallet.did,
            recipient=peer,
            sequence=row.seq,
            timestamp=row.ts_ms,
            payload=b"".join((row.msg_id, _U64.pack(row.prev), row.data)),
        )
        self._dirty.add(peer)
        body = self._crypto(entry).seal(frame, sign=True)
        commitment, signature = self._signer.last
        record = Record(
            kind="msg",
            record_id=row.msg_id,
            sender=self._wallet.did,
            recipient=peer,
            commitment=commitment,
            signature=signature,
            timestamp_ms=row.ts_ms,
        )
        return body, record

    def open_message(self, peer: str, body: bytes) -> Opened:
        entry = self._get(peer)
        frame, commitment = self._crypto(entry).open(body)
        self._dirty.add(peer)
        if frame.type != MSG_FRAME_TYPE:
            raise ProtocolError(f"expected a message frame, got type {frame.type}")
        # The audit record needs the sender's valid signature (docs/DESIGN.md "block
        # log"): a message that could not be sealed into a block is not taken.
        if not commitment.signature:
            raise UnsignedMessageError("message frame is unsigned; messages must be signed")
        if not verify_with_public_key(
            entry.session.peer_identity.signing_key,
            commitment.signed_bytes(),
            commitment.signature,
        ):
            raise BadMessageSignatureError("message frame signature does not verify")
        if frame.sender != peer or frame.recipient != self._wallet.did:
            raise ProtocolError("message frame names other parties than this link")
        if len(frame.payload) < _MSG_HEAD:
            raise MalformedFrameError("message frame too short for its id and prev seq")
        msg_id = frame.payload[:16]
        (prev,) = _U64.unpack_from(frame.payload, 16)
        if prev >= frame.sequence:
            raise ProtocolError("message prev seq is not below its own seq")
        try:
            text = frame.payload[_MSG_HEAD:].decode()
        except UnicodeDecodeError:
            raise MalformedFrameError("message text is not UTF-8") from None
        record = Record(
            kind="msg",
            record_id=msg_id,
            sender=peer,
            recipient=self._wallet.did,
            commitment=commitment.signed_bytes(),
            signature=commitment.signature,
            timestamp_ms=frame.timestamp,
        )
        return Opened(msg_id, frame.sequence, frame.timestamp, text, record, prev)

    def seal_app(self, peer: str, name: str, payload: bytes) -> bytes:
        entry = self._get(peer)
        raw = name.encode()
        self._dirty.add(peer)
        return entry.session.encrypt(bytes((len(raw),)) + raw + payload, _APP_AD)

    def prepare_send(self, peer: str) -> None:
        """Take the sending step ``peer``'s session owes now (ADR 0002 point 5), if any."""
        entry = self._entries.get(peer)
        if entry is not None and entry.session.prepare_send():
            self._dirty.add(peer)

    def open_app(self, peer: str, body: bytes) -> tuple[str, bytes]:
        plain = self._get(peer).session.decrypt(body, _APP_AD)
        self._dirty.add(peer)
        if not plain or len(plain) < 1 + plain[0]:
            raise MalformedFrameError("app frame too short for its channel name")
        n = plain[0]
        try:
            name = plain[1 : 1 + n].decode()
        except UnicodeDecodeError:
            raise MalformedFrameError("app channel name is not UTF-8") from None
        return name, plain[1 + n :]


def _reserve(
    reserved: dict[str, int],
    peer: str,
    target: int,
    unused_ids: list[int],
    limit: int,
    mint: Callable[[int], list[int]],
) -> int | None:
    """The unused one-time key id offered to ``peer`` alone (``reserved`` is updated),
    minting ``target`` more when all are taken; None when none is configured or left."""
    if target == 0:
        return None
    unused = set(unused_ids)
    kept = reserved.get(peer)
    if kept in unused:
        return kept
    # Forget reservations whose key was consumed, then take a free one.
    for p in [p for p, i in reserved.items() if i not in unused]:
        del reserved[p]
    free = sorted(unused - set(reserved.values()))
    if not free:
        room = limit - len(unused)
        if room <= 0:
            return None  # X3DH without a one-time key (Signal X3DH spec section 3.3)
        free = mint(min(room, max(1, target)))
    reserved[peer] = free[0]
    return free[0]
