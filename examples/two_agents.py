"""Two agents messaging through two in-process Talos nodes.

Shows the ``talos.node.Node`` contract (docs/ARCHITECTURE.md "Node contract"):

1. ``init_home`` creates an identity (0600 key file) in a home folder.
2. ``Node(home, config).start()`` listens on 127.0.0.1 (port 0 picks one);
   bob allows alice's DID, alice dials ``ws://HOST:PORT#DID`` (the fragment
   pins the identity the link handshake must prove).
3. ``send_message(did, text, wait=True)`` returns once bob has committed the
   message to LMDB and acknowledged it; bob reads it with ``wait_inbox``.
4. Store-and-forward: bob goes offline, alice queues a message in her durable
   outbox, bob comes back on the same address and receives it.
5. App channels (``register_app`` / ``send_app``): ordered, sealed, not durable.
6. A third node that bob has not allowed cannot link to him.

Everything lives in a temporary folder removed at the end.
Run: ``python examples/two_agents.py``
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path

from talos.config import NodeConfig
from talos.logging import configure
from talos.node import Node, init_home
from talos_sdk.errors import LinkRefusedError

# Short timers so the example finishes in a second or two; the defaults suit real links.
CONFIG = NodeConfig(
    listen="127.0.0.1:0",
    api=False,
    seal_interval=0.05,
    reconnect_initial=0.05,
    reconnect_max=0.3,
    retry_interval=0.3,
)


def address(node: Node) -> str:
    assert node.listen_url is not None
    return f"{node.listen_url}#{node.did}"


async def next_message(node: Node, after: int) -> tuple[int, str, str]:
    entries = await node.wait_inbox(after, timeout=10)
    if not entries:
        raise SystemExit("no message arrived within 10 s")
    e = entries[0]
    return e.n, e.sender, e.text


async def demo(root: Path) -> None:
    for name in ("alice", "bob", "mallory"):
        init_home(root / name, CONFIG)

    alice, bob = Node(root / "alice", CONFIG), Node(root / "bob", CONFIG)
    await alice.start()
    await bob.start()
    print(f"alice {alice.did}\nbob   {bob.did} on {bob.listen_url}")

    bob.allow(alice.did)
    await alice.connect(address(bob))
    await alice.wait_connected(bob.did, timeout=10)
    print("link up: Noise handshake done (both identities proven), Double Ratchet session ready")

    msg_id = await alice.send_message(
        bob.did, "hello bob, can you summarise the report?", wait=True
    )
    print(f"alice -> bob: message {msg_id[:12]}… acknowledged after bob's durable commit")
    n, sender, text = await next_message(bob, 0)
    print(f"bob's inbox #{n}: from {'alice' if sender == alice.did else sender}: {text!r}")
    await bob.send_message(alice.did, "done: three findings, one risk", wait=True)
    _, _, reply = await next_message(alice, 0)
    print(f"alice's inbox: {reply!r}")

    # Store-and-forward: the message waits in alice's outbox while bob is down.
    bob_listen = bob.listen_url.removeprefix("ws://") if bob.listen_url else ""
    await bob.stop()
    print("\nbob stopped")
    queued = await alice.send_message(bob.did, "sent while you were offline")
    print(f"alice queued {queued[:12]}… (outbox is durable)")
    bob = Node(root / "bob", CONFIG.model_copy(update={"listen": bob_listen}))
    await bob.start()
    bob.allow(alice.did)
    print(f"bob restarted on {bob.listen_url}; alice's dialer reconnects with backoff")
    n, _, text = await next_message(bob, n)
    print(f"bob's inbox #{n}: {text!r}")

    # App channels: what the MCP tunnel uses. Ordered on the link, not stored.
    got: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    bob.register_app("ping", lambda did, payload: got.put_nowait((did, payload)))
    await alice.wait_connected(bob.did, timeout=10)
    for i in range(3):
        await alice.send_app(bob.did, "ping", f"ping {i}".encode())
    async with asyncio.timeout(10):
        pings = [(await got.get())[1].decode() for _ in range(3)]
    print(f"\napp channel 'ping' delivered in order: {pings}")

    # An identity bob never allowed is refused at the link handshake.
    mallory = Node(root / "mallory", CONFIG)
    await mallory.start()
    await mallory.connect(address(bob))
    try:
        await mallory.wait_connected(bob.did, timeout=10.0)
    except LinkRefusedError as exc:  # at the refusal, not after the timeout
        print(f"mallory (not allowed by bob) gets no link: LinkRefusedError: {exc}")
    else:
        raise SystemExit("an unknown peer got a link")

    for node in (mallory, alice, bob):
        await node.stop()
    print("nodes stopped")


def main() -> None:
    # Node logs are structured key=value lines on stderr; warnings show the refusals.
    configure("kv", logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="talos-two-agents-") as tmp:
        asyncio.run(demo(Path(tmp)))


if __name__ == "__main__":
    main()
