"""A token bucket: work a party may make us do over time, paid before it is done.

Pure (the clock is handed in). The node gives each peer's ratchet sessions two,
one for its links' frames and one for relay mail naming it
(:attr:`talos_sdk.ratchet.Session.skip_budget` picks): a message header may ask for up
to MAX_SKIP skipped-key derivations per chain before its AEAD tag can be checked,
so a peer sending forged headers would otherwise cost ~2.4 ms of CPU per 82-byte
frame, ~110 times a real one, for as long as it pleased.
"""

from __future__ import annotations

from collections.abc import Callable

from talos_sdk.errors import UsageError

__all__ = ["TokenBucket"]


class TokenBucket:
    """Holds up to ``burst`` tokens, refilled at ``rate`` per second of ``clock``."""

    __slots__ = ("_clock", "_level", "_stamp", "burst", "rate")

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        if not rate > 0 or not burst > 0:
            raise UsageError("a token bucket needs rate > 0 and burst > 0")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._level = float(burst)
        self._stamp = clock()

    def take(self, amount: float) -> bool:
        """Pay ``amount`` tokens if the bucket holds them (then True); else take none."""
        now = self._clock()
        self._level = min(self.burst, self._level + max(now - self._stamp, 0.0) * self.rate)
        self._stamp = now
        if amount > self._level:
            return False
        self._level -= amount
        return True
