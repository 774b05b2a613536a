"""One process per host: start-up, agreement, each process's slice of the data, and a watchdog.

JAX's multi-controller runtime runs the same program in every process; each process owns its
local devices and the mesh spans all of them. What this module adds around
``jax.distributed.initialize``: start-up input checked before anything waits on it, a check
that every process was started with the same configuration (else they would compile different
programs and hang in their first collective), and a watchdog that turns a dead or hung peer
into one error line within a bounded time. JAX's own heartbeat also notices a dead peer, but it
aborts with a C++ stack trace; the watchdog fires first and says which process was lost.
(Losing process 0 aborts the others at once: ``zero_jax.supervise`` reports that.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from zero_jax import internals

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}
PREFIX = "zero_jax"


class StartupError(ValueError):
    """Start-up input that cannot work; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Group:
    coordinator: str | None
    num_processes: int
    process_id: int

    @property
    def primary(self) -> bool:
        return self.process_id == 0


def settings(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None, auto: bool = False,
             environ: dict | None = None) -> dict | None:
    """What to pass to ``jax.distributed.initialize``, or None for one process.

    Flags win over the environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID``). With none of them, SLURM with several tasks, Open MPI with several
    ranks, or ``auto`` lets JAX detect the cluster (Cloud TPU, Kubernetes, ...)."""
    env = os.environ if environ is None else environ
    given = {"coordinator": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    for key, var in ENV.items():
        if given[key] is None and env.get(var):
            value = env[var]
            if key != "coordinator":
                try:
                    value = int(value)
                except ValueError:
                    raise StartupError(f"{var}={value!r} is not an integer") from None
            given[key] = value
    if all(v is None for v in given.values()):
        several = any(int(env.get(v, "1") or 1) > 1
                      for v in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
        return {} if auto or several else None  # {}: JAX detects everything
    n, i = given["num_processes"], given["process_id"]
    if n is not None and n < 1:
        raise StartupError(f"the number of processes must be at least 1 (got {n})")
    if n is not None and i is not None and not 0 <= i < n:
        raise StartupError(f"process id {i} is out of range for {n} processes: give each "
                           f"process a distinct id from 0 to {n - 1}")
    if given["coordinator"] is not None and ":" not in given["coordinator"]:
        raise StartupError(f"coordinator address {given['coordinator']!r} has no port: write "
                           "HOST:PORT, e.g. 10.0.0.1:1234 (the host of process 0)")
    return {k: v for k, v in given.items() if v is not None}


def initialize(spec: dict, timeout_s: float = 30) -> Group:
    """Join the process group. ``timeout_s`` bounds the wait for the coordinator and is the
    watchdog's limit; JAX's own heartbeat is set a little longer as a backstop."""
    where = spec.get("coordinator") or "the auto-detected coordinator"
    if spec.get("coordinator") and spec.get("process_id", 0) != 0:
        _wait_for(spec["coordinator"], spec.get("process_id", "?"), timeout_s)
    try:
        jax.distributed.initialize(
            coordinator_address=spec.get("coordinator"),
            num_processes=spec.get("num_processes"), process_id=spec.get("process_id"),
            initialization_timeout=max(1, int(timeout_s)),
            heartbeat_timeout_seconds=int(timeout_s) + 15,
            shutdown_timeout_seconds=max(1, int(timeout_s)))
    except (ValueError, TypeError) as e:  # JAX's own checks, e.g. nothing detected
        raise StartupError(f"cannot start the process group: {_line(e)}") from None
    except Exception as e:  # the coordinator never answered within the timeout
        raise StartupError(f"process {spec.get('process_id', '?')} could not reach the "
                           f"coordinator at {where} within {timeout_s:g} s ({_line(e)}): start "
                           "process 0 first and check the address, port and firewall") from None
    return Group(spec.get("coordinator") or internals.coordinator_address(), jax.process_count(),
                 jax.process_index())


def _wait_for(address: str, process_id: Any, timeout_s: float) -> None:
    """Wait until the coordinator accepts connections: JAX itself aborts the process with a
    stack trace when it cannot register, so an unreachable address is caught here first."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            return
        except (OSError, ValueError) as e:
            if time.monotonic() > deadline:
                raise StartupError(
                    f"process {process_id} could not reach the coordinator at {address} within "
                    f"{timeout_s:g} s ({e}): start process 0 there and check the address, "
                    "port and firewall") from None
            time.sleep(0.2)


def _client():
    return internals.distributed_client()  # the runtime's key-value store


def agree(name: str, value: dict, timeout_s: float = 30) -> None:
    """Every process must hold the same ``value`` (e.g. the configuration); raise naming the
    first key where a process differs from process 0. Uses the coordinator's key-value store,
    so it costs no compilation and cannot hang past ``timeout_s``."""
    if jax.process_count() == 1:
        return
    client, me = _client(), jax.process_index()
    text = json.dumps(value, sort_keys=True, default=str)
    client.key_value_set(f"{PREFIX}/agree/{name}/{me}", text, allow_overwrite=True)
    values = []
    for peer in range(jax.process_count()):  # all of them, so that every process says it
        try:
            values.append(json.loads(client.blocking_key_value_get(
                f"{PREFIX}/agree/{name}/{peer}", int(timeout_s * 1000))))
        except Exception as e:
            raise StartupError(f"process {peer} never published its {name} within "
                               f"{timeout_s:g} s ({_line(e)})") from None
    for peer, value in enumerate(values):
        if value != values[0]:
            key = _first_difference(values[0], value)
            raise StartupError(f"processes disagree on the {name}: {key} is "
                               f"{_get(values[0], key)!r} in process 0 but {_get(value, key)!r} "
                               f"in process {peer}: start every process with the same "
                               "arguments")


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    return path


def _get(tree: Any, path: str) -> Any:
    for k in path.split("."):
        tree = tree.get(k) if isinstance(tree, dict) else None
    return tree


def local_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> slice:
    """The rows (first dimension) of a global array of ``shape`` this process's devices hold:
    the only rows it needs to build. Raises if they are not one contiguous block (a mesh whose
    device order does not keep a host's devices together)."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(shape[0])
        starts.append(start)
        stops.append(stop)
    lo, hi = min(starts), max(stops)
    covered = np.zeros(hi - lo, bool)
    for a, b in zip(starts, stops, strict=True):
        covered[a - lo: b - lo] = True
    if not covered.all():
        raise ValueError("this process's rows of the batch are not contiguous: build the mesh "
                         "with zero_jax.make_mesh, which keeps each host's devices together")
    return slice(lo, hi)


def global_array(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                 local: np.ndarray) -> jax.Array:
    """The global array whose rows ``local_rows(sharding, shape)`` are ``local``."""
    return jax.make_array_from_process_local_data(sharding, local, shape)


def processes_spanned(groups: tuple[tuple[int, ...], ...], mesh: Any) -> int:
    """The most processes one replica group spans (its ids are positions in the mesh's device
    order): above 1, the collective's bytes cross between hosts."""
    owner = [d.process_index for d in mesh.devices.flat]
    return max((len({owner[i] for i in g if i < len(owner)}) for g in groups), default=1)


class Watchdog:
    """Every process publishes a heartbeat and how far it got; each one stops itself, with one
    line naming the culprit, when a peer's heartbeat is older than ``timeout_s`` (it died or is
    stopped), when a peer has not reached the point this process waits at for ``timeout_s``
    (it hangs), or when a peer reports an error. ``os._exit`` because the main thread is stuck
    in a collective that will never complete; checkpoints are safe since orbax only lists a
    step once every process finished writing it."""

    def __init__(self, timeout_s: float = 30, poll_s: float = 0.5):
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.checkpoints: str | None = None  # the run's checkpoint directory, named on exit
        self.me, self.n = jax.process_index(), jax.process_count()
        self.reached = 0  # progress counter: steps (and saves) this process has reached
        self.reached_at = time.monotonic()
        self._stop = threading.Event()
        self._beat = 0
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last beat, when it changed)
        self._progress: dict[int, int] = {}
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="zero_jax-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.n > 1:
            self._thread.start()
        return self

    def reach(self, point: int) -> None:
        """The main thread is about to wait on the other processes at ``point``."""
        self.reached, self.reached_at = point, time.monotonic()

    def failed(self, message: str) -> None:
        """Tell the peers why this process is about to exit, so they stop at once."""
        self._stop.set()  # this process says why it stops itself; the watchdog need not
        if self.n > 1:
            try:
                _client().key_value_set(f"{PREFIX}/failed/{self.me}", message,
                                        allow_overwrite=True)
            except Exception:  # the coordinator may be gone already
                pass

    def linger(self, seconds: float = 5) -> None:
        """Before a failing process exits: wait (briefly) until every peer has stopped too, so
        that one which found the same problem (a disagreement) can say so itself."""
        deadline = time.monotonic() + seconds
        while self.n > 1 and time.monotonic() < deadline:
            try:
                done = dict(_client().key_value_dir_get(f"{PREFIX}/failed/"))
            except Exception:
                return
            if len(done) >= self.n:
                if self.me == 0:  # it hosts the coordinator: leave last, or JAX aborts the rest
                    time.sleep(1.5)
                return
            time.sleep(0.1)

    def settle(self, error: BaseException) -> None:
        """A collective failed (gloo: "Connection reset by peer"), maybe inside a checkpoint's
        save (the cause of ``error``): most likely a peer died. Give the watchdog the time it
        needs to name it, then let the caller report ``error``."""
        causes = [error]
        while len(causes) < 8 and (cause := causes[-1].__cause__ or causes[-1].__context__):
            causes.append(cause)
        if (self.n > 1 and self._thread.is_alive()
                and any(isinstance(c, jax.errors.JaxRuntimeError) for c in causes)):
            time.sleep(self.timeout_s + 4 * self.poll_s)

    def stop(self) -> None:
        """Training ended normally: stop watching, tell the others not to wait for us."""
        if self.n > 1 and self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            try:
                _client().key_value_set(f"{PREFIX}/beat/{self.me}", "done", allow_overwrite=True)
            except Exception:
                pass

    def _run(self) -> None:
        client = _client()
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            try:
                self._beat += 1
                client.key_value_set(f"{PREFIX}/beat/{self.me}",
                                     f"{self._beat} {self.reached}", allow_overwrite=True)
                beats = dict(client.key_value_dir_get(f"{PREFIX}/beat/"))
                failed = dict(client.key_value_dir_get(f"{PREFIX}/failed/"))
                self._last_ok = now
            except Exception as e:
                if now - self._last_ok > self.timeout_s:
                    self._die(f"lost process 0 (it runs the coordinator): no answer for "
                              f"{self.timeout_s:g} s ({_line(e)})")
                continue
            for key, message in sorted(failed.items()):
                peer = int(key.rsplit("/", 1)[1])
                if peer != self.me:
                    self._die(f"process {peer} failed: {message}")
            for peer in range(self.n):
                if peer == self.me:
                    continue
                value = beats.get(f"{PREFIX}/beat/{peer}", "")
                if value == "done":
                    continue
                if peer not in self._seen or self._seen[peer][0] != value:
                    self._seen[peer] = (value, now)
                    self._progress[peer] = int(value.split()[1]) if value else 0
                elif now - self._seen[peer][1] > self.timeout_s:
                    self._die(f"lost process {peer}: no heartbeat for {self.timeout_s:g} s "
                              "(it died or is stopped)")
                alive = now - self._seen[peer][1] <= max(2.0, 4 * self.poll_s)
                if (alive and self._progress.get(peer, 0) < self.reached
                        and now - self.reached_at > self.timeout_s):  # a dead peer: above
                    self._die(f"process {peer} hangs: it is alive but has not reached step "
                              f"{self.reached} (this process waits there) for "
                              f"{self.timeout_s:g} s")

    def _die(self, why: str) -> None:
        if self._stop.is_set():  # already exiting with its own error
            return
        # a new line first: a progress bar may have left the cursor in the middle of one
        print(f"\nerror: [process {self.me}] {why}; stopping at step {self.reached}; "
              f"{self.newest()}", file=sys.stderr, flush=True)
        os._exit(1)

    def newest(self) -> str:
        return newest_checkpoint(self.checkpoints)


def newest_checkpoint(directory: str | None) -> str:
    """The newest complete checkpoint, in words: orbax names a step's directory by its number
    only once every process has written it."""
    if not directory:
        return "nothing was saved (no checkpoint directory)"
    try:
        steps = [int(p.name) for p in os.scandir(directory) if p.name.isdigit() and p.is_dir()]
    except OSError:
        steps = []
    return (f"newest complete checkpoint: {max(steps)} in {directory}; resume from it"
            if steps else f"no complete checkpoint in {directory}")


def _line(e: BaseException) -> str:
    text = [x for x in str(e).strip().splitlines() if x.strip()]
    return text[0] if text else type(e).__name__
