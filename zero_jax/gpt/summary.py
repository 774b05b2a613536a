"""What a run says as it goes and as it ends: progress, and the one line of each ending."""

from __future__ import annotations

import signal
import sys
import time

import numpy as np

from zero_jax.checkpoint import CheckpointError
from zero_jax.gpt.cli import fail, process
from zero_jax.gpt.resume import jax_primary
from zero_jax.loop import (
    SIGNAL_EXIT,
    Checkpointer,
    DivergenceGuard,
    Hook,
    OutputError,
    Preemption,
    finite_record,
)

DIVERGED = 3  # the exit code of a run the divergence guard stopped (train.max_bad_steps)


class Tally(Hook):
    """A hook: the losses, the skipped steps, the throughput so far (the progress bar's and the
    summary's figure alike), and the records for --plot's curves (kept only for them: a long
    run's records add up). Without a terminal (output to a file), a plain line every tenth of
    the run instead of the bar's redrawn one."""

    def __init__(self, bar, tokens_per_step: int, keep_records: bool = False):
        self.bar, self.losses, self.skipped = bar, [], 0
        self.eval_loss: float | None = None  # the last held-out loss (train.eval_every)
        self.records: list[dict] | None = [] if keep_records else None
        self.tokens_per_step, self.tokens_per_s = tokens_per_step, 0.0
        self.start = time.perf_counter()
        self.every = max(1, (bar.total - bar.n) // 10) if bar.disable and jax_primary() else 0

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        self.losses.append(m["loss"])
        self.skipped += m["skipped"]
        self.eval_loss = record.get("eval_loss", self.eval_loss)
        if self.records is not None:
            self.records.append(finite_record(record))
        self.tokens_per_s = len(self.losses) * self.tokens_per_step / (
            time.perf_counter() - self.start)
        self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{self.tokens_per_s:,.0f}")
        if self.every and (len(self.losses) % self.every == 0 or n == self.bar.total):
            print(f"step {n}/{self.bar.total}: loss {m['loss']:.3f}, "
                  f"{self.tokens_per_s:,.0f} tokens/s", flush=True)


def ending(t: dict, first: int, tally: Tally, elapsed: float, stop: Preemption,
           guard: DivergenceGuard, step: int, saver: Checkpointer | None) -> int:
    """The run's last line and exit code: stopped by a signal, diverged, or done."""
    saved, ckpts = (saver.saved, saver.ckpts) if saver else (None, None)
    if stop.signum:
        return stopped(stop, step, saved, ckpts, guard.bad_from)
    if guard.streak_from is not None:  # max_bad_steps in a row, or the run ended in a streak
        return diverged(t["max_bad_steps"], guard, step, ckpts)
    return done(t["steps"], first, tally, elapsed,
                f"checkpoint {saved} in {ckpts.path}" if saved else
                newest_checkpoint(ckpts, "from before this run"))


def done(steps: int, first: int, tally: Tally, elapsed: float, saved: str) -> int:
    losses = tally.losses
    last = min(10, len(losses))
    print(f"done: steps {first + 1}-{steps} in {elapsed:.1f} s, loss {losses[0]:.3f} -> "
          f"{float(np.mean(losses[-last:])):.3f} (mean of last {last}), "
          + (f"held-out {tally.eval_loss:.3f}, " if tally.eval_loss is not None else "")
          + f"{tally.tokens_per_s:,.0f} tokens/s"
          + (f", {tally.skipped} steps skipped (gradient not finite)" if tally.skipped else "")
          + f"; {saved}")
    return 0


def newest_checkpoint(ckpts, when: str = "from before it") -> str:
    if not ckpts:
        return "nothing was saved (no --checkpoint-dir)"
    if (newest := ckpts.latest_step()) is None:
        return f"no checkpoint is in {ckpts.path}"
    return f"the newest checkpoint, {when}, is {newest} in {ckpts.path}"


def diverged(max_bad: int, guard: DivergenceGuard, step: int, ckpts) -> int:
    """The divergence guard's one line: which steps, the last good one, what is kept."""
    bad_from, n = guard.streak_from, step - guard.streak_from + 1
    why = ("its update went in" if n < max_bad and guard.diverged
           else "the run ended in it" if not guard.diverged
           else f"train.max_bad_steps is {max_bad}")
    good = (f"the last step with a finite loss was {guard.last_finite}" if guard.last_finite
            else "no step of this run had a finite loss")
    fix = "with a lower optimizer.lr, or a larger optimizer.warmup_steps"
    if not max_bad:  # the guard off: the run went on to its last step, and saved as it went
        newest = newest_checkpoint(ckpts, "saved as it went")
        kept = f"train.max_bad_steps 0 kept it going, {newest}: train again from before step " \
               f"{bad_from} {fix}"
    else:
        kept = f"nothing saved since, {newest_checkpoint(ckpts)}: resume from it {fix}"
    print(f"error: {process()}training diverged: step{'s' if n > 1 else ''} "
          f"{bad_from}{f'-{step}' if n > 1 else ''} had a non-finite loss or gradient "
          f"({n} in a row; {why}); {good}; {kept}", file=sys.stderr)
    return DIVERGED


def stopped(stop: Preemption, step: int, saved: int | None, ckpts,
            bad_from: int | None) -> int:
    name = signal.Signals(stop.signum).name
    if saved == step:
        what = f"checkpoint {step} saved in {ckpts.path}; continue with --resume"
    elif bad_from is not None:
        what = (f"not saved: steps {bad_from}-{step} had a non-finite loss or gradient; "
                f"{newest_checkpoint(ckpts)}")
    elif ckpts:
        what = "nothing new to save"
    else:
        what = "not saved (no --checkpoint-dir)"
    print(f"stopped by {name} after step {step}: {what}", file=sys.stderr)
    return SIGNAL_EXIT[stop.signum]


def tier_failed(e, saver: Checkpointer | None) -> str:
    """The NVMe tier's files failed or were damaged: the saves in flight (all read back, and
    checked, before it) are finished, and the line says where to resume from."""
    if saver is None:
        return f"{e}; {newest_checkpoint(None)}"
    try:
        saver.ckpts.finish()
    except CheckpointError as c:
        return f"{e}; {c}"
    return f"{e}; {newest_checkpoint(saver.ckpts)}: continue from it with --resume"


def output_failed(e: OutputError, saver: Checkpointer | None, step: int) -> int:
    """A --metrics write that failed mid-run: the step trained is saved (unless the
    divergence guard forbids it), then one line and exit 1."""
    what = ""
    if saver:
        try:
            saver.finish(force=True)
            if saver.saved == step:
                what = f"; checkpoint {step} saved in {saver.ckpts.path}"
        except CheckpointError as c:
            what = f"; {c}"
    return fail(f"{e}; stopped after step {step}{what}", 1)
