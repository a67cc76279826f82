"""An agent's message through two running nodes: ``send`` on one, ``inbox`` long-poll on the other
(docs/DESIGN.md "Agents on a node", docs/adr/0012-local-clients.md).

Two ``talosd run`` processes on 127.0.0.1; this process is both agents,
attached over each node's local socket (``talos.local.client.LocalClient``,
the client ``talosd mcp`` uses). Measured in the same run:

* wake: from the ``send`` call on A to the return of B's parked ``inbox``
  long-poll with the message (p50 / p99);
* floor: ``send`` with ``wait`` on A, i.e. until B's durable commit was
  acknowledged back (the end-to-end durable message of bench_e2e.py, through
  the socket). The wake latency should be no more than that.
* the send path at A: its process CPU time per ``send`` with ``wait``
  (target <= 0.3 ms), and acked messages/s from one local connection keeping
  IN_FLIGHT sends outstanding (target >= 3,000 /s).

    python bench/bench_agents.py [--fast] [--count N]
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite, latency_main, quantiles
from _procs import TALOSD, child, run, run_quiet, thread_cpu_seconds

from talos.local.client import LocalClient

IN_FLIGHT = 64


async def windowed(client: LocalClient, count: int, in_flight: int) -> float:
    """``count`` acked sends over one connection, ``in_flight`` outstanding: messages/s."""
    window = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        try:
            await client.call("send", to="b", text=f"f{i}", wait=True)
        finally:
            window.release()

    tasks = []
    start = time.perf_counter()
    for i in range(count):
        await window.acquire()
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return count / (time.perf_counter() - start)


async def _node(home: Path) -> None:
    await run_quiet([*TALOSD, "init", "--home", str(home), "--no-passphrase"])
    config = json.loads((home / "config.json").read_text())
    config.update({"listen": "127.0.0.1:0", "api": False})
    (home / "config.json").write_text(json.dumps(config))


async def measure(suite: Suite, count: int, burst: int) -> None:
    with tempfile.TemporaryDirectory(prefix="talos-bench-agents-") as tmp:
        a_home, b_home = Path(tmp) / "a", Path(tmp) / "b"
        await asyncio.gather(_node(a_home), _node(b_home))
        async with (
            child([*TALOSD, "run", "--home", str(a_home)], "talosd run a") as a_proc,
            child([*TALOSD, "run", "--home", str(b_home)], "talosd run b") as b_proc,
        ):
            a_line = await a_proc.wait_line(r"listening on (ws://\S+) did=(\S+)")
            b_line = await b_proc.wait_line(r"listening on (ws://\S+) did=(\S+)")
            a = await LocalClient.connect(a_home)
            b = await LocalClient.connect(b_home)
            # B knows A before A dials: otherwise B may refuse A's first link for good.
            await b.call("peers.add", addr=f"{a_line.group(1)}#{a_line.group(2)}", name="a")
            await a.call("peers.add", addr=f"{b_line.group(1)}#{b_line.group(2)}", name="b")
            cursor = 0
            for _ in range(max(count // 10, 5)):  # warm-up: link, session
                await a.call("send", to="b", text="warm", wait=True)
            cursor = int((await b.call("inbox", limit=1))["last"])
            wakes, acks = [], []
            for i in range(count):
                poll = asyncio.ensure_future(b.call("inbox", after=cursor, wait=30))
                await asyncio.sleep(0.002)  # the long-poll is parked at B
                start = time.perf_counter()
                await a.call("send", to="b", text=f"m{i}")
                got = await poll
                wakes.append(time.perf_counter() - start)
                cursor = int(got["next"])
            cpu = thread_cpu_seconds(a_proc.pid)
            for i in range(count):
                start = time.perf_counter()
                await a.call("send", to="b", text=f"w{i}", wait=True)
                acks.append(time.perf_counter() - start)
            sender_cpu = (thread_cpu_seconds(a_proc.pid) - cpu) / count
            rate = await windowed(a, burst, IN_FLIGHT)
            await a.close()
            await b.close()
    w50, w99 = quantiles(wakes)
    f50, f99 = quantiles(acks)
    rec = suite.record
    rec("agents.ack.p50", "send --wait through the socket (acked), p50", f50, "s", row=False)
    rec("agents.wake.p50", "send -> peer's read_inbox returns, p50", w50, "s", raw="agents.ack.p50")
    rec("agents.ack.p99", "send --wait through the socket (acked), p99", f99, "s", row=False)
    rec("agents.wake.p99", "send -> peer's read_inbox returns, p99", w99, "s", raw="agents.ack.p99")
    rec("agents.sender.cpu", "sender node CPU per send --wait (local socket)", sender_cpu, "s")
    rec(
        f"agents.send.inflight{IN_FLIGHT}",
        f"acked sends from one local connection, {IN_FLIGHT} in flight",
        rate,
        "ops/s",
    )
    suite.record_samples("send -> long-poll wake", wakes)
    suite.record_samples("send --wait (acked)", acks)


def main() -> None:
    latency_main(
        __file__,
        __doc__,
        lambda suite, args: run(measure(suite, args.count, args.burst)),
        count=(30, 500),
        burst=(200, 10000),
    )


if __name__ == "__main__":
    main()
