"""The node's connection to a NATS relay (docs/adr/0010-nats-relay.md).

Asyncio only: it moves packets (:mod:`talos.relay.wire`) and envelopes
(:mod:`talos.relay.envelope`) and never decides what they mean. One
:class:`RelayClient` per node connects out to the relay's servers (``--relay``
given several times names servers of one NATS deployment), authenticates as
the node's own Ed25519 key (nkey), and

* subscribes to its link subject: OPEN requests become accepted
  :class:`~talos.relay.stream.RelayStream` s handed to ``on_stream``, DATA and
  CLOSE packets go to their stream;
* opens streams to peers by their DID (:meth:`open_stream`);
* keeps its own JetStream mailbox stream (bounded by age and bytes, new
  messages refused when full) and hands what arrives there to ``on_mailbox``,
  acknowledging each message to JetStream only when the handler says it is
  committed;
* publishes envelopes to a peer's mailbox (:meth:`put_mailbox`).

The relay being down at start, restarting, or refusing is never fatal: the
connection is retried with capped backoff, streams open during an outage are
closed (their links relink), and a mailbox that cannot take a message leaves
it in the sender's outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from talos.logging import event
from talos.relay import wire
from talos.relay.names import (
    MAILBOX_CONSUMER,
    USER_INFO_SUBJECT,
    RelayNames,
    nkey_seed,
    publisher_account,
    user_info_account,
)
from talos.relay.stream import CLOSE_RELAY_LOST, RelayStream
from talos_sdk.errors import TalosError
from talos_sdk.wallet import Wallet

__all__ = [
    "ACCOUNT_RETRY_MAX",
    "MailboxFullError",
    "MailboxSettings",
    "MailboxUnavailableError",
    "RelayClient",
    "RelayError",
    "RelayUnavailableError",
]

_log = logging.getLogger("talos.relay")
#: Stream header bytes on top of a chunk (wire._DATA_HEAD).
_DATA_OVERHEAD: Final = 26
_CLOSE_TRY_AGAIN: Final = 1013
#: JetStream API error codes for a stream at its limits (nats-server errors.json).
_STREAM_FULL_CODES: Final = frozenset({10077, 10047, 10028})
#: Longest pause, in seconds, between two askings of an unanswered account question.
ACCOUNT_RETRY_MAX: Final = 60.0


class RelayError(TalosError):
    """Something about the relay went wrong (node layer)."""


class RelayUnavailableError(RelayError, ConnectionError):
    """Not connected to the relay, or the peer is not on it."""


class MailboxUnavailableError(RelayError):
    """The recipient has no mailbox on this relay (it never connected to it)."""


class MailboxFullError(RelayError):
    """The recipient's mailbox is at its age / size limit; the message stays queued."""


@dataclass(frozen=True, slots=True)
class MailboxSettings:
    """Bounds of this node's own mailbox stream on the relay."""

    max_age: float = 7 * 86400.0
    max_bytes: int = 64 << 20
    batch: int = 256


StreamHandler = Callable[[RelayStream], Awaitable[None]]
#: Gets a batch, returns for each message True (committed or worthless: ack) or False (nak).
#: What the mailbox handler answers for each message: ``None`` takes it (the relay
#: drops it), a number of seconds hands it back that much later.
MailboxVerdict = float | None
MailboxHandler = Callable[[list[bytes]], Awaitable[list[MailboxVerdict]]]
#: The usual hand-back delay: a message whose commit did not finish in time.
RETRY_SOON: Final = 1.0


class RelayClient:
    """This node on the relay: streams in and out, its mailbox, peers' mailboxes."""

    def __init__(
        self,
        servers: Sequence[str],
        wallet: Wallet,
        *,
        max_frame: int,
        ping_interval: float,
        handshake_timeout: float,
        on_stream: StreamHandler,
        on_mailbox: MailboxHandler | None = None,
        mailbox: MailboxSettings | None = None,
        max_streams: int = 1024,
        reconnect_max: float = 10.0,
    ) -> None:
        if not servers:
            raise ValueError("a relay client needs at least one server")
        self.servers = list(servers)
        self.names = RelayNames.for_did(wallet.did)
        self._wallet = wallet
        self._max_frame = max_frame
        self._ping_interval = ping_interval
        self._handshake_timeout = handshake_timeout
        self._on_stream = on_stream
        self._on_mailbox = on_mailbox
        self.mailbox = mailbox or MailboxSettings()
        self._max_streams = max_streams
        self._reconnect_max = reconnect_max
        self._streams: dict[bytes, RelayStream] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._nc: Any = None
        self._js: Any = None
        self._stopping = False
        #: The account the relay says this node is in (None: not told, e.g. a relay
        #: configured before it allowed the question), asked at each connect; only
        #: when it is the node's own does a packet header's account come from the server.
        self.account: str | None = None
        self.vouched = False
        self._checks = 0  # the latest account check's number: an older answer is stale
        self.connected = asyncio.Event()
        self.counters: dict[str, int] = {}

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background; the node does not wait for the relay."""
        self._spawn(self._connect_loop(), "talos-relay-connect")

    async def stop(self) -> None:
        self._stopping = True
        for stream in list(self._streams.values()):
            await stream.close(CLOSE_RELAY_LOST, "node shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()

    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    async def _connect_loop(self) -> None:
        import nats

        delay = 0.2
        while not self._stopping:
            try:
                nc = await nats.connect(
                    servers=self.servers,
                    name="talos",
                    nkeys_seed_str=nkey_seed(self._wallet.seed),
                    inbox_prefix=self.names.inbox_prefix,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=min(2.0, self._reconnect_max),
                    connect_timeout=self._handshake_timeout,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    pending_size=8 << 20,
                )
            except Exception as exc:  # down, refused, unauthorised: retried, never fatal
                event(
                    _log,
                    "relay_unreachable",
                    level=logging.WARNING,
                    servers=",".join(self.servers),
                    error=str(exc) or type(exc).__name__,
                    retry_in=round(delay, 2),
                )
                await asyncio.sleep(random.uniform(0.5, 1.0) * delay)
                delay = min(delay * 2, self._reconnect_max)
                continue
            self._nc = nc
            self._js = nc.jetstream(timeout=self._handshake_timeout)
            await nc.subscribe(
                self.names.link,
                cb=self._on_link_msg,
                pending_msgs_limit=65536,
                pending_bytes_limit=256 << 20,
            )
            self.connected.set()
            event(_log, "relay_connected", server=self._server_name())
            self._spawn(self._check_account(), "talos-relay-account")
            if self._on_mailbox is not None:
                self._spawn(self._drain_loop(), "talos-relay-mailbox")
            return

    def _server_name(self) -> str:
        nc = self._nc
        url = getattr(nc, "connected_url", None) if nc is not None else None
        return f"{url.hostname}:{url.port}" if url is not None else "?"

    async def _on_error(self, exc: Exception) -> None:
        event(_log, "relay_error", level=logging.WARNING, error=str(exc) or type(exc).__name__)

    async def _on_disconnected(self) -> None:
        if self._stopping:
            return
        self.connected.clear()
        event(_log, "relay_disconnected", level=logging.WARNING)
        # Packets in flight are gone: close every stream so its link relinks and resends.
        for stream in list(self._streams.values()):
            stream.abort(CLOSE_RELAY_LOST, "relay connection lost")

    async def _on_reconnected(self) -> None:
        self.connected.set()
        event(_log, "relay_reconnected", server=self._server_name())
        self.vouched = False  # maybe another server of the cluster: ask again
        self._spawn(self._check_account(), "talos-relay-account")

    async def _check_account(self) -> None:
        """Ask the server which account this node is in: :attr:`vouched` if its own.

        A relay that puts nodes in one shared account leaves it False: packets are
        then taken as they come and every relayed handshake shares one admission
        share. A question nobody answers (a relay configured before it was allowed,
        a busy server) is asked again, every :data:`ACCOUNT_RETRY_MAX` s at most,
        until one does or the connection changes (which starts a new check).
        """
        nc = self._nc
        self._checks += 1
        check = self._checks
        wait = 1.0
        while True:
            try:
                reply = await nc.request(USER_INFO_SUBJECT, b"", timeout=self._handshake_timeout)
                break
            except Exception as exc:  # not allowed, no answer: not vouched, for now
                if check != self._checks:
                    return
                self._count("relay_account_unanswered")
                if wait == 1.0:
                    event(_log, "relay_account_unanswered", level=logging.WARNING,
                          error=str(exc) or type(exc).__name__)  # fmt: skip
                self.account, self.vouched = None, False
                await asyncio.sleep(wait * random.uniform(0.5, 1.0))
                wait = min(wait * 2, ACCOUNT_RETRY_MAX)
                if check != self._checks or self._stopping:
                    return
        if check != self._checks:
            return
        account = user_info_account(reply.data)
        self.account = account
        self.vouched = account == self.names.account
        event(_log, "relay_account", account=account, own=self.vouched)

    # --- streams ---------------------------------------------------------------------------------

    def _new_stream(self, stream_id: bytes, peer: RelayNames, source: str = "relay") -> RelayStream:
        nc = self._nc
        max_chunk = max(1024, int(nc.max_payload) - _DATA_OVERHEAD)
        state = wire.StreamState(stream_id, self._max_frame, max_chunk)
        stream = RelayStream(
            self._publish,
            peer,
            state,
            max_buffer=16 * (self._max_frame + 64),
            ping_interval=self._ping_interval,
            pending=lambda: int(getattr(nc, "pending_data_size", 0)),
            on_closed=self._forget,
            source=source,
        )
        self._streams[stream_id] = stream
        return stream

    def _forget(self, stream: RelayStream) -> None:
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]

    async def _publish(self, subject: str, data: bytes) -> None:
        nc = self._nc
        if nc is None or not nc.is_connected:
            raise RelayUnavailableError("not connected to the relay")
        await nc.publish(subject, data)

    async def open_stream(self, did: str) -> RelayStream:
        """Open a stream to ``did``'s node; RelayUnavailableError if it is not on the relay."""
        import nats.errors

        nc = self._nc
        if nc is None or not self.connected.is_set():
            raise RelayUnavailableError("not connected to the relay")
        if len(self._streams) >= self._max_streams:
            raise RelayUnavailableError("too many relay streams open")
        peer = RelayNames.for_did(did)
        stream_id = os.urandom(wire.STREAM_ID_LEN)
        stream = self._new_stream(stream_id, peer)
        opening = wire.encode(wire.Open(stream_id, self.names.token))
        try:
            reply = await nc.request(peer.link, opening, timeout=self._handshake_timeout)
            answer = wire.decode(reply.data)
        except nats.errors.NoRespondersError:
            stream.abort(CLOSE_RELAY_LOST, "peer not on the relay")
            raise RelayUnavailableError(f"{did} is not connected to the relay") from None
        except (nats.errors.TimeoutError, TimeoutError):
            stream.abort(CLOSE_RELAY_LOST, "open timed out")
            raise RelayUnavailableError(f"no answer from {did} through the relay") from None
        except TalosError as exc:
            stream.abort(CLOSE_RELAY_LOST, "bad answer")
            raise RelayUnavailableError(f"bad answer to a relay open: {exc}") from None
        except Exception as exc:
            stream.abort(CLOSE_RELAY_LOST, "relay error")
            raise RelayUnavailableError(f"relay open failed: {exc}") from None
        if isinstance(answer, wire.Close):
            stream.abort(answer.code, answer.reason)
            raise RelayUnavailableError(f"{did} refused the relay stream: {answer.reason}")
        if not isinstance(answer, wire.Accept) or answer.stream_id != stream_id:
            stream.abort(CLOSE_RELAY_LOST, "bad answer")
            raise RelayUnavailableError("bad answer to a relay open")
        return stream

    async def _on_link_msg(self, msg: Any) -> None:
        try:
            packet = wire.decode(msg.data)
        except TalosError:
            self._count("relay_packets_rejected")
            return
        # Where the relay names the sending account, it must be the node the packet
        # claims (an OPEN's token) or the stream's peer: another node's account is
        # forging (docs/PROTOCOL.md "Relay", who sent a packet).
        sender = publisher_account(msg.headers) if self.vouched else None
        if isinstance(packet, wire.Open):
            opener = RelayNames(packet.token)
            if sender is not None and sender != opener.account:
                self._count("relay_packets_forged")
                return
            await self._on_open(packet, opener, msg, vouched=sender is not None)
            return
        stream = self._streams.get(packet.stream_id)
        if stream is None or isinstance(packet, wire.Accept):
            self._count("relay_packets_dropped")  # a closed or unknown stream, or a replay
            return
        if sender is not None and sender != stream.peer_account:
            self._count("relay_packets_forged")
            return
        stream.feed(packet)

    async def _on_open(
        self, packet: wire.Open, opener: RelayNames, msg: Any, *, vouched: bool
    ) -> None:
        if not msg.reply:
            self._count("relay_packets_rejected")
            return
        if self._stopping or packet.stream_id in self._streams:
            answer: wire.Packet = wire.Close(packet.stream_id, _CLOSE_TRY_AGAIN, "refused")
        elif len(self._streams) >= self._max_streams:
            answer = wire.Close(packet.stream_id, _CLOSE_TRY_AGAIN, "too many relay streams")
        else:
            answer = wire.Accept(packet.stream_id)
        with contextlib.suppress(Exception):
            await msg.respond(wire.encode(answer))
        if isinstance(answer, wire.Accept):
            # Handshake admission counts a vouched opener by its account, so a flood from
            # one relay account fills that account's share, not every relayed link's.
            source = f"relay {opener.account}" if vouched else "relay"
            stream = self._new_stream(packet.stream_id, opener, source)
            self._spawn(self._on_stream(stream), "talos-relay-accept")

    # --- mailbox ---------------------------------------------------------------------------------

    async def _ensure_mailbox(self) -> Any:
        from nats.js.api import (
            ConsumerConfig,
            DiscardPolicy,
            RetentionPolicy,
            StorageType,
            StreamConfig,
        )
        from nats.js.errors import BadRequestError, NotFoundError

        max_bytes = self.mailbox.max_bytes
        # The relay caps this node's account (talos/relay/serverconf.py): ask for no more,
        # or the stream is refused for want of storage.
        with contextlib.suppress(Exception):
            granted = int((await self._js.account_info()).limits.max_storage)
            if granted > 0:
                max_bytes = min(max_bytes, granted)
        config = StreamConfig(
            name=self.names.stream,
            subjects=[self.names.mailbox],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_age=self.mailbox.max_age,
            max_bytes=max_bytes,
            discard=DiscardPolicy.NEW,
            num_replicas=1,
        )
        try:
            await self._js.add_stream(config)
        except BadRequestError:  # it exists with other bounds: take ours
            await self._js.update_stream(config)
        # No bound on unacknowledged mail: mail left with the relay (its sender not let
        # link, or past its inbox share) stays unacknowledged for a while, and under
        # JetStream's default bound (1,000) a sender with that much of it held up
        # everyone else's mail (docs/PROTOCOL.md "Relay"). A consumer made earlier with
        # that bound is made again (nats-py only creates one that is missing); in a
        # work-queue stream the mail it had not acknowledged stays for the new one.
        with contextlib.suppress(NotFoundError):
            info = await self._js.consumer_info(self.names.stream, MAILBOX_CONSUMER)
            if info.config.max_ack_pending != -1:
                await self._js.delete_consumer(self.names.stream, MAILBOX_CONSUMER)
        return await self._js.pull_subscribe(
            self.names.mailbox,
            durable=MAILBOX_CONSUMER,
            stream=self.names.stream,
            config=ConsumerConfig(max_ack_pending=-1),
        )

    async def _drain_loop(self) -> None:
        """Drain this node's mailbox for as long as the node runs."""
        import nats.errors

        assert self._on_mailbox is not None
        delay = 0.2
        sub: Any = None
        while not self._stopping:
            try:
                if sub is None:
                    await self.connected.wait()
                    sub = await self._ensure_mailbox()
                    delay = 0.2
                try:
                    msgs = await sub.fetch(self.mailbox.batch, timeout=5)
                except (nats.errors.TimeoutError, TimeoutError):
                    continue
                verdicts = await self._on_mailbox([bytes(m.data) for m in msgs])
                for m, later in zip(msgs, verdicts, strict=True):
                    if later is None:
                        await m.ack()
                    else:
                        await m.nak(delay=later)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # relay restarted, stream gone, limits: set up again
                event(
                    _log,
                    "relay_mailbox_retry",
                    level=logging.WARNING,
                    error=str(exc) or type(exc).__name__,
                )
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                sub = None
                await asyncio.sleep(random.uniform(0.5, 1.0) * delay)
                delay = min(delay * 2, self._reconnect_max)

    async def put_mailbox(self, did: str, envelope: bytes) -> None:
        """Store ``envelope`` in ``did``'s mailbox; relay acceptance is not delivery."""
        import nats.errors
        from nats.js.errors import APIError, NoStreamResponseError

        js = self._js
        if js is None or not self.connected.is_set():
            raise RelayUnavailableError("not connected to the relay")
        if len(envelope) > int(self._nc.max_payload):
            raise MailboxFullError("envelope above the relay's message size bound")
        try:
            await js.publish(RelayNames.for_did(did).mailbox, envelope)
        except (nats.errors.NoRespondersError, NoStreamResponseError):
            raise MailboxUnavailableError(f"{did} has no mailbox on this relay") from None
        except APIError as exc:
            if exc.err_code in _STREAM_FULL_CODES or exc.code == 503:
                raise MailboxFullError(f"mailbox of {did} is full: {exc.description}") from None
            raise RelayError(f"relay refused the mailbox message: {exc.description}") from None
        except (nats.errors.TimeoutError, TimeoutError):
            raise RelayUnavailableError("the relay did not confirm the mailbox message") from None
        except nats.errors.Error as exc:
            raise RelayUnavailableError(f"relay error: {exc}") from None

    @property
    def streams(self) -> int:
        return len(self._streams)

    @property
    def max_payload(self) -> int | None:
        """The relay's bound on one message (None until connected): a mailbox envelope's."""
        nc = self._nc
        return int(nc.max_payload) if nc is not None and self.connected.is_set() else None
