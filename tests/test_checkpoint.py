"""Checkpoints: exact resume, restore onto any stage and device count, export, and failures
that lose nothing."""

import contextlib
import io
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FIXED_SCHEDULE, ONE_LAYER, SUBPROCESS_ENV, example, small_problem
from lm import LAYERS

import zero_jax as zj
from zero_jax import export
from zero_jax.checkpoint import CheckpointError, Checkpoints
from zero_jax.precision import LossScaleConfig

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train as train_py  # noqa: E402

# The processes compile as this one does (LLVM at level 0; the runs here train a few steps):
# what one of them compiled, the others load from JAX's persistent cache, this process too.
ENV = SUBPROCESS_ENV
ONE = [*ONE_LAYER, *FIXED_SCHEDULE]  # conftest.py


def train(*args, cwd=ROOT, timeout=300, prefix=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(prefix or []), str(ROOT / "train.py"), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def main(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    """``train.main`` in this process, run from ``cwd``, its output caught as a process's: a
    train.py start-up less, for the runs no signal or limit of a process of their own stops."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = train_py.main(list(map(str, args)))
    return subprocess.CompletedProcess(["train.py", *args], code, out.getvalue(), err.getvalue())


def listing(directory: pathlib.Path) -> dict:
    """Every file under ``directory`` with its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(mesh, small, tmp_path_factory):
    """Per stage, a checkpoint written on 8 devices in that stage's layout, of a state after 2
    AdamW steps, and its values. The steps are trained once, at stage 3, and the state placed
    in each stage's layout (``state_shardings``): what a restore reads is the layout on disk,
    and one train step compiles instead of four. Also the stage-3 plan and its compiled step,
    which ``test_saves_are_sharded_and_async_under_donation`` trains with."""
    _, init, loss_fn, batches = small
    tx = optax.adamw(1e-2)
    shapes = jax.eval_shape(init, jax.random.key(0))
    plan3 = zj.make_plan(shapes, mesh, 3, layers=LAYERS)
    step3 = zj.make_train_step(plan3, loss_fn, tx)
    state = zj.init_state(plan3, init, tx, jax.random.key(0))
    for b in batches[:2]:
        state, _ = step3(state, b)
    trained = jax.device_get(state)
    out = {}
    for stage in range(4):
        plan = zj.make_plan(shapes, mesh, stage, layers=LAYERS)
        placed = jax.device_put(trained, zj.state_shardings(plan, tx))
        ckpts = Checkpoints(tmp_path_factory.mktemp(f"stage{stage}"))
        ckpts.save(placed, {"config": {}})
        ckpts.finish()
        out[stage] = (ckpts, trained)
    return init, tx, out, (plan3, step3)


@pytest.mark.parametrize("devices", [4, 2])
@pytest.mark.parametrize("source", range(4))
def test_restore_onto_any_stage_and_device_count(source, devices, saved):
    init, tx, out, _ = saved
    ckpts, values = out[source]
    shapes = jax.eval_shape(init, jax.random.key(0))
    for target in range(4):
        plan = zj.make_plan(shapes, zj.make_mesh(devices), target, layers=LAYERS)
        state, _ = ckpts.restore(zj.abstract_state(plan, tx))
        got = jax.tree.leaves(state)
        for a, b in zip(got, jax.tree.leaves(values), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        # Born in the target layout: each device reads only its own shard.
        specs = jax.tree.leaves(zj.state_specs(plan, tx),
                                is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        for a, spec in zip(got, specs, strict=True):
            assert a.sharding.is_equivalent_to(jax.sharding.NamedSharding(plan.mesh, spec),
                                               a.ndim)
        assert int(state.step) == 2


def test_stage3_on_8_restores_on_one_device(saved):
    init, tx, out, _ = saved
    ckpts, values = out[3]
    plan = zj.make_plan(jax.eval_shape(init, jax.random.key(0)), zj.make_mesh(1), 0,
                        layers=LAYERS)
    state, _ = ckpts.restore(zj.abstract_state(plan, tx))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(values), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_saves_are_sharded_and_async_under_donation(small, saved, tmp_path):
    """Each device writes its own shard (the chunks on disk are shard-sized), and training
    that goes on while the save is in flight (donating the saved buffers) does not leak into
    it. (Stage 3 with AdamW: ``saved``'s plan and step, compiled once for both.)"""
    _, _, _, batches = small
    init, tx, _, (plan, step) = saved
    state = zj.init_state(plan, init, tx, jax.random.key(0))
    state, _ = step(state, batches[0])
    snapshot = jax.device_get(state)
    ckpts = Checkpoints(tmp_path)
    ckpts.save(state, {"config": {}})
    for b in batches[1:4]:
        state, _ = step(state, b)  # donates the buffers the save was given
    stats = ckpts.finish()
    assert stats.blocked_s <= stats.total_s and stats.size_bytes > 0
    restored, _ = ckpts.restore(zj.abstract_state(plan, tx))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(snapshot), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    stored = ckpts.manager.item_metadata(1)["params"].tree
    kernel = stored["params"]["blocks"]["qkv"]["kernel"]
    assert tuple(kernel.storage.chunk_shape) == plan.shardings(plan.param_specs)["blocks"][
        "qkv"]["kernel"].shard_shape(kernel.shape)


def test_mismatched_restores_name_the_path_and_change_nothing(saved):
    init, _, out, _ = saved
    ckpts, _ = out[2]
    before = listing(ckpts.path)
    shapes = jax.eval_shape(init, jax.random.key(0))
    plan = zj.make_plan(shapes, zj.make_mesh(8), 2, layers=LAYERS)
    with pytest.raises(CheckpointError, match=r"opt_state/0/count is in the checkpoint but not"):
        ckpts.restore(zj.abstract_state(plan, optax.sgd(0.1)))  # another optimizer
    deeper = jax.tree.map(lambda s: jax.ShapeDtypeStruct((s.shape[0] + 1, *s.shape[1:]),
                                                         s.dtype), shapes)
    plan = zj.make_plan(deeper, zj.make_mesh(8), 2, layers=LAYERS)
    with pytest.raises(CheckpointError, match=r"params/blocks/\S+ has shape \(2, .*\) in the "
                                              r"checkpoint but \(3, .*\) here"):
        ckpts.restore(zj.abstract_state(plan, optax.adamw(1e-2)))
    assert listing(ckpts.path) == before


def user_plans(mesh) -> dict:
    """A user's states that are not plain dicts of arrays: an NNX model's ``State`` (lists
    keyed by integers, ``Variable``s) with AdamW and with plain SGD, whose state holds no
    array, and the linen model with plain SGD; each case's stage-3 plan and optimizer, and
    what trains it (a restoring process needs the plans alone)."""
    from functools import partial

    from test_nnx import Listed, data, problem

    _, linen_init, linen_loss, batches = small_problem()
    nnx_init, nnx_loss = problem(partial(Listed, n=2))
    cases = {"nnx-adamw": (nnx_init, nnx_loss, optax.adamw(1e-2), r"^blocks/\d+$", data(0)),
             "nnx-sgd": (nnx_init, nnx_loss, optax.sgd(0.1), r"^blocks/\d+$", data(0)),
             "linen-sgd": (linen_init, linen_loss, optax.sgd(0.1), LAYERS, batches[0])}
    return {name: (zj.make_plan(jax.eval_shape(init, jax.random.key(0)), mesh, 3, layers=layers),
                   tx, (init, loss_fn, batch))
            for name, (init, loss_fn, tx, layers, batch) in cases.items()}


def user_states(mesh) -> dict:
    """``user_plans``' cases, each after one step at stage 3."""
    out = {}
    for name, (plan, tx, (init, loss_fn, batch)) in user_plans(mesh).items():
        state = zj.init_state(plan, init, tx, jax.random.key(0))
        state, _ = zj.make_train_step(plan, loss_fn, tx)(state, batch)
        out[name] = (plan, tx, state)
    return out


RESTORE = """
import sys; sys.path.insert(0, {tests!r})
import conftest, jax, numpy as np, zero_jax as zj
from test_checkpoint import user_plans
for name, (plan, tx, _) in user_plans(conftest.make_mesh(8)).items():
    ckpts = zj.Checkpoints({root!r} + "/" + name, read_only=True)
    state, meta = ckpts.restore(zj.abstract_state(plan, tx))
    print(name, jax.tree.structure(state), sorted(meta))
    np.savez({root!r} + "/" + name + ".npz", *map(np.asarray, jax.tree.leaves(state)))
"""


def test_nnx_and_stateless_states_restore_exactly_in_a_new_process(mesh, tmp_path):
    states = user_states(mesh)
    for name, (_, _, state) in states.items():
        ckpts = Checkpoints(tmp_path / name)
        ckpts.save(state, {"note": name})
        ckpts.finish()
        assert ckpts.steps() == [1]
        ckpts.close()
    run = subprocess.run([sys.executable, "-c", RESTORE.format(
        tests=str(ROOT / "tests"), root=str(tmp_path))], env=ENV, capture_output=True,
        text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    for name, (_, _, state) in states.items():
        structure, meta = lines[name].rsplit(" [", 1)
        assert structure == str(jax.tree.structure(state))  # NNX's State comes back as one
        assert meta == "'note', 'step']"  # the user's metadata and the step, nothing internal
        with np.load(tmp_path / f"{name}.npz") as got:
            want = jax.tree.leaves(state)
            assert len(got.files) == len(want) > 0
            for i, leaf in enumerate(want):
                np.testing.assert_array_equal(got[f"arr_{i}"], np.asarray(leaf))
    assert not (tmp_path / "nnx-sgd" / "1" / "opt_state").exists()  # nothing to write


@pytest.mark.parametrize("meta, phrase", [
    ({"step": 5}, "meta's step 5 is not the state's step 1, which the checkpoint records"),
    ({"format": 1}, "meta key 'format' is the checkpoint's own"),
    ({"loss": np.float32(0.5)}, "meta must be JSON (dicts, lists, strings, numbers, booleans, "
                                "None): Object of type float32 is not JSON serializable"),
])
def test_meta_that_would_not_come_back_is_refused_before_writing(mesh, tmp_path, meta, phrase):
    """A ``step`` other than the state's was saved, and the checkpoint then read as corrupted;
    meta that is not JSON failed in orbax's background thread, with its tracebacks, after the
    arrays were written. Both are refused before anything is written; the state's own step in
    meta is fine, and comes back with the user's keys."""
    plan = zj.make_plan({"w": jax.ShapeDtypeStruct((8, 4), np.float32)}, mesh, 1)
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    state = zj.init_state(plan, {"w": w}, optax.adam(0.1))._replace(step=jax.numpy.asarray(1))
    ckpts = Checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(phrase)):
        ckpts.save(state, meta)
    assert ckpts.steps() == [] and sorted(p.name for p in tmp_path.iterdir()) == [".writer.lock"]
    ckpts.save(state, {"step": 1, "note": "ok"})
    ckpts.finish()
    restored, back = ckpts.restore(zj.abstract_state(plan, optax.adam(0.1)))
    ckpts.close()
    assert back == {"step": 1, "note": "ok"}
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), w)


POLICIES = {"fp32": {}, "bf16": {"precision": zj.Precision("bf16")},
            "fp16": {"precision": zj.Precision("fp16", loss_scale=LossScaleConfig())},
            "fp32-offload": {"offload": zj.Offload(optimizer=1.0)}}


def policy_run(mesh, policy: str, stage: int):
    """A linear model's plan, state after one AdamW step, and step, under ``policy``."""
    shapes = {"w": jax.ShapeDtypeStruct((8, 4), np.float32)}
    x, y = jax.random.normal(jax.random.key(1), (16, 8)), jax.random.normal(jax.random.key(2),
                                                                            (16, 4))
    loss_fn = lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2)  # noqa: E731
    plan = zj.make_plan(shapes, mesh, stage, **POLICIES[policy])
    step = zj.make_train_step(plan, loss_fn, optax.adam(0.1))
    w = {"w": np.asarray(jax.random.normal(jax.random.key(0), (8, 4)))}
    state, _ = step(zj.init_state(plan, w, optax.adam(0.1)), (x, y))
    return plan, state, step, (x, y)


@pytest.mark.parametrize("source, target", [("fp32", "bf16"), ("bf16", "fp32"),
                                            ("fp16", "bf16"), ("fp32", "fp32-offload"),
                                            ("fp32-offload", "fp32")])
def test_a_state_restores_under_another_precision_policy(mesh, tmp_path, source, target):
    """A checkpoint of one precision policy restores under another (fp32 keeps its parameters
    alone; bf16 and fp16, and an offloaded optimizer in fp32, an fp32 master copy beside the
    compute copy): the fp32 values become the target's master, or its parameters, bit for
    bit, its compute copy their cast; the optimizer state as saved. It trains on as a state
    the target's policy made from those values does."""
    _, saved, _, _ = policy_run(mesh, source, 3)
    ckpts = Checkpoints(tmp_path)
    ckpts.save(saved, {})
    ckpts.finish()
    plan, _, step, batch = policy_run(mesh, target, 1)
    got, _ = ckpts.restore(zj.abstract_state(plan, optax.adam(0.1)))
    ckpts.close()
    fp32 = np.asarray((saved.master or saved.params)["w"])
    want = zj.init_state(plan, {"w": fp32}, optax.adam(0.1))
    put = lambda a, t: jax.device_put(a, t.sharding)  # noqa: E731  (the target's memories)
    want = want._replace(**{k: jax.tree.map(put, getattr(saved, k), getattr(want, k))
                            for k in ("step", "opt_state", "skipped")})
    assert (got.master is None) == (want.master is None)
    np.testing.assert_array_equal(np.asarray((got.master or got.params)["w"]), fp32)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    (after, m), (ref, m_ref) = step(got, batch), step(want, batch)
    assert float(m["loss"]) == float(m_ref["loss"])
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_an_fp16_run_refuses_a_state_without_a_loss_scale(mesh, tmp_path):
    """fp16's loss scale is state of its own, which no other policy keeps: refused, naming
    the policies that resume it."""
    _, saved, _, _ = policy_run(mesh, "bf16", 3)
    ckpts = Checkpoints(tmp_path)
    ckpts.save(saved, {})
    ckpts.finish()
    plan = zj.make_plan({"w": jax.ShapeDtypeStruct((8, 4), np.float32)}, mesh, 3,
                        **POLICIES["fp16"])
    with pytest.raises(CheckpointError, match=r"holds no loss scale \(written without fp16\): "
                       r"an fp16 run cannot resume it; resume it in bf16 or fp32"):
        ckpts.restore(zj.abstract_state(plan, optax.adam(0.1)))
    ckpts.close()


def test_names_are_flax_state_dict_names():
    """Checkpoints written before NNX states were saved named each array by flax's state
    dict; plain dicts and optax's states must still read back under the same names."""
    from flax import serialization

    from zero_jax.checkpoint import _flat, _items

    _, init, _, _ = small_problem()
    params = jax.eval_shape(init, jax.random.key(0))  # names only: shapes, no values
    labels = jax.tree.map(lambda _: "trained", params)
    labels["ln_f"] = jax.tree.map(lambda _: "frozen", params["ln_f"])
    for tx in (optax.adamw(1e-3), optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3)),
               optax.multi_transform({"trained": optax.adafactor(1e-3),
                                      "frozen": optax.set_to_zero()}, labels)):
        state = zj.TrainState(jax.numpy.zeros((), int), params, None,
                              jax.eval_shape(tx.init, params), None, jax.numpy.zeros((), int))
        ours = _flat({k: v[k] for k, v in _items(state).items()})
        flax = {f"{name}/{k}".rstrip("/"): v for name in ("params", "opt_state", "skipped")
                for k, v in _flat(serialization.to_state_dict(getattr(state, name))).items()
                if hasattr(v, "shape")}
        assert ours.keys() == flax.keys()


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> pathlib.Path:
    """train.py's default run (``ONE``: one layer, its schedule fixed), 4 steps saved every 2
    (both kept), started in a directory of its own with a relative --checkpoint-dir:
    ``runs/ckpt`` there. Tests work on copies."""
    cwd = tmp_path_factory.mktemp("written")
    run = main(*ONE, "--steps", 4, "--save-every", 2, "--keep", 2, "--checkpoint-dir",
               "runs/ckpt", cwd=cwd)
    assert run.returncode == 0, run.stderr
    return cwd / "runs" / "ckpt"


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    """A save killed half-way is never listed; --resume takes the last complete one."""
    ckpt = tmp_path / "ckpt"
    big = ["--set", "model.d_model=512", "--set", "model.d_ff=2048",  # 40 MB per checkpoint
           "--set", "train.batch_size=8", "--set", "model.seq_len=4",  # a cheap step
           *ONE]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *big, "--steps", "1000",
                             "--save-every", "3", "--checkpoint-dir", str(ckpt)],
                            cwd=ROOT, env={**ENV, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("saving checkpoint 6"):  # 3 is complete, 6 is being written
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    partial = [p.name for p in ckpt.iterdir() if p.name.startswith("6.")]
    assert partial, sorted(p.name for p in ckpt.iterdir())  # the save really was in flight
    run = main(*big, "--steps", 4, "--checkpoint-dir", ckpt, "--resume")
    assert run.returncode == 0, run.stderr
    assert "resumed from step 3" in run.stdout


def test_disk_full_during_save_stops_and_keeps_older_checkpoints(tmp_path, written):
    ckpt = shutil.copytree(written, tmp_path / "ckpt")  # steps 2 and 4, saved every 2, keep 2
    # The kernel refuses to grow any file past 4 KB from here on: writes fail as on a full disk.
    limit = ("import resource, runpy, signal, sys\n"
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, "
             "(4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
             "sys.argv = sys.argv[1:]\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    run = train(*ONE, "--steps", 8, "--save-every", 2, "--keep", 2, "--checkpoint-dir", ckpt,
                "--resume", prefix=["-c", limit])
    assert run.returncode == 1
    # one line; orbax's logged tracebacks and asyncio's "Event loop is closed" are kept quiet
    errors = [x for x in run.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        rf"error: saving checkpoint 6 in {re.escape(str(ckpt))} \([\d.]+ GiB free there\) "
        r"failed: .*File too large; older checkpoints are kept", errors[0]), run.stderr[-3000:]
    # (asyncio's "exception was never retrieved" of orbax's futures showed on a loaded machine)
    noise = ("Traceback", "ERROR:absl", "ERROR:asyncio", "never retrieved", "never awaited")
    assert not any(x in run.stderr for x in noise), run.stderr[-3000:]
    ckpts = Checkpoints(ckpt)
    assert ckpts.manager.all_steps() == [2, 4]  # keep=2 deleted nothing for the failed 6
    assert ckpts.meta(4)["step"] == 4


def test_export_reads_with_plain_orbax_and_generates(tmp_path, written):
    shutil.copytree(written, tmp_path / "runs" / "ckpt")
    # the export in this process (a fresh one is the reader's point, below, not the writer's)
    err = io.StringIO()
    with contextlib.chdir(tmp_path), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(err):
        code = export.main(["runs/ckpt", "runs/export", "--dtype", "bf16"])
    assert code == 0, err.getvalue()
    # Loading needs orbax only: a fresh one-device process that never imports zero_jax.
    check = ("import os, sys, orbax.checkpoint as ocp\n"
             "p = ocp.StandardCheckpointer().restore(os.path.abspath('runs/export/params'))\n"
             "assert 'zero_jax' not in sys.modules\n"
             "print(p['blocks']['qkv']['kernel'].dtype, p['wte'].shape)\n")
    run = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.split() == ["bfloat16", "(256,", "128)"], run.stderr
    snippet = example("docs/guides/checkpoints.md", "export-example")
    run = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("def ") and len(run.stdout) > 20


def test_frozen_modules_must_match_the_checkpoint():
    """Frozen modules carry no optimizer state, so a checkpoint fits only the same setting."""
    from zero_jax.gpt import config
    from zero_jax.gpt.experiment import check_compatible

    saved = {"config": config.load("tiny", ["optimizer.frozen_modules=[wpe]"])}
    check_compatible(saved, config.load("tiny", ["optimizer.frozen_modules=[wpe]"]))
    with pytest.raises(CheckpointError, match=r"optimizer.frozen_modules=\['wpe'\]"):
        check_compatible(saved, config.load("tiny"))
