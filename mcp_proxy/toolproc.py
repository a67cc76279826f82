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
import time
from collections.abc import Callable, Mapping
from typing import Final, cast

from mcp_proxy.jsonrpc import INTERNAL_ERROR, RequestId, error_reply
from mcp_proxy.lines import LineSplitter
from mcp_proxy.policy import ServerSpec
from mcp_proxy.tunnel_wire import MAX_MESSAGE_BYTES
from talos.logging import Throttle, event

__all__ = ["EXIT_SPAWN_FAILED", "ToolProcess"]

log = logging.getLogger(__name__)

# Reported as the exit code when the process never started (like a shell's 127).
EXIT_SPAWN_FAILED: Final = 127
# One JSON-RPC line may be large (a resource read); refuse beyond what the tunnel carries.
LINE_LIMIT: Final = MAX_MESSAGE_BYTES
# How long a tool gets to exit after its stdin closes before SIGTERM.
STDIN_CLOSE_WAIT: Final = 0.5
#: Lines of a tool's stderr logged per minute; the next logged one says how many were not.
STDERR_LINES: Final = 600
#: Seconds a tool that closed its stdout has to exit before it is killed: it can answer
#: nothing any more, and a caller waiting for it would wait for ever.
STDOUT_CLOSED_WAIT: Final = 1.0

LineCallback = Callable[[bytes], None]
ExitCallback = Callable[[int], None]
BatchCallback = Callable[[], None]


class _Pipes(asyncio.SubprocessProtocol):
    """Routes the child's pipes to the owning ToolProcess."""

    def __init__(self, owner: ToolProcess) -> None:
        self.owner = owner
        self.stdout = LineSplitter(owner._on_stdout, owner._on_overflow, LINE_LIMIT)
        self.stderr = LineSplitter(owner._on_stderr, lambda: None, 64 * 1024)
        self.writable = asyncio.Event()
        self.writable.set()

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        assert isinstance(data, bytes)
        if fd == 1:
            self.stdout.feed(data)
            if self.owner._on_batch is not None:
                self.owner._on_batch()
        else:
            self.stderr.feed(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1:
            self.stdout.eof()
            self.owner._on_stdout_closed()
        elif fd == 2:
            self.stderr.eof()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def process_exited(self) -> None:
        self.owner._on_process_exited()

    def connection_lost(self, exc: Exception | None) -> None:
        # Exited and every pipe drained: all of the tool's output has been delivered.
        self.writable.set()
        self.owner._on_connection_lost()


class ToolProcess:
    """A supervised tool process: lines via ``on_line`` (``on_batch`` per read), end ``on_exit``."""

    def __init__(
        self,
        spec: ServerSpec,
        on_line: LineCallback,
        on_exit: ExitCallback,
        *,
        label: str = "tool",
        log_fields: Mapping[str, object] | None = None,
        grace: float = 2.0,
        on_batch: BatchCallback | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        # The whole environment of the tool (mcp_proxy.toolenv); None: this process's plus spec.env.
        self._env = dict(env) if env is not None else {**os.environ, **spec.env}
        self.label = label
        # Who this process serves, on every event it logs (peer, session, server).
        self.log_fields = dict(log_fields) if log_fields is not None else {"tool": label}
        self._on_line = on_line
        self._on_exit = on_exit
        self._stderr_throttle = Throttle(burst=STDERR_LINES, period=60.0, keys=1)
        # After the lines of one stdout read were handed on: lets the owner send them together.
        self._on_batch = on_batch
        self._grace = grace
        self._transport: asyncio.SubprocessTransport | None = None
        self._pipes: _Pipes | None = None
        self._stdin: asyncio.WriteTransport | None = None
        self._returncode: int | None = None
        self._process_done = asyncio.Event()
        self.pending: set[RequestId] = set()
        self.exit_code: int | None = None
        self._exited = asyncio.Event()
        self._why = ""  # set when the proxy itself stopped the tool
        self._stopping = False  # terminate() under way
        # Lines written between hold() and release(): one pipe write for a whole tunnel
        # frame instead of one per line (write syscalls were 14 % of serve's GIL time
        # at 64 in flight, one per message).
        self._held: list[bytes] | None = None
        # Set while start() waits for the spawn: terminate() waits for it too, or a
        # process spawned just after a terminate() would be reported gone and run on.
        self._spawning: asyncio.Event | None = None

    @property
    def pid(self) -> int | None:
        return self._transport.get_pid() if self._transport is not None else None

    @property
    def alive(self) -> bool:
        return self._transport is not None and self.exit_code is None

    async def start(self) -> None:
        """Spawn the process; a failure to spawn is reported through ``on_exit``, not raised."""
        env = self._env
        loop = asyncio.get_running_loop()
        spawning = self._spawning = asyncio.Event()
        try:
            transport, pipes = await loop.subprocess_exec(
                lambda: _Pipes(self),
                self.spec.command,
                *self.spec.args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                # Its own process group, so termination reaches the tool's children too.
                start_new_session=True,
            )
        except OSError as exc:
            event(
                log,
                "tool_spawn_failed",
                logging.WARNING,
                **self.log_fields,
                command=self.spec.command,
                error=exc.strerror or str(exc),
            )
            self._finish(EXIT_SPAWN_FAILED)
            return
        finally:
            spawning.set()
        self._transport, self._pipes = transport, pipes
        # Not an isinstance check: uvloop's pipe transports do not subclass asyncio's ABCs.
        self._stdin = cast(asyncio.WriteTransport, transport.get_pipe_transport(0))
        event(log, "tool_started", **self.log_fields, pid=transport.get_pid())

    def send(self, line: bytes, request_id: RequestId | None = None) -> None:
        """Write one message; a request id is remembered until ``settle`` or exit."""
        if request_id is not None:
            self.pending.add(request_id)
        if self.exit_code is not None:
            self._fail_pending()
            return
        stdin = self._stdin
        if stdin is None:
            raise RuntimeError("send() before start()")
        if stdin.is_closing():
            # Exiting: the exit report answers the pending ids.
            return
        if self._held is not None:
            self._held += (line, b"\n")
            return
        stdin.write(line + b"\n")

    def hold(self) -> None:
        """Keep what ``send`` writes until :meth:`release` (the lines of one frame)."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Write what was held since :meth:`hold`, in one write."""
        held, self._held = self._held, None
        stdin = self._stdin
        if held and stdin is not None and not stdin.is_closing():
            stdin.write(b"".join(held))

    def pause_output(self) -> None:
        """Stop reading the tool's stdout (the caller's link is not taking it)."""
        self._reading(False)

    def resume_output(self) -> None:
        self._reading(True)

    def _reading(self, on: bool) -> None:
        transport = self._transport
        pipe = transport.get_pipe_transport(1) if transport is not None else None
        if pipe is not None and not pipe.is_closing():
            # Not an isinstance check: uvloop's pipe transports do not subclass asyncio's ABCs.
            read = cast(asyncio.ReadTransport, pipe)
            read.resume_reading() if on else read.pause_reading()

    @property
    def writable(self) -> bool:
        """False while stdin holds more than its high-water mark (then ``drain``)."""
        pipes = self._pipes
        return pipes is None or pipes.writable.is_set()

    @property
    def backlog(self) -> int:
        """Bytes written to stdin that the tool has not read yet."""
        stdin = self._stdin
        return stdin.get_write_buffer_size() if stdin is not None else 0

    def discard_input(self) -> None:
        """Drop what the tool has not read and close its stdin (the session failed)."""
        if self._stdin is not None:
            self._stdin.abort()

    async def drain(self) -> None:
        """Wait for stdin to accept what was written (back-pressure from a slow tool)."""
        if self._pipes is not None and self.exit_code is None:
            await self._pipes.writable.wait()

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
        self._stopping = True
        if self._spawning is not None:
            await self._spawning.wait()
        if self._transport is not None and not self._process_done.is_set():
            if self._stdin is not None:
                self._stdin.close()
            if not await self._wait_process(min(STDIN_CLOSE_WAIT, self._grace)):
                self._signal(signal.SIGTERM)
                if not await self._wait_process(self._grace):
                    self._signal(signal.SIGKILL)
                    await self._process_done.wait()
        if self._transport is None and self.exit_code is None:
            self._finish(EXIT_SPAWN_FAILED)
        return await self.wait()

    async def _wait_process(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._process_done.wait()
        except TimeoutError:
            return False
        return True

    def _signal(self, sig: signal.Signals) -> None:
        pid = self.pid
        if pid is None or self._process_done.is_set():
            return
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    # --- pipe callbacks ---------------------------------------------------------------------

    def _on_stdout(self, line: bytes) -> None:
        self._on_line(line)

    def _on_stderr(self, line: bytes) -> None:
        # A tool writing stderr without end wrote 72k log lines a second, serve at 100%
        # CPU and other peers' calls 47 times slower: at most STDERR_LINES a minute.
        dropped = self._stderr_throttle.admit("", time.monotonic())
        if dropped is not None:
            fields = {"suppressed": dropped} if dropped else {}
            text = line.decode("utf-8", "replace")
            event(log, "tool_stderr", **self.log_fields, **fields, line=text)

    def _on_stdout_closed(self) -> None:
        if not self._process_done.is_set():
            asyncio.get_running_loop().call_later(STDOUT_CLOSED_WAIT, self._stdout_gone)

    def _stdout_gone(self) -> None:
        if self._process_done.is_set() or self._stopping or self._why:
            return  # it exited as it closed, or something else is ending it
        event(log, "tool_output_closed", logging.WARNING, **self.log_fields)
        self._why = "the tool closed its output and kept running"
        self._signal(signal.SIGKILL)

    def _on_overflow(self) -> None:
        event(log, "tool_line_oversize", logging.WARNING, **self.log_fields, limit=LINE_LIMIT)
        self._why = f"tool output line above {LINE_LIMIT} bytes"
        self._signal(signal.SIGKILL)

    def _on_process_exited(self) -> None:
        assert self._transport is not None
        code = self._transport.get_returncode()
        self._returncode = code if code is not None else -1
        self._process_done.set()
        if self._stdin is not None:
            # A dead reader: close our end so the transport can finish.
            self._stdin.close()
        # A paused stdout never reports its end, so the exit would never be reported:
        # read what it wrote before exiting (one pipe's worth at most), then EOF.
        self.resume_output()

    def _on_connection_lost(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._process_done.set()
        self._finish(self._returncode if self._returncode is not None else -1)

    def _finish(self, code: int) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        event(log, "tool_exited", **self.log_fields, code=code)
        # Exit first: the session is reported failed before its pending calls are
        # answered, so a caller that retries at once never races the failure notice.
        self._on_exit(code)
        self._fail_pending()
        self._exited.set()

    @property
    def exit_reason(self) -> str:
        """Why the process ended, as callers are told (why the proxy stopped it, exit code)."""
        message = f"tool process exited (code {self.exit_code})"
        return f"{self._why}; {message}" if self._why else message

    def _fail_pending(self) -> None:
        message = self.exit_reason
        pending, self.pending = self.pending, set()
        for request_id in pending:
            self._on_line(error_reply(request_id, INTERNAL_ERROR, message))
