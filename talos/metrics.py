"""In-process counters, gauges and a latency histogram, rendered as Prometheus text.

Exposition format: https://prometheus.io/docs/instrumenting/exposition_formats/
Kept dependency-free and O(1) per observation so the hot path can afford it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

__all__ = ["Histogram", "Metrics"]

_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class Histogram:
    """Cumulative-bucket histogram of seconds."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = _BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.total += seconds

    def render(self, name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.count}")
        return lines


class Metrics:
    """The node's metrics: counters by name, gauges read on demand, one histogram."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.gauges: dict[str, Callable[[], float]] = {}
        self.ack_latency = Histogram()

    def inc(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        self.gauges[name] = read

    def render(self) -> str:
        lines: list[str] = []
        for name, value in sorted(self.counters.items()):
            lines += [f"# TYPE talos_{name} counter", f"talos_{name} {value}"]
        for name, read in sorted(self.gauges.items()):
            lines += [f"# TYPE talos_{name} gauge", f"talos_{name} {read()}"]
        lines += self.ack_latency.render("talos_message_ack_seconds")
        return "\n".join(lines) + "\n"
