"""Several JAX processes on one machine, as a cluster would start them on several hosts.

    python -m zero_jax.launch --processes 2 --devices-per-process 4 -- train.py --stage 3

Each process gets the environment a cluster launcher would give it (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) and its own simulated CPU devices. Output goes to the
terminal a whole line at a time (a line ends at a newline, or at a carriage return: progress
bars), so two processes' lines never run together; the program prints from process 0 only. If
a process fails, the others are given ``--grace`` seconds to stop by themselves (their
watchdog), then killed. The exit code is 0, or the first failure's (128 + the signal for a
process that was killed).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(command: list[str], processes: int, devices_per_process: int,
          port: int | None = None, env: dict | None = None, **popen: object
          ) -> list[subprocess.Popen]:
    """Start ``processes`` copies of ``python command...``, one per simulated host."""
    port = port or free_port()
    base = dict(os.environ if env is None else env)
    flags = " ".join(f for f in base.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)
    procs = []
    for i in range(processes):
        e = {**base, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
             "JAX_NUM_PROCESSES": str(processes), "JAX_PROCESS_ID": str(i),
             "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
             "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count="
                          f"{devices_per_process}".strip()}
        procs.append(subprocess.Popen([sys.executable, *command], env=e, **popen))
    return procs


def describe(rc: int) -> str:
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


def wait(procs: list[subprocess.Popen], grace: float) -> int:
    """Wait for all; after the first failure give the rest ``grace`` seconds, then kill them.
    Returns 0, or the first failure's exit code (128 + signal for a killed process).

    Each process is waited for by a thread of its own, which records the order in which they
    exit: the first failure is known even when every process has exited before it is looked
    at."""
    exits: list[tuple[int, int]] = []  # (process, return code), in the order they exited
    lock = threading.Lock()

    def reap(i: int, p: subprocess.Popen) -> None:
        rc = p.wait()
        with lock:
            exits.append((i, rc))

    threads = [threading.Thread(target=reap, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    first: tuple[int, int] | None = None
    deadline = None
    while True:
        with lock:
            done = list(exits)
        if first is None and (failed := [(i, rc) for i, rc in done if rc != 0]):
            first, deadline = failed[0], time.monotonic() + grace
            if first[1] < 0:  # it could not say so itself
                print(f"error: [launch] process {first[0]} {describe(first[1])}",
                      file=sys.stderr, flush=True)
        if len(done) == len(procs):
            break
        if deadline is not None and time.monotonic() > deadline:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    print(f"error: [launch] process {i} did not stop within {grace:g} s of "
                          f"process {first[0]}'s failure: killing it", file=sys.stderr,
                          flush=True)
                    p.kill()
            deadline = None
        time.sleep(0.05)
    for t in threads:
        t.join()
    if first is None:
        return 0
    return first[1] if first[1] > 0 else 128 - first[1]


# Gloo (JAX's CPU collectives across processes) prints one such line per rank and
# communicator to stdout, from C++ and unconditionally, into the middle of Python's lines.
GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected "
                            rb"number of connected peer ranks is : \d+\n")


class _Lines:
    """Copies the processes' pipes to our stdout and stderr a whole line at a time, under one
    lock: what two processes print never runs together on one line. A line ends at ``\\n`` or
    ``\\r`` (a progress bar redraws itself with ``\\r``); an unfinished last line is ended.
    Gloo's connection lines are left out (``GLOO_CONNECTED``), and the line they cut in two is
    joined again: one is only matched once whole, as it holds no line end but its last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def follow(self, pipe, out) -> None:
        t = threading.Thread(target=self.copy, args=(pipe, out), daemon=True)
        t.start()
        self.threads.append(t)

    def copy(self, pipe, out) -> None:
        fd, pending = pipe.fileno(), b""
        while chunk := os.read(fd, 1 << 16):
            pending = GLOO_CONNECTED.sub(b"", pending + chunk)
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
            if cut:
                self.write(out, pending[:cut])
                pending = pending[cut:]
        if pending:
            self.write(out, pending + b"\n")
        pipe.close()

    def write(self, out, data: bytes) -> None:
        with self.lock:
            if hasattr(out, "buffer"):
                out.buffer.write(data)
            else:  # a text stream that stands in for the terminal
                out.write(data.decode(errors="replace"))
            out.flush()

    def join(self, timeout: float = 10) -> None:
        """After the processes exit; a pipe a grandchild still holds open is not waited for."""
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, like train.py
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def check(args: argparse.Namespace, command: list[str]) -> str | None:
    """What the arguments cannot mean, found before any process starts."""
    if args.processes < 1 or args.devices_per_process < 1:
        return (f"--processes and --devices-per-process must be at least 1 (got "
                f"{args.processes} and {args.devices_per_process})")
    if not command:
        return ("put the program after --, e.g. python -m zero_jax.launch --processes 2 "
                "--devices-per-process 4 -- train.py --stage 3")
    if args.port is not None and not 1 <= args.port <= 65535:
        return (f"--port must be a TCP port, 1 to 65535 (got {args.port}); leave it out for a "
                "free one")
    if not (args.grace >= 0 and args.grace != float("inf")):  # nan fails both
        return f"--grace must be a finite number of seconds, at least 0 (got {args.grace:g})"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = _Parser(prog="python -m zero_jax.launch", description=__doc__.splitlines()[0],
                usage="%(prog)s [options] -- PROGRAM [ARGS ...]",
                epilog="e.g. python -m zero_jax.launch --processes 2 --devices-per-process 4 "
                       "-- train.py --stage 3")
    p.add_argument("--processes", type=int, default=2, help="processes (simulated hosts)")
    p.add_argument("--devices-per-process", type=int, default=4,
                   help="simulated CPU devices in each process")
    p.add_argument("--port", type=int, help="coordinator port, 1-65535 (default: a free one)")
    p.add_argument("--grace", type=float, default=60,
                   help="seconds the others get to stop after one fails, before being killed")
    args, unknown = p.parse_known_args(argv[:cut])  # --help prints and exits 0 here
    command = argv[cut + 1:]
    if unknown and "--" in argv:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if problem := check(args, command):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    lines = _Lines()
    procs = spawn(command, args.processes, args.devices_per_process, args.port,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for q in procs:
        lines.follow(q.stdout, sys.stdout)
        lines.follow(q.stderr, sys.stderr)

    def forward(signum, frame):
        for q in procs:
            if q.poll() is None:
                q.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    code = wait(procs, args.grace)
    lines.join()
    return code


if __name__ == "__main__":
    sys.exit(main())
