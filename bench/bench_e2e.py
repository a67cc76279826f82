"""Durable message latency A -> B between two real nodes (docs/DESIGN.md "Performance targets").

Node B is a real ``talosd run`` subprocess, node A runs in this process, so the
two nodes use both cores as in a deployment. A times ``send_message(wait=True)``
(ratchet seal, link frame, receiver commit + fsync, ack; the sender's outbox
commit overlaps it and needs no fsync of its own with ``wait``, ADR 0007) one
at a time for p50 / p99, then with many messages in flight for throughput.

The floor is measured in the same run, one sample of each after every message
(the disk is shared, so its cost drifts): one durable LMDB commit (raw
``lmdb``, same flags as talos/store.py: commit then ``env.sync(True)``) and one
plain ``websockets`` round trip between this process and an echo child
process, with a payload the size of a sealed message frame. Target: p50 <= 1 ms and
<= 2 x (sync commit + websocket round trip).

    python bench/bench_e2e.py [--fast] [--count N] [--in-flight K]
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite, latency_main, quantiles
from _procs import PYTHON, TALOSD, child

from talos import runtime

# A short chat-sized message; the sealed frame on the wire is ~FRAME_BYTES.
TEXT = "x" * 100
FRAME_BYTES = 400
WS_ECHO_FLAG = "--ws-echo"


async def ws_echo_server() -> None:
    """Child process: echo every websocket message back; print the port, run until killed."""
    from websockets.asyncio.server import ServerConnection, serve

    async def echo(ws: ServerConnection) -> None:
        async for msg in ws:
            await ws.send(msg)

    async with serve(echo, "127.0.0.1", 0, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"echo on {port}", flush=True)
        await asyncio.Future()


class Floor:
    """The two raw costs under every ack, sampled between messages so they see the same disk.

    The disk here is shared: an fsync costs 0.1 ms one second and 4 ms the next,
    so a floor measured before or after the messages would not be comparable.
    """

    def __init__(self, folder: Path, ws: Any) -> None:
        import lmdb

        # Same flags as talos/store.py: MDB_NOSYNC, then one explicit env.sync per commit.
        self.env = lmdb.open(str(folder), map_size=64 << 20, sync=False, metasync=False)
        self.ws = ws
        self.payload = b"\x00" * FRAME_BYTES
        self.commits: list[float] = []
        self.round_trips: list[float] = []

    def commit(self) -> None:
        n = len(self.commits)
        start = time.perf_counter()
        with self.env.begin(write=True) as txn:
            txn.put(n.to_bytes(8, "big"), b"v" * 200)
        self.env.sync(True)
        self.commits.append(time.perf_counter() - start)

    async def round_trip(self) -> None:
        start = time.perf_counter()
        await self.ws.send(self.payload)
        await self.ws.recv()
        self.round_trips.append(time.perf_counter() - start)


@dataclass(frozen=True, slots=True)
class Measured:
    latencies: list[float]
    commits: list[float]
    round_trips: list[float]
    rate: float


async def node_latency(
    root: Path, echo_port: int, count: int, burst: int, in_flight: int
) -> Measured:
    """Sequential ``send_message(wait=True)`` latencies (floor sampled in between), then a burst."""
    from websockets.asyncio.client import connect

    from talos.config import NodeConfig
    from talos.node import Node, init_home

    config = NodeConfig(api=False)
    a_home, b_home = root / "a", root / "b"
    did_a = init_home(a_home, config).did
    init_home(b_home, config)
    argv = [*TALOSD, "run", "--home", str(b_home), "--listen", "127.0.0.1:0", "--allow", did_a]
    async with (
        child(argv, "talosd run (B)") as b,
        connect(f"ws://127.0.0.1:{echo_port}", compression=None) as ws,
    ):
        m = await b.wait_line(r"listening on (\S+) did=(\S+)")
        did_b = m.group(2)
        floor = Floor(root / "lmdb", ws)
        node = Node(a_home, config)
        await node.start()
        try:
            await node.add_peer(f"{m.group(1)}#{did_b}")
            await node.wait_connected(did_b, 30)
            for _ in range(max(count // 10, 5)):  # warm-up: session, caches, page faults
                await node.send_message(did_b, TEXT, wait=True)
                await floor.round_trip()
            floor.round_trips.clear()
            latencies = []
            for _ in range(count):
                start = time.perf_counter()
                await node.send_message(did_b, TEXT, wait=True)
                latencies.append(time.perf_counter() - start)
                floor.commit()
                await floor.round_trip()
            window = asyncio.Semaphore(in_flight)

            async def one() -> None:
                async with window:
                    await node.send_message(did_b, TEXT, wait=True)

            start = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(burst)))
            rate = burst / (time.perf_counter() - start)
        finally:
            await node.stop()
            floor.env.close()
    return Measured(latencies, floor.commits, floor.round_trips, rate)


async def measure(suite: Suite, count: int, burst: int, in_flight: int) -> None:
    with tempfile.TemporaryDirectory(prefix="talos-bench-e2e-") as tmp:
        async with child([PYTHON, __file__, WS_ECHO_FLAG], "websocket echo") as echo:
            port = int((await echo.wait_line(r"echo on (\d+)")).group(1))
            got = await node_latency(Path(tmp), port, count, burst, in_flight)

    commit = statistics.median(got.commits)
    ws50, ws99 = quantiles(got.round_trips)
    p50, p99 = quantiles(got.latencies)
    suite.record("e2e.sync_commit", "raw lmdb durable commit, 1 record (median)", commit, "s")
    suite.record("ws.roundtrip.p50", f"websocket round trip {FRAME_BYTES} B, p50", ws50, "s")
    suite.record("ws.roundtrip.p99", f"websocket round trip {FRAME_BYTES} B, p99", ws99, "s")
    floor = commit + ws50
    suite.record("e2e.floor", "sync commit + websocket round trip", floor, "s", row=False)
    suite.record(
        "e2e.latency.p50", "A -> B durable message, wait for ack, p50", p50, "s", raw="e2e.floor"
    )
    suite.record("e2e.latency.p99", "A -> B durable message, wait for ack, p99", p99, "s")
    suite.record(
        "e2e.throughput", f"A -> B durable messages, {in_flight} in flight", got.rate, "ops/s"
    )
    suite.record_samples("A -> B durable message", got.latencies)
    suite.record_samples("websocket round trip", got.round_trips)
    suite.record_samples("lmdb sync commit", got.commits)


def _terminated(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def run_on_node_loop(main: Coroutine[Any, Any, None]) -> None:
    """Like ``_procs.run`` (SIGTERM still runs every finally), on talos.runtime's loop.

    Node A runs in this process, so it gets the loop ``talosd run`` gives node B
    (uvloop unless TALOS_NO_UVLOOP=1); the floor's websocket round trip is
    measured from the same loop, and the echo child runs on it too.
    """
    signal.signal(signal.SIGTERM, _terminated)
    runtime.run(main)


def main() -> None:
    if WS_ECHO_FLAG in sys.argv:
        with contextlib.suppress(KeyboardInterrupt):
            runtime.run(ws_echo_server())
        return
    latency_main(
        __file__,
        __doc__,
        lambda suite, args: run_on_node_loop(
            measure(suite, args.count, args.burst, args.in_flight)
        ),
        count=(20, 2000),
        burst=(50, 5000),
        options=lambda parser, fast: parser.add_argument("--in-flight", type=int, default=64),
    )


if __name__ == "__main__":
    main()
