"""How long the ``talosd`` client commands take to start, beside ``python -c pass``
(docs/adr/0012-local-clients.md: client commands import neither aiohttp nor pydantic).

Each command is a real subprocess, timed from spawn to exit, interleaved with
``python -c pass`` in the same run (the floor: the interpreter starting and
stopping). ``send`` and ``inbox`` talk to a running ``talosd run`` over its
local socket (``send`` queues for a peer that is not reachable, so no link is
measured). Figures are the median of ``--count`` runs; the target is each
command <= 5 x the floor.

    python bench/bench_cli.py [--fast] [--count N]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite, latency_main
from _procs import ENV, PYTHON, TALOSD, child, run, run_quiet

from talos.local.client import LocalClient


async def elapsed(argv: Sequence[str]) -> float:
    """Spawn ``argv`` (output discarded) and time it until it has exited; it must succeed."""
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=ENV
    )
    _, err = await proc.communicate()
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {err.decode(errors='replace')}")
    return took


async def measure(suite: Suite, count: int) -> None:
    with tempfile.TemporaryDirectory(prefix="talos-bench-cli-") as tmp:
        home, other = Path(tmp) / "a", Path(tmp) / "b"
        await run_quiet([*TALOSD, "init", "--home", str(home), "--no-passphrase"])
        peer = await run_quiet([*TALOSD, "init", "--home", str(other), "--no-passphrase"])
        config = json.loads((home / "config.json").read_text())
        config.update({"listen": "127.0.0.1:0", "api": False})
        (home / "config.json").write_text(json.dumps(config))
        async with child([*TALOSD, "run", "--home", str(home)], "talosd run") as node:
            await node.wait_line(r"listening on ws:")
            client = await LocalClient.connect(home)
            # Nothing listens on port 9 of 127.0.0.1: the message stays queued.
            await client.call("peers.add", addr=f"ws://127.0.0.1:9#{peer}", name="b")
            await client.close()
            commands = {
                "python": [PYTHON, "-c", "pass"],
                "help": [*TALOSD, "--help"],
                "send": [*TALOSD, "send", "--home", str(home), "b", "hello"],
                "inbox": [*TALOSD, "inbox", "--home", str(home)],
            }
            times: dict[str, list[float]] = {name: [] for name in commands}
            for _ in range(count):
                for name, argv in commands.items():  # interleaved: load drifts hit all alike
                    times[name].append(await elapsed(argv))
    median = {name: statistics.median(samples) for name, samples in times.items()}
    rec = suite.record
    rec("cli.python", "python -c pass (start + exit)", median["python"], "s", row=False)
    rec("cli.help", "talosd --help", median["help"], "s", raw="cli.python")
    for name in ("send", "inbox"):
        label = f"talosd {name} (running node, local socket)"
        rec(f"cli.{name}", label, median[name], "s", raw="cli.python")


def main() -> None:
    latency_main(
        __file__, __doc__, lambda suite, args: run(measure(suite, args.count)), count=(3, 30)
    )


if __name__ == "__main__":
    main()
