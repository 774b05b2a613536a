"""train.py as a user runs it: a short training run, a dry run of a 1.3B model, bad input."""

import contextlib
import io
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import ONE_LAYER, SUBPROCESS_ENV, TRAIN_ENV, check_files, equations

from zero_jax import planner, plot
from zero_jax.gpt import layouts
from zero_jax.gpt.cli import in_flags
from zero_jax.gpt.model import GPTConfig

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train as train_py  # noqa: E402


def env(args) -> dict:
    """A dry run only compiles: LLVM at level 0 (the trillion planner's run: 13 -> 8 s)."""
    return SUBPROCESS_ENV if "--dry-run" in args else TRAIN_ENV


def train(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env(args),
                          capture_output=True, text=True, timeout=timeout)


def main(*args: str) -> subprocess.CompletedProcess:
    """``train.main`` in this process, its output caught as a process's: a dry run or a short
    run without a start-up of its own (about 2.4 s of the 7 a cached dry run takes; the
    process's compiler settings are a started dry run's, SUBPROCESS_ENV). train.py's own
    start-up is run by the tests that train for longer, and by the dry runs on more devices
    than this process has."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_py.main(list(args))
    return subprocess.CompletedProcess(["train.py", *args], code, out.getvalue(), err.getvalue())


def dry_run(tmp_path, *args, timeout: int = 300) -> tuple[subprocess.CompletedProcess, dict]:
    """``train.py --dry-run`` with ``args``, succeeded, and its planner's report."""
    report = tmp_path / "plan.json"
    argv = ["--dry-run", *args, "--report", str(report)]
    run = train(*argv, timeout=timeout) if "--devices" in args else main(*argv)
    assert run.returncode == 0, run.stderr
    return run, json.loads(report.read_text())


def test_trains_and_writes_metrics(tmp_path):
    """40 steps of the default model cut to one layer (its loss falls as far: 5.36 -> 2.91 over
    the last five steps, against 5.38 -> 2.85 with four, in half the CPU time)."""
    metrics, report = tmp_path / "m.jsonl", tmp_path / "r.json"
    run = train("--stage", "2", "--steps", "40", *ONE_LAYER,
                "--metrics", str(metrics), "--report", str(report))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert set(rows[0]) == {"step", "loss", "grad_norm", "lr", "skipped", "tokens_per_s"}
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first > 5.0 and last < first - 1.5  # bytes start near ln(256) = 5.5 and fall
    assert rows[0]["lr"] == 0.0 and rows[-1]["lr"] > 0  # warmup from zero
    r = json.loads(report.read_text())
    assert r["stage"] == 2 and r["mesh"] == {"data": 8}
    # Output to a file (no terminal): a plain line every tenth of the run, no redrawn bar, and
    # the last line's throughput is the summary's.
    lines = re.findall(r"^step (\d+)/40: loss [\d.]+, ([\d,]+) tokens/s$", run.stdout, re.M)
    assert [int(n) for n, _ in lines] == list(range(4, 41, 4)) and "\r" not in run.stderr
    summary = re.search(r"^done: steps 1-40 in [\d.]+ s, loss [\d.]+ -> [\d.]+ \(mean of last "
                        r"10\), ([\d,]+) tokens/s; nothing was saved \(no --checkpoint-dir\)$",
                        run.stdout, re.M)
    assert summary and summary.group(1) == lines[-1][1]


def peak_rss_mb(*args: str) -> tuple[subprocess.CompletedProcess, float, bool]:
    """Run train.py in a child that prints, as its last two lines, whether it imported
    ``flax.nnx`` and its own peak resident memory: VmHWM, its address space's high-water mark.
    Not ``ru_maxrss``, which Linux carries across exec: a child of a large process (a pytest
    worker) would report the parent's size."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['train.py', *{list(args)!r}]\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
            "finally:\n"
            "    print('flax.nnx' in sys.modules)\n"
            "    print(next(int(x.split()[1]) for x in open('/proc/self/status')\n"
            "               if x.startswith('VmHWM')) / 1024)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(args),
                         capture_output=True, text=True, timeout=300)
    nnx, rss = run.stdout.strip().splitlines()[-2:]
    return run, float(rss), nnx == "True"


def test_dry_run_of_1_3b_compiles_without_allocating(tmp_path):
    report = tmp_path / "r.json"
    run, rss_mb, nnx = peak_rss_mb("--dry-run", "--config", "gpt-1.3b", "--stage", "3",
                                   "--report", str(report))
    assert run.returncode == 0, run.stderr
    r = json.loads(report.read_text())
    psi = r["n_params"]
    assert 1.25e9 < psi < 1.35e9
    per_device = r["per_device_bytes"]
    assert per_device["params"] == pytest.approx(4 * psi / 8, rel=0.01)
    assert per_device["opt_state"] == pytest.approx(8 * psi / 8, rel=0.01)
    for key in ("argument_bytes", "output_bytes", "temp_bytes"):
        assert r["compiled"][key] > 0
    assert {"kind", "count", "bytes", "group_size", "in_loop"} <= set(r["collectives"][0])
    # The 8 devices' model states are 15.8 GB; the process (jax, XLA compiling five programs:
    # 0.5 GB alone, up to 1.55 GB seen within the suite) never held even one device's share.
    share_mb = (per_device["params"] + per_device["opt_state"]) / 2**20
    assert share_mb > 1800 and rss_mb < share_mb, (rss_mb, share_mb)
    # A linen model's step, prefetching its scanned stack, never loads Flax NNX (0.16 s).
    assert r["prefetch_bytes"] > 0 and not nnx


@pytest.mark.parametrize("args, message", [
    (["--stage", "4"], "ZeRO stage must be 0, 1, 2 or 3"),
    (["--stage", "x"], "invalid int value"),
    (["--devices", "0"], "--devices must be at least 1"),
    (["--devices", "3"], "global batch 32 is not divisible by 3"),
    (["--set", "model.n_layer=2"], "unknown config key model.n_layer"),
    (["--set", "optimizer.lr=fast"], "optimizer.lr must be a float"),
    (["--set", "train.batch_size=12"], "global batch 12 is not divisible by 8"),
    (["--data", "/no/such/file.txt"], "data file /no/such/file.txt does not exist"),
    (["--config", "nope"], "config nope not found"),
    (["--zero3-size", "3"], "zero.zero3_size 3 does not divide the 8 data-parallel devices"),
    (["--zero3-size", "4", "--stage", "2"], "hierarchical ZeRO (zero3_size 4) is built on"),
    (["--set", "zero.ignored_modules=[encoder]"],
     "zero.ignored_modules: the model has no module 'encoder'; its modules are blocks,"),
    (["--set", "zero.transformer_layers=[ln_f]"], "'ln_f' is not a layer stack of this model"),
    (["--set", "train.ckpt_load_path=/no/such/dir"],
     "train.ckpt_load_path: checkpoint directory /no/such/dir does not exist"),
    # The library's refusal, in its terms, with the config keys that set what it names
    (["--set", "zero.tile_mb=0.000001", "--set", "zero.prefetch=false"],
     "raise tile_mb, or leave its module out of layers= (train.py: zero.tile_mb, "
     "zero.transformer_layers)"),
])
def test_bad_input_gives_one_line_and_exit_2(args, message, capsys):
    """``train.main`` in this process (train.py's own start-up is run by the tests above)."""
    try:
        code = train_py.main([*args, "--steps", "1"])
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert "Traceback" not in err


def test_library_refusals_name_the_flags_that_set_what_they_name():
    assert in_flags("pass keep=None or at least 1") == \
        "pass keep=None or at least 1 (train.py: --keep)"
    # Named already (a demo message), or nothing of the library's: as it was
    said = "zero.prefetch: prefetch runs at stage 3"
    assert in_flags(said) == said and in_flags("no such file") == "no such file"


def test_bad_input_from_the_command_line():
    run = train("--stage", "4", "--steps", "1", timeout=120)
    assert run.returncode == 2 and run.stderr.strip() == \
        "error: ZeRO stage must be 0, 1, 2 or 3 (got 4)", run.stderr


def test_user_data_files(tmp_path, monkeypatch):
    """A text file and a file of token ids train (one layer of the default model: the files
    are what is tested), every batch cut from the file's tokens."""
    from zero_jax.gpt import data

    seen, cut = [], data.batch  # the tokens each batch was cut from, and the batch

    def batch(tokens, *args, **kwargs):
        seen.append((tokens, cut(tokens, *args, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(data, "batch", batch)
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    # ids past the bytes' 256 (test_hardening.py's table refuses them at vocabulary 256), in a
    # vocabulary of 1024, not 5000: the logits of a step a fifth the size
    ids = tmp_path / "tokens.bin"
    (np.arange(5000, dtype=np.uint16) % 1024).tofile(ids)
    for path, want, more in ((text, np.frombuffer(text.read_bytes(), np.uint8), ["--stage", "1"]),
                             (ids, np.arange(5000) % 1024, ["--set", "model.vocab_size=1024"])):
        seen.clear()
        run = main("--data", str(path), "--steps", "2", *more, *ONE_LAYER)  # 2 batches each
        assert run.returncode == 0, run.stderr
        assert len(seen) == 2
        for tokens, batch in seen:
            assert np.array_equal(tokens, want)
            for row in batch:  # a window of the file
                assert any(np.array_equal(row, want[s: s + len(row)])
                           for s in np.flatnonzero(want == row[0]))


def test_prompt_completion_records_train_on_the_completions(tmp_path):
    """A .jsonl of {"prompt", "completion"} records with train.completion_only: the first
    step's loss is the mean over the batch's completion tokens alone (a prompt's are read,
    not predicted), as optax computes it on one device from the same initialization; without
    the key the records train whole, as text would; the key on data without prompts is
    refused in one line."""
    import jax
    import optax

    from zero_jax.gpt import config, data
    from zero_jax.gpt.experiment import Experiment, mesh_for
    from zero_jax.gpt.model import build

    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Q: what is {i} + {i}? ",
                                          "completion": f"A: {2 * i}.\n"}) for i in range(300)))
    # One device's cross-entropy from the runs' initialization, jitted (op by op, each operation
    # is a program compiled of its own); the model is the same with the key or without.
    cfg = config.load("tiny", ["model.n_layers=1"])
    exp = Experiment.build(cfg, mesh_for(cfg, None))
    model = build(exp.model)
    cross_entropy = jax.jit(lambda ids: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": exp.init(jax.random.key(0))}, ids[:, :-1]), ids[:, 1:]))
    for only in ("true", "false"):
        sets = ["model.n_layers=1", f"train.completion_only={only}"]
        run = main("--data", str(path), "--steps", "1", "--metrics", str(tmp_path / only),
                   *[x for s in sets for x in ("--set", s)])
        assert run.returncode == 0, run.stderr
        first = json.loads((tmp_path / only).read_text())["loss"]
        tokens = data.load_tokens(str(path))
        tokens = tokens if only == "true" else data.unprompted(tokens)
        batch = data.batch(tokens, 0, cfg["train"]["batch_size"], exp.model.seq_len, 0)
        ids = np.where(batch < 0, -1 - batch, batch)
        ce = cross_entropy(ids)
        w = batch[:, 1:] >= 0
        assert 0.1 < w.mean() < 0.5 if only == "true" else w.all()  # completions: ~27%
        assert first == pytest.approx(float(np.sum(ce * w) / np.sum(w)), rel=1e-5)
    refused = main("--steps", "1", "--set", "train.completion_only=true")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "train.completion_only trains on the completions" in refused.stderr


# The planner sweeps' small model.
SMALL = {"n_layers": 2, "d_model": 32, "d_ff": 64, "seq_len": 16}
SMALL_SETS = [x for k, v in SMALL.items() for x in ("--set", f"model.{k}={v}")]


@pytest.fixture(scope="module")
def offload_sweep(tmp_path_factory):
    """Stage 3 and remat full fixed, so the three offload settings, with one collective per
    leaf and no prefetch (a layer more, in the offloaded layouts too): the budget sits between
    the layouts' temps so compiled. With the planner's figure."""
    d = tmp_path_factory.mktemp("sweep")
    run, r = dry_run(d, "--device-memory", "160KiB", "--host-memory", "1GB", "--stage", "3",
                     "--tensor-parallel", "1", "--set", "model.remat=full",
                     "--set", "train.batch_size=8", *SMALL_SETS, "--set", "zero.bucket_mb=0",
                     "--set", "zero.prefetch=false", "--set", "zero.gather=block",
                     "--plot", str(d / "fig"))
    return run, r, d / "fig"


def test_planner_names_the_layout_that_fits(offload_sweep):
    """--dry-run --device-memory/--host-memory compiles each layout not fixed on the command
    line and reports, from the compiled programs, what each keeps on the device and on the
    host; the one that fits and moves least wins."""
    run, r, _ = offload_sweep
    psi = GPTConfig(**SMALL).n_params
    n, per_host = 8, r["devices_per_host"]
    rows = {c["offload"]: c for c in r["candidates"]}
    assert set(rows) == {"none", "optimizer", "params"}
    # fp32 model states per device, ZeRO's formulas (plus a few scalars: step, counts):
    # 4 Psi/N parameters and 8 Psi/N Adam moments; offloaded, the moments and a 4 Psi/N master
    # move to the host, and with the parameters offloaded those too.
    expect = {"none": (12, 0), "optimizer": (4, 12), "params": (0, 16)}
    for name, (device, host) in expect.items():
        c = rows[name]
        assert c["device_state_bytes"] == pytest.approx(device * psi / n, abs=64)
        assert c["host_bytes_per_host"] == pytest.approx(host * psi / n * per_host, abs=64 * 8)
        assert c["device_bytes"] == c["device_state_bytes"] + c["temp_bytes"]
        assert c["temp_bytes"] > 0 and c["fits"] == (c["device_bytes"] <= 0.9 * 160 * 1024)
    assert not rows["none"]["fits"] and rows["optimizer"]["fits"] and rows["params"]["fits"]
    # The same collectives for all three; the least host traffic decides.
    assert len({c["comm_bytes"] for c in rows.values()}) == 1
    assert r["best"] == {"stage": 3, "offload": "optimizer", "remat": "full", "tp": 1}
    assert "--stage 3 --set model.remat=full --set zero.offload_optimizer.device=cpu" \
        in run.stdout
    # What fills each layout's peak, by kind (XLA's live set: the kinds add up to it), beside
    # ZeRO's figures (one block gathered; two with prefetch: the trillion test below); the
    # chosen layout's split printed under the table.
    for c in r["candidates"]:
        peak = c["peak"]
        assert peak["peak_bytes"] == sum(peak["by_kind"].values()) > c["temp_bytes"] / 2
        assert peak["expected"]["gathered weights"] == peak["expected"]["gradients"] > 0
    split = run.stdout.split("at the peak of stage 3, offload optimizer, remat full")[1]
    assert re.search(r"\n +gathered weights +[\d.]+ MiB +ZeRO: [\d.]+ MiB\n", split)
    # A line per layout as it is compiled, before the table: which, whether it fits, what is
    # left at the mean compile time so far (T fixed: every layout counted from the start).
    progress = [x for x in run.stdout.splitlines() if x.startswith("[")]
    assert run.stdout.index(progress[-1]) < run.stdout.index("layouts of ")
    assert len(progress) == len(r["candidates"]) == 3
    for k, (line, c) in enumerate(zip(progress, r["candidates"], strict=True), 1):
        verdict = "fits" if c["fits"] else "does not fit"
        assert re.fullmatch(rf"\[{k}/3\] {re.escape(planner.describe(c))}: {verdict} \(device "
                            rf"{c['device_bytes'] / 2**20:.2f} MiB, host "
                            rf"{c['host_bytes_per_host'] / 2**20:.2f} MiB per host\), ~\d+ s left",
                            line), line


def test_planner_figure_marks_each_layout_and_the_choice(offload_sweep):
    _, plan, fig_dir = offload_sweep
    side = check_files(fig_dir, "planner")
    assert [(p["device_bytes"], p["host_bytes_per_host"], p["fits"]) for p in side["points"]] \
        == [(c["device_bytes"], c["host_bytes_per_host"], c["fits"]) for c in plan["candidates"]]
    assert len(side["points"]) == 3 and side["best"] == plan["best"]
    fig, data = plot.planner(plan)
    assert data == side
    ax = fig.axes[0]
    offsets = np.concatenate([c.get_offsets() for c in ax.collections
                              if c.get_label().startswith("_stage")])
    np.testing.assert_allclose(offsets, [[c["device_bytes"] / side["device_unit_bytes"],
                                          c["host_bytes_per_host"] / side["host_unit_bytes"]]
                                         for c in plan["candidates"]], rtol=1e-12)
    star = next(c for c in ax.collections if c.get_label().startswith("chosen"))
    best = next(c for c in plan["candidates"]
                if all(c[k] == v for k, v in plan["best"].items()))
    assert star.get_offsets().tolist() == [[best["device_bytes"] / side["device_unit_bytes"],
                                            best["host_bytes_per_host"]
                                            / side["host_unit_bytes"]]]
    # Named: the two layouts that fit (the chosen one among them), not the one that does not.
    at = lambda c: (c["device_bytes"] / side["device_unit_bytes"],
                    c["host_bytes_per_host"] / side["host_unit_bytes"])
    assert sorted(t.xy for t in ax.texts) == sorted(at(c) for c in plan["candidates"]
                                                    if c["fits"])
    assert len(ax.texts) == 2 and [t.get_text() for t in ax.texts] == ["full", "full"]


def test_planner_offloads_beside_tensor_parallelism(tmp_path):
    """T = 2 with each offload (stage 3, remat full, the small model of the sweep above): ZeRO's
    per-device figures hold per tensor-parallel rank, 1/(D T) of each state with D T = 8, within
    the leaves tensor parallelism keeps whole on ``model`` (6%); the advice names the offload
    beside --tensor-parallel 2."""
    run, r = dry_run(tmp_path, "--device-memory", "150KiB", "--host-memory", "1GB", "--stage", "3",
                     "--tensor-parallel", "2", "--set", "model.remat=full",
                     "--set", "train.batch_size=8", *SMALL_SETS, "--set", "zero.bucket_mb=0",
                     "--set", "zero.prefetch=false", "--set", "zero.gather=block")
    psi, per_host = GPTConfig(**SMALL).n_params, r["devices_per_host"]
    rows = {c["offload"]: c for c in r["candidates"]}
    assert set(rows) == {"none", "optimizer", "params"} and {c["tp"] for c in rows.values()} \
        == {2}
    for name, (device, host) in {"none": (12, 0), "optimizer": (4, 12), "params": (0, 16)}.items():
        c = rows[name]
        assert device * psi / 8 <= c["device_state_bytes"] <= 1.06 * device * psi / 8 + 512
        assert host * psi <= c["host_bytes_per_host"] / per_host * 8 <= 1.06 * host * psi
    assert r["best"]["tp"] == 2 and r["best"]["offload"] in ("optimizer", "params")
    assert "zero.offload_optimizer.device=cpu" in run.stdout.split("fits and communicates")[1]
    assert "--tensor-parallel 2 --set zero.partition_activations=true" in run.stdout


def test_planner_names_tensor_parallelism_when_nothing_fits_without_it(tmp_path):
    """Remat full, no offload, prefetch on (set: else the planner compiles T = 1 again without
    prefetch, which fits), the stage left open: T = 1 needs about 7.72 MiB per device at stage
    3 on the default model, T = 2 7.38 (partitioned activations on), T = 4 7.70; with 8.4 MiB
    (7.56 usable) only T = 2 fits. Where stage 3 with T = 2 fits, stage 2 with T = 2 is
    tried (it keeps more, and communicates less) and does not fit, so stage 1 is not tried; the
    stages below 3 at T = 1 do not fit either (stage 0's model state alone, 12.7 MiB, does
    not: it is not compiled). Tensor parallelism is tried as nothing fits without it. The
    advice names T = 2."""
    run, r = dry_run(tmp_path, "--device-memory", "8.4MiB", "--host-memory", "1GB",
                     "--set", "model.remat=full", "--set", "zero.offload_optimizer.device=none",
                     "--set", "zero.gather=block", "--set", "zero.prefetch=true")
    rows = {(c["stage"], c["tp"], c.get("prefetch", True)): c for c in r["candidates"]}
    # T: the divisors cutting 4 heads; prefetch as set, never dropped
    assert set(rows) == {(1, 1, True), (2, 1, True), (3, 1, True), (3, 2, True),
                         (3, 4, True), (2, 2, True)}
    assert "layouts whose model state alone does not fit: 1\n" in run.stdout
    assert [key for key, c in rows.items() if c["fits"]] == [(3, 2, True)]
    assert rows[3, 2, True]["temp_bytes"] < rows[3, 1, True]["temp_bytes"]
    assert rows[2, 2, True]["comm_bytes"] < rows[3, 2, True]["comm_bytes"]
    assert rows[2, 2, True]["device_bytes"] > rows[3, 2, True]["device_bytes"]
    assert r["best"] == {"stage": 3, "offload": "as set", "remat": "full", "tp": 2}
    advice = run.stdout.split("fits and communicates least")[1]
    assert "--tensor-parallel 2 --set zero.partition_activations=true" in advice
    assert "zero.prefetch=false" not in advice


@pytest.mark.slow
def test_planner_compiles_only_what_can_change_the_answer(tmp_path):
    """Stage 3 and remat full fixed, offload and T left open, a device that fits all: the
    layout without offload fits, so its offloaded versions (the same collectives, more moved
    to and from the host: the sweep above) are not compiled, nor tensor parallelism, which was
    not asked for: 1 compile of the 9 (T = 1, 2, 4 with each offload) the full sweep made.
    Asked for T = 2 (the stage open), every stage of it fits and each communicates more than
    the layout chosen without it (Megatron's activations on top of ZeRO's). With the sweeps'
    collectives per leaf and no prefetch: stage 3's layouts without offload at T = 1 and 2
    are theirs, loaded from the persistent cache."""
    per_leaf = ["--set", "zero.bucket_mb=0", "--set", "zero.prefetch=false",
                "--set", "zero.gather=block"]
    sets = ["--host-memory", "1GB", "--stage", "3", "--set", "model.remat=full",
            "--set", "train.batch_size=8", *SMALL_SETS, *per_leaf]
    run, r = dry_run(tmp_path, "--device-memory", "1GB", *sets)
    assert [(c["stage"], c["offload"], c["tp"]) for c in r["candidates"]] == [(3, "none", 1)]
    assert r["best"] == {"stage": 3, "offload": "none", "remat": "full", "tp": 1}
    assert "not compiled, as they cannot change the answer: offloaded layouts whose layout " \
        "without offload fits: 2; tensor-parallel layouts (one fits without: --tensor-parallel " \
        "T plans them): 6\n" in run.stdout
    assert len(re.findall(r"^\[\d+/\d+\] ", run.stdout, re.M)) == 1
    _, t2 = dry_run(tmp_path, "--device-memory", "1GB", "--tensor-parallel", "2", *sets[:2],
                    "--set", "model.remat=full", "--set", "train.batch_size=8", *SMALL_SETS,
                    *per_leaf)
    assert sorted(c["stage"] for c in t2["candidates"]) == [0, 1, 2, 3]
    assert all(c["fits"] and c["tp"] == 2 and c["comm_bytes"] > r["candidates"][0]["comm_bytes"]
               for c in t2["candidates"])


def test_planner_takes_tensor_parallelism_at_the_stage_set(tmp_path):
    """--stage 2 --tensor-parallel 2: that layout is measured (with partitioned activations),
    not dropped as a stage without tensor parallelism."""
    run, r = dry_run(tmp_path, "--device-memory", "1GB", "--host-memory", "1GB", "--stage", "2",
                     "--tensor-parallel", "2", "--set", "model.remat=full",
                     "--set", "zero.offload_optimizer.device=none")
    assert r["best"] == {"stage": 2, "offload": "as set", "remat": "full", "tp": 2}
    assert "--stage 2 --set model.remat=full --tensor-parallel 2 --set " \
           "zero.partition_activations=true" in run.stdout


def test_planner_tiles_when_nothing_fits_untiled(tmp_path):
    """Stage 3, T = 1, no offload, remat full, gathering by block, the default model with
    d_ff 4096 and a batch of 8 (one sequence per device), so that one leaf, fc1's kernel
    (128 x 4096 in fp32: 2 MiB a layer), outweighs the activations: untiled it needs about
    24.9 MiB per device with prefetch, 17.7 without; with nothing fitting 19 MiB (17.1 usable),
    the planner compiles ZeRO-Infinity's tiling at a quarter and a sixteenth of that leaf, about
    15.2 and 14.7 MiB, and names the one that communicates least."""
    run, r = dry_run(tmp_path, "--device-memory", "19MiB", "--host-memory", "1GB", "--stage", "3",
                     "--tensor-parallel", "1", "--set", "model.remat=full",
                     "--set", "zero.offload_optimizer.device=none", "--set", "zero.gather=block",
                     "--set", "model.d_ff=4096", "--set", "train.batch_size=8")
    plain = [c for c in r["candidates"] if "tile_mb" not in c]
    tiled = {c["tile_mb"]: c for c in r["candidates"] if "tile_mb" in c}
    assert [c.get("prefetch", True) for c in plain] == [True, False]
    assert not any(c["fits"] for c in plain)
    assert sorted(tiled) == [2 / 16, 2 / 4]
    for c in tiled.values():  # less temp, more all-gathers (a tile gathered up to 3 times)
        assert c["fits"] and c["temp_bytes"] < min(p["temp_bytes"] for p in plain)
        assert c["comm_bytes"] > plain[0]["comm_bytes"]
    least = min(tiled, key=lambda t: tiled[t]["comm_bytes"])
    assert r["best"] == {"stage": 3, "offload": "none", "remat": "full", "tp": 1,
                         "tile_mb": least}
    assert f"tiled within {least:g} MiB: --stage 3 --set model.remat=full --set " \
        f"zero.tile_mb={least:g}" in run.stdout


def test_planner_gathers_by_module_when_blocks_do_not_fit(tmp_path):
    """The tiling test's model and device (its untiled layouts, loaded from the persistent
    cache), zero.gather left open: gathering by block needs about 25.0 MiB per device with
    prefetch, 17.7 without; with 19 MiB (17.1 usable) neither fits, so the planner compiles the
    layout again gathering by module (about 15.0 MiB: one module's weights whole, not a
    block's), which fits and is named; it moves more than by block (the matrices gathered
    again in their backward), and nothing is tiled."""
    run, r = dry_run(tmp_path, "--device-memory", "19MiB", "--host-memory", "1GB", "--stage", "3",
                     "--tensor-parallel", "1", "--set", "model.remat=full",
                     "--set", "zero.offload_optimizer.device=none", "--set", "model.d_ff=4096",
                     "--set", "train.batch_size=8")
    rows = {(c.get("prefetch", True), c.get("gather", "block")): c for c in r["candidates"]}
    assert set(rows) == {(True, "block"), (False, "block"), (True, "module")}
    block, module = rows[True, "block"], rows[True, "module"]
    assert module["fits"] and not any(rows[p, "block"]["fits"] for p in (True, False))
    assert module["temp_bytes"] < min(rows[p, "block"]["temp_bytes"] for p in (True, False))
    assert module["comm_bytes"] > block["comm_bytes"]
    assert r["best"] == {"stage": 3, "offload": "as set", "remat": "full", "tp": 1,
                         "gather": "module"}
    assert "by module: --stage 3 --set model.remat=full --set zero.gather=module" \
        in run.stdout


# The ZeRO paper's 1T example: GPT with d_model 25600, 128 layers, 160 heads, d_ff 102400,
# vocabulary 51200, batch 1024 x 2048 tokens, bf16, on 1024 devices of 80 GB, 8 per host.
TRILLION = {"d_model": 25600, "n_layers": 128, "n_heads": 160, "d_ff": 102400,
            "vocab_size": 51200, "seq_len": 2048}


@pytest.fixture(scope="module")
def trillion(tmp_path_factory):
    """The test below's two dry runs, T = 1 and T = 8, in one process of 1024 devices (a
    start-up less): each run's output and its planner's report, by T."""
    d = tmp_path_factory.mktemp("trillion")
    sets = [x for k, v in TRILLION.items() for x in ("--set", f"model.{k}={v}")]
    argv = {tp: ["--dry-run", "--devices", "1024", "--stage", "3", "--tensor-parallel", str(tp),
                 *sets, "--set", "train.batch_size=1024", "--set", "precision.param_dtype=bf16",
                 "--set", "model.remat=full", "--set", "zero.offload_optimizer.device=none",
                 "--set", f"zero.partition_activations={'true' if tp > 1 else 'false'}",
                 "--device-memory", "80GB", "--host-memory", "2TB", "--devices-per-host", "8",
                 "--report", str(d / f"{tp}.json")] for tp in (1, 8)}
    code = ("import contextlib, sys, train\n"
            f"for tp, argv in {argv!r}.items():\n"
            f"    with open({str(d)!r} + f'/{{tp}}.txt', 'w') as out, "
            "contextlib.redirect_stdout(out):\n"
            "        code = train.main(argv)\n"
            "    if code:\n"
            "        sys.exit(code)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(["--dry-run"]),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    return {tp: (subprocess.CompletedProcess(["train.py", *a], 0, (d / f"{tp}.txt").read_text(),
                                             run.stderr),
                 json.loads((d / f"{tp}.json").read_text())) for tp, a in argv.items()}


@pytest.mark.parametrize("tp", [1, 8])
def test_a_trillion_parameters_fit_80gb_tiled_or_tensor_parallel(tp, trillion):
    """Stage 3, no offload, remat full, compiled on abstract arrays for 1024 devices (seconds
    each): untiled at T = 1 nothing fits (a layer is 7.9 B parameters), gathered by block or by
    module, and the planner's tiling does; at T = 8 with partitioned activations the layout
    fits as it is. Beside each, ZeRO's accounting of the model states: (2 + 2 + 12) Psi / 1024
    per device, the paper's 1T row (16 TB over 1024 devices, 15.6 GB each), within the few
    leaves that stay whole."""
    run, r = trillion[tp]
    psi = GPTConfig(**TRILLION).n_params
    assert psi == 1_008_038_758_400
    for c in r["candidates"]:
        assert 16 * psi / 1024 <= c["model_state_bytes"] <= 1.015 * 16 * psi / 1024
        assert c["fits"] == (c["device_bytes"] <= 0.9 * 80e9)
    untiled = [c for c in r["candidates"] if "tile_mb" not in c]
    best = r["best"]
    # T = 1: without prefetch too, and gathering by module (one module's weights, not a layer's:
    # 88.7 GiB against 128.4 by block)
    assert len(untiled) == (3 if tp == 1 else 1) and best is not None
    if tp == 1:
        assert all(c["device_bytes"] > 80e9 for c in untiled) and best["tile_mb"] > 0
        module = next(c for c in untiled if c.get("gather") == "module")
        assert module["device_bytes"] < min(c["device_bytes"] for c in untiled if c != module)
        assert "--set zero.tile_mb=" in run.stdout
    else:
        assert untiled[0]["fits"] and best["tp"] == 8 and "tile_mb" not in best
    # ZeRO's gathered figure: two blocks with prefetch, one without (and tiled, which has none)
    for c in r["candidates"]:
        expected, prefetch = c["peak"]["expected"], "tile_mb" not in c and c.get("prefetch", 1)
        assert expected["gathered weights"] == (1 + bool(prefetch)) * expected["gradients"] > 0


def test_planner_puts_the_optimizer_on_nvme_when_the_host_is_too_small(tmp_path):
    """--nvme-memory: each layout whose whole optimizer is offloaded (its parameters too, or
    not) is planned again with its master and optimizer state on the disk (the same compiled
    gradient half); with a host too small for them, that layout fits and is named, with its
    flags; the planner's figure draws every row."""
    run, r = dry_run(tmp_path, "--device-memory", "160KiB", "--host-memory", "300KiB",
                     "--nvme-memory", "1GB", "--stage", "3", "--tensor-parallel", "1",
                     "--set", "model.remat=full", "--set", "train.batch_size=8", *SMALL_SETS,
                     "--set", "zero.bucket_mb=0", "--set", "zero.prefetch=false",
                     "--set", "zero.gather=block",
                     "--set", "zero.offload_optimizer.buffer_mb=0.00390625")  # 4 KiB, the least
    rows = {c["offload"]: c for c in r["candidates"] if not c.get("tile_mb")}
    assert set(rows) == {"none", "optimizer", "params", "nvme", "nvme+params"}
    per_host, psi = r["devices_per_host"], GPTConfig(**SMALL).n_params
    # master and Adam moments (12 Psi/N per device) go from the host to the disk, the host
    # keeps 4 buffers of 4 KiB (and the offloaded parameters); the devices and the traffic
    # stay as they were
    for host, nvme in ((rows["optimizer"], rows["nvme"]), (rows["params"], rows["nvme+params"])):
        assert nvme["nvme_bytes_per_host"] == pytest.approx(12 * psi / 8 * per_host, abs=64 * 8)
        assert nvme["host_bytes_per_host"] == pytest.approx(
            host["host_bytes_per_host"] - nvme["nvme_bytes_per_host"] + 4 * 4096,
            abs=per_host)
        for key in ("device_bytes", "comm_bytes", "host_traffic_bytes"):
            assert nvme[key] == host[key]
    assert rows["nvme+params"]["host_bytes_per_host"] > rows["nvme"]["host_bytes_per_host"]
    assert not rows["optimizer"]["fits"] and not rows["params"]["fits"] and rows["nvme"]["fits"]
    assert r["best"] == {"stage": 3, "offload": "nvme", "remat": "full", "tp": 1}
    assert "--set zero.offload_optimizer.device=nvme --set zero.offload_optimizer.nvme_path=" \
        "DIR --set optimizer.clip_norm=0" in run.stdout
    assert layouts.flags({**r["best"], "offload": "nvme+params"}).endswith(
        "optimizer.clip_norm=0 --set zero.offload_params=cpu")
    legend = plot.planner(r)[0].axes[0].get_legend()
    assert {"offload nvme", "offload nvme+params"} <= {t.get_text() for t in legend.get_texts()}


def test_planner_names_what_it_did_not_try_when_nothing_fits():
    """One layout fixed (stage 3, T = 1, no offload, remat full, tiled) and too small a device:
    the advice names the flags the command line kept from the search. The layout is the tiling
    test's smaller tile (14.7 MiB, loaded from the persistent cache), the device 12 MiB: its
    model state (6.5 MiB) fits, so it is compiled, not left out."""
    run = main("--dry-run", "--device-memory", "12MiB", "--host-memory", "1GB", "--stage", "3",
               "--tensor-parallel", "1", "--set", "model.remat=full",
               "--set", "zero.offload_optimizer.device=none", "--set", "zero.tile_mb=0.125",
               "--set", "zero.gather=block", "--set", "model.d_ff=4096",
               "--set", "train.batch_size=8")
    assert run.returncode == 0, run.stderr
    assert ("nothing fits: more devices, a smaller model or train.batch_size; not tried in this "
            "search: zero.offload_optimizer.device=cpu, zero.offload_params=cpu, "
            "--tensor-parallel T\n") in run.stdout, run.stdout[-800:]


def test_remat_auto_saves_nothing_where_the_attention_runs_as_einsums():
    """On a CUDA GPU in bf16, ``attention: auto`` is cuDNN's and ``remat: auto`` then ``dots``,
    unless the model's attention has soft caps or sinks (Gemma 2's, GPT-OSS's), which no fused
    kernel computes: XLA's einsums, and ``full`` (``dots`` saved what they compute: GPT-OSS 20B
    on 8 H100s at 4,096 tokens compiled to 137 GiB of temp, not 17.7); cuDNN asked for such a
    model is refused in one line."""
    import jax.numpy as jnp

    from zero_jax.gpt import config, experiment

    base = config.load("llama")["model"]
    plain = experiment.resolved_model(base, "gpu", jnp.bfloat16)
    assert (plain["attention"], plain["remat"]) == ("cudnn", "dots")
    for own in ({"gemma": 2, "attn_softcap": 50.0}, {"gpt_oss": True, "n_experts": 4}):
        model = experiment.resolved_model({**base, **own}, "gpu", jnp.bfloat16)
        assert (model["attention"], model["remat"]) == ("xla", "full")
        with pytest.raises(ValueError, match="model.attention=cudnn cannot run here: its flash "
                                             "attention has no soft caps or sinks"):
            experiment.resolved_model({**base, **own, "attention": "cudnn"}, "gpu",
                                      jnp.bfloat16)


def test_remat_auto_takes_full_where_dots_does_not_fit(tmp_path, monkeypatch):
    """``model.remat: auto`` saves the matmuls' outputs (``dots``) where cuDNN attends, "where
    memory allows": on a device that holds the step with ``full`` but not with ``dots`` (as
    auto resolves on a GPU, made so here), the run says so in one line, compiles again with
    ``full`` and trains exactly as a run that set ``model.remat=full`` (the default model cut
    to 2 layers, at stage 3 on the CPU mesh: 8.4 MB a device with ``dots``, 6.5 with ``full``;
    one layer is too few, its ``dots`` fitting where ``full`` does)."""
    from zero_jax import fit
    from zero_jax.gpt import experiment

    run = ["--steps", "2", "--stage", "3", "--set", "model.n_layers=2"]  # 2: the state carries
    full = main(*run, "--set", "model.remat=full", "--metrics", str(tmp_path / "full.jsonl"),
                "--report", str(tmp_path / "full.json"))
    assert full.returncode == 0, full.stderr
    c = json.loads((tmp_path / "full.json").read_text())["compiled"]
    capacity = c["argument_bytes"] + c["output_bytes"] - c["alias_bytes"] + c["temp_bytes"]
    resolved = experiment.resolved_model
    monkeypatch.setattr(experiment, "resolved_model", lambda model, *a: {
        **resolved(model, *a), **({"remat": "dots"} if model["remat"] == "auto" else {})})
    sizes = []

    def check(compiled, devices):  # a device that holds the full step and no more
        sizes.append(fit.step_bytes(compiled))
        return None if sizes[-1] <= capacity else f"the step needs {sizes[-1]} bytes"
    monkeypatch.setattr(fit, "check", check)
    auto = main(*run, "--metrics", str(tmp_path / "auto.jsonl"))
    assert auto.returncode == 0, auto.stderr
    assert sizes[0] > capacity == sizes[1], sizes  # dots, then full
    assert f"model.remat auto: with dots the step needs {sizes[0]} bytes; trying full\n" \
        in auto.stdout
    losses = [[json.loads(line)["loss"] for line in (tmp_path / f"{n}.jsonl").read_text()
               .splitlines()] for n in ("full", "auto")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


def test_the_layer_loop_unrolled_trains_as_the_loop(tmp_path, monkeypatch):
    """``model.scan_unroll``: the default model cut to 2 layers, both in one iteration of
    prefetch's layer loops at stage 3 (the step's loops carry the unroll), trains as one layer
    an iteration does. (Two layers: the unrolled program traces and compiles two copies of a
    layer, not four; any unroll above 1 is the claim.)"""
    import jax

    from zero_jax.gpt.experiment import Experiment
    from zero_jax.state import abstract_state

    built, build = [], Experiment.build  # each run's experiment, to read its step's jaxpr
    monkeypatch.setattr(Experiment, "build",
                        classmethod(lambda cls, *a: built.append(build(*a)) or built[-1]))
    for k in (1, 2):
        run = main("--steps", "2", "--stage", "3", "--set", f"model.scan_unroll={k}",
                   "--set", "model.n_layers=2", "--metrics", str(tmp_path / f"{k}.jsonl"))
        assert run.returncode == 0, run.stderr
        exp = built[-1]  # its trace, from jit's cache: the program the run compiled
        jaxpr = jax.make_jaxpr(exp.step.fn)(abstract_state(exp.plan, exp.tx), exp.batch_shape)
        unrolls = [e.params["unroll"] for e, _ in equations(jaxpr.jaxpr)
                   if e.primitive.name == "scan"]  # the layer loops, and the loss's chunks
        assert [u for u in unrolls if u != 1] == ([] if k == 1 else [2, 2]), unrolls
    losses = [[json.loads(line)["loss"] for line in (tmp_path / f"{k}.jsonl").read_text()
               .splitlines()] for k in (1, 2)]
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses
