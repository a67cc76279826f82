"""One blocking call to a running node over its local socket (docs/PROTOCOL.md "Local clients").

Standard library only, no event loop: the ``talosd`` client commands start
without importing the node, aiohttp or pydantic.
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from talos.local import wire
from talos_sdk.errors import LinkRefusedError, PeerUnreachableError, TalosError, UsageError

__all__ = [
    "BUSY_RETRY",
    "SOCKET_NAME",
    "LocalCallError",
    "LocalUsageError",
    "NoNodeError",
    "NodeGoneError",
    "busy_waits",
    "call",
    "connect_nowait",
    "socket_path",
    "still_busy",
]

SOCKET_NAME = "talosd.sock"


def socket_path(home: Path) -> Path:
    return Path(home) / SOCKET_NAME


class NoNodeError(TalosError):
    """No node is running in that home (nothing listens on its socket)."""


class NodeGoneError(TalosError, ConnectionError):
    """The node stopped (or refused us) while we were attached."""


class LocalCallError(TalosError):
    """The node answered a call with an error; ``code`` says whose fault it was."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class LocalUsageError(LocalCallError, UsageError):
    """The node refused the call's input (unknown peer, bad DID, message too large, ...)."""


def raise_for(error: Any) -> None:
    if not isinstance(error, dict):
        raise LocalCallError("internal", "malformed error reply from the node")
    code, message = str(error.get("code", "internal")), str(error.get("message", ""))
    if code in ("usage", "not_found"):
        raise LocalUsageError(code, message)
    if code == "timeout":
        raise TimeoutError(message)
    if code == "refused":
        raise LinkRefusedError(message)
    if code == "unreachable":
        raise PeerUnreachableError(message)
    raise LocalCallError(code, message)


def no_node(home: Path, exc: OSError) -> NoNodeError:
    if isinstance(exc, PermissionError):
        return NoNodeError(f"permission denied on the node socket of {home}")
    return NoNodeError(f"no node is running on {home}; start one with `talosd run --home {home}`")


#: Longest a client retries a connect the node's full listen backlog turned away
#: (EAGAIN: hundreds of clients connecting at once).
BUSY_RETRY = 10.0


def _busy(exc: OSError) -> bool:
    """The node's listen backlog is full: the connect may be tried again."""
    return exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def connect_nowait(home: Path) -> socket.socket | None:
    """A connected non-blocking socket to the node of ``home``; None while its backlog is full.

    A Unix socket's connect never waits: it is made, refused, or EAGAIN.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(str(socket_path(home)))
        return sock
    except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
        sock.close()
        raise no_node(home, exc) from None
    except OSError as exc:
        sock.close()
        if _busy(exc):
            return None
        raise


def still_busy(home: Path) -> NoNodeError:
    return NoNodeError(f"the node of {home} takes no connections: its queue stayed full")


def busy_waits(home: Path, within: float) -> Iterator[float]:
    """Pauses between connects a full listen queue turned away (5 ms, doubling to 0.2 s);
    past ``within`` seconds (at most BUSY_RETRY), :func:`still_busy` is raised."""
    deadline = time.monotonic() + min(within, BUSY_RETRY)
    pause = 0.005
    while time.monotonic() <= deadline:
        yield pause
        pause = min(pause * 2, 0.2)
    raise still_busy(home)


def _connect(home: Path, timeout: float) -> socket.socket:
    waits = busy_waits(home, timeout)
    while (sock := connect_nowait(home)) is None:
        time.sleep(next(waits))
    sock.settimeout(timeout)
    return sock


def call(home: Path, op: str, args: dict[str, Any] | None = None, *, timeout: float = 30) -> Any:
    """One call to the node of ``home``; NoNodeError if none runs."""
    sock = _connect(home, timeout)
    try:
        sock.sendall(wire.encode_json(wire.Kind.CALL, {"id": 1, "op": op, "args": args or {}}))
        reader = wire.FrameReader()
        while True:
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                raise TimeoutError(f"the node did not answer {op!r} within {timeout} s") from None
            if not data:
                raise NodeGoneError(f"the node of {home} closed the connection")
            for frame in reader.feed(data):
                body = frame.body
                stop = isinstance(body, dict) and body.get("event") in ("refused", "stopping")
                if frame.kind is wire.Kind.EVENT and stop:
                    assert isinstance(body, dict)
                    raise NodeGoneError(f"the node of {home}: {body.get('reason')}")
                if frame.kind is wire.Kind.REPLY and isinstance(body, dict):
                    if "error" in body:
                        raise_for(body["error"])
                    return body.get("result")
    finally:
        sock.close()
