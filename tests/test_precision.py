"""Mixed precision, fp16 loss scaling and gradient accumulation, at every stage."""

import contextlib
import dataclasses
import io
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import OPTIMIZED, SUBPROCESS_ENV, local_bytes, tree_rel
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax import report
from zero_jax.gpt.model import GPT, LAYERS, GPTConfig, init_fn, lm_loss
from zero_jax.hlo import collectives
from zero_jax.precision import LossScaleConfig, Precision

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

N = 8
TINY = GPTConfig()  # the demo's default model, whose figures the docs give
SMALL = GPTConfig(vocab_size=250, d_model=40, n_layers=2, n_heads=4, d_ff=100, seq_len=12)
PSI = TINY.n_params
KEY = jax.random.key(0)
BF16 = Precision(param_dtype="bf16")


def setup(mesh, stage, precision=BF16, accum_steps=1, cfg=TINY, tx=None, loss_fn=None,
          comm=None):
    model = GPT(cfg)
    init = init_fn(model)
    tx = tx or optax.adamw(1e-3)
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, stage, layers=LAYERS,
                        precision=precision, comm=comm or zj.Comm())
    step = zj.make_train_step(plan, loss_fn or lm_loss(model), tx, accum_steps=accum_steps)
    return plan, init, tx, step


@pytest.fixture(scope="module")
def bf16_stages(mesh):
    out = {}
    for stage in range(4):
        plan, init, tx, step = setup(mesh, stage)
        state = zj.init_state(plan, init, tx, KEY)
        lowered = step.lower(state, jax.ShapeDtypeStruct((32, TINY.seq_len + 1), jnp.int32))
        out[stage] = dict(state=state, lowered=lowered,
                          report=report.build(plan, state, lowered, lowered.compile()))
    return out


# ZeRO's mixed-precision accounting per device, bytes per parameter (K = 12: fp32 master + Adam).
FORMULAS = {  # stage: (compute params, grads, master + moments)
    0: (2, 2, 12), 1: (2, 2, 12 / N), 2: (2, 2 / N, 12 / N), 3: (2 / N, 2 / N, 12 / N)}


@pytest.mark.parametrize("stage", range(4))
def test_each_copy_follows_the_mixed_precision_formula(stage, bf16_stages):
    """stage 0: 16 Psi; 1: 4 Psi + 12 Psi/N; 2: 2 Psi + 14 Psi/N; 3: 16 Psi/N."""
    s = bf16_stages[stage]
    params, grads, optimizer = FORMULAS[stage]
    state = s["state"]
    assert jax.tree.leaves(state.params)[0].dtype == jnp.bfloat16
    assert jax.tree.leaves(state.master)[0].dtype == jnp.float32
    assert local_bytes(state.params) == pytest.approx(params * PSI, rel=0.02)
    assert local_bytes(state.master) + local_bytes(state.opt_state) == pytest.approx(
        optimizer * PSI, rel=0.02)
    assert s["report"]["per_device_bytes"]["grads"] == pytest.approx(grads * PSI, rel=0.02)


def test_sharded_bf16_gradients_show_in_temp_memory(bf16_stages):
    temp = {k: v["report"]["compiled"]["temp_bytes"] for k, v in bf16_stages.items()}
    saved, expected = temp[1] - temp[2], (N - 1) / N * 2 * PSI
    assert 0.8 * expected < saved < 1.5 * expected, (temp, expected)


def test_the_report_says_the_collectives_run_in_f32_on_the_cpu(bf16_stages):
    """bf16 asks for bf16 collectives; the CPU backend runs them in f32 (the compiled table
    says f32): the headline says so beside the dtype asked for, and the theory the ratio is
    taken against counts every phase in f32, twice ZeRO's bytes in bf16 (given beside it)."""
    for s in bf16_stages.values():
        r = s["report"]
        text = report.format_table(r)
        assert {g["dtype"] for g in r["collectives"]} == {"f32"}
        assert r["collectives_run_in"] == "f32"
        assert r["comm_bytes_theory_as_run"] == 2 * r["comm_bytes_theory"] > 0
        assert text.splitlines()[0].endswith(
            "compute bfloat16, gradient collectives bfloat16 (run in f32 by the cpu backend)")
        formula = r["comm_theory_formula"]
        assert (f"ZeRO theory {r['comm_bytes_theory_as_run'] / 2**20:.2f} MiB ({formula}, in "
                "f32 as the cpu backend runs the 16-bit collectives; "
                f"{r['comm_bytes_theory'] / 2**20:.2f} MiB in the dtypes requested), ratio "
                f"{r['comm_bytes_per_step'] / r['comm_bytes_theory_as_run']:.2f}") in text


def requested(lowered):
    """(kind, dtype, in_loop) of the collectives the program asks XLA for."""
    return {(c.kind, c.dtype, c.in_loop) for c in collectives(lowered.as_text(dialect="hlo"), N)}


@pytest.mark.parametrize("reduce_dtype, reduced", [(None, "bf16"), ("fp32", "f32")])
def test_stage3_gathers_in_param_dtype_and_reduces_in_reduce_dtype(mesh, reduce_dtype, reduced,
                                                                  bf16_stages):
    """Checked on the program as lowered: the CPU backend then runs bf16 collectives in f32
    (its compiled HLO shows f32), while GPU and TPU backends keep the requested dtype. The
    default reduce_dtype's step is the one ``bf16_stages`` lowered at stage 3 (``BF16``)."""
    if reduce_dtype is None:
        lowered = bf16_stages[3]["lowered"]
    else:
        plan, init, tx, step = setup(mesh, 3, Precision(param_dtype="bf16",
                                                        reduce_dtype=reduce_dtype))
        lowered = step.lower(zj.abstract_state(plan, tx),
                             jax.ShapeDtypeStruct((32, TINY.seq_len + 1), jnp.int32))
    found = requested(lowered)
    gathers = {d for k, d, loop in found if k == "all-gather" and loop}
    scatters = {d for k, d, loop in found if k == "reduce-scatter" and loop}
    assert gathers == {"bf16"} and scatters == {reduced}


def train_losses(mesh, stage, precision, steps=50, accum_steps=1, batch=32, tx=None,
                 loss_fn=None, batches=None, cfg=TINY, comm=None, long=False, built=None):
    """``long``: the step compiled with LLVM's optimizations (``conftest.OPTIMIZED``);
    ``built``: ``setup``'s (plan, init, tx, step) for these arguments, made once for two runs."""
    from zero_jax.gpt import data
    plan, init, tx, step = built or setup(mesh, stage, precision, accum_steps, cfg, tx, loss_fn,
                                          comm)
    state = zj.init_state(plan, init, tx, KEY)
    tokens = data.stdlib_corpus(1 << 20)
    get = lambda i: batches[i] if batches else data.batch(tokens, i, batch, cfg.seq_len, seed=0)
    if long:
        step = step.lower(state, get(0)).compile(compiler_options=OPTIMIZED)
    out = []
    for i in range(steps):
        state, m = step(state, get(i))
        out.append({k: float(v) for k, v in m.items()})
    return state, out


@pytest.fixture(scope="module")
def bf16_runs(mesh):
    # Compiled as the suite compiles (LLVM level 0): for this small model the five compiles at
    # level 2 cost more than their 250 steps gain (4 stages: 15.6-16.3 s against 10.1-10.8).
    run = lambda stage, precision: [m["loss"] for m in train_losses(
        mesh, stage, precision, cfg=SMALL, batch=16)[1]]
    fp32 = run(0, Precision())
    bf16 = {s: run(s, BF16) for s in range(4)}
    return np.array(fp32), {s: np.array(v) for s, v in bf16.items()}


def test_bf16_tracks_fp32_and_stages_agree(bf16_runs):
    """50 AdamW steps: every bf16 stage stays within 0.05 nats of fp32 stage 0 at every step
    (the loss falls by over 1.5), and the stages agree with each other within 0.03."""
    fp32, bf16 = bf16_runs
    assert fp32[0] - fp32[-5:].mean() > 1.5
    for stage, losses in bf16.items():
        assert np.abs(losses - fp32).max() < 0.05, (stage, np.abs(losses - fp32).max())
        assert np.abs(losses - bf16[0]).max() < 0.03, (stage, np.abs(losses - bf16[0]).max())


def test_int8_trains_the_default_model_like_unquantized(mesh):
    """ZeRO++'s int8 weight all-gathers, and its int8 gradient reduction, each at stage 3 over
    50 AdamW steps of train.py's default run cut to one layer (seed 0, its data, batch 32; lr
    1e-3): within 0.05 nats of the unquantized stage 3 at every step, while the loss falls by
    over 2 nats. Measured 0.017 and 0.001 (seeds 42 and 7: 0.018 / 0.001 and 0.004 / 0.001;
    bf16 compute alone 0.003-0.004), in 0.43x the CPU time of four layers. Only what crosses
    the wire is rounded; the master copy and the optimizer stay exact.

    With the default four layers two runs part by chance as much as by rounding (0.024 / 0.026
    at seed 0, 0.061 / 0.051 and 0.095 / 0.093 at seeds 42 and 7, bf16 alone up to 0.090), so
    that bound held there by the luck of the seed; one layer keeps it at every seed tried.
    docs/guides/communication.md gives the figures; the gradients themselves are checked
    directly in test_comm.py."""
    cfg = dataclasses.replace(TINY, n_layers=1)
    losses = lambda comm: np.array([m["loss"] for m in train_losses(
        mesh, 3, Precision(), comm=comm, cfg=cfg, long=True)[1]])
    plain = losses(zj.Comm())  # buckets of 25 MiB
    assert plain[0] - plain[-5:].mean() > 2
    for comm in (zj.Comm(quantize_weights=True), zj.Comm(quantize_grads=True)):
        assert np.abs(losses(comm) - plain).max() < 0.05, comm


def poisoned(model, bad_step_token):
    """The model's loss, made infinite on the batch whose first token is ``bad_step_token``:
    an overflow injected into one step."""
    base = lm_loss(model)

    def loss_fn(params, tokens):
        # Times inf, not replaced by inf: the gradient must overflow too.
        return base(params, tokens) * jnp.where(jnp.any(tokens[:, 0] == bad_step_token),
                                                jnp.inf, 1.0)
    return loss_fn


def test_fp16_overflow_skips_that_step_and_halves_the_scale(mesh, stage=3):
    from zero_jax.gpt import data
    cfg = SMALL
    scaler = LossScaleConfig(initial_scale_power=12, window=1000, hysteresis=1)
    fp16 = Precision(param_dtype="fp16", loss_scale=scaler)
    tokens = data.stdlib_corpus(1 << 20) % 200  # ids 200+ never occur: free for the marker
    batches = [data.batch(tokens, i, 16, cfg.seq_len, seed=0) for i in range(8)]
    bad = batches[3].copy()
    bad[0, 0] = 249
    sgd = optax.sgd(0.3)
    loss_fn = poisoned(GPT(cfg), 249)
    built = setup(mesh, stage, fp16, 1, cfg, sgd, loss_fn)  # one step, traced once for both
    state, got = train_losses(mesh, stage, fp16, 9, built=built, cfg=cfg,
                              batches=batches[:3] + [bad] + batches[3:])
    ref_state, ref = train_losses(mesh, stage, fp16, 8, built=built, cfg=cfg, batches=batches)
    assert [m["skipped"] for m in got] == [0, 0, 0, 1, 0, 0, 0, 0, 0]
    scales = [m["loss_scale"] for m in got]
    assert scales[:5] == [2.0 ** 12] * 4 + [2.0 ** 11]  # halved after the overflow
    assert int(state.skipped) == 1 and int(state.step) == 9
    # The skipped step changed nothing: the run goes on as the one that never saw that batch,
    # up to fp16 rounding (its backward now runs at half the scale of the reference's).
    clean = [m["loss"] for i, m in enumerate(got) if i != 3]
    np.testing.assert_allclose(clean, [m["loss"] for m in ref], rtol=1e-3)
    assert tree_rel(state.master, ref_state.master) < 2e-4


@pytest.mark.parametrize("stage", [0, 2])
def test_a_non_finite_step_is_skipped_alike_by_select_and_cond(mesh, stage, monkeypatch):
    """The update skips a step whose gradient is not finite with a cond on the CPU and a
    select per leaf on GPUs (``step.selects_in_place``, for memory): run here both ways, AdamW
    with a poisoned fourth batch, the two give the same
    losses, parameters and optimizer state bit for bit, and the skipped step changed none of
    them."""
    from zero_jax import step as step_module
    from zero_jax.gpt import data
    tokens = data.stdlib_corpus(1 << 20) % 200  # ids 200+ never occur: free for the marker
    batches = [data.batch(tokens, i, 16, SMALL.seq_len, seed=0) for i in range(5)]
    batches[3][0, 0] = 249
    runs = {}
    for select in (False, True):
        monkeypatch.setattr(step_module, "selects_in_place", lambda plan, s=select: s)
        runs[select] = train_losses(mesh, stage, Precision(), 5, tx=optax.adamw(1e-2),
                                    loss_fn=poisoned(GPT(SMALL), 249), cfg=SMALL,
                                    batches=batches)
    assert [m["skipped"] for m in runs[True][1]] == [0, 0, 0, 1, 0]
    for key in runs[True][1][0]:  # NaN equals NaN here
        np.testing.assert_array_equal([m[key] for m in runs[True][1]],
                                      [m[key] for m in runs[False][1]])
    for a, b in zip(jax.tree.leaves(runs[True][0]), jax.tree.leaves(runs[False][0]), strict=True):
        np.testing.assert_array_equal(a, b)
    # Skipped: four steps' state, one step count and AdamW count behind the step.
    assert int(runs[True][0].step) == 5 and int(runs[True][0].skipped) == 1
    counts = [x for x in jax.tree.leaves(runs[True][0].opt_state) if x.dtype == jnp.int32]
    assert counts and all(int(c) == 4 for c in counts)


def test_loss_scale_follows_deepspeed_hysteresis_and_window():
    from zero_jax.precision import update_loss_scale
    c = LossScaleConfig(initial_scale_power=16, window=3, hysteresis=2, min_scale=1.0)
    s = Precision(param_dtype="fp16", loss_scale=c).init_loss_scale()
    trace = []
    for finite in [False, False, True, True, True, False, False, False]:
        s = update_loss_scale(s, jnp.asarray(finite), c)
        trace.append(float(s.scale))
    # 1st overflow uses up hysteresis, 2nd halves; 3 clean steps double and restore
    # hysteresis; then again one tolerated overflow, then halvings.
    assert trace == [2**16, 2**15, 2**15, 2**15, 2**16, 2**16, 2**15, 2**14]


@pytest.mark.parametrize("stage", [0, 2, 3])  # stage 1 accumulates exactly as stage 0 does
def test_accumulation_equals_one_big_batch(mesh, stage):
    """4 microbatches of 8 == one batch of 32, in fp32, with SGD (which, unlike Adam, shows a
    gradient of the wrong scale), and the gradient norms equal."""
    tx = optax.sgd(0.5)
    big, big_m = train_losses(mesh, stage, Precision(), 3, 1, tx=tx, cfg=SMALL)
    acc, acc_m = train_losses(mesh, stage, Precision(), 3, 4, tx=tx, cfg=SMALL)
    np.testing.assert_allclose([m["loss"] for m in acc_m], [m["loss"] for m in big_m],
                               rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in acc_m], [m["grad_norm"] for m in big_m],
                               rtol=1e-5)
    assert tree_rel(acc.params, big.params) < 1e-5


def test_stage2_accumulator_is_a_shard(mesh):
    """With 4 microbatches, the fp32 accumulator of stage 2 is 1/N of stage 1's."""
    temp = {}
    for stage in (1, 2):
        plan, init, tx, step = setup(mesh, stage, Precision(), accum_steps=4)
        state = zj.abstract_state(plan, tx)
        lowered = step.lower(state, jax.ShapeDtypeStruct(
            (32, TINY.seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, P("data"))))
        compiled = lowered.compile()
        temp[stage] = compiled.memory_analysis().temp_size_in_bytes
        # The report of a step of 4 microbatches (read off the step: a report of the theory of
        # one was the user's to avoid): stage 2 reduce-scatters each one's gradient, (k + 1)
        # Psi, and the compiled program moves that.
        r = report.build(plan, state, lowered, compiled)
        assert r["precision"]["accum_steps"] == 4
        with pytest.raises(ValueError, match="made with 4 microbatches"):
            report.build(plan, state, lowered, compiled, accum_steps=1)
        if stage == 2:
            assert r["comm_theory_formula"].startswith("5 Psi")
            assert r["comm_bytes_per_step"] == pytest.approx(r["comm_bytes_theory"], rel=0.02)
        assert report.model_states(plan, zj.abstract_state(plan, tx), 4)[0]["grads"] == \
            pytest.approx(4 * PSI / (N if stage == 2 else 1), rel=0.02)
    # Stage 1 holds a whole fp32 accumulator and a whole microbatch gradient; stage 2 a shard
    # of each: the saving is about twice (N-1)/N of the gradient bytes, at least once.
    expected = (N - 1) / N * 4 * PSI
    assert 0.9 * expected < temp[1] - temp[2] < 2.2 * expected, (temp, expected)


SEPARATOR = "=== next train.py run ==="


def train_py_runs(*argvs: list[str]) -> list[str]:
    """The stdout of each of train.py's runs ``argvs`` (its ``main``), one after another in one
    fresh process (their ``--devices``, alike: the test's own process has 8); each must exit 0."""
    root = pathlib.Path(__file__).resolve().parent.parent
    script = ("import json, sys\nfrom zero_jax.gpt.run import main\n"
              "for argv in json.loads(sys.argv[1]):\n"
              f"    print({SEPARATOR!r}, flush=True)\n"
              "    if code := main(argv):\n"
              "        sys.exit(code)\n")
    run = subprocess.run([sys.executable, "-c", script, json.dumps(argvs)], cwd=root,
                         env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    outs = run.stdout.split(SEPARATOR)[1:]
    assert len(outs) == len(argvs), run.stdout
    return outs


def test_dry_run_of_7_5b_on_64_devices_matches_the_paper(tmp_path):
    """The ZeRO paper's Figure 1: Psi = 7.5B, N = 64, K = 12: 120 / 31.4 / 16.6 / 1.9 GB."""
    out, plan = tmp_path / "r.json", tmp_path / "plan.json"
    # The planner's run below as well, in the same process of 64 devices: one start-up.
    run, _ = train_py_runs(
        ["--dry-run", "--config", "gpt-7.5b", "--devices", "64", "--stage", "3",
         "--set", "precision.param_dtype=bf16", "--report", str(out)],
        ["--dry-run", "--config", "gpt-7.5b", "--devices", "64",
         "--set", "precision.param_dtype=bf16", "--set", "model.remat=full",
         "--set", "zero.offload_optimizer.device=none", "--tensor-parallel", "1",
         "--device-memory", "160GB", "--host-memory", "512GB", "--report", str(plan)])
    r = json.loads(out.read_text())
    psi, scale = r["n_params"], r["n_params"] / 7.5e9
    assert 7.4e9 < psi < 7.6e9
    paper_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    plain = {row["stage"]: row["total"] for row in r["stages"] if not row["offload"]}
    for row in r["stages"]:
        n = 64 if row["stage"] else 1  # fp32 master and Adam moments: 12 Psi, cut from stage 1
        assert row["total"] == pytest.approx(row["zero_formula_total"], rel=0.001)
        assert row["host"] == pytest.approx(row["zero_formula_host"], rel=0.001)
        if not row["offload"]:
            assert row["total"] / 1e9 == pytest.approx(paper_gb[row["stage"]] * scale, rel=0.02)
            assert row["host"] == 0
        else:  # ZeRO-Offload: the 12 Psi (/N) of master and moments move to the host, and at
            # stages 2 and 3 the 16-bit gradient shards stream there too (2 Psi/N)
            moved = (12 + 2 * (row["stage"] >= 2)) * psi / n
            assert row["master"] == row["opt_state"] == 0
            assert row["host"] == pytest.approx(moved, rel=0.001)
            assert row["total"] == pytest.approx(plain[row["stage"]] - moved, rel=0.001)
    assert "model states per device at each stage" in run

    # The planner compiles each stage's step (remat and offload fixed here, so stages 0-3 only)
    # and reads the same model states off each candidate's shardings: the paper's figures.
    # Devices of 160 GB: on smaller ones a stage whose model state alone does not fit (stage 0's
    # 120 GB) is not compiled.
    rows = json.loads(plan.read_text())["candidates"]
    assert [c["stage"] for c in rows] == [0, 1, 2, 3]
    for c in rows:
        assert c["model_state_bytes"] / 1e9 == pytest.approx(paper_gb[c["stage"]] * scale,
                                                             rel=0.02)
        assert c["model_state_bytes"] == pytest.approx(plain[c["stage"]], rel=1e-9)


def test_zero_offload_puts_13b_on_one_device_in_2_psi(tmp_path):
    """ZeRO-Offload's headline: 13B parameters on one 32 GB device. Stage 2, bf16, the optimizer
    offloaded: the device keeps the 16-bit parameters (2 Psi, at most 27 GB); the host the
    streamed 16-bit gradients, the fp32 master and Adam's moments (2 + 4 + 8 = 14 Psi)."""
    from zero_jax.gpt.run import main  # what train.py runs

    out, err = tmp_path / "r.json", io.StringIO()
    # In this process, on the first of its 8 devices (--devices 1): a dry run needs no
    # start-up of its own (its compiler settings are this process's, SUBPROCESS_ENV's).
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["--dry-run", "--config", "gpt-13b", "--devices", "1", "--stage", "2",
                     "--set", "precision.param_dtype=bf16",
                     "--set", "zero.offload_optimizer.device=cpu", "--report", str(out)])
    assert code == 0, err.getvalue()
    r = json.loads(out.read_text())
    psi, device, host = r["n_params"], r["per_device_bytes"], r["per_device_host_bytes"]
    assert 12.5e9 < psi < 13.5e9
    assert device == {"params": 2 * psi, "grads": 0, "master": 0, "opt_state": 0}
    assert sum(device.values()) <= 27e9
    assert host["grads"] == 2 * psi and host["master"] == 4 * psi
    assert host["opt_state"] == pytest.approx(8 * psi, abs=64)  # and Adam's count
