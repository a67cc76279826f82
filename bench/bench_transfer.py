"""Encrypted file transfer between two ``talosd run`` processes vs a plain websocket copy.

docs/DESIGN.md "Performance targets" (file transfer row). Both nodes are
real subprocesses on 127.0.0.1: A sends, B auto-accepts (``transfer.json``).
The clock runs from ``POST /v1/files`` (what ``talosd send-file`` does; the
sender hashes while it streams) to the sender seeing ``complete`` (B verified
the SHA-256); polling the control API directly keeps CLI start-up out of the figure.
Peak RSS of each node is its ``VmHWM`` read before it stops. The plain copy and
the transfer take turns (``--rounds``, 3 by default), each after ``sync``, and
the run of median time of each kind is reported.

The floor, same run, same bytes: an unencrypted ``websockets`` copy from this
process to a child process that writes the file and fsyncs it at the end,
1 MiB messages, compression off. Targets: >= 1.0 x that copy, >= 400 MB/s,
peak RSS < 200 MB per node. The CPU each end spent per MiB (``/proc/PID/stat``
during the copy) is printed beside the plain copy's: on a shared machine it
moves less than MB/s does.

    python bench/bench_transfer.py [--fast] [--size BYTES] [--rounds N]
    (default 1 GiB, 3 rounds; --fast 4 MiB, 1 round)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite
from _procs import PYTHON, TALOSD, child, cpu_seconds, peak_rss, run

WS_SINK_FLAG = "--ws-sink"
CHUNK = 1 << 20
FINAL = frozenset({"complete", "failed", "rejected", "cancelled"})
TRANSFER_TIMEOUT = 1800.0
#: Each poll is a local-socket call the sending node serves (~0.7 ms of its CPU);
#: 20 ms keeps that under 4 % of a core and the clock's granularity under 1 % of 1 GiB.
POLL = 0.02
#: Below this the CPU figures (clock ticks of 10 ms) are too coarse to print.
CPU_ROWS_FROM = 64 << 20


def make_payload(path: Path, size: int) -> None:
    """``size`` incompressible bytes (an 8 MiB random block, repeated)."""
    block = os.urandom(min(size, 8 << 20))
    with path.open("wb") as fh:
        left = size
        while left:
            n = min(left, len(block))
            fh.write(block[:n])
            left -= n


async def ws_sink(target: Path) -> None:
    """Child process: write every binary message to ``target``; on "done", fsync and reply."""
    from websockets.asyncio.server import ServerConnection, serve

    async def receive(ws: ServerConnection) -> None:
        with target.open("wb") as fh:
            async for msg in ws:
                if isinstance(msg, str):  # the end marker
                    fh.flush()
                    os.fsync(fh.fileno())
                    await ws.send(str(fh.tell()))
                    return
                fh.write(msg)

    async with serve(receive, "127.0.0.1", 0, compression=None, max_size=2 * CHUNK) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"sink on {port}", flush=True)
        await asyncio.Future()


@dataclass(frozen=True)
class Run:
    """One copy: wall seconds and the CPU seconds each end spent during it."""

    seconds: float
    cpu_sender: float
    cpu_receiver: float
    rss_sender: int = 0
    rss_receiver: int = 0


async def plain_ws_copy(source: Path, root: Path) -> Run:
    """Copy ``source`` over a plain websocket into a child process."""
    from websockets.asyncio.client import connect

    argv = [PYTHON, __file__, WS_SINK_FLAG, str(root / "plain-copy.bin")]
    me = os.getpid()
    async with child(argv, "websocket sink") as sink:
        port = int((await sink.wait_line(r"sink on (\d+)")).group(1))
        async with connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
            cpu0 = cpu_seconds(me), cpu_seconds(sink.pid)
            start = time.perf_counter()
            with source.open("rb") as fh:
                while chunk := fh.read(CHUNK):
                    await ws.send(chunk)
            await ws.send("done")
            copied = int(await ws.recv())
            elapsed = time.perf_counter() - start
            cpu1 = cpu_seconds(me), cpu_seconds(sink.pid)
    if copied != source.stat().st_size:
        raise RuntimeError(f"plain copy wrote {copied} bytes of {source.stat().st_size}")
    return Run(elapsed, cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])


def _call(home: Path, op: str, args: dict[str, Any] | None = None) -> Any:
    """One op on the running node of ``home`` over its local socket (ADR 0012)."""
    from talos.local.call import call

    return call(home, op, args)


async def _until(cond: Any, what: str, timeout: float = 60.0) -> Any:
    """Poll a blocking API call off the event loop (children's pipes keep draining)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(cond)
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL)


async def talos_transfer(source: Path, root: Path) -> Run:
    """A -> B of ``source``, with the peak RSS (bytes) of sender and receiver."""
    from talos.home import init_home

    a_home, b_home = root / "a", root / "b"
    did_a = init_home(a_home).did
    did_b = init_home(b_home).did
    (b_home / "transfer.json").write_text(json.dumps({"auto_accept": [did_a]}))
    b_argv = [*TALOSD, "run", "--home", str(b_home), "--listen", "127.0.0.1:0", "--allow", did_a]
    async with child(b_argv, "talosd run (B)") as b:
        listen = (await b.wait_line(r"listening on (\S+) did=")).group(1)
        a_argv = [*TALOSD, "run", "--home", str(a_home), "--peer", f"{listen}#{did_b}"]
        async with child(a_argv, "talosd run (A)") as a:
            await a.wait_line(r"^running did=")  # printed once the local socket listens

            def linked() -> bool:
                links = _call(a_home, "status")["links"]
                return any(x["did"] == did_b and x["ready"] for x in links)

            await _until(linked, "the A -> B link")
            cpu0 = cpu_seconds(a.pid), cpu_seconds(b.pid)
            start = time.perf_counter()
            body = {"to": did_b, "path": str(source)}
            tid = (await asyncio.to_thread(_call, a_home, "files.send", body))["tid"]

            def finished() -> dict[str, Any] | None:
                info: dict[str, Any] = _call(a_home, "files.get", {"id": tid})
                return info if info["state"] in FINAL else None

            info = await _until(finished, "the transfer", TRANSFER_TIMEOUT)
            elapsed = time.perf_counter() - start
            cpu1 = cpu_seconds(a.pid), cpu_seconds(b.pid)
            if info["state"] != "complete":
                raise RuntimeError(f"transfer ended {info['state']}: {info.get('error')}")
            rss_a, rss_b = peak_rss(a.pid), peak_rss(b.pid)
    received = b_home / "files" / source.name
    if received.stat().st_size != source.stat().st_size:
        raise RuntimeError(f"{received} has {received.stat().st_size} bytes")
    return Run(elapsed, cpu1[0] - cpu0[0], cpu1[1] - cpu0[1], rss_a, rss_b)


def _median_run(runs: list[Run]) -> Run:
    """The run of median wall time (its CPU and RSS figures go with it)."""
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


async def measure(suite: Suite, size: int, rounds: int) -> None:
    plains: list[Run] = []
    ourses: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="talos-bench-transfer-") as tmp:
        root = Path(tmp)
        source = root / "payload.bin"
        make_payload(source, size)
        for i in range(rounds):
            # Each copy starts with no dirty pages left by the one before (or by
            # the payload), so neither side pays for the other's writeback.
            os.sync()
            plains.append(await plain_ws_copy(source, root))
            (root / "plain-copy.bin").unlink()  # keep the disk footprint at two copies
            os.sync()
            (root / f"nodes-{i}").mkdir()
            ourses.append(await talos_transfer(source, root / f"nodes-{i}"))
            (root / f"nodes-{i}" / "b" / "files" / source.name).unlink()
    plain, ours = _median_run(plains), _median_run(ourses)
    mib = size / (1 << 20)
    label = f"{mib:g} MiB"
    suite.record(
        "transfer.plain_ws", f"plain websocket copy {label}", size / plain.seconds, "B/s", row=False
    )
    suite.record(
        "transfer.encrypted",
        f"talos send-file {label}, encrypted",
        size / ours.seconds,
        "B/s",
        raw="transfer.plain_ws",
    )
    # CPU per MiB at each end: steadier than MB/s when other jobs share the cores.
    for end in ("sender", "receiver") if size >= CPU_ROWS_FROM else ():
        plain_cpu = getattr(plain, f"cpu_{end}") / mib
        suite.record(
            f"transfer.plain_ws.cpu.{end}",
            f"plain copy, {end} CPU per MiB",
            plain_cpu,
            "s",
            row=False,
        )
        suite.record(
            f"transfer.cpu.{end}",
            f"{end} CPU per MiB",
            getattr(ours, f"cpu_{end}") / mib,
            "s",
            raw=f"transfer.plain_ws.cpu.{end}",
        )
    rss = max(ours.rss_sender, ours.rss_receiver)
    suite.record("transfer.peak_rss", "peak RSS, larger of the two nodes", rss, "B")
    suite.record("transfer.peak_rss.sender", "peak RSS, sending node", ours.rss_sender, "B")
    suite.record("transfer.peak_rss.receiver", "peak RSS, receiving node", ours.rss_receiver, "B")


def main() -> None:
    if WS_SINK_FLAG in sys.argv:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(ws_sink(Path(sys.argv[sys.argv.index(WS_SINK_FLAG) + 1])))
        return
    suite = Suite.create(__file__, pyperf_runner=False)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=(4 << 20) if suite.fast else (1 << 30))
    parser.add_argument(
        "--rounds",
        type=int,
        default=1 if suite.fast else 3,
        help="copies of each kind, taken in turns",
    )
    args = parser.parse_args()
    if args.size <= 0 or args.rounds <= 0:
        parser.error("--size and --rounds must be positive")
    run(measure(suite, args.size, args.rounds))
    suite.finish()


if __name__ == "__main__":
    main()
