"""A connected pair of link handshakes driven without sockets (like h11's ConnectionPair)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from talos.link import handshake as hs

Tamper = Callable[[int, bytes], bytes]


def _untouched(index: int, data: bytes) -> bytes:
    return data


@dataclass
class HandshakePair:
    """Initiator and responder exchanging messages in memory; ``tamper`` sits on the path."""

    ini: hs.LinkHandshake
    res: hs.LinkHandshake
    tamper: Tamper = _untouched
    wire: list[bytes] = field(default_factory=list)  # every message as it crossed

    def run(self) -> tuple[hs.Authenticated, hs.Authenticated]:
        """Run to completion; Refusal / PeerRefused propagate from whichever side raised."""
        data = self.ini.start()
        sides = (self.res, self.ini)
        turn = 0
        while data is not None:
            data = self.tamper(len(self.wire), data)
            self.wire.append(data)
            data = sides[turn].receive(data)
            turn = 1 - turn
        assert self.ini.done and self.res.done
        assert self.ini.result is not None and self.res.result is not None
        return self.ini.result, self.res.result
