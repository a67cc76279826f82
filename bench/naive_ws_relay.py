"""A naive, unencrypted stdio-over-WebSocket relay: the peer the tunnel is measured against.

What anyone would write first to put a stdio MCP server on the network, with
no encryption, no authentication, no audit and no JSON-RPC checks: the
``serve`` end spawns the tool for each WebSocket connection and copies its
stdout lines into WebSocket messages and the messages into its stdin; the
``connect`` end copies its own stdin lines into WebSocket messages and the
messages back to its stdout. One ``websockets`` message per line, plain
asyncio streams on both ends (bench_tunnel.py measures it beside
``talos-proxy``, on 127.0.0.1 only).

    python bench/naive_ws_relay.py serve -- CMD [ARGS...]   # prints "relay on ws://..."
    python bench/naive_ws_relay.py connect ws://127.0.0.1:PORT
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

LIMIT = 16 * 1024 * 1024


async def _lines_to_ws(reader: asyncio.StreamReader, ws: ServerConnection | object) -> None:
    while line := await reader.readline():
        await ws.send(line.rstrip(b"\n"))  # type: ignore[attr-defined]


async def _ws_to_writer(ws: object, writer: asyncio.StreamWriter) -> None:
    async for message in ws:  # type: ignore[attr-defined]
        writer.write((message if isinstance(message, bytes) else message.encode()) + b"\n")
        await writer.drain()


async def run_serve(command: list[str]) -> None:
    async def handler(ws: ServerConnection) -> None:
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=LIMIT
        )
        assert proc.stdin is not None and proc.stdout is not None
        pump = asyncio.create_task(_lines_to_ws(proc.stdout, ws))
        try:
            await _ws_to_writer(ws, proc.stdin)
        finally:
            pump.cancel()
            proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async with serve(handler, "127.0.0.1", 0, compression=None, max_size=LIMIT) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"relay on ws://127.0.0.1:{port}", flush=True)
        await asyncio.Future()


async def run_connect(url: str) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    w_transport, w_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, sys.stdout.buffer
    )
    writer = asyncio.StreamWriter(w_transport, w_protocol, None, loop)
    async with connect(url, compression=None, max_size=LIMIT) as ws:
        pump = asyncio.create_task(_ws_to_writer(ws, writer))
        await _lines_to_ws(reader, ws)
        pump.cancel()


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["serve"]:
        command = args[2:] if args[1:2] == ["--"] else args[1:]
        asyncio.run(run_serve(command))
    elif args[:1] == ["connect"] and len(args) == 2:
        asyncio.run(run_connect(args[1]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
