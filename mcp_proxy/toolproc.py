"""One stdio MCP tool process per remote client session (MCP "Transports: stdio").

MCP servers are stateful, so every tunnel session gets its own process. This
module spawns it, writes newline-delimited JSON-RPC to its stdin, hands each
stdout line to a callback, drains stderr into the log, and remembers which
request ids are still unanswered. When the process cannot start, crashes or
exits, every pending request is answered with a -32603 error ("tool process
exited (code N)") through the same callback, so no caller ever hangs. Shutdown
follows the MCP stdio guidance: close stdin, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from typing import Final

from mcp_proxy.jsonrpc import INTERNAL_ERROR, RequestId, error_reply
from mcp_proxy.policy import ServerSpec

__all__ = ["EXIT_SPAWN_FAILED", "ToolProcess"]

log = logging.getLogger(__name__)

# Reported as the exit code when the process never started (like a shell's 127).
EXIT_SPAWN_FAILED: Final = 127
# One JSON-RPC line may be large (a resource read); refuse beyond this.
LINE_LIMIT: Final = 16 * 1024 * 1024
# How long a tool gets to exit after its stdin closes before SIGTERM.
STDIN_CLOSE_WAIT: Final = 0.5

LineCallback = Callable[[bytes], None]
ExitCallback = Callable[[int], None]


class ToolProcess:
    """A supervised tool process; lines out via ``on_line``, its end via ``on_exit``."""

    def __init__(
        self,
        spec: ServerSpec,
        on_line: LineCallback,
        on_exit: ExitCallback,
        *,
        label: str = "tool",
        grace: float = 2.0,
    ) -> None:
        self.spec = spec
        self.label = label
        self._on_line = on_line
        self._on_exit = on_exit
        self._grace = grace
        self._proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.pending: set[RequestId] = set()
        self.exit_code: int | None = None
        self._exited = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self.exit_code is None

    async def start(self) -> None:
        """Spawn the process; a failure to spawn is reported through ``on_exit``, not raised."""
        env = {**os.environ, **self.spec.env}
        try:
            self._proc = await asyncio.create_subprocess_exec(
                self.spec.command,
                *self.spec.args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                limit=LINE_LIMIT,
                # Its own process group, so termination reaches the tool's children too.
                start_new_session=True,
            )
        except OSError as exc:
            log.warning("%s: cannot start %r: %s", self.label, self.spec.command, exc)
            self._finish(EXIT_SPAWN_FAILED)
            return
        log.info("%s: started pid %d", self.label, self._proc.pid)
        self._tasks = [
            asyncio.create_task(self._read_stdout(), name=f"{self.label}-stdout"),
            asyncio.create_task(self._read_stderr(), name=f"{self.label}-stderr"),
        ]

    def send(self, line: bytes, request_id: RequestId | None = None) -> None:
        """Write one message; a request id is remembered until ``settle`` or exit."""
        if request_id is not None:
            self.pending.add(request_id)
        if self.exit_code is not None:
            self._fail_pending()
            return
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise RuntimeError("send() before start()")
        # On a broken pipe the reader sees EOF and reports the exit; pending ids get errors then.
        with contextlib.suppress(ConnectionResetError, BrokenPipeError, RuntimeError):
            proc.stdin.write(line + b"\n")

    async def drain(self) -> None:
        """Wait for stdin to accept what was written (back-pressure from a slow tool)."""
        proc = self._proc
        if proc is not None and proc.stdin is not None and self.exit_code is None:
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                await proc.stdin.drain()

    def settle(self, request_id: RequestId) -> bool:
        """Forget an answered request; False if it was not pending."""
        try:
            self.pending.remove(request_id)
        except KeyError:
            return False
        return True

    async def wait(self) -> int:
        """Wait until the process has exited and been reported."""
        await self._exited.wait()
        assert self.exit_code is not None
        return self.exit_code

    async def terminate(self) -> int:
        """Stop the process: close stdin, SIGTERM, then SIGKILL after the grace period."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), min(STDIN_CLOSE_WAIT, self._grace))
            except TimeoutError:
                self._signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), self._grace)
                except TimeoutError:
                    self._signal(signal.SIGKILL)
                    await proc.wait()
        if proc is None and self.exit_code is None:
            self._finish(EXIT_SPAWN_FAILED)
        return await self.wait()

    def _signal(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    async def _read_stdout(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        try:
            while True:
                try:
                    line = await proc.stdout.readline()
                except ValueError:
                    log.warning(
                        "%s: output line above %d bytes; stopping the tool", self.label, LINE_LIMIT
                    )
                    self._signal(signal.SIGKILL)
                    break
                if not line:
                    break
                line = line.rstrip(b"\r\n")
                if line:
                    self._on_line(line)
        finally:
            code = await proc.wait()
            # Let stderr finish so the log shows why the tool died before its callers hear of it.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._tasks[1]), 1.0)
            self._finish(code)

    async def _read_stderr(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stderr is not None
        while True:
            try:
                line = await proc.stderr.readline()
            except ValueError:
                continue
            if not line:
                return
            log.info("%s stderr: %s", self.label, line.rstrip().decode("utf-8", "replace"))

    def _finish(self, code: int) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        log.info("%s: exited with code %d", self.label, code)
        # Exit first: the session is reported failed before its pending calls are
        # answered, so a caller that retries at once never races the failure notice.
        self._on_exit(code)
        self._fail_pending()
        self._exited.set()

    def _fail_pending(self) -> None:
        message = f"tool process exited (code {self.exit_code})"
        pending, self.pending = self.pending, set()
        for request_id in pending:
            self._on_line(error_reply(request_id, INTERNAL_ERROR, message))
