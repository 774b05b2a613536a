"""Several JAX processes on one machine, as a cluster would start them on several hosts.

    python -m zero_jax.launch --processes 2 --devices-per-process 4 -- train.py --stage 3

Each process gets the environment a cluster launcher would give it (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) and its own simulated CPU devices. Output goes
straight to the terminal; the program prints from process 0 only. If a process fails, the
others are given ``--grace`` seconds to stop by themselves (their watchdog), then killed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
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
    Returns 0, or the first failure's exit code (128 + signal for a killed process)."""
    first: tuple[int, int] | None = None
    deadline = None
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            if first is None and p.poll() not in (None, 0):
                first, deadline = (i, p.returncode), time.monotonic() + grace
                if p.returncode < 0:  # it could not say so itself
                    print(f"error: [launch] process {i} {describe(p.returncode)}",
                          file=sys.stderr, flush=True)
        if deadline and time.monotonic() > deadline:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    print(f"error: [launch] process {i} did not stop within {grace:g} s of "
                          f"process {first[0]}'s failure: killing it", file=sys.stderr,
                          flush=True)
                    p.kill()
            deadline = None
        time.sleep(0.1)
    if first is None:
        return 0
    return first[1] if first[1] > 0 else 128 - first[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("error: put the program after --, e.g. python -m zero_jax.launch --processes 2 "
              "--devices-per-process 4 -- train.py --stage 3", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m zero_jax.launch",
                                description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=2, help="processes (simulated hosts)")
    p.add_argument("--devices-per-process", type=int, default=4,
                   help="simulated CPU devices in each process")
    p.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    p.add_argument("--grace", type=float, default=60,
                   help="seconds the others get to stop after one fails, before being killed")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if args.processes < 1 or args.devices_per_process < 1 or not command:
        print("error: --processes and --devices-per-process must be at least 1 and a program "
              "must follow --", file=sys.stderr)
        return 2
    procs = spawn(command, args.processes, args.devices_per_process, args.port)

    def forward(signum, frame):
        for q in procs:
            if q.poll() is None:
                q.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    return wait(procs, args.grace)


if __name__ == "__main__":
    sys.exit(main())
