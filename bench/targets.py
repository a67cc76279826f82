"""The performance targets of docs/DESIGN.md "Performance targets", as data.

Each :class:`Target` row carries the seed figure we set out to beat, the floor
measured on this class of machine (both as text, copied from docs/DESIGN.md) and
one or more criteria that ``run_all.py`` checks against the figures MEASURED in
this run (``bench/results/*.json``). A criterion names metric keys written by
the bench scripts; a key that no script has written yet reads "not measured
yet" instead of pass or miss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from _common import Metric, format_rate, format_seconds

MB = 1e6


@dataclass(frozen=True, slots=True)
class Check:
    """The outcome of one criterion: what was measured and whether it met the target."""

    measured: str
    floor: str
    ratio: str
    ok: bool | None  # None: not measured yet


NOT_MEASURED = Check("—", "", "", None)


def _rate_text(m: Metric, per: str = "/s") -> str:
    if m.unit == "B/s":
        return f"{m.value / MB:,.0f} MB/s"
    return f"{format_rate(m.rate())}{per}"


@dataclass(frozen=True, slots=True)
class AtLeastRatio:
    """rate(ours) >= factor x the fastest of the raw rates, all from the same run."""

    ours: str
    raws: tuple[str, ...]
    factor: float

    @property
    def text(self) -> str:
        """The target as written in the report."""
        return f"≥ {self.factor:g} × raw"

    def check(self, metrics: Mapping[str, Metric]) -> Check:
        """Compare the measured rates."""
        if self.ours not in metrics or not all(r in metrics for r in self.raws):
            return NOT_MEASURED
        ours = metrics[self.ours]
        best = max((metrics[r] for r in self.raws), key=lambda m: m.rate())
        r = ours.rate() / best.rate()
        return Check(
            _rate_text(ours), f"{_rate_text(best)} ({best.label})", f"{r:.2f}×", r >= self.factor
        )


@dataclass(frozen=True, slots=True)
class AtLeastRate:
    """rate(key) >= minimum per second (ops, records, requests or bytes)."""

    key: str
    minimum: float
    per: str = "/s"
    floor: str | None = None

    @property
    def text(self) -> str:
        """The target as written in the report."""
        if self.per == " MB/s":
            return f"≥ {self.minimum / MB:,.0f} MB/s"
        return f"≥ {format_rate(self.minimum)}{self.per}"

    def check(self, metrics: Mapping[str, Metric]) -> Check:
        """Compare the measured rate with the absolute target."""
        if self.key not in metrics:
            return NOT_MEASURED
        m = metrics[self.key]
        floor = metrics.get(self.floor) if self.floor else None
        floor_text = f"{_rate_text(floor)} ({floor.label})" if floor else ""
        ratio = f"{m.rate() / floor.rate():.2f}×" if floor else ""
        return Check(_rate_text(m), floor_text, ratio, m.rate() >= self.minimum)


@dataclass(frozen=True, slots=True)
class AtMost:
    """value(key) <= limit, for latencies (seconds) and sizes (bytes)."""

    key: str
    limit: float
    floors: tuple[str, ...] = ()
    floor_factor: float | None = None
    size: bool = False  # bytes rather than seconds (keys ending in "rss" are sizes too)

    @property
    def text(self) -> str:
        """The target as written in the report."""
        parts = []
        if self.limit != float("inf"):
            parts.append(f"≤ {self._fmt(self.limit)}")
        if self.floor_factor is not None:
            parts.append(f"≤ {self.floor_factor:g} × floor")
        return ", ".join(parts)

    def _fmt(self, v: float) -> str:
        if self.size or self.key.endswith("rss"):
            return f"{v / 1e3:,.1f} kB" if v < MB else f"{v / MB:,.0f} MB"
        return format_seconds(v)

    def check(self, metrics: Mapping[str, Metric]) -> Check:
        """Compare with the absolute limit and, if given, a multiple of the summed floors."""
        if self.key not in metrics or not all(f in metrics for f in self.floors):
            return NOT_MEASURED
        v = metrics[self.key].value
        ok = v <= self.limit
        floor_text, ratio = "", ""
        if self.floors:
            floor = sum(metrics[f].value for f in self.floors)
            floor_text = (
                self._fmt(floor) + " (" + " + ".join(metrics[f].label for f in self.floors) + ")"
            )
            ratio = f"{v / floor:.2f}× floor"
            if self.floor_factor is not None:
                ok = ok and v <= self.floor_factor * floor
        return Check(self._fmt(v), floor_text, ratio, ok)


Criterion = AtLeastRatio | AtLeastRate | AtMost


@dataclass(frozen=True, slots=True)
class Target:
    """One row of docs/DESIGN.md's targets table."""

    what: str
    seed: str
    floor_here: str
    criteria: tuple[Criterion, ...]


TARGETS: tuple[Target, ...] = (
    # Ed25519 against the faster library: libsodium through its raw binding (the pair's
    # raw side, measured in alternation with ours) or OpenSSL. PyNaCl's SigningKey /
    # VerifyKey call the same libsodium function through a class and are shown as
    # floors only: measured once, apart from ours, the same C call read up to 18 %
    # faster or slower than itself from one pyperf run to the next on this host.
    Target(
        "Wallet.sign (64 B)",
        "15.4k ops/s",
        "libsodium 34k, OpenSSL 27k",
        (
            AtLeastRatio(
                "wallet.sign.64B",
                ("wallet.sign.64B.raw", "ed25519.sign.64B.openssl"),
                0.9,
            ),
        ),
    ),
    Target(
        "Wallet.verify (64 B)",
        "6.9k ops/s",
        "libsodium 12k, OpenSSL 8k",
        (
            AtLeastRatio(
                "wallet.verify.64B",
                ("wallet.verify.64B.raw", "ed25519.verify.64B.openssl"),
                0.9,
            ),
        ),
    ),
    Target(
        "ChaCha20-Poly1305 seal, 35 B frame (framing included)",
        "290k ops/s",
        "1.1M raw calls/s",
        (AtLeastRatio("stream.seal.35B", ("chacha20poly1305.seal.35B",), 0.5),),
    ),
    Target(
        "StreamSealer.seal, 1 MiB chunk (as fast as seal_into)",
        "844 us, 480 page faults per call",
        "seal_into 251 us; raw seal 273 us",
        (AtLeastRatio("stream.seal.1MiB", ("stream.seal_into.1MiB",), 0.85),),
    ),
    Target(
        "Session.encrypt (35 B)",
        "50.7k ops/s",
        "—",
        (AtLeastRate("session.encrypt.35B", 150_000, floor="chacha20poly1305.seal.35B"),),
    ),
    Target(
        "Hybrid sign (Ed25519 + ML-DSA-65, 64 B)",
        "—",
        "sum of raw Ed25519 + ML-DSA-65 sign",
        (AtLeastRatio("hybrid.sign.64B", ("hybrid.sign.64B.raw",), 0.9),),
    ),
    Target(
        "Hybrid verify (Ed25519 + ML-DSA-65, 64 B)",
        "—",
        "sum of raw Ed25519 + ML-DSA-65 verify",
        (AtLeastRatio("hybrid.verify.64B", ("hybrid.verify.64B.raw",), 0.9),),
    ),
    # Below the floor on this machine: a create pair is at least 2 Ed25519 key
    # pairs, 5 X25519 key pairs, 8 X25519 DHs, 3 Ed25519 signs and 2 verifies
    # (bench_ratchet._raw_pair). At the costs of docs/BENCHMARKS.md's quiet run
    # (Ed25519 key pair 37 us, DH 40 us, sign 34 us, verify 65 us) and a
    # libsodium X25519 key pair of ~22 us (bench_crypto "x25519.generate.nacl")
    # that is 2*37 + 5*22 + 8*40 + 3*34 + 2*65 = 736 us, 1.36k/s; the measured
    # primitive sum (the "raw floor" column) was 818 us, 1.22k/s. 3k/s is 333 us:
    # the eight DHs alone take 320 us. The hybrid adds ML-KEM-768 key from seed,
    # encapsulate and decapsulate (~110 + 26 + 43 us): >= 915 us, <= 1.09k/s,
    # under 1.5k/s. Kept as set, shown as a miss; the ratio rows below are what
    # we can move.
    Target(
        "Session create pair, X3DH, keys included",
        "669 /s (1.49 ms)",
        "X25519 27k DH/s; BELOW ITS FLOOR here: 2 Ed25519 + 5 X25519 key pairs, "
        "8 DH, 3 sign, 2 verify = 2×37 + 5×22 + 8×40 + 3×34 + 2×65 µs ≈ 736 µs "
        "(1.36k/s), the 8 DHs alone 320 µs; 3k/s = 333 µs",
        (
            AtLeastRate(
                "session.create_pair.x25519",
                3_000,
                floor="session.create_pair.x25519.primitives",
            ),
        ),
    ),
    Target(
        "Session create pair, PQ hybrid (ML-KEM-768)",
        "—",
        "BELOW ITS FLOOR here: the classical floor ≈ 736 µs plus ML-KEM-768 key from "
        "seed + encaps + decaps ≈ 180 µs ≈ 915 µs (1.09k/s); 1.5k/s = 667 µs",
        (
            AtLeastRate(
                "session.create_pair.x25519-mlkem768",
                1_500,
                floor="session.create_pair.x25519-mlkem768.primitives",
            ),
        ),
    ),
    Target(
        "link frame seal + open, 35 B",
        "—",
        "raw ChaCha20-Poly1305 encrypt + decrypt",
        (AtLeastRatio("link.seal_open.35B", ("link.seal_open.35B.raw",), 0.5),),
    ),
    Target(
        "link frame seal + open, 64 KiB",
        "—",
        "raw ChaCha20-Poly1305 encrypt + decrypt",
        (AtLeastRatio("link.seal_open.64KiB", ("link.seal_open.64KiB.raw",), 0.9),),
    ),
    Target(
        "canonical_json_bytes (small object)",
        "297k ops/s",
        "—",
        (AtLeastRate("canonical.small", 500_000, floor="canonical.small.raw"),),
    ),
    Target(
        "LMDB block store write (batch)",
        "2.0M ops/s",
        "raw lmdb 475k",
        (AtLeastRatio("store.append.batch", ("store.append.batch.raw",), 0.7),),
    ),
    Target(
        "LMDB block store read (random)",
        "3.9M ops/s",
        "raw lmdb 1.04M",
        (AtLeastRatio("store.read.random", ("store.read.random.raw",), 0.7),),
    ),
    Target(
        "block validation, one core",
        "0.24 ms/block",
        "Ed25519 verify 12k/s",
        (
            AtLeastRate(
                "chain.validate.1core", 10_000, " records/s", floor="ed25519.verify.64B.nacl"
            ),
        ),
    ),
    Target(
        "block validation, all cores vs one",
        "—",
        "2 cores",
        (AtLeastRatio("chain.validate.allcores", ("chain.validate.1core",), 1.7),),
    ),
    Target(
        "chain verify memory flat in log size (4x the records)",
        "1.24 GB at 1M records (the whole log read into dicts)",
        "verify at a quarter of the records, same run",
        (AtMost("chain.verify.large.rss", float("inf"), ("chain.verify.small.rss",), 1.25),),
    ),
    Target(
        "block log append + seal: bytes LMDB writes per record flat "
        "(records 10k-100k and 100k-1M vs 0-10k; write(2) bytes, see bench_chain._io_counters "
        "for why not write_bytes)",
        "41.9 KB written per 376-byte record at 1M",
        "the first 10k records, same run",
        tuple(
            AtMost(
                f"chain.sustained.wchar.{when}",
                float("inf"),
                ("chain.sustained.wchar.first",),
                1.25,
                size=True,
            )
            for when in ("mid", "last")
        ),
    ),
    Target(
        "block log append time flat (records 10k-100k and 100k-1M vs 0-10k)",
        "6.4 → 12.9 µs per append",
        "the first 10k records, same run",
        tuple(
            AtMost(
                f"chain.sustained.{what}.{when}",
                float("inf"),
                (f"chain.sustained.{what}.first",),
                1.25,
            )
            for what in ("append", "total")
            for when in ("mid", "last")
        ),
    ),
    Target(
        "Session.create_pair vs the sum of its raw primitives (X3DH)",
        "502–555 µs",
        "its primitives alone ≈ 405 µs",
        (
            AtLeastRatio(
                "session.create_pair.x25519",
                (
                    "session.create_pair.x25519.primitives",
                    "session.create_pair.x25519.primitives.openssl",
                ),
                0.8,
            ),
        ),
    ),
    Target(
        "Session.create_pair vs the sum of its raw primitives (PQ hybrid, ML-KEM-768)",
        "670–771 µs",
        "its primitives alone, same run",
        (
            AtLeastRatio(
                "session.create_pair.x25519-mlkem768",
                (
                    "session.create_pair.x25519-mlkem768.primitives",
                    "session.create_pair.x25519-mlkem768.primitives.openssl",
                ),
                0.8,
            ),
        ),
    ),
    Target(
        "scale: one hub, 60 peer processes vs 10 (bench_scale)",
        "—",
        "the 10-peer step, same run",
        (
            AtLeastRatio("scale.60.rate", ("scale.10.rate",), 0.8),
            AtMost("scale.60.hub_cpu", float("inf"), ("scale.10.hub_cpu",), 1.25),
            AtMost("scale.60.peer_cpu", float("inf"), ("scale.10.peer_cpu",), 1.25),
            AtMost("scale.60.link_mem", float("inf"), ("scale.10.link_mem",), 1.25, size=True),
        ),
    ),
    Target(
        "end-to-end message A → B, durable (fsync before ack), p50",
        "4–6 ms",
        "one LMDB sync commit 0.4 ms",
        (AtMost("e2e.latency.p50", 1e-3, ("e2e.sync_commit", "ws.roundtrip.p50"), 2.0),),
    ),
    Target(
        "sending node CPU per message, send with wait (local socket)",
        "1.1 ms (control API, K=10 senders)",
        "the receiving hub spends 0.2 ms",
        (AtMost("agents.sender.cpu", 0.3e-3),),
    ),
    Target(
        "acked messages/s from one sender, 64 in flight on one local connection",
        "562 msg/s (one sender, control API)",
        "—",
        (AtLeastRate("agents.send.inflight64", 3_000, " msg/s"),),
    ),
    Target(
        "CLI start: talosd --help, send, inbox (each vs python -c pass)",
        "--help 300 ms, send --wait 310 ms",
        "python -c pass, same run",
        tuple(
            AtMost(f"cli.{c}", float("inf"), ("cli.python",), 5.0)
            for c in ("help", "send", "inbox")
        ),
    ),
    Target(
        "relayed message round trip (NATS relay), p50",
        "—",
        "the direct link, same run",
        (AtMost("relay.msg.p50", float("inf"), ("relay.direct.p50",), 3.0),),
    ),
    Target(
        "MCP tunnel added round trip (ping)",
        "+12.3 ms",
        "naive unencrypted relay +0.5 ms",
        (AtMost("tunnel.ping.added.p50", 0.6e-3), AtMost("tunnel.ping.added.p99", 2e-3)),
    ),
    Target(
        "MCP tunnel, lean JSON-RPC client, sequential",
        "~80 req/s",
        "raw stdio 2,600 /s",
        (
            AtLeastRate(
                "tunnel.lean.sequential", 1_000, " req/s", floor="tunnel.lean.sequential.raw"
            ),
        ),
    ),
    Target(
        "MCP tunnel, 64 requests in flight",
        "—",
        "raw 18k /s, naive relay 9.2k /s",
        (
            AtLeastRate(
                "tunnel.lean.inflight64", 8_000, " req/s", floor="tunnel.lean.inflight64.raw"
            ),
        ),
    ),
    Target(
        "MCP tunnel tools/call, 8 / 64 / 256 in flight",
        "6.3k / 15.5k / 22k req/s (0.18-0.42 x raw)",
        "raw stdio tools/call, same run; the naive relay (no crypto, no audit) beside it"
        " in the bench_tunnel rows: four processes share the cores where raw has two",
        tuple(
            AtLeastRatio(f"tunnel.echo.inflight{n}", (f"tunnel.echo.inflight{n}.raw",), 0.6)
            for n in (8, 64, 256)
        ),
    ),
    Target(
        "MCP tunnel added round trip, tools/call, p50 (vs a naive WebSocket relay)",
        "—",
        "bench/naive_ws_relay.py (plain websockets, no crypto, no audit), same run",
        (AtMost("tunnel.echo.added.p50", float("inf"), ("relay.echo.added.p50",), 1.0),),
    ),
    Target(
        "MCP tunnel tools/call p99 at 256 in flight",
        "50 ms",
        "raw stdio at 256 in flight, same run",
        (
            AtMost(
                "tunnel.echo.inflight256.p99",
                float("inf"),
                ("tunnel.echo.inflight256.raw.p99",),
                2.0,
            ),
        ),
    ),
    Target(
        "file transfer, loopback, encrypted",
        "9.1 MB/s",
        "ChaCha20 1.9 GB/s/core; plain websockets copy 200–250 MiB/s",
        (
            AtLeastRatio("transfer.encrypted", ("transfer.plain_ws",), 1.0),
            AtLeastRate("transfer.encrypted", 400 * MB, " MB/s"),
            AtMost("transfer.peak_rss", 200 * MB),
        ),
    ),
)
