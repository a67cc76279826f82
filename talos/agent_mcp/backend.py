"""Where ``talosd mcp`` gets its answers: the running node of the home, or one it runs itself.

Both speak the ops of talos/local/ops.py, so tools behave the same either way
(docs/adr/0012-local-clients.md). Attached, a node that stops turns every call
into a clear NodeGoneError until it runs again (the next call re-attaches). A
node that ran inside another ``talosd mcp`` is handed over when that agent
leaves: an attached ``talosd mcp`` then runs it itself, as it would have at its
start (and of several, the ones that lose the store attach to the winner).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

from talos.local.client import LocalClient, NodeGoneError, NoNodeError
from talos.store import StoreInUseError

__all__ = ["AttachedBackend", "Backend", "InProcessBackend", "open_backend"]

_log = logging.getLogger("talos.agent_mcp")


class Backend(Protocol):
    did: str

    @property
    def mode(self) -> str:
        """'attached' to a running node, or 'in-process'."""

    async def call(self, op: str, **args: Any) -> Any: ...

    async def close(self) -> None: ...


class AttachedBackend:
    """Calls over the node's local socket."""

    def __init__(self, home: Path, client: LocalClient, passphrase_file: str | None) -> None:
        self.home = home
        self.client = client
        self.did = client.did
        self.passphrase_file = passphrase_file
        #: The backend that took over the home after a handover.
        self.successor: Backend | None = None
        self._reattach = asyncio.Lock()

    @property
    def mode(self) -> str:
        return "attached" if self.successor is None else self.successor.mode

    async def call(self, op: str, **args: Any) -> Any:
        if self.client.stopping.done() and self.successor is None:
            async with self._reattach:  # the inbox watcher and a tool may both get here
                await self._follow_the_node()
        if self.successor is not None:
            return await self.successor.call(op, **args)
        return await self.client.call(op, **args)

    async def _follow_the_node(self) -> None:
        if not self.client.stopping.done() or self.successor is not None:
            return
        handover = self.client.handover
        await self.client.close()
        try:
            self.client = await LocalClient.connect(self.home)
            return
        except NoNodeError:
            if not handover:  # `talosd run` was stopped: its user decides what runs next
                raise NodeGoneError(
                    f"the node of {self.home} stopped; start it again with "
                    f"`talosd run --home {self.home}`"
                ) from None
        _log.warning("the agent that ran the node of %s left: taking the node over", self.home)
        self.successor = await open_backend(
            self.home, passphrase_file=self.passphrase_file, handover=True
        )

    async def close(self) -> None:
        await self.client.close()
        if self.successor is not None:
            await self.successor.close()


class InProcessBackend:
    """No node was running: this process runs it (other clients may attach to it)."""

    mode = "in-process"

    def __init__(self, daemon: Any) -> None:
        from talos.local.ops import LocalHost

        self.daemon = daemon
        self.host = LocalHost(daemon.node, daemon.transfers)
        self.did = str(daemon.node.did)

    async def call(self, op: str, **args: Any) -> Any:
        from talos.local.ops import run_op

        return await run_op(self.host, op, args)

    async def close(self) -> None:
        await self.daemon.stop(handover=True)


#: How long a `talosd mcp` that finds the home's store held keeps trying to attach to
#: the node that holds it, or to run its own once the store is free.
_RACE_WAIT = 30.0


async def open_backend(
    home: Path, *, passphrase_file: str | None = None, handover: bool = False
) -> Backend:
    """Attach to the node of ``home``, or start one in this process when none runs.

    Only the in-process node needs the identity key: it is unlocked as for
    ``talosd run`` (``passphrase_file``, ``TALOS_PASSPHRASE``, a terminal;
    talos/keys.py), and a key that cannot be unlocked is a clear error.
    ``handover``: called by a running server taking over a node whose agent left.
    """
    try:
        return AttachedBackend(home, await LocalClient.connect(home), passphrase_file)
    except NoNodeError:
        pass
    from talos.config import Home
    from talos.daemon import Daemon
    from talos.keys import PassphraseNeededError, unlock
    from talos_sdk.errors import UsageError

    if not Home(home).exists():
        raise UsageError(f"no identity in {home}: run `talosd init --home {home}` first")
    if handover:  # the server runs: scrypt off its loop (stdin is the agent's, no prompt)
        key = Home(home).identity
        wallet = await asyncio.to_thread(unlock, key, passphrase_file=passphrase_file)
    else:
        # On the loop's (main) thread, where a prompt's Ctrl-C works (talos/keys.py); nothing
        # else runs yet: the client's first request waits in the pipe until the server starts.
        try:
            wallet = unlock(Home(home).identity, passphrase_file=passphrase_file)
        except PassphraseNeededError as exc:
            # The usual cause is no running node to attach to, not a missing passphrase.
            raise PassphraseNeededError(
                f"no node is running on {home} to attach to (start `talosd run --home {home}`,"
                f" then talosd mcp needs no passphrase), and running one here needs the key: "
                f"{exc}"
            ) from None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _RACE_WAIT
    while True:
        # the node, its file transfers, API and socket, as `talosd run`
        daemon = Daemon(home, wallet=wallet)
        try:
            await daemon.start()  # waits a while for the store's lock (STORE_LOCK_WAIT)
            break
        except StoreInUseError:
            # Another process holds the home: a second `talosd mcp` started at the same
            # moment whose node is coming up (attach to it), or the node handed over that
            # is still stopping (run it once the store is free).
            try:
                client = await LocalClient.connect(home)
            except NoNodeError:
                if loop.time() > deadline:
                    raise StoreInUseError(
                        f"the store of {home} is held by another process that is not a "
                        "node (talos-proxy, or an offline talosd command): stop it, or run "
                        f"`talosd run --home {home}`"
                    ) from None
                await asyncio.sleep(0.1)
                continue
            return AttachedBackend(home, client, passphrase_file)
    # A warning, so it reaches the agent host's log: this node is not `talosd run`.
    _log.warning(
        "no node was running on %s: this talosd mcp runs one until its agent exits "
        "(listening on %s, from config.json only: talosd run's options do not apply); "
        "run `talosd run --home %s` for a node that stays up for peers and other agents",
        home,
        daemon.node.listen_url or "nothing",
        home,
    )
    return InProcessBackend(daemon)
