"""The relay as a node uses it (docs/adr/0010-nats-relay.md; docs/DESIGN.md "Discovery and scale").

* :class:`RelayResolver` answers every DID with the relay's address, after the
  direct sources in the node's resolver chain, so a direct address is tried
  first and the relay is the fallback.
* :class:`NodeRelay` dials a peer through the relay (a relay stream under the
  ordinary link handshake and session setup), accepts peers' streams, tries a
  direct address again now and then while a link is relayed (a direct link
  replaces it), and runs the offline mailbox:

  - sender: rows for a peer without a ready link, with whom a session exists,
    are sealed as usual (Double Ratchet + signed commitment), wrapped in an
    envelope to the recipient (:mod:`talos.relay.envelope`) and published to
    its mailbox. The outbox row stays until the recipient's end-to-end ACK
    arrives on a link; the relay's acceptance changes nothing.
  - recipient: drained envelopes are opened and fed to the same MSG path as
    link frames (same ordering, duplicate and gap rules); a mailbox message is
    acknowledged to JetStream only once its message is committed (or refused
    as worthless), so a crash before the commit gets it redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from talos import pipeline as pl
from talos.link import wire as link_wire
from talos.link.peer import Link, dial_link, initiate_link
from talos.logging import Throttle, event
from talos.relay.client import (
    RETRY_SOON,
    MailboxFullError,
    MailboxSettings,
    MailboxUnavailableError,
    MailboxVerdict,
    RelayClient,
    RelayError,
)
from talos.relay.envelope import open_envelope, seal_envelope
from talos.relay.stream import RelayStream
from talos_sdk.did import public_key_from_did
from talos_sdk.errors import (
    DecryptionError,
    ProtocolError,
    SignatureError,
    UsageError,
)

if TYPE_CHECKING:
    from talos.node import Node
    from talos.node_base import Peer as _Peer

__all__ = ["RELAY_SCHEMES", "NodeRelay", "RelayResolver", "is_relay_address"]

_log = logging.getLogger("talos.relay")
RELAY_SCHEMES: Final = ("nats://", "tls://")
#: Seconds a peer without a mailbox (or with a full one) is left alone.
_MAILBOX_HOLD: Final = 30.0
#: Longest wait for a drained message's commit before it is handed back to JetStream.
_COMMIT_WAIT: Final = 30.0


#: Longest the mailbox drain holds the event loop between two turns, in seconds.
_DRAIN_SLICE: Final = 0.02
#: Seconds before mail the node does not take now (from a sender it does not let link,
#: or past its sender's inbox share) is handed back again.
_NOT_ALLOWED_RETRY: Final = 300.0


def is_relay_address(url: str) -> bool:
    return url.startswith(RELAY_SCHEMES)


class RelayResolver:
    """Every DID is reachable through the relay (last in the chain: direct first)."""

    def __init__(self, address: str, own_did: str | None = None) -> None:
        self.address = address
        self.own_did = own_did

    def resolve(self, did: str) -> list[str]:
        return [] if did == self.own_did else [self.address]

    def learn(self, did: str, addr: str, source: str) -> None:
        return None


class NodeRelay:
    """Dialling, accepting and the mailbox through one NATS relay, for one node."""

    def __init__(self, node: Node, servers: Sequence[str]) -> None:
        self.node = node
        config = node.config
        self.address = servers[0]
        self.client = RelayClient(
            servers,
            node.wallet,
            max_frame=config.max_frame,
            ping_interval=config.ping_interval,
            handshake_timeout=config.handshake_timeout,
            on_stream=self._on_stream,
            on_mailbox=self._on_mailbox,
            mailbox=MailboxSettings(config.mailbox_max_age, config.mailbox_max_bytes),
            reconnect_max=config.reconnect_max,
        )
        self._mailboxed: dict[str, int] = {}
        self._hold: dict[str, float] = {}
        self._throttle = Throttle()  # anyone may put garbage in this node's mailbox
        #: peer -> (seq, relay bound) of the message last found too large to mail
        self._oversize: dict[str, tuple[int, int]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self.counters: dict[str, int] = {}

    def start(self) -> None:
        self.client.start()
        self.node.on_link_change(self._link_changed)
        self._tasks = [
            asyncio.create_task(self._mailbox_loop(), name="talos-relay-outbox"),
            asyncio.create_task(self._direct_loop(), name="talos-relay-direct"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.stop()

    def _count(self, name: str, n: int = 1) -> None:
        self.node.metrics.inc(name, n)

    def mailboxed(self, did: str) -> int:
        """Highest sequence number posted to ``did``'s mailbox and not yet known acked (0: none)."""
        return self._mailboxed.get(did, 0)

    def status(self) -> dict[str, Any]:
        client = self.client
        return {
            "servers": client.servers,
            "connected": client.connected.is_set(),
            "token": client.names.token,
            "account": client.account,
            "vouched": client.vouched,
            "streams": client.streams,
            "relay_packets_rejected": 0,
            "relay_packets_dropped": 0,
            "relay_packets_forged": 0,
            **client.counters,
        }

    # --- links -----------------------------------------------------------------------------------

    async def dial(self, did: str) -> Link:
        """A link to ``did`` through the relay (ConnectionError if it is not there)."""
        stream = await self.client.open_stream(did)
        node = self.node
        try:
            return await initiate_link(stream, did, node.wallet, node.authorizer, node.settings)
        except BaseException:
            await stream.close()
            raise

    async def _on_stream(self, stream: RelayStream) -> None:
        await self.node.links.accept(stream)

    def _link_changed(self, did: str, up: bool) -> None:
        if not up:
            self._mailboxed.pop(did, None)  # unacked rows may go to the mailbox again

    async def _direct_loop(self) -> None:
        """While a peer is linked through the relay, try its direct addresses now and then."""
        node = self.node
        while True:
            await asyncio.sleep(random.uniform(1.0, 1.5) * 3 * node.config.reconnect_max)
            for peer in list(node._peers.values()):
                link = peer.link
                if link is None or link.via == "direct" or not link.open:
                    continue
                urls = [u for u in node.links.resolve(peer.did) if not is_relay_address(u)]
                for url in urls:
                    try:
                        direct = await dial_link(
                            url, peer.did, node.wallet, node.authorizer, node.settings
                        )
                    except Exception:  # still unreachable directly: the relay it stays
                        continue
                    event(_log, "relay_link_upgraded", peer=peer.did)
                    node.links.adopt_soon(direct)  # a direct link replaces the relayed one
                    break

    # --- mailbox, sender side --------------------------------------------------------------------

    async def _mailbox_loop(self) -> None:
        node = self.node
        while True:
            await asyncio.sleep(node.config.retry_interval)
            if not self.client.connected.is_set():
                continue
            for peer in list(node._peers.values()):
                try:
                    await self.post(peer)
                except Exception as exc:  # one peer's trouble must not stop the others
                    event(
                        _log, "mailbox_post_failed", level=logging.ERROR, peer=peer.did,
                        error=repr(exc),
                    )  # fmt: skip

    def _rows(self, peer: _Peer, after: int) -> list[pl.OutboxEntry]:
        with self.node.store.read() as txn:
            rows: list[pl.OutboxEntry] = []
            for row in pl.iter_outbox(txn, peer.did, after):
                rows.append(row)
                if len(rows) >= 256:
                    return rows
        last = rows[-1].seq if rows else after
        return rows + [r for r in peer.fresh if r.seq > last]

    async def post(self, peer: _Peer) -> int:
        """Mailbox the peer's unacknowledged rows if no link carries them; returns how many."""
        node = self.node
        did = peer.did
        if peer.link is not None or peer.ready.is_set():
            return 0
        if peer.last_assigned <= peer.tx.acked or not node.sessions.has(did):
            return 0  # nothing to send, or no session to seal with (first contact needs a link)
        if time.monotonic() < self._hold.get(did, 0.0):
            return 0
        posted = 0
        after = max(peer.tx.acked, self._mailboxed.get(did, 0))
        while True:
            rows = self._rows(peer, after)
            if not rows:
                return posted
            for row in rows:
                if peer.link is not None:
                    return posted
                after = row.seq
                ready = node.prepare_row(peer, row)
                if ready is None:
                    continue  # the peer can never accept it: failed for good
                row = ready
                bound = self.client.max_payload
                if bound is not None and self._oversize.get(did) == (row.seq, bound):
                    # Found too large before: not sealed again (each seal spends a key).
                    self._hold[did] = time.monotonic() + _MAILBOX_HOLD
                    return posted
                body, record = node.sessions.seal_message(did, row)
                frame = link_wire.encode(link_wire.Msg(row.seq, body))
                envelope = seal_envelope(did, node.did, node.wallet.sign, frame, os.urandom(32))
                if bound is not None and len(envelope) > bound:
                    self._too_large(did, row.seq, bound)
                    return posted
                try:
                    await self.client.put_mailbox(did, envelope)
                except (MailboxUnavailableError, MailboxFullError) as exc:
                    self._hold[did] = time.monotonic() + _MAILBOX_HOLD
                    full = isinstance(exc, MailboxFullError)
                    self._count("mailbox_full" if full else "mailbox_unavailable")
                    event(
                        _log,
                        "mailbox_refused",
                        level=logging.WARNING if full else logging.INFO,
                        peer=did,
                        reason=str(exc),
                    )
                    return posted
                except RelayError as exc:
                    event(_log, "mailbox_post_retry", level=logging.INFO, peer=did, reason=str(exc))
                    return posted
                peer.max_sent = max(peer.max_sent, row.seq)
                if row.seq > peer.tx.acked:  # not dropped (talosd outbox --drop) meanwhile
                    peer.records[row.seq] = record
                    peer.sent_at.setdefault(row.seq, time.monotonic())
                self._mailboxed[did] = row.seq
                posted += 1
                self._count("mailbox_out")

    def _too_large(self, did: str, seq: int, bound: int) -> None:
        """A message the relay's message bound cannot take waits for a link, and the
        ones after it with it (they are delivered in order); said once per message."""
        self._hold[did] = time.monotonic() + _MAILBOX_HOLD
        self._oversize[did] = (seq, bound)
        self._count("mailbox_too_large")
        event(
            _log, "mailbox_message_too_large", level=logging.WARNING, peer=did, seq=seq,
            max_payload=bound, reason="it waits for a link, and the messages after it too",
        )  # fmt: skip

    # --- mailbox, recipient side -----------------------------------------------------------------

    async def _on_mailbox(self, batch: list[bytes]) -> list[MailboxVerdict]:
        node = self.node
        verdicts: list[MailboxVerdict] = []
        waiting: list[tuple[int, _Peer, int]] = []
        senders: set[str] = set()
        held: set[str] = set()  # senders whose mail this batch leaves with the relay
        turn = time.monotonic()
        for data in batch:
            # A message that names a known sender costs its ratchet work before it fails
            # (a forged header may make it derive thousands of keys): a batch of them
            # must not hold the loop, and every link's traffic, for seconds. A turn per
            # _DRAIN_SLICE, not per message: a drain of good mail pays no loop turn each.
            if time.monotonic() - turn > _DRAIN_SLICE:
                await asyncio.sleep(0)
                turn = time.monotonic()
            try:
                taken = self._take(data, held)
            except (ProtocolError, DecryptionError, SignatureError, UsageError) as exc:
                # Garbage, a replay, a forged sender: dropped (the sender's outbox still
                # holds anything real), never counted towards a session resync.
                self._count("mailbox_rejected")
                dropped = self._throttle.admit(type(exc).__name__, time.monotonic())
                if dropped is not None:
                    event(
                        _log, "mailbox_rejected", level=logging.WARNING,
                        kind=type(exc).__name__, error=str(exc),
                        **({"suppressed": dropped} if dropped else {}),
                    )  # fmt: skip
                verdicts.append(None)
                continue
            if taken is None:
                # Left with the relay, handed back now and then until the node lets the
                # sender link (`peers.allow`) or its inbox share has room (the inbox is
                # pruned), or the mailbox's max age drops it: taken and dropped, it was
                # lost for offline delivery (the sender mails it only once). A link would
                # refuse the sender too.
                self._count("mailbox_held")
                verdicts.append(_NOT_ALLOWED_RETRY)
                continue
            peer, seq = taken
            senders.add(peer.did)
            if peer.rx.delivered < seq <= peer.rx.accepted:
                waiting.append((len(verdicts), peer, seq))  # in the open batch: ack after commit
            verdicts.append(None)
        if waiting:
            await self._committed(waiting)
            for i, peer, seq in waiting:
                verdicts[i] = None if peer.rx.delivered >= seq else RETRY_SOON
        for did in senders:
            node.links.ensure(did)  # so the end-to-end ACK can reach the sender
        return verdicts

    def _take(self, data: bytes, held: set[str]) -> tuple[_Peer, int] | None:
        """Open one mail and hand its MSG frame on; None, and the mail left unopened, if
        the node does not let its sender link (a session outlives the allow list it was
        made under), or the message would pass its sender's inbox share: opened, its
        message key would be spent and it could not be read when handed back. Its
        sender's later mail in ``held``'s batch is left unopened with it."""
        node = self.node
        env = open_envelope(node.wallet.seed, node.did, data)
        public_key_from_did(env.sender)
        frame = link_wire.decode(env.frame, node.config.max_frame)
        if not isinstance(frame, link_wire.Msg):
            raise ProtocolError(f"{type(frame).__name__} in a mailbox (only MSG frames go there)")
        if env.sender == node.did or not node.sessions.has(env.sender):
            raise ProtocolError("mailbox message from a peer without a session")
        if not node.authorizer(env.sender) or env.sender in held:
            return None
        peer = node._peer(env.sender)
        # The sealed body is larger than the inbox row it makes: no message that passes
        # here is refused for its share once opened.
        if node.past_share(peer, len(frame.body)):
            held.add(env.sender)
            return None
        with node.sessions.opening_mail():  # the envelope proves no sender: its own budget
            node._on_msg(peer, frame)
        self._count("mailbox_in")
        return peer, frame.seq

    async def _committed(self, waiting: list[tuple[int, _Peer, int]]) -> None:
        node = self.node
        deadline = time.monotonic() + _COMMIT_WAIT

        def pending() -> bool:
            # Still accepted but not delivered: the commit has not finished (a failed
            # commit rolls ``accepted`` back, which ends the wait too).
            return any(p.rx.delivered < s <= p.rx.accepted for _, p, s in waiting)

        while True:
            signal = node._inbox_event  # taken before the check: a commit sets this one
            if not pending() or time.monotonic() > deadline or node._stopping:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await signal.wait()
