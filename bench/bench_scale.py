"""One hub node with 10 / 30 / 60 peers, every node a separate process (scale bench).

The hub is a real ``talosd run`` subprocess. Each peer is this script run with
``--peer``: a full :class:`~talos.node.Node` in its own process, driven over
its stdin. The peers start once; the bench then links them to the hub in steps
(10, then 20 more, then 30 more) and at each step every linked peer sends its
share of the messages to the hub at once (``send_message(wait=True)``, a few in
flight per peer), so the hub receives from all of them concurrently.

Figures at each step:

- messages/s into the hub, all linked peers together (wall time of the step);
- hub memory per link: growth of the hub's resident set while this step's
  links come up (before its messages), divided by the links added;
- CPU per message at each end: the hub's user + system time during the step
  (``/proc/<pid>/stat``) and the peers' own ``getrusage`` time, summed, each
  divided by the messages of the step.

There is no raw floor for a whole node; the rows at 30 and 60 peers show their
ratio to the 10-peer row of the same run, so flat scaling reads 1.00x (for the
rate and CPU rows above 1 is better, for memory per link below 1 is).

    python bench/bench_scale.py [--fast] [--peers 10,30,60] [--messages 3000] [--in-flight 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite
from _procs import PYTHON, TALOSD, Child, child, cpu_seconds, run

PEER_FLAG = "--peer"
TEXT = "x" * 100
LINK_TIMEOUT = 120.0


# --- the peer process ---------------------------------------------------------------------------


async def peer_main(home: Path, hub_addr: str, hub_did: str) -> None:
    """A peer node driven by lines on stdin: ``link``, ``send TAG N K``, ``stop``."""
    from talos.config import NodeConfig
    from talos.node import Node

    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    node = Node(home, NodeConfig(api=False))
    await node.start()
    print("started", flush=True)
    try:
        while line := (await commands.readline()).decode().split():
            if line[0] == "link":
                await node.add_peer(f"{hub_addr}#{hub_did}")
                await node.wait_connected(hub_did, LINK_TIMEOUT)
                print("linked", flush=True)
            elif line[0] == "send":
                tag, count, in_flight = line[1], int(line[2]), int(line[3])
                cpu, wall = await _send(node, hub_did, count, in_flight)
                print(f"sent {tag} cpu={cpu:.6f} wall={wall:.6f}", flush=True)
            else:
                break
    finally:
        await node.stop()


async def _send(node: object, did: str, count: int, in_flight: int) -> tuple[float, float]:
    from talos.node import Node

    assert isinstance(node, Node)
    window = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with window:
            await node.send_message(did, TEXT, wait=True)

    cpu0, start = _own_cpu(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    return _own_cpu() - cpu0, time.perf_counter() - start


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- the bench ----------------------------------------------------------------------------------


def _rss_of(pid: int) -> int:
    """Current resident set of a live process in bytes (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _tell(peers: Sequence[Child], line: str) -> None:
    for p in peers:
        assert p.proc.stdin is not None
        p.proc.stdin.write(line.encode() + b"\n")
        await p.proc.stdin.drain()


async def measure(suite: Suite, sizes: Sequence[int], messages: int, in_flight: int) -> None:
    from talos.config import NodeConfig
    from talos.node import init_home

    with tempfile.TemporaryDirectory(prefix="talos-bench-scale-") as tmp:
        root = Path(tmp)
        homes = [root / f"peer{i}" for i in range(max(sizes))]
        dids = [init_home(h, NodeConfig(api=False)).did for h in homes]
        init_home(root / "hub", NodeConfig(api=False, allow=tuple(dids)))
        argv = [*TALOSD, "run", "--home", str(root / "hub"), "--listen", "127.0.0.1:0"]
        async with contextlib.AsyncExitStack() as stack:
            hub = await stack.enter_async_context(child(argv, "talosd run (hub)"))
            m = await hub.wait_line(r"listening on (\S+) did=(\S+)")
            hub_addr, hub_did = m.group(1), m.group(2)
            peers = [
                await stack.enter_async_context(
                    child(
                        [PYTHON, __file__, PEER_FLAG, str(h), hub_addr, hub_did],
                        f"peer {i}",
                        stdin=asyncio.subprocess.PIPE,
                    )
                )
                for i, h in enumerate(homes)
            ]
            await asyncio.gather(*(p.wait_line("^started$", LINK_TIMEOUT) for p in peers))
            await asyncio.sleep(0.5)  # the hub settles after start-up
            linked = 0
            for k in sizes:
                # Memory per link: the hub's growth while this step's links come
                # up, before its messages (traffic grows the heap too).
                before = _rss_of(hub.pid)
                await _tell(peers[linked:k], "link")
                await asyncio.gather(
                    *(p.wait_line("^linked$", LINK_TIMEOUT) for p in peers[linked:k])
                )
                await asyncio.sleep(0.5)
                link_mem = max(_rss_of(hub.pid) - before, 1) / (k - linked)
                linked = k
                await step(suite, sizes[0], k, hub, peers[:k], link_mem, messages, in_flight)
            await _tell(peers, "stop")
            await asyncio.gather(*(p.proc.wait() for p in peers))


async def step(
    suite: Suite,
    first: int,
    k: int,
    hub: Child,
    peers: Sequence[Child],
    link_mem: float,
    messages: int,
    in_flight: int,
) -> None:
    """One step: k linked peers send ``messages`` in all to the hub; record its rows."""
    per_peer = max(1, messages // k)
    total = per_peer * k
    tag = f"k{k}"
    hub_cpu0, start = cpu_seconds(hub.pid), time.perf_counter()
    await _tell(peers, f"send {tag} {per_peer} {in_flight}")
    done = await asyncio.gather(
        *(p.wait_line(rf"^sent {tag} cpu=(\S+) wall=(\S+)$", LINK_TIMEOUT * 5) for p in peers)
    )
    wall = time.perf_counter() - start
    hub_cpu = cpu_seconds(hub.pid) - hub_cpu0
    peer_cpu = sum(float(d.group(1)) for d in done)

    def key(what: str, n: int = k) -> str:
        return f"scale.{n}.{what}"

    base = None if k == first else key
    suite.record(
        key("rate"),
        f"{k} peers -> hub, durable messages/s ({in_flight} in flight per peer)",
        total / wall,
        "ops/s",
        raw=base and base("rate", first),
    )
    suite.record(
        key("link_mem"),
        f"hub memory per new link, up to {k} links",
        link_mem,
        "B",
        raw=base and base("link_mem", first),
    )
    suite.record(
        key("hub_cpu"),
        f"hub CPU per message received, {k} peers",
        max(hub_cpu, 1e-9) / total,
        "s",
        raw=base and base("hub_cpu", first),
    )
    suite.record(
        key("peer_cpu"),
        f"sender CPU per message, {k} peers (all senders summed)",
        max(peer_cpu, 1e-9) / total,
        "s",
        raw=base and base("peer_cpu", first),
    )


def main() -> None:
    if PEER_FLAG in sys.argv:
        home, addr, did = sys.argv[sys.argv.index(PEER_FLAG) + 1 :][:3]
        with contextlib.suppress(KeyboardInterrupt):
            run(peer_main(Path(home), addr, did))
        return
    suite = Suite.create(__file__, pyperf_runner=False)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="1,2" if suite.fast else "10,30,60")
    parser.add_argument("--messages", type=int, default=4 if suite.fast else 3000)
    parser.add_argument("--in-flight", type=int, default=4)
    args = parser.parse_args()
    sizes = sorted({int(x) for x in args.peers.split(",")})
    run(measure(suite, sizes, args.messages, args.in_flight))
    suite.finish()


if __name__ == "__main__":
    main()
