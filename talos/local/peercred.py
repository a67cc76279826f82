"""Who is at the other end of the node's Unix socket (docs/adr/0012-local-clients.md).

Only the node's own user may attach: the kernel says who connected
(``SO_PEERCRED`` on Linux), so no token is needed on the socket.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

__all__ = ["peer_allowed", "peer_uid"]

_CREDS = struct.Struct("3i")


def peer_uid(sock: Any) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux ``SO_PEERCRED``)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, opt, _CREDS.size)
    except OSError:
        return None
    return int(_CREDS.unpack(raw)[1])


def peer_allowed(uid: int | None, own_uid: int) -> bool:
    """Only the node's own user may attach (an unknown uid is refused)."""
    return uid is not None and uid == own_uid
