"""The asyncio client of a running node's local socket (docs/PROTOCOL.md "Local clients").

:class:`LocalClient` is what ``talos-proxy`` and ``talosd mcp`` use to attach
to a node; the blocking one-shot :func:`~talos.local.call.call` is the
``talosd`` command line's. Both raise NoNodeError when no node runs there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from talos.local import wire
from talos.local.call import (
    BUSY_RETRY,
    LocalCallError,
    LocalUsageError,
    NodeGoneError,
    NoNodeError,
    busy_waits,
    call,
    connect_nowait,
    raise_for,
    socket_path,
)
from talos.local.flow import FlowControlled
from talos_sdk.errors import TalosError

__all__ = [
    "LocalCallError",
    "LocalClient",
    "LocalUsageError",
    "NoNodeError",
    "NodeGoneError",
    "call",
    "socket_path",
]  # the errors, call and socket_path are talos.local.call's, re-exported

# --- asyncio, for attached proxies and talosd mcp ----------------------------------------------

AppReceiver = Callable[[str, str, bytes], Awaitable[None] | None]
EventListener = Callable[[dict[str, Any]], None]


class _Protocol(FlowControlled):
    def __init__(self, client: LocalClient) -> None:
        super().__init__()
        self.client = client
        self.reader = wire.FrameReader()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except TalosError as exc:
            self.client._gone(f"malformed frame from the node: {exc}")
            return
        for frame in frames:
            self.client._on_frame(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        stopping = self.client.stopping
        self.client._gone(
            stopping.result() if stopping.done() else "the node closed the connection"
        )
        self.wake_writers()


def _cancel(call_id: int) -> dict[str, Any]:
    """The frame that drops call ``call_id`` at the node (it has no id: no reply)."""
    return {"op": "cancel", "args": {"id": call_id}}


class LocalClient:
    """An attachment to the running node of a home."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.hello: dict[str, Any] = {}
        self._proto = _Protocol(self)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._listeners: list[EventListener] = []
        self._app: AppReceiver | None = None
        loop = asyncio.get_running_loop()
        #: The node said it stops (or the connection ended): calls still work until ``gone``.
        self.stopping: asyncio.Future[str] = loop.create_future()
        #: The connection ended; pending and later calls fail with NodeGoneError.
        self.gone: asyncio.Future[str] = loop.create_future()
        #: The node stopped because the agent that ran it left (LocalServer.close).
        self.handover = False

    @classmethod
    async def connect(cls, home: Path, *, watch: bool = False) -> LocalClient:
        """Attach to the node of ``home``; NoNodeError when none runs there."""
        client = cls(home)
        loop = asyncio.get_running_loop()
        # Connected by hand: asyncio's own connect takes EAGAIN (the node's listen backlog
        # is full) for "in progress" and hands back a socket that never connected.
        waits = busy_waits(home, BUSY_RETRY)
        while (sock := connect_nowait(home)) is None:
            await asyncio.sleep(next(waits))
        await loop.create_unix_connection(lambda: client._proto, sock=sock)
        client.hello = await client.call("hello", watch=watch)
        return client

    @property
    def did(self) -> str:
        return str(self.hello["did"])

    async def call(self, op: str, **args: Any) -> Any:
        """One op on the node; its errors are raised (LocalUsageError, TimeoutError, ...)."""
        if self.gone.done():
            raise NodeGoneError(self.gone.result())
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        try:
            self._write(wire.encode_json(wire.Kind.CALL, {"id": call_id, "op": op, "args": args}))
            return await fut
        except asyncio.CancelledError:
            if fut.cancelled():
                # The node drops the call too: a long-poll, a send waiting for its ack.
                with contextlib.suppress(NodeGoneError):
                    self._write(wire.encode_json(wire.Kind.CALL, _cancel(call_id)))
            raise
        finally:
            self._pending.pop(call_id, None)

    def on_event(self, listener: EventListener) -> None:
        """``listener(event)`` for link events (``hello`` with ``watch``) and ``stopping``."""
        self._listeners.append(listener)

    def set_app_receiver(self, receiver: AppReceiver) -> None:
        """``receiver(channel, peer, payload)``; an awaitable it returns pauses reading."""
        self._app = receiver

    def send_app_nowait(self, channel: str, peer: str, payload: bytes) -> bool:
        """Hand an app frame to the node now; False (nothing written) while the socket is full."""
        if self._proto.drained is not None:
            return False
        self._write(wire.encode_app(channel, peer, payload))
        return True

    async def send_app(self, channel: str, peer: str, payload: bytes) -> None:
        while self._proto.drained is not None:
            await self._proto.drained
            if self.gone.done():
                raise NodeGoneError(self.gone.result())
        self._write(wire.encode_app(channel, peer, payload))

    async def close(self) -> None:
        transport = self._proto.transport
        if transport is not None and not transport.is_closing():
            transport.close()
        self._gone("closed by this client")

    # --- internals ---------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        transport = self._proto.transport
        if self.gone.done() or transport is None or transport.is_closing():
            raise NodeGoneError(self.gone.result() if self.gone.done() else "not connected")
        transport.write(data)

    def _on_frame(self, frame: wire.LocalFrame) -> None:
        body = frame.body
        if frame.kind is wire.Kind.APP:
            assert isinstance(body, wire.AppFrame)
            if self._app is not None:
                wait = self._app(body.channel, body.peer, body.payload)
                if wait is not None:
                    self._pause_until(wait)
            return
        assert isinstance(body, dict)
        if frame.kind is wire.Kind.REPLY:
            fut = self._pending.get(body.get("id", -1))
            if fut is None or fut.done():
                return
            if "error" in body:
                try:
                    raise_for(body["error"])
                except Exception as exc:
                    fut.set_exception(exc)
            else:
                fut.set_result(body.get("result"))
        elif frame.kind is wire.Kind.EVENT:
            kind = body.get("event")
            if kind == "refused":
                self._gone(f"the node of {self.home} refused us: {body.get('reason')}")
                return
            if kind == "stopping":
                if self.stopping.done():
                    return
                # A client holding app channels may still finish its work (ADR 0012).
                self.handover = body.get("handover") is True
                self.stopping.set_result(f"the node of {self.home} stopped: {body.get('reason')}")
            for listener in list(self._listeners):
                listener(body)

    def _pause_until(self, wait: Awaitable[None]) -> None:
        transport = self._proto.transport
        if transport is None:
            return
        transport.pause_reading()
        fut = asyncio.ensure_future(wait)

        def resume(_: asyncio.Future[None]) -> None:
            if not transport.is_closing():
                transport.resume_reading()

        fut.add_done_callback(resume)

    def _gone(self, reason: str) -> None:
        if self.gone.done():
            return
        self.gone.set_result(reason)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(NodeGoneError(reason))
        if self.stopping.done():
            return  # listeners heard it already
        self.stopping.set_result(reason)
        stop = {"event": "stopping", "reason": reason}
        for listener in list(self._listeners):
            with contextlib.suppress(Exception):
                listener(stop)
