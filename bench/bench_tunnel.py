"""MCP through the Talos tunnel vs the same server on raw stdio
(docs/DESIGN.md "Performance targets").

``talos-proxy serve`` and ``talos-proxy connect`` run as real subprocesses on
127.0.0.1; the tool is bench/mcp_ping_server.py, a minimal stdio MCP server, so
the tool never is the bottleneck. Each figure is measured against the SAME
server spawned directly on stdio in the same run:

* ping round trip p50 / p99 with the lean JSON-RPC client (bench/lean_jsonrpc.py)
  and with the official MCP SDK client (``stdio_client`` + ``ClientSession.send_ping``);
  added latency = tunnel - raw (targets: p50 <= +0.6 ms, p99 <= +2 ms, lean client);
  the lean round trips behind every added-latency row (raw stdio, naive relay,
  tunnel, per-turn-ratchet tunnel) are taken in turns of 50, so each command meets
  the same moments of load;
* lean requests/s sequential (>= 1,000 /s) and with 64 in flight (>= 8,000 /s);
* the same sequential figures with ``serve --audit strict`` (one durable
  audit commit per call, docs/DESIGN.md "Notes"): shown, not a target;
* the ``connect --http`` front (docs/adr/0008-http-front-eras.md), 2026-07-28
  stateless and 2025-11-25 session clients: ``tools/call echo`` p50 and
  throughput with 64 in flight against the same call on raw stdio. mcp-proxy
  and supergateway are not installed here, so they have no rows.
* ``tools/call echo`` through the tunnel and through bench/naive_ws_relay.py (stdio
  lines over plain websockets, no crypto, no audit) beside raw stdio: added p50
  sequential (target: the tunnel's <= the relay's), requests/s at 8 / 64 / 256 in
  flight (>= 0.6 x raw), p99 at 256 in flight (<= 2 x raw's);
* ``connect`` attached to a running ``talosd run`` (docs/adr/0012-local-clients.md)
  vs the embedded node: added p50 and 64-in-flight throughput, same run;
* the serving process's CPU time per ``tools/call`` (user + system, all its
  threads, from ``/proc/PID/task/*/schedstat``; the tool process is not counted), sequential
  and at 256 in flight, beside the naive relay's serving process, same run; and the
  same for the connecting process (``talos-proxy connect`` / the relay's ``connect``).

    python bench/bench_tunnel.py [--fast] [--count N] [--burst M]
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, Suite, latency_main, quantiles
from _procs import ENV, PROXY, PYTHON, TALOSD, child, run, run_quiet, thread_cpu_seconds
from http_front_client import HttpMcpClient
from lean_jsonrpc import LeanClient

PING_SERVER = [PYTHON, str(Path(__file__).resolve().parent / "mcp_ping_server.py")]
# Proxy logs at WARNING so stderr chatter does not cost time inside the measurement.
QUIET = ["--log-level", "WARNING"]
IN_FLIGHT = 64
SETUP_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class LeanRun:
    """What the lean client measured against one stdio command."""

    pings: list[float]
    sequential: float  # requests/s, one at a time
    in_flight: float  # requests/s, IN_FLIGHT outstanding
    # requests/s at each other level of LEVELS, and the latencies at the highest one
    rates: dict[int, float] = field(default_factory=dict)
    tail: list[float] = field(default_factory=list)
    # CPU seconds per request of the serving process (``cpu_pid``): sequential, highest level
    cpu_sequential: float = 0.0
    cpu_top: float = 0.0
    # The same for the process the client spawned and talks to (connect; the tool when raw)
    front_cpu_sequential: float = 0.0
    front_cpu_top: float = 0.0


ECHO = {"name": "echo", "arguments": {"text": "hi"}}
# In-flight levels of the tools/call throughput rows (raw, naive relay, tunnel).
LEVELS = (8, IN_FLIGHT, 256)
RELAY = [PYTHON, str(Path(__file__).resolve().parent / "naive_ws_relay.py")]


async def timed_burst(
    client: LeanClient, method: str, params: Any, burst: int, in_flight: int
) -> tuple[float, list[float]]:
    """``burst`` requests keeping ``in_flight`` unanswered: requests/s and each one's latency."""
    window = asyncio.Semaphore(in_flight)
    latencies: list[float] = []
    futures = []

    def answered(started: float, fut: asyncio.Future[Any]) -> None:
        latencies.append(time.perf_counter() - started)
        window.release()

    start = time.perf_counter()
    for i in range(burst):
        await window.acquire()
        fut = client.start(method, params)
        fut.add_done_callback(functools.partial(answered, time.perf_counter()))
        futures.append(fut)
        if i % in_flight == in_flight - 1:
            await client.writer.drain()
    await client.writer.drain()
    await asyncio.gather(*futures)
    return burst / (time.perf_counter() - start), latencies


#: Sequential calls each command takes in one turn of :func:`interleaved_pings`.
TURN = 50


async def interleaved_pings(
    argvs: Sequence[Sequence[str]], count: int, method: str, params: Any = None
) -> list[list[float]]:
    """``count`` sequential round trips on each of ``argvs``, in turns of :data:`TURN`.

    Rows that subtract one command's p50 from another's (raw stdio, the naive
    relay, the tunnel) then sample the same moments of a drifting machine load.
    """
    clients: list[LeanClient] = []
    samples: list[list[float]] = [[] for _ in argvs]
    try:
        for argv in argvs:
            client = await LeanClient.spawn(list(argv), env=ENV)
            clients.append(client)
            await asyncio.wait_for(client.initialize(), SETUP_TIMEOUT)
            for _ in range(max(count // 10, 5)):  # warm-up: link, session, tool process
                await client.request(method, params)
        for done in range(0, count, TURN):
            for client, out in zip(clients, samples, strict=True):
                for _ in range(min(TURN, count - done)):
                    start = time.perf_counter()
                    await client.request(method, params)
                    out.append(time.perf_counter() - start)
    finally:
        for client in clients:
            await client.close()
    return samples


async def lean_run(
    argv: Sequence[str],
    count: int,
    burst: int,
    method: str = "ping",
    params: Any = None,
    levels: Sequence[int] = (),
    cpu_pid: int | None = None,
) -> LeanRun:
    """Call ``method`` on ``argv`` (an MCP stdio server) one at a time, then IN_FLIGHT at a time
    (and at each of ``levels``); with ``cpu_pid``, that process's CPU time per request,
    and always the CPU time of the process ``argv`` started."""
    client = await LeanClient.spawn(list(argv), env=ENV)
    front = client.process.pid if client.process is not None else None
    try:
        await asyncio.wait_for(client.initialize(), SETUP_TIMEOUT)
        for _ in range(max(count // 10, 5)):  # warm-up: link, session, tool process
            await client.request(method, params)
        pings = []
        cpu, front_cpu = thread_cpu_seconds(cpu_pid), thread_cpu_seconds(front)
        for _ in range(count):
            start = time.perf_counter()
            await client.request(method, params)
            pings.append(time.perf_counter() - start)
        cpu_sequential = (thread_cpu_seconds(cpu_pid) - cpu) / count
        front_sequential = (thread_cpu_seconds(front) - front_cpu) / count
        sequential = count / sum(pings)
        start = time.perf_counter()
        await client.pipelined(method, (params for _ in range(burst)), IN_FLIGHT)
        in_flight = burst / (time.perf_counter() - start)
        rates: dict[int, float] = {}
        tail: list[float] = []
        cpu_top = front_top = 0.0
        for level in levels:
            cpu, front_cpu = thread_cpu_seconds(cpu_pid), thread_cpu_seconds(front)
            rates[level], tail = await timed_burst(client, method, params, burst, level)
            cpu_top = (thread_cpu_seconds(cpu_pid) - cpu) / burst
            front_top = (thread_cpu_seconds(front) - front_cpu) / burst
    finally:
        await client.close()
    return LeanRun(
        pings,
        sequential,
        in_flight,
        rates,
        tail,
        cpu_sequential,
        cpu_top,
        front_sequential,
        front_top,
    )


async def sdk_pings(argv: Sequence[str], count: int) -> list[float]:
    """Ping round trips with the official MCP SDK client over stdio."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(
        command=argv[0], args=list(argv[1:]), env=dict(ENV), cwd=str(REPO_ROOT)
    )
    samples = []
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await asyncio.wait_for(session.initialize(), SETUP_TIMEOUT)
        for _ in range(max(count // 10, 5)):
            await session.send_ping()
        for _ in range(count):
            start = time.perf_counter()
            await session.send_ping()
            samples.append(time.perf_counter() - start)
    return samples


#: Signal's schedule, a talosd home's default: a DH ratchet step every turn. The
#: proxies' own homes step after 64 sends or 1 s (ADR 0002, "The tunnel's schedule").
PER_TURN: dict[str, object] = {"ratchet_every": 1}


@dataclass(frozen=True, slots=True)
class Served:
    """A running serving side: the command that connects to it and the serving process's pid."""

    connect: list[str]
    pid: int


@contextlib.asynccontextmanager
async def tunnel(
    root: Path, name: str, *serve_args: str, node: dict[str, object] | None = None
) -> AsyncIterator[Served]:
    """A running ``talos-proxy serve`` over the ping server; yields how to connect, its pid.

    ``node``: NodeConfig fields set in both homes (e.g. the per-turn ratchet, ADR 0002).
    """
    c_home, s_home = root / f"{name}-connect", root / f"{name}-serve"
    did_c = await run_quiet([*PROXY, "id", "--home", str(c_home), "--no-passphrase"])
    if node:
        await run_quiet([*PROXY, "id", "--home", str(s_home), "--no-passphrase"])
        for home in (c_home, s_home):
            config = home / "config.json"
            config.write_text(json.dumps({**json.loads(config.read_text()), **node}))
    argv = [*PROXY, *QUIET, "serve", "--home", str(s_home), "--listen", "127.0.0.1:0"]
    argv += ["--allow", did_c, *serve_args, "--", *PING_SERVER]
    async with child(argv, f"talos-proxy serve ({name})") as serve:
        address = (await serve.wait_line(r"serving on (ws://\S+)")).group(1)
        connect = [*PROXY, *QUIET, "connect", "--home", str(c_home), "--peer", address]
        yield Served(connect, serve.pid)


@contextlib.asynccontextmanager
async def naive_relay() -> AsyncIterator[Served]:
    """bench/naive_ws_relay.py serving the ping server; yields its connect command and pid."""
    async with child([*RELAY, "serve", "--", *PING_SERVER], "naive relay serve") as serve:
        url = (await serve.wait_line(r"relay on (ws://\S+)")).group(1)
        yield Served([*RELAY, "connect", url], serve.pid)


@contextlib.asynccontextmanager
async def http_front(root: Path) -> AsyncIterator[tuple[str, str]]:
    """``connect --http`` in front of a tunnel to the ping server; yields (URL, token)."""
    async with tunnel(root, "http") as served:
        argv = [*served.connect, "--http", "127.0.0.1:0", "--http-idle", "600"]
        async with child(argv, "talos-proxy connect --http") as front:
            url = (await front.wait_line(r"Streamable HTTP on (http://\S+)")).group(1)
            home = Path(served.connect[served.connect.index("--home") + 1])
            token = (home / "proxy-http.token").read_text().strip()
            yield url, token


async def http_run(url: str, token: str, count: int, burst: int, *, stateless: bool) -> LeanRun:
    """``tools/call echo`` over the HTTP front, one at a time, then IN_FLIGHT at a time."""
    client = HttpMcpClient(url, token, stateless=stateless, in_flight=IN_FLIGHT)
    try:
        await asyncio.wait_for(client.start(), SETUP_TIMEOUT)
        await client.timed(max(count // 10, 5))  # warm-up: link, tool process(es)
        samples = await client.timed(count)
        in_flight = await client.throughput(burst, IN_FLIGHT)
    finally:
        await client.close()
    return LeanRun(samples, count / sum(samples), in_flight)


@contextlib.asynccontextmanager
async def attached_tunnel(root: Path) -> AsyncIterator[list[str]]:
    """``talos-proxy connect`` attached to a running ``talosd run`` (ADR 0012)."""
    c_home, s_home = root / "attached-node", root / "attached-serve"
    did_c = await run_quiet([*TALOSD, "init", "--home", str(c_home), "--no-passphrase"])
    argv = [*PROXY, *QUIET, "serve", "--home", str(s_home), "--listen", "127.0.0.1:0"]
    argv += ["--allow", did_c, "--", *PING_SERVER]
    node_argv = [*TALOSD, "run", "--home", str(c_home)]
    async with (
        child(argv, "talos-proxy serve (attached)") as serve,
        child(node_argv, "talosd run") as node,
    ):
        await node.wait_line(r"running did=")
        address = (await serve.wait_line(r"serving on (ws://\S+)")).group(1)
        yield [*PROXY, *QUIET, "connect", "--home", str(c_home), "--peer", address]


async def measure(suite: Suite, count: int, burst: int) -> None:
    with tempfile.TemporaryDirectory(prefix="talos-bench-tunnel-") as tmp:
        root = Path(tmp)
        raw = await lean_run(PING_SERVER, count, burst)
        raw_sdk = await sdk_pings(PING_SERVER, count)
        raw_echo = await lean_run(PING_SERVER, count, burst, "tools/call", ECHO, LEVELS)
        async with (
            naive_relay() as relay,
            tunnel(root, "group") as served,
            tunnel(root, "per-turn", node=PER_TURN) as turn_served,
        ):
            relay_echo = await lean_run(
                relay.connect, count, burst, "tools/call", ECHO, LEVELS, relay.pid
            )
            ours = await lean_run(served.connect, count, burst)
            ours_sdk = await sdk_pings(served.connect, count)
            ours_echo = await lean_run(
                served.connect, count, burst, "tools/call", ECHO, LEVELS, served.pid
            )
            per_turn = await lean_run(turn_served.connect, count, burst)
            # The added-latency rows compare commands: measure them in turns, same moments.
            raw_p, ours_p = await interleaved_pings([PING_SERVER, served.connect], count, "ping")
            raw_e, relay_e, ours_e, turn_e = await interleaved_pings(
                [PING_SERVER, relay.connect, served.connect, turn_served.connect],
                count,
                "tools/call",
                ECHO,
            )
        raw, ours = replace(raw, pings=raw_p), replace(ours, pings=ours_p)
        raw_echo, relay_echo = replace(raw_echo, pings=raw_e), replace(relay_echo, pings=relay_e)
        ours_echo = replace(ours_echo, pings=ours_e)
        async with tunnel(root, "strict", "--audit", "strict") as served:
            strict = await lean_run(served.connect, count, burst)
        async with attached_tunnel(root) as connect:
            attached = await lean_run(connect, count, burst)
        async with http_front(root) as (url, token):
            stateless = await http_run(url, token, count, burst, stateless=True)
            legacy = await http_run(url, token, count, burst, stateless=False)
    record_http(suite, raw_echo, stateless, legacy)
    record_echo(suite, raw_echo, relay_echo, ours_echo)
    record_ratchet_share(suite, raw_echo, turn_e)

    raw50, raw99 = quantiles(raw.pings)
    p50, p99 = quantiles(ours.pings)
    s50, _ = quantiles(strict.pings)
    sdk_raw50, sdk_raw99 = quantiles(raw_sdk)
    sdk50, sdk99 = quantiles(ours_sdk)
    rec = suite.record
    rec("tunnel.ping.raw.p50", "lean ping, raw stdio, p50", raw50, "s", row=False)
    rec("tunnel.ping.p50", "lean ping through tunnel, p50", p50, "s", raw="tunnel.ping.raw.p50")
    rec("tunnel.ping.raw.p99", "lean ping, raw stdio, p99", raw99, "s", row=False)
    rec("tunnel.ping.p99", "lean ping through tunnel, p99", p99, "s", raw="tunnel.ping.raw.p99")
    rec("tunnel.ping.added.p50", "tunnel added round trip, p50", p50 - raw50, "s")
    rec("tunnel.ping.added.p99", "tunnel added round trip, p99", p99 - raw99, "s")
    rec("tunnel.sdk.ping.raw.p50", "MCP SDK ping, raw stdio, p50", sdk_raw50, "s", row=False)
    rec(
        "tunnel.sdk.ping.p50",
        "MCP SDK ping through tunnel, p50",
        sdk50,
        "s",
        raw="tunnel.sdk.ping.raw.p50",
    )
    rec("tunnel.sdk.ping.raw.p99", "MCP SDK ping, raw stdio, p99", sdk_raw99, "s", row=False)
    rec(
        "tunnel.sdk.ping.p99",
        "MCP SDK ping through tunnel, p99",
        sdk99,
        "s",
        raw="tunnel.sdk.ping.raw.p99",
    )
    rec("tunnel.sdk.ping.added.p50", "MCP SDK added round trip, p50", sdk50 - sdk_raw50, "s")
    rec(
        "tunnel.lean.sequential.raw",
        "lean, raw stdio, sequential",
        raw.sequential,
        "ops/s",
        row=False,
    )
    rec(
        "tunnel.lean.sequential",
        "lean through tunnel, sequential",
        ours.sequential,
        "ops/s",
        raw="tunnel.lean.sequential.raw",
    )
    rec(
        "tunnel.lean.inflight64.raw",
        f"lean, raw stdio, {IN_FLIGHT} in flight",
        raw.in_flight,
        "ops/s",
        row=False,
    )
    rec(
        "tunnel.lean.inflight64",
        f"lean through tunnel, {IN_FLIGHT} in flight",
        ours.in_flight,
        "ops/s",
        raw="tunnel.lean.inflight64.raw",
    )
    rec("tunnel.strict.ping.p50", "lean ping, --audit strict, p50", s50, "s")
    rec(
        "tunnel.strict.sequential",
        "lean, --audit strict, sequential",
        strict.sequential,
        "ops/s",
        raw="tunnel.lean.sequential",
    )
    rec(
        "tunnel.strict.inflight64",
        f"lean, --audit strict, {IN_FLIGHT} in flight",
        strict.in_flight,
        "ops/s",
        raw="tunnel.lean.inflight64",
    )
    # A talosd home's default, a DH ratchet step per turn, beside the tunnel's (ADR 0002).
    rec(
        "tunnel.per_turn.sequential",
        "lean, ratchet step every turn, sequential",
        per_turn.sequential,
        "ops/s",
        raw="tunnel.lean.sequential",
    )
    rec(
        "tunnel.per_turn.inflight64",
        f"lean, ratchet step every turn, {IN_FLIGHT} in flight",
        per_turn.in_flight,
        "ops/s",
        raw="tunnel.lean.inflight64",
    )
    a50, _ = quantiles(attached.pings)
    rec(
        "tunnel.attached.ping.added.p50", "attached connect added round trip, p50", a50 - raw50, "s"
    )
    rec(
        "tunnel.attached.ping.p50",
        "lean ping, attached connect, p50 (vs embedded)",
        a50,
        "s",
        raw="tunnel.ping.p50",
    )
    rec(
        "tunnel.attached.inflight64",
        f"lean, attached connect, {IN_FLIGHT} in flight",
        attached.in_flight,
        "ops/s",
        raw="tunnel.lean.inflight64",
    )
    suite.record_samples("lean ping, tunnel attached to talosd run", attached.pings)
    suite.record_samples("lean ping, raw stdio", raw.pings)
    suite.record_samples("lean ping, tunnel", ours.pings)
    suite.record_samples("lean ping, tunnel --audit strict", strict.pings)
    suite.record_samples("MCP SDK ping, raw stdio", raw_sdk)
    suite.record_samples("MCP SDK ping, tunnel", ours_sdk)


def record_echo(suite: Suite, raw: LeanRun, relay: LeanRun, ours: LeanRun) -> None:
    """tools/call rows: tunnel and naive relay beside raw stdio at 1 / 8 / 64 / 256 in flight."""
    rec = suite.record
    raw50, _ = quantiles(raw.pings)
    for name, run_ in (("relay", relay), ("tunnel", ours)):
        who = "naive WebSocket relay" if name == "relay" else "tunnel"
        p50, _ = quantiles(run_.pings)
        rec(
            f"{name}.echo.added.p50",
            f"{who} added round trip, tools/call, p50",
            p50 - raw50,
            "s",
            raw=None if name == "relay" else "relay.echo.added.p50",
        )
    for level in LEVELS:
        label = f"tools/call echo, {level} in flight"
        raw_key = f"tunnel.echo.inflight{level}.raw"
        if level != IN_FLIGHT:  # the 64 row is record_http's
            rec(raw_key, f"lean {label}, raw stdio", raw.rates[level], "ops/s", row=False)
        rec(f"relay.echo.inflight{level}", f"{label}, naive relay", relay.rates[level], "ops/s",
            raw=raw_key)  # fmt: skip
        rec(f"tunnel.echo.inflight{level}", f"{label}, tunnel", ours.rates[level], "ops/s",
            raw=raw_key)  # fmt: skip
    top = LEVELS[-1]
    _, raw_tail99 = quantiles(raw.tail)
    _, tail99 = quantiles(ours.tail)
    _, relay99 = quantiles(relay.tail)
    rec(f"tunnel.echo.inflight{top}.raw.p99", f"raw stdio, {top} in flight, p99", raw_tail99, "s",
        row=False)  # fmt: skip
    rec(f"relay.echo.inflight{top}.p99", f"naive relay, {top} in flight, p99", relay99, "s",
        raw=f"tunnel.echo.inflight{top}.raw.p99")  # fmt: skip
    rec(f"tunnel.echo.inflight{top}.p99", f"tunnel, {top} in flight, p99", tail99, "s",
        raw=f"tunnel.echo.inflight{top}.raw.p99")  # fmt: skip
    # Serve-side CPU per call: where the tunnel's microseconds go, beside the relay's.
    for when, ours_cpu, relay_cpu in (
        ("sequential", ours.cpu_sequential, relay.cpu_sequential),
        (f"{top} in flight", ours.cpu_top, relay.cpu_top),
    ):
        key = "sequential" if when == "sequential" else f"inflight{top}"
        rec(f"relay.serve.cpu.{key}", f"naive relay serving process CPU per tools/call, {when}",
            relay_cpu, "s", row=False)  # fmt: skip
        rec(f"tunnel.serve.cpu.{key}", f"talos-proxy serve CPU per tools/call, {when}", ours_cpu,
            "s", raw=f"relay.serve.cpu.{key}")  # fmt: skip
    # The connecting process's CPU per call likewise (stdin/stdout, framing, sealing).
    for when, ours_cpu, relay_cpu in (
        ("sequential", ours.front_cpu_sequential, relay.front_cpu_sequential),
        (f"{top} in flight", ours.front_cpu_top, relay.front_cpu_top),
    ):
        key = "sequential" if when == "sequential" else f"inflight{top}"
        rec(f"relay.connect.cpu.{key}", f"naive relay connecting process CPU per tools/call, "
            f"{when}", relay_cpu, "s", row=False)  # fmt: skip
        rec(f"tunnel.connect.cpu.{key}", f"talos-proxy connect CPU per tools/call, {when}",
            ours_cpu, "s", raw=f"relay.connect.cpu.{key}")  # fmt: skip
    suite.record_samples("tools/call echo, naive relay", relay.pings)
    suite.record_samples("tools/call echo, tunnel", ours.pings)


def record_ratchet_share(suite: Suite, raw: LeanRun, per_turn: list[float]) -> None:
    """The tools/call added p50 with a DH ratchet step every turn (a talosd home's
    default, ADR 0002) beside the naive relay's.

    This row minus the default tunnel's is what the per-turn step (a key pair, 2
    X25519 and 2 root KDFs per side per round trip) would cost on the path.
    """
    raw50, _ = quantiles(raw.pings)
    turn50, _ = quantiles(per_turn)
    suite.record(
        "tunnel.per_turn.echo.added.p50",
        "tunnel added round trip, tools/call, p50, ratchet step every turn",
        turn50 - raw50,
        "s",
        raw="relay.echo.added.p50",
    )


def record_http(suite: Suite, raw: LeanRun, stateless: LeanRun, legacy: LeanRun) -> None:
    """HTTP front rows: added p50 and 64-in-flight throughput against direct stdio, same run."""
    rec = suite.record
    raw50, _ = quantiles(raw.pings)
    rec("tunnel.echo.raw.p50", "lean tools/call echo, raw stdio, p50", raw50, "s", row=False)
    rec(
        "tunnel.echo.inflight64.raw",
        f"lean tools/call echo, raw stdio, {IN_FLIGHT} in flight",
        raw.in_flight,
        "ops/s",
        row=False,
    )
    for era, run_ in (("stateless", stateless), ("legacy", legacy)):
        p50, _ = quantiles(run_.pings)
        name = "2026-07-28 stateless" if era == "stateless" else "2025-11-25 session"
        rec(
            f"tunnel.http.{era}.p50",
            f"HTTP front ({name}) echo, p50",
            p50,
            "s",
            raw="tunnel.echo.raw.p50",
        )
        rec(f"tunnel.http.{era}.added.p50", f"HTTP front ({name}) added, p50", p50 - raw50, "s")
        rec(
            f"tunnel.http.{era}.inflight64",
            f"HTTP front ({name}) echo, {IN_FLIGHT} in flight",
            run_.in_flight,
            "ops/s",
            raw="tunnel.echo.inflight64.raw",
        )
        suite.record_samples(f"echo, HTTP front {era}", run_.pings)


def main() -> None:
    latency_main(
        __file__,
        __doc__,
        lambda suite, args: run(measure(suite, args.count, args.burst)),
        count=(200, 2000),
        burst=(500, 20000),
    )


if __name__ == "__main__":
    main()
