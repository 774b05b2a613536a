"""``zero_jax.loop``'s services in a loop of one's own: docs/guides/checkpoints.md's loop, run as
written. A SIGTERM mid-run saves the step it finished, and the resumed run ends bit for bit where
an uninterrupted one does; the divergence guard stops a streak of non-finite steps unsaved."""

import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import example

import zero_jax as zj

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

LOOP = example("docs/guides/checkpoints.md", "loop-example")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(16)(nn.gelu(nn.Dense(64)(x)))


class Net(nn.Module):
    def setup(self):
        self.h = [Block() for _ in range(2)]
        self.out = nn.Dense(1)

    def __call__(self, x):
        for block in self.h:
            x = block(x)
        return self.out(x)


@pytest.fixture(scope="module")
def setup(mesh):
    model, tx, key = Net(), optax.adamw(1e-2), jax.random.key(0)
    init = lambda k: model.init(k, jnp.zeros((1, 16)))["params"]

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    plan = zj.make_plan(jax.eval_shape(init, key), mesh, stage=3, layers=r"^h_\d+$")
    return plan, tx, lambda: zj.init_state(plan, init, tx, key), \
        zj.make_train_step(plan, loss_fn, tx)


def run(setup, directory, steps: int, batch) -> dict:
    plan, tx, fresh, step = setup
    ns = {"zj": zj, "directory": str(directory), "plan": plan, "tx": tx, "step": step,
          "steps": steps, "state": fresh(), "batch": batch}
    exec(compile(LOOP, "docs/guides/checkpoints.md", "exec"), ns)
    return ns


def data(n: int, nan_from: int | None = None, kill_at: int | None = None):
    if n == kill_at:  # a preemption, delivered while the step's batch is made
        signal.raise_signal(signal.SIGTERM)
    x = jax.random.normal(jax.random.key(n), (16, 16))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    return x, y * jnp.nan if nan_from is not None and n >= nan_from else y


def test_preempted_run_saves_its_step_and_resumes_exactly(setup, tmp_path):
    handler = signal.getsignal(signal.SIGTERM)
    whole = run(setup, tmp_path / "whole", 6, data)
    stopped = run(setup, tmp_path / "stopped", 6, lambda n: data(n, kill_at=3))
    assert stopped["stop"].signum == signal.SIGTERM and stopped["n"] == 3
    assert signal.getsignal(signal.SIGTERM) is handler  # put back as it was
    assert zj.Checkpoints(tmp_path / "stopped", read_only=True).steps() == [3]
    resumed = run(setup, tmp_path / "stopped", 6, data)
    assert resumed["meta"]["data_position"] == 3 and int(resumed["state"].step) == 6
    assert zj.Checkpoints(tmp_path / "stopped", read_only=True).steps() == [3, 6]
    for a, b in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(whole["state"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_divergence_guard_stops_a_streak_and_saves_none_of_it(setup, tmp_path):
    """Non-finite steps are skipped (the state stays finite); five in a row stop the run, and
    the step the run ends at is not saved."""
    run(setup, tmp_path, 2, data)  # a healthy start, saved at its last step
    diverged = run(setup, tmp_path, 8, lambda n: data(n, nan_from=4))
    guard = diverged["guard"]
    assert diverged["n"] == 8 and guard.diverged and guard.streak_from == 4
    assert guard.last_finite == 3 and diverged["m"]["skipped"] == 1
    assert zj.Checkpoints(tmp_path, read_only=True).steps() == [2]  # step 8 was the last


def test_every_save_the_checkpointer_starts_is_reported_done(setup, tmp_path):
    """A save still in flight when the next one starts is waited for by that save: its line
    (size and time) was lost, leaving only "saving checkpoint N"."""
    _, _, fresh, _ = setup
    state, lines = fresh(), []
    ckpts = zj.Checkpoints(tmp_path)
    saver = zj.loop.Checkpointer(ckpts, every=1, last=3, stop=zj.loop.Preemption(),
                                 guard=zj.loop.DivergenceGuard(), meta=lambda n: {},
                                 write=lines.append)
    for n in (1, 2, 3):  # each save starts while the one before is being written
        saver(n, state._replace(step=jnp.asarray(n)), {}, {})
    saver.finish()
    ckpts.close()
    started = [int(line.split()[2]) for line in lines if line.startswith("saving checkpoint")]
    done = [int(line.split()[1][:-1]) for line in lines if line.startswith("checkpoint ")]
    assert started == done == [1, 2, 3], lines
    assert zj.Checkpoints(tmp_path, read_only=True).steps() == [1, 2, 3]


class _Read:
    """A metric that records when the host reads it (``float``): the host waited for it."""

    def __init__(self, n: int, log: list, value: float = 1.0):
        self.n, self.log, self.value = n, log, value

    def __float__(self) -> float:
        self.log.append(("read", self.n))
        return float(self.value)


class _Saves(zj.loop.Hook):
    """A hook that wants the state of every 3rd step, and records what it was given."""

    def __init__(self):
        self.seen = []

    def sync(self, n: int) -> bool:
        return n % 3 == 0

    def __call__(self, n, state, m, record):
        self.seen.append((n, state))


@pytest.mark.parametrize("bad_from", [None, 5])
def test_run_steps_queues_the_next_step_before_reading_one(bad_from):
    """``run_steps``: step n's metrics are read only once step n+1 is queued, except where a
    hook wants step n's state (then before it, the next step taking the state); the hooks see
    every step, with its state where it is still there; the divergence guard stops at the same
    step as a loop that waits (max_bad_steps 1: step 5's non-finite loss), the step queued
    after it never reported."""
    log = []

    def step(state, batch):
        log.append(("queue", batch))
        loss = float("nan") if batch == bad_from else 1.0
        return state + 1, {"loss": _Read(batch, log, loss), "grad_norm": _Read(batch, [], loss),
                           "skipped": _Read(batch, [], 0)}

    saves, guard = _Saves(), zj.loop.DivergenceGuard(max_bad=1)
    with zj.loop.Preemption(enabled=False) as stop:
        last = zj.loop.run_steps(step, 0, ((n, n) for n in range(1, 8)), [saves], guard, stop)
    want = []
    for n in range(1, 8):
        if n > 1 and (n - 1) % 3 == 0:
            want.append(("read", n - 1))
        want.append(("queue", n))
        if n > 1 and (n - 1) % 3:
            want.append(("read", n - 1))
    want.append(("read", 7))
    if bad_from:
        want = want[:want.index(("read", bad_from)) + 1]
    assert log == want
    assert last == (bad_from or 7) and [n for n, _ in saves.seen] == list(range(1, last + 1))
    assert [(n, s) for n, s in saves.seen if s is not None] == \
        [(n, n) for n in (3, 6, 7) if n <= last]


def test_tensorboard_of_a_resumed_run_hides_the_steps_trained_again(tmp_path):
    """A run that wrote steps 1-6 and resumed from its checkpoint at step 4: TensorBoard reads
    steps 1-4 of the first run and 5-8 of the second, not the first run's 5 and 6 beside the
    second's (``TensorBoard``'s ``purge_step``); the summary text at the resumed step too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from zero_jax.loop import TensorBoard

    first = TensorBoard(str(tmp_path))
    for n in range(1, 7):
        first(n, None, {}, {"step": n, "loss": 10.0 + n, "eval_loss": 20.0 + n})
    first.close()
    resumed = TensorBoard(str(tmp_path), first=4, text="resumed at 4")
    for n in range(5, 9):
        resumed(n, None, {}, {"step": n, "loss": 100.0 + n})
    resumed.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    read = {name: [(e.step, e.value) for e in events.Scalars(name)]
            for name in events.Tags()["scalars"]}
    assert read["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 105.0),
                                  (6, 106.0), (7, 107.0), (8, 108.0)]
    assert read["eval/loss"] == [(1, 21.0), (2, 22.0), (3, 23.0), (4, 24.0)]
    assert [e.step for e in events.Tensors("report/text_summary")] == [4]


class _Stopper(_Saves):
    """A hook that, asked whether it needs step 3 alone, delivers a stop signal: one that
    arrives after the loop's check and before the saver's (``Checkpointer.sync`` says yes
    once a signal has come)."""

    def __init__(self, stop: zj.loop.Preemption):
        super().__init__()
        self.stop = stop

    def sync(self, n: int) -> bool:
        self.stop.signum = self.stop.signum or (signal.SIGTERM if n == 3 else None)
        return bool(self.stop.signum)


def test_a_stop_signal_during_a_read_saves_that_step_alone():
    """The signal came while step 3 was read for a save: step 3 is the run's last, no step 4
    is queued (its state would have been saved again at the stop)."""
    log = []

    def step(state, batch):
        log.append(batch)
        return state + 1, {"loss": 1.0, "grad_norm": 1.0, "skipped": 0}

    with zj.loop.Preemption(enabled=False) as stop:
        saver = _Stopper(stop)
        last = zj.loop.run_steps(step, 0, ((n, n) for n in range(1, 8)), [saver],
                                 zj.loop.DivergenceGuard(), stop)
    assert last == 3 and log == [1, 2, 3]
    assert [(n, s) for n, s in saver.seen if s is not None] == [(3, 3)]
