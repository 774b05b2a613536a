"""``make_eval_step``: a held-out batch's loss at the sharded parameters equals one device's, at
every stage, and the compiled program holds the forward only (its gradients are unread)."""

import collections
import dataclasses
import json
import pathlib
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import KEY, rel
from lm import LAYERS

import zero_jax as zj
from zero_jax.gpt import config, data
from zero_jax.gpt.experiment import Experiment
from zero_jax.gpt.model import build as build_model
from zero_jax.gpt.model import lm_loss
from zero_jax.hlo import collectives
from zero_jax.planner import step_flops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import train as train_py  # noqa: E402

LAYOUTS = {
    "stage 0": dict(stage=0),
    "stage 1": dict(stage=1),
    "stage 2": dict(stage=2),
    "stage 3": dict(stage=3, layers=LAYERS),
    "stage 3, prefetch": dict(stage=3, layers=zj.Layers(LAYERS, prefetch=True)),
    "stage 3, offloaded parameters": dict(stage=3, layers=LAYERS,
                                         offload=zj.Offload(optimizer=1.0, params=True)),
}


@pytest.fixture(scope="module")
def trained(small):
    """The small model after three plain SGD steps on one device, and a batch it never saw
    (jitted: op by op each operation is a program compiled of its own)."""
    _, init, loss_fn, batches = small
    params, tx, grad = jax.jit(init)(KEY), optax.sgd(0.5), jax.jit(jax.grad(loss_fn))
    opt_state = tx.init(params)
    for b in batches[:3]:
        grads = grad(params, b)
        params = optax.apply_updates(params, tx.update(grads, opt_state, params)[0])
    return params, batches[-1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_held_out_loss_equals_one_device(small, mesh, trained, layout):
    _, _, loss_fn, _ = small
    params, held_out = trained
    plan = zj.make_plan(jax.eval_shape(lambda: params), mesh, **LAYOUTS[layout])
    state = zj.init_state(plan, jax.device_get(params), optax.sgd(0.5))
    metrics = zj.make_eval_step(plan, loss_fn)(state.params, held_out)
    assert rel(metrics["loss"], jax.jit(loss_fn)(params, held_out)) < 2e-6
    # Nothing was updated: the parameters are still the ones given.
    assert rel(jax.device_get(state.params["blocks"]["fc1"]["kernel"]),
               params["blocks"]["fc1"]["kernel"]) == 0


def test_the_compiled_program_is_the_forward_alone(small, mesh, trained):
    """Stage 3: the blocks' gathers and the loss's one all-reduce are left, the backward's
    reduce-scatters and its FLOPs are gone."""
    _, _, loss_fn, _ = small
    params, held_out = trained
    plan = zj.make_plan(jax.eval_shape(lambda: params), mesh, 3, layers=LAYERS)
    tx = optax.sgd(0.5)
    state = zj.init_state(plan, jax.device_get(params), tx)
    evaluate = zj.make_eval_step(plan, loss_fn).lower(state.params, held_out).compile()
    step = zj.make_train_step(plan, loss_fn, tx).lower(state, held_out).compile()

    def kinds(compiled):
        count = collections.Counter()
        for c in collectives(compiled.as_text(), mesh.size):
            count[c.kind] += c.count
        return count
    assert kinds(step)["reduce-scatter"] > 0 and kinds(evaluate)["reduce-scatter"] == 0
    assert kinds(evaluate)["all-gather"] > 0 and kinds(evaluate)["all-reduce"] == 1
    # The backward computes about twice the forward: the program is about a third of the step.
    assert 0.2 < step_flops(evaluate) / step_flops(step) < 0.4


def test_the_experts_evaluate_at_their_own_capacity():
    """Experts trained at a capacity (0.25: pairs dropped) evaluate every pair by default
    (``model.eval_capacity_factor`` 0), as the exported model computes them: one device's loss of
    the uncapped model on the batch; at an evaluation capacity of their own, each device's row
    capped as one device caps it alone."""
    sets = ["model.arch=llama", "model.n_experts=4", "model.expert_capacity_factor=0.25",
            "model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.seq_len=16",
            "train.batch_size=8", "zero.stage=3"]
    batch = np.asarray(jax.random.randint(KEY, (8, 17), 0, 256))
    losses = {}
    for factor in (0.0, 0.25):
        exp = Experiment.build(config.load("tiny", [*sets, f"model.eval_capacity_factor={factor}"]),
                               zj.make_mesh(8))
        state = zj.init_state(exp.plan, exp.init, exp.tx, KEY)
        metrics = exp.eval_step()(state.params, jax.device_put(batch, exp.batch_sharding))
        losses[factor] = float(metrics["loss"])
    params = jax.device_get(state.params)
    at = lambda factor: lm_loss(build_model(dataclasses.replace(  # noqa: E731
        exp.model, expert_capacity_factor=factor)))
    dropless = float(jax.jit(at(0.0))(params, batch))
    rows = jax.jit(lambda p: jax.lax.map(lambda r: at(0.25)(p, r[None]), batch))(params)
    assert abs(losses[0.0] - dropless) < 1e-5 * dropless
    assert abs(losses[0.25] - float(np.mean(rows))) < 1e-5 * losses[0.25]
    assert abs(losses[0.25] - losses[0.0]) > 1e-3 * losses[0.0]


def one_device_eval(ckpt: pathlib.Path, sets: list[str], step: int, tokens) -> float:
    """One device's mean loss over two held-out batches of ``tokens`` at the parameters that
    ``train.py --stage 3`` with ``sets`` saved at ``step``."""
    exp = Experiment.build(config.load("tiny", ["zero.stage=3", f"train.steps={step}", *sets]),
                           zj.make_mesh(8))
    ckpts = zj.Checkpoints(ckpt)
    try:
        state = ckpts.restore(zj.abstract_state(exp.plan, exp.tx), step)[0]
    finally:
        ckpts.close()
    params, m = jax.device_get(state.params), exp.model
    loss_fn = jax.jit(lm_loss(build_model(m)))
    return float(np.mean([loss_fn(params, data.eval_batch(tokens, j, 32, m.seq_len))
                          for j in range(2)]))


@pytest.mark.slow
def test_train_py_evaluates_on_the_held_out_tenth(tmp_path, capsys):
    """``train.eval_every``: ``eval_loss`` in the metrics file at every second step and the
    last (5 steps: two evaluations on the way, the last step's not one of them), the summary's
    held-out figure, and at the last step the one-device loss of the held-out batches at the
    parameters it saved; with microbatches, the same."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    sets = ["model.n_layers=1", "train.eval_every=2", "train.eval_batches=2",
            "optimizer.decay_steps=20"]  # the same schedule for 5 steps and 2
    assert train_py.main(["--stage", "3", "--steps", "5", "--metrics", str(metrics),
                          "--checkpoint-dir", str(ckpt),
                          *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 5]
    held = rows[-1]["eval_loss"]
    assert f"held-out {held:.3f}" in out and f"step 5: eval loss {held:.4f}" in out

    _, tokens = data.held_out(data.load_tokens(None), 64, "")  # the tiny model's seq_len
    assert rel(held, one_device_eval(ckpt, sets, 5, tokens)) < 1e-5
    # With two microbatches the same held-out windows, a microbatch at a time: the same loss.
    accum = tmp_path / "accum.jsonl"
    assert train_py.main(["--stage", "3", "--steps", "2", "--metrics", str(accum),
                          *[a for s in [*sets, "train.accum_steps=2"] for a in ("--set", s)]]) == 0
    rows_2 = [json.loads(line) for line in accum.read_text().splitlines()]
    assert rel(rows_2[-1]["eval_loss"], rows[1]["eval_loss"]) < 1e-5
    # Resumed without evaluation it would train on the held-out tenth: refused, one line.
    assert train_py.main(["--stage", "3", "--steps", "6", "--checkpoint-dir", str(ckpt),
                          "--resume", "--set", "model.n_layers=1"]) == 2
    err = capsys.readouterr().err
    assert "trained on all but the held-out tenth of its data, this run on all" in err


@pytest.mark.slow
def test_train_py_evaluates_on_eval_data(tmp_path, capsys):
    """``--eval-data``: training reads all of ``--data`` (its losses those of a run without
    evaluation, to the bit), the eval loss is one device's mean loss over that file's batches
    at the parameters the step saved, a resume without evaluation trains on the same data;
    without ``train.eval_every``, or naming no file, one line and exit code 2."""
    val = tmp_path / "val.txt"
    val.write_bytes(data.stdlib_corpus(5 << 20)[4 << 20:].tobytes())  # past what --data reads
    sets = ["model.n_layers=1", "train.eval_batches=2", "optimizer.decay_steps=20"]
    flags = lambda *more: [a for s in [*sets, *more] for a in ("--set", s)]
    ckpt, metrics, plain = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "plain.jsonl"
    assert train_py.main(["--stage", "3", "--steps", "2", "--eval-data", str(val),
                          "--metrics", str(metrics), "--checkpoint-dir", str(ckpt),
                          *flags("train.eval_every=2")]) == 0
    assert train_py.main(["--stage", "3", "--steps", "2", "--metrics", str(plain),
                          *flags()]) == 0
    rows, ref = ([json.loads(line) for line in f.read_text().splitlines()]
                 for f in (metrics, plain))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]
    assert rel(rows[-1]["eval_loss"], one_device_eval(ckpt, sets, 2, data.load_tokens(str(val)))
               ) < 1e-5
    capsys.readouterr()
    assert train_py.main(["--stage", "3", "--steps", "3", "--checkpoint-dir", str(ckpt),
                          "--resume", *flags()]) == 0
    for args, message in [
            (["--eval-data", str(val)], f"--eval-data {val} is evaluated every "
                                        "train.eval_every steps, which is 0"),
            (["--eval-data", str(tmp_path / "none.bin"), *flags("train.eval_every=2")],
             f"data file {tmp_path / 'none.bin'} does not exist")]:
        capsys.readouterr()
        assert train_py.main(["--steps", "2", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
