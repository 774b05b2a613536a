"""A multi-process run's worker runs as a child process, so that losing process 0 is one line.

Process 0 hosts JAX's coordination service. When it dies, JAX's runtime in every other process
aborts that process within about a second (SIGABRT: "Terminating process because the JAX
distributed service detected fatal errors" and a native stack trace), before any Python code
can run: neither ``jax_enable_recoverability`` nor the heartbeat settings prevent it, and a
Python ``missed_heartbeat_callback`` fails with ``std::bad_cast`` (jax 0.10.2). A parent
process outlives the abort. It relays the worker's output a whole line at a time, holding the
runtime's own log lines back for a moment; when the worker was aborted after the coordinator
went away it drops them and prints one line instead, naming the step the worker reached and the
newest complete checkpoint. Every other exit passes through unchanged (lines and exit code).
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from zero_jax.distributed import newest_checkpoint

WORKER = "ZERO_JAX_SUPERVISOR_FD"  # in the worker's environment: its side channel's descriptor
LOST_COORDINATOR = 1  # the exit code: a lost peer, as the watchdog's
# The runtime's own lines: absl's log format, and what follows a fatal one (its stack trace).
NATIVE = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]")
FATAL = re.compile(rb"F\d{4} ")


class Worker:
    """A supervised worker's side channel: every ``period_s``, this process's id, the step it
    reached and the coordinator's address (``track``); exit at once when the supervisor is
    gone (a killed process 0 takes its coordination service along)."""

    def __init__(self, fd: int, period_s: float):
        self._progress: Callable[[], str] = lambda: "- 0 -"

        def tell() -> None:
            while True:
                try:
                    os.write(fd, f"{self._progress()}\n".encode())
                except OSError:  # the supervisor died: its end of the pipe is closed
                    os._exit(1)
                time.sleep(period_s)

        threading.Thread(target=tell, name="zero_jax-supervised", daemon=True).start()

    def track(self, progress: Callable[[], tuple[int, int, str]]) -> None:
        """What the channel reports from now on: (process id, step reached, coordinator)."""
        self._progress = lambda: " ".join(str(x) for x in progress())


def attach(period_s: float = 0.25) -> Worker | None:
    """This process's side channel if it is a supervised worker (``run`` started it)."""
    if WORKER not in os.environ:
        return None
    return Worker(int(os.environ.pop(WORKER)), period_s)


class _Relay:
    """Copies one of the worker's pipes to ``out`` a whole line at a time (a line ends at
    ``\\n`` or ``\\r``: progress bars), holding the runtime's log lines back for ``hold_s``, and
    everything from a fatal one on until the worker's exit decides (``finish``)."""

    lock = threading.Lock()  # the two pipes' lines never run together

    def __init__(self, pipe, out, hold_s: float = 1.0):
        self.pipe, self.out, self.hold_s = pipe, out, hold_s
        self.held: list[tuple[float, bytes]] = []
        self.fatal = False
        self.thread = threading.Thread(target=self.copy, daemon=True)
        self.thread.start()

    def copy(self) -> None:
        fd, pending = self.pipe.fileno(), b""
        while True:
            if select.select([fd], [], [], 0.2)[0]:
                if not (chunk := os.read(fd, 1 << 16)):
                    break
                pending += chunk
                lines = re.findall(rb"[^\r\n]*[\r\n]", pending)
                pending = pending[sum(map(len, lines)):]
                for line in lines:
                    self.line(line)
            self.release(time.monotonic() - self.hold_s)
        if pending:
            self.line(pending + b"\n")

    def line(self, line: bytes) -> None:
        if self.fatal or NATIVE.match(line):
            self.fatal = self.fatal or bool(FATAL.match(line))
            self.held.append((time.monotonic(), line))
        else:
            self.release(float("inf"))
            self.write(line)

    def release(self, before: float) -> None:
        """Show the held lines older than ``before`` (not during an abort)."""
        while self.held and not self.fatal and self.held[0][0] <= before:
            self.write(self.held.pop(0)[1])

    def write(self, data: bytes) -> None:
        with self.lock:
            if hasattr(self.out, "buffer"):
                self.out.buffer.write(data)
            else:  # a text stream standing in for the terminal
                self.out.write(data.decode(errors="replace"))
            self.out.flush()

    def finish(self, show: bool) -> None:
        self.thread.join(5)
        if show:
            self.fatal = False
            self.release(float("inf"))
        self.held.clear()


class _Heard:
    """The last (process id, step, coordinator) the worker reported through the pipe."""

    def __init__(self, fd: int):
        self.process, self.step, self.coordinator = "-", "0", "-"
        self.thread = threading.Thread(target=self.read, args=(fd,), daemon=True)
        self.thread.start()

    def read(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(4096):
                *lines, pending = (pending + chunk).split(b"\n")
                if lines and len(fields := lines[-1].decode().split()) == 3:
                    self.process, self.step, self.coordinator = fields


def run(command: list[str], process_id: int | None, checkpoints: str | None) -> int:
    """Run ``command`` (this program again) as the worker; relay, wait, and say how it ended.
    Returns the worker's exit code, 128 + the signal that killed it, or ``LOST_COORDINATOR``."""
    read, write = os.pipe()
    child = subprocess.Popen(command, env={**os.environ, WORKER: str(write),
                                           "PYTHONUNBUFFERED": "1"},
                             pass_fds=(write,), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             process_group=0)  # a Ctrl-C reaches it once: through us
    os.close(write)
    relays = [_Relay(child.stdout, sys.stdout), _Relay(child.stderr, sys.stderr)]
    heard = _Heard(read)

    def forward(signum, frame) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    rc = child.wait()
    for s, handler in previous.items():
        signal.signal(s, handler)
    heard.thread.join(1)
    me = heard.process if heard.process != "-" else process_id
    lost = rc < 0 and str(me) != "0" and not _reachable(heard.coordinator)
    for relay in relays:
        relay.finish(show=not lost)
    if rc >= 0:
        return rc
    where = f"[process {me}] " if me is not None else ""
    if lost:
        print(f"error: {where}lost process 0 (the coordinator) at step {heard.step}; "
              f"{newest_checkpoint(checkpoints)}", file=sys.stderr, flush=True)
        return LOST_COORDINATOR
    print(f"error: {where}the worker process was killed by {signal.Signals(-rc).name} at step "
          f"{heard.step}; {newest_checkpoint(checkpoints)}", file=sys.stderr, flush=True)
    return 128 - rc


def _reachable(address: str, timeout_s: float = 2) -> bool:
    """Whether the coordinator still accepts connections (unknown: assume it does)."""
    if ":" not in address:
        return True
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False
