"""Misbehaving stdio "MCP servers" for failure tests.

``python -m tests.tools.bad_server MODE`` where MODE is:

- ``exit-at-start``: exits with code 4 before reading anything;
- ``crash-in-initialize``: reads the first line (initialize) and exits with code 5;
- ``garbage``: answers every request line with a line of garbage, then with a
  response lacking result/error for the same id, then the proper echo response;
- ``hang``: prints ``ready``, reads and never answers, ignoring SIGTERM (to exercise SIGKILL);
- ``deaf``: prints ``ready`` and never reads stdin (a tool slower than its caller);
- ``record``: answers every request with ``{"seen": [every message read so far]}``, so a
  test can check what reached the tool (and what did not).
"""

from __future__ import annotations

import json
import signal
import sys


def main(mode: str) -> None:
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
    seen: list[object] = []
    for line in sys.stdin:
        if mode == "record":
            message = json.loads(line)
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
