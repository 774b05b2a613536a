"""The services a training loop needs, as hooks over a step: preemption, checkpoint cadence
with the stop-time save, the divergence guard, evaluation on held-out data, a metrics file,
TensorBoard, a profiler window.

A loop calls each hook's ``before(n)`` before step ``n``, ``hook(n, state, metrics, record)``
after it (``metrics`` as numbers, ``record`` the JSON line of the step), and ``close()`` at the
end, as levanter's hooks and nanodo's periodic actions are called. ``train.py`` is one such
loop; a loop of one's own takes the same (``tests/test_loop.py``).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from zero_jax.checkpoint import Checkpoints

# 128 + the signal, as shells report; SIGHUP: the terminal or ssh session closed
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class OutputError(Exception):
    """A file a hook writes could not be written (a full disk, say)."""

    def __init__(self, what: str, path: str, e: OSError):
        super().__init__(f"{what} {path}: {e.strerror or e}")


class Preemption:
    """SIGTERM (preemption), Ctrl-C or SIGHUP (the terminal closed), as a context manager:
    ``signum`` records it, the loop finishes its step, ``Checkpointer`` saves it, and the
    program exits with ``SIGNAL_EXIT[signum]`` (143, 130, 129). A second Ctrl-C exits at once;
    orbax renames a save only when complete, so the one in flight is dropped and the last
    complete checkpoint stays. SIGHUP ignored when the run starts (nohup) stays ignored."""

    def __init__(self, enabled: bool = True):
        self.signum: int | None = None
        self.previous: dict = {}
        self.enabled = enabled
        self.compiling = False  # while XLA compiles, Python runs no handler until it returns
        self.wakeup: tuple[int, int] | None = None  # the C handler's pipe, and the old fd
        self.terminal: list[int] = []  # stdout, stderr: those on a terminal

    def __enter__(self) -> Preemption:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in SIGNAL_EXIT
                             if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN}
            self.terminal = [fd for fd in (1, 2) if os.isatty(fd)]
            # The C-level handler writes each signal to this pipe at once, even while the main
            # thread is inside a compile: a thread answers then, not after the compile.
            read, write = os.pipe()
            os.set_blocking(write, False)
            self.wakeup = (write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            threading.Thread(target=self.acknowledge, args=(read,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.wakeup:
            signal.set_wakeup_fd(self.wakeup[1])
            os.close(self.wakeup[0])  # the thread reads the end of the pipe and returns

    def acknowledge(self, read: int) -> None:
        """Say at once that a signal during compilation was heard: the run stops when the
        compile returns, before any state exists, so there is nothing to save yet."""
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while data := pipe.read(16):
                if self.compiling and any(n in SIGNAL_EXIT for n in data):
                    name = signal.Signals(next(n for n in data if n in SIGNAL_EXIT)).name
                    print(f"\n{name} during compilation: stopping once it returns; nothing to "
                          "save yet", file=sys.stderr, flush=True)

    def handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            print("\nerror: interrupted again: stopped at once; a save in flight is dropped, the "
                  "last complete checkpoint is kept", file=sys.stderr, flush=True)
            os._exit(SIGNAL_EXIT[signal.SIGINT])
        if signum == signal.SIGHUP:  # a terminal that hung up fails every write (EIO)
            for fd in self.terminal:
                if not os.isatty(fd):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        self.signum = self.signum or signum


class Hook:
    """Told before step ``n`` runs, called with its results (``n, state, metrics, record``),
    closed at the end."""

    def before(self, n: int) -> None:
        pass

    def sync(self, n: int) -> bool:
        """Whether this hook must see step ``n`` before the next step is queued: to save its
        state (the next step takes it, donated), or to start or end a trace between steps.
        ``run_steps`` then waits for step ``n`` and reports it first."""
        return False

    def trained(self, n: int, state) -> None:
        """Step ``n`` was trained (``state``), but its results will not be reported: a hook
        failed on the step before. A saver may still save it."""

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def run_steps(step: Callable, state: Any, batches: Iterable[tuple[int, Any]],
              hooks: list[Hook], guard: DivergenceGuard, stop: Preemption,
              tokens_per_step: int = 0) -> int | None:
    """Train on ``batches`` (``(n, batch)``, step ``n``'s) until they end, a stop signal or
    the divergence guard, each step's results to every hook; the last step the hooks saw.

    The host never waits for the device between steps: step ``n``'s metrics are read once step
    ``n + 1`` is queued, so the device always has the next step. Where a hook asks for step
    ``n`` alone (``Hook.sync``: a save, a profile's edge) or the run stops after it, they are
    read first: the next step takes the state (donated). A hook told of a step whose state is
    gone gets ``state=None``. The guard stops at the step it stops at today; the step queued after
    it is dropped, its results never reported."""
    pending: tuple[int, dict] | None = None
    last, read_at = None, time.perf_counter()  # when the step before was read

    def report(n: int, m: dict, state_n: Any) -> bool:
        nonlocal read_at
        m = {k: float(v) for k, v in m.items()}  # waits for step n
        m["skipped"] = int(m["skipped"])
        now = time.perf_counter()  # since the step before was read: this step's time
        record = {"step": n, **m, "tokens_per_s": tokens_per_step / max(now - read_at, 1e-9)}
        read_at = now
        stop_now = guard.update(m, n)
        for hook in hooks:
            hook(n, state_n, m, record)
        return stop_now

    for n, batch in batches:
        if pending and any(hook.sync(pending[0]) for hook in hooks):
            (last, m), pending = pending, None
            if report(last, m, state):
                return last
        if stop.signum:  # checked after the report: a signal that came in it saved that step
            break
        for hook in hooks:
            hook.before(n)
        state, m = step(state, batch)
        if pending:
            (last, m_before), pending = pending, (n, m)
            try:
                halt = report(last, m_before, None)
            except BaseException:
                for hook in hooks:  # a failed output: the newest state can still be saved
                    hook.trained(n, state)
                raise
            if halt:
                return last
        else:
            pending = (n, m)
    if pending:
        last = pending[0]
        report(last, pending[1], state)
    return last


class Evaluation(Hook):
    """A hook: every ``every`` steps and at step ``last``, ``evaluate(state)`` (metrics by name,
    say the mean of ``zero_jax.make_eval_step``'s over held-out batches) joins the step's record
    as ``eval_<name>``, for the hooks after this one to write, and ``write`` says it. It waits
    for the step (``sync``): the next step takes the state, donated."""

    def __init__(self, evaluate: Callable[[Any], dict], every: int, last: int,
                 write: Callable[[str], None] = print):
        self.evaluate, self.every, self.last, self.write = evaluate, every, last, write

    def sync(self, n: int) -> bool:
        return bool(self.every) and (n % self.every == 0 or n == self.last)

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        if state is None or not self.sync(n):
            return
        result = {f"eval_{k}": float(v) for k, v in self.evaluate(state).items()}
        record.update(result)
        self.write(f"step {n}: " + ", ".join(f"{k.replace('_', ' ')} {v:.4f}"
                                             for k, v in result.items()))


class MetricsFile(Hook):
    """A hook: one strict-JSON line per step (``finite_record``), line-buffered. Resumed at
    ``first``, the ``records`` (``(step, line)`` of the file) after it, from a run that went
    further than its last checkpoint, are dropped, since they are trained again. ``label``
    names the file in errors (a program's flag for it)."""

    def __init__(self, path: str, first: int = 0, records: list[tuple[int, str]] = (),
                 label: str = "metrics file"):
        p = pathlib.Path(path)
        if first and p.exists():
            keep = "".join(line for step, line in records if step <= first)
            tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")  # a kill leaves the old file
            tmp.write_text(keep)
            os.replace(tmp, p)
        self.file = open(p, "a" if first else "w", buffering=1)
        self.path, self.label, self.failed = path, label, False

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        try:
            self.file.write(json.dumps(finite_record(record), allow_nan=False) + "\n")
        except OSError as e:
            self.failed = True
            raise OutputError(self.label, self.path, e) from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError as e:  # the line that failed is flushed again: said already
            if not self.failed:
                raise OutputError(self.label, self.path, e) from None


class Checkpointer(Hook):
    """A hook: save every ``every`` steps, at step ``last`` and on a stop signal, unless the
    divergence guard is in a streak of bad steps; ``write`` says when saves start and end.
    ``meta(n)`` is the JSON saved with step ``n``; ``whole(state)`` the state to save."""

    def __init__(self, ckpts: Checkpoints, every: int, last: int, stop: Preemption,
                 guard: DivergenceGuard, meta: Callable[[int], dict],
                 whole: Callable = lambda state: state, write: Callable[[str], None] = print):
        self.ckpts, self.every, self.last, self.stop = ckpts, every, last, stop
        self.guard, self.write, self.meta = guard, write, meta
        self.whole = whole  # the state to save: with the NVMe tier, read back from its files
        self.saved: int | None = None  # the newest step saved
        self.n, self.state = None, None  # the newest step trained, for a stop signal's save

    def sync(self, n: int) -> bool:
        return bool(self.every and n % self.every == 0) or n == self.last \
            or bool(self.stop.signum)

    def trained(self, n: int, state) -> None:
        self.n, self.state = n, state

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        if state is not None:  # else the step's state is gone: a later one is saved
            self.n, self.state = n, state
            if self.sync(n):
                self.save()
        if done := self.ckpts.poll():
            self.write(str(done))

    def save(self) -> None:
        if self.saved != self.n and self.guard.bad_from is None:
            if done := self.ckpts.finish():  # the save before, still in flight: said first
                self.write(str(done))
            self.ckpts.save(self.whole(self.state), self.meta(self.n))
            self.saved = self.n
            self.write(f"saving checkpoint {self.n} (training goes on)")

    def finish(self, force: bool = False) -> None:
        """Wait for the saves in flight. A stop signal that came after this step's check (in
        the poll, say) still saves the step: the loop then stops before training another; so
        does ``force`` (an output that failed)."""
        if (self.stop.signum or force) and self.n is not None:
            self.save()
        if done := self.ckpts.finish():
            self.write(str(done))
        self.state = None


class TensorBoard(Hook):
    """A hook: each step's record as TensorBoard scalars, and ``text`` (a run's summary)."""

    def __init__(self, directory: str, first: int = 0, text: str | None = None):
        from tensorboardX import SummaryWriter

        # A resumed run hides the old events past its checkpoint (trained again). Its file is
        # named by the step it starts from too: a file's name is the second it was opened in,
        # and a run resumed within the same second would otherwise write over the first's.
        self.writer = SummaryWriter(directory, purge_step=first + 1 if first else None,
                                    flush_secs=10, filename_suffix=f".from-{first:010d}")
        if text:
            self.writer.add_text("report", text, first)

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        for key, value in record.items():
            if key != "step":  # eval_loss as eval/loss
                name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
                self.writer.add_scalar(name, value, n)

    def close(self) -> None:
        self.writer.close()


class Profile(Hook):
    """A hook: a JAX profiler trace of steps ``window[0]`` to ``window[1] - 1``, beside the
    compiled step's HLO."""

    def __init__(self, directory: str, window: tuple[int, int], compiled: Any,
                 write: Callable[[str], None] = print):
        self.dir, self.window, self.write = pathlib.Path(directory), window, write
        self.tracing = False
        self.dir.mkdir(parents=True, exist_ok=True)
        # The trace's events are named by the program's instructions: the HLO says what each
        # one is (all_gather.3 -> an all-gather of which shapes, in which loop).
        (self.dir / "train_step.hlo.txt").write_text(compiled.as_text())

    def sync(self, n: int) -> bool:  # the traced steps alone: none queued across an edge
        return n in (self.window[0] - 1, self.window[1] - 1)

    def before(self, n: int) -> None:
        if n == self.window[0]:
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.tracing = True

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        if self.tracing and n == self.window[1] - 1:
            self.close()

    def close(self) -> None:
        """Also when a run stops inside the window: what was traced is kept."""
        if not self.tracing:
            return
        self.tracing = False
        jax.profiler.stop_trace()
        a, b = self.window
        self.write(f"profile of steps {a}-{b - 1} in {self.dir} (open it with TensorBoard's "
                   "profile plugin, or its perfetto_trace.json.gz in ui.perfetto.dev)")


class DivergenceGuard:
    """The divergence guard: a streak of bad steps (``bad_step``) stops the run once it is
    ``max_bad`` long, or at once when a bad step's update went in; nothing is saved
    while a streak lasts, so the newest checkpoint is from before it. Off (0), it stops and
    holds back nothing, but a run that ends in a streak is still not reported done.

    A finite loss far above the last ``WINDOW`` (``jumped``) is only warned of (``write``):
    damaged state or too high a learning rate shows there first, yet a noisy run may also
    jump once."""

    WINDOW = 10

    def __init__(self, max_bad: int = 5, min_loss_scale: float = 1.0,
                 write: Callable[[str], None] | None = None):
        self.max_bad, self.min_loss_scale = max_bad, min_loss_scale
        self.streak_from: int | None = None  # the first step of the current streak
        self.last_finite: int | None = None  # the last step with a finite loss
        self.diverged = False
        self.recent: list[float] = []  # the last WINDOW finite losses
        self.write = write or (lambda text: print(f"warning: {text}", file=sys.stderr))

    @property
    def bad_from(self) -> int | None:
        """The streak that holds back saves: none with the guard off."""
        return self.streak_from if self.max_bad > 0 else None

    def update(self, m: dict, step: int) -> bool:
        """Record step ``step``'s metrics; whether to stop now."""
        if math.isfinite(m["loss"]):
            self.last_finite = step
            self.jumped(m["loss"], step)
        bad = bad_step(m, self.min_loss_scale)
        self.streak_from = (self.streak_from or step) if bad else None
        self.diverged = self.bad_from is not None and (
            step + 1 - self.bad_from >= self.max_bad or not m["skipped"])
        return self.diverged

    def jumped(self, loss: float, step: int) -> None:
        """Warn of a loss above the highest of the last WINDOW by more than their spread (and
        by a tenth of it at least, for a loss that had settled)."""
        if len(self.recent) == self.WINDOW:
            lo, hi = min(self.recent), max(self.recent)
            if loss > hi + max(hi - lo, 0.1 * abs(hi)):
                self.write(f"the loss jumped to {loss:.4g} at step {step}, far above its last "
                           f"{self.WINDOW} steps' {lo:.4g} to {hi:.4g}: training goes on; if "
                           "it stays there, resume from a checkpoint before this step (with a "
                           "lower learning rate, if the state is sound)")
        self.recent = [*self.recent[-self.WINDOW + 1:], loss]


def bad_step(m: dict, min_loss_scale: float) -> bool:
    """A step that did not train: its loss or gradient was not finite, or it was skipped. Not
    one that fp16's loss scaler skipped while it can still lower the scale: that is the scaler
    finding its level, as it does at the start of every fp16 run."""
    if math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and not m["skipped"]:
        return False
    return not (m["skipped"] and math.isfinite(m["loss"])
                and m.get("loss_scale", 0.0) > min_loss_scale)


def finite_record(record: dict) -> dict:
    """``record`` as strict JSON can hold it: a non-finite float becomes null, and the keys
    that held one are listed under ``nonfinite``."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, "nonfinite": bad}
