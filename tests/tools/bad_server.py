"""Misbehaving stdio "MCP servers" for failure tests.

``python -m tests.tools.bad_server MODE`` where MODE is:

- ``exit-at-start``: exits with code 4 before reading anything;
- ``crash-in-initialize``: reads the first line (initialize) and exits with code 5;
- ``garbage``: answers every request line with a line of garbage, then with a
  response lacking result/error for the same id, then the proper echo response;
- ``hang``: prints ``ready``, reads and never answers, ignoring SIGTERM (to exercise SIGKILL);
- ``deaf``: prints ``ready`` and never reads stdin (a tool slower than its caller);
- ``nap``: answers every request with ``{"read": messages read so far}``; a ``nap``
  request (``{"seconds": S}``) is answered at once, then stdin is not read for S
  seconds (a tool that falls behind its caller for a while);
- ``record``: answers every request with ``{"seen": [every message read so far]}``, so a
  test can check what reached the tool (and what did not); it reads lines the way the
  MCP Python SDK does (universal newlines: CR, LF and CRLF all end a line);
- ``env``: answers every request with ``{"env": its environment}``;
- ``huge-line``: answers ``initialize``, then writes one line above the proxy's 16 MiB
  limit for the next request and waits;
- ``crash-mid-call``: answers ``initialize``, then for the next request writes half a
  response (no newline) and exits with code 7;
- ``cr-reply``: answers every request with a response whose JSON holds raw CRs around a
  nested object that looks like another message (a reader splitting on CR sees three lines);
- ``flood COUNT_FILE``: for every request, writes ``FLOOD_LINES`` log notifications of
  ``FLOOD_BYTES`` each, then the response; after each line it records in COUNT_FILE how
  many it has written (a blocked stdout shows as a count that stops growing).
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time

FLOOD_LINES = 2000
FLOOD_BYTES = 32 * 1024


def flood(count_file: str) -> None:
    data = "x" * FLOOD_BYTES
    note = json.dumps(
        {
            "jsonrpc": "2.0",
            "method": "notifications/message",
            "params": {"level": "info", "data": data},
        }
    )
    fd = os.open(count_file, os.O_WRONLY | os.O_CREAT, 0o600)
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message or "method" not in message:
            continue
        for n in range(1, FLOOD_LINES + 1):
            sys.stdout.write(note + "\n")
            sys.stdout.flush()
            os.pwrite(fd, b"%10d" % n, 0)
        reply = {"jsonrpc": "2.0", "id": message["id"], "result": {"lines": FLOOD_LINES}}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def nap() -> None:
    read = 0
    for line in sys.stdin.buffer:
        read += 1
        message = json.loads(line)
        if "id" not in message or "method" not in message:
            continue
        reply = {"jsonrpc": "2.0", "id": message["id"], "result": {"read": read}}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if message["method"] == "nap":
            time.sleep(message["params"]["seconds"])


def ask_flood() -> None:
    """Answer a ping, then ask the caller to sample ten times (it answers none)."""
    for line in sys.stdin.buffer:
        message = json.loads(line)
        if message.get("method") != "ping":
            continue
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {}}) + "\n")
        for i in range(10):
            params = {"messages": [], "maxTokens": 1}
            ask = {"jsonrpc": "2.0", "id": f"s{i}", "method": "sampling/createMessage"}
            sys.stdout.write(json.dumps({**ask, "params": params}) + "\n")
        sys.stdout.flush()


def broken_output(mode: str) -> None:
    """Answer each request with bytes that are not UTF-8 in a string ("bad-utf8"), or
    close stdout at the first request and run on ("close-stdout")."""
    for line in sys.stdin.buffer:
        message = json.loads(line)
        if "id" not in message or "method" not in message:
            continue
        if mode == "close-stdout":
            sys.stdout.flush()
            os.close(1)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(600)
        rid = json.dumps(message["id"]).encode()
        sys.stdout.buffer.write(b'{"jsonrpc":"2.0","id":' + rid + b',"result":{"t":"\xff"}}\n')
        sys.stdout.buffer.flush()


def main(mode: str) -> None:
    if mode in ("bad-utf8", "close-stdout"):
        broken_output(mode)
        return
    if mode == "ask-flood":
        ask_flood()
        return
    if mode == "flood":
        flood(sys.argv[2])
        return
    if mode == "exit-at-start":
        sys.exit(4)
    if mode == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        for _ in sys.stdin:
            pass
        signal.pause()
    if mode == "deaf":
        print("ready", flush=True)
        signal.pause()
    if mode == "nap":
        nap()
        return
    seen: list[object] = []
    answered = 0
    # Like the MCP SDK's stdio server (sys.stdin itself would split on LF only).
    stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    for line in stdin:
        if mode in ("env", "huge-line", "crash-mid-call", "cr-reply"):
            message = json.loads(line)
            if "id" not in message or "method" not in message:
                continue
            rid = json.dumps(message["id"])
            answered += 1
            if mode == "huge-line" and answered > 1:
                sys.stdout.write('{"jsonrpc":"2.0","id":' + rid + ',"result":"')
                sys.stdout.write("x" * (17 * 1024 * 1024) + '"}\n')
                sys.stdout.flush()
                signal.pause()
            if mode == "crash-mid-call" and answered > 1:
                sys.stdout.write('{"jsonrpc":"2.0","id":' + rid + ',"result":{"content":[')
                sys.stdout.flush()
                os._exit(7)
            if mode == "cr-reply":
                hidden = '{"jsonrpc":"2.0","id":' + rid + ',"error":{"code":1,"message":"h"}}'
                sys.stdout.write('{"jsonrpc":"2.0","id":' + rid + ',"result":{"x":\r' + hidden)
                sys.stdout.write("\r}}\n")
            else:
                result = {"env": dict(os.environ)} if mode == "env" else {}
                reply = {"jsonrpc": "2.0", "id": message["id"], "result": result}
                sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
            continue
        if mode == "record":
            try:
                message = json.loads(line)
            except ValueError:  # what a split message leaves: kept, so a test sees it
                seen.append({"unparsed": line})
                continue
            seen.append(message)
            if "id" in message and "method" in message:
                reply = {"jsonrpc": "2.0", "id": message["id"], "result": {"seen": seen}}
                sys.stdout.write(json.dumps(reply) + "\n")
                sys.stdout.flush()
            continue
        if mode == "crash-in-initialize":
            sys.stderr.write("bad_server: crashing during initialize\n")
            sys.exit(5)
        message = json.loads(line)
        if "id" not in message or "method" not in message:
            continue
        out = sys.stdout
        out.write("this is not json {\n")
        out.write(json.dumps({"jsonrpc": "2.0", "id": message["id"]}) + "\n")
        out.write(
            json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {"echo": message}}) + "\n"
        )
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
