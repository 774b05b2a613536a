"""Plots, TensorBoard scalars, profiler traces and DeepSpeed configs, read back and compared
with the report and the metrics file they came from.

Two train.py runs: one trains 4 steps from a DeepSpeed config in Hugging Face Trainer's form
("auto" values, WarmupDecayLR) and writes everything at once (metrics, report, figures,
TensorBoard, a profile of steps 2-3); one trains the same 4 steps from the equivalent --set
flags. The planner's figure is read in test_cli.py, from its sweep.
"""

import collections
import gzip
import json
import math
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ONE_LAYER, SUBPROCESS_ENV, check_files

from zero_jax import plot
from zero_jax.hlo import KINDS

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

MiB = 2**20
STEPS = 4

# As DeepSpeed's docs write them.
DS_STAGE2_BF16 = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                 "warmup_num_steps": 3}},
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
}
SETS_STAGE2_BF16 = [
    "zero.stage=2", "zero.prefetch=true", "zero.bucket_mb=382",  # 2e8 x 2 bytes in MiB, up
    "precision.param_dtype=bf16", "train.accum_steps=1", "train.batch_size=8",
    "optimizer.name=adamw", "optimizer.lr=3e-3", "optimizer.b1=0.9", "optimizer.b2=0.95",
    "optimizer.eps=1e-8", "optimizer.weight_decay=0.1", "optimizer.schedule=constant",
    "optimizer.warmup_steps=3", "optimizer.warmup_type=log", "optimizer.warmup_min_lr=0.0",
    "optimizer.clip_norm=1.0"]
# Hugging Face Trainer's form of it: "auto" for what the run's own config says (here zero_jax's
# defaults: a batch of 32, 1 microbatch, AdamW at 3e-3 with betas 0.9/0.95, eps 1e-8, weight
# decay 0.1, clipping at 1.0), and WarmupDecayLR over the run's steps.
DS_STAGE2_HF = {
    **DS_STAGE2_BF16,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 2,
        "total_num_steps": "auto"}},
}
SETS_STAGE2_HF = [
    "zero.stage=2", "zero.prefetch=true", "zero.bucket_mb=382", "precision.param_dtype=bf16",
    "train.accum_steps=1", "train.batch_size=32", "optimizer.name=adamw", "optimizer.lr=3e-3",
    "optimizer.b1=0.9", "optimizer.b2=0.95", "optimizer.eps=1e-8", "optimizer.weight_decay=0.1",
    "optimizer.schedule=linear", "optimizer.warmup_steps=2", "optimizer.warmup_type=log",
    "optimizer.decay_steps=0", "optimizer.warmup_min_lr=0.0", "optimizer.clip_norm=1.0"]
DS_STAGE3_OFFLOAD = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.5},
        "offload_param": {"device": "none"},
        "overlap_comm": False,
        "reduce_bucket_size": 5e7,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "sub_group_size": 1e9},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                             "weight_decay": 0.01}},
    "fp16": {"enabled": False},
}
SETS_STAGE3_OFFLOAD = [
    "zero.stage=3", "zero.prefetch=false", "zero.bucket_mb=191",  # 5e7 x 4 bytes in MiB, up
    "zero.min_shard_elems=10000", "zero.offload_optimizer.device=cpu",
    "zero.offload_params=none", "zero.offload_optimizer.ratio=0.5",
    "precision.param_dtype=fp32", "train.accum_steps=2", "train.batch_size=64",  # 4 x 2 x 8
    "optimizer.name=adamw", "optimizer.lr=1e-3", "optimizer.b1=0.9", "optimizer.b2=0.999",
    "optimizer.eps=1e-8", "optimizer.weight_decay=0.01", "optimizer.schedule=constant",
    "optimizer.warmup_steps=0", "optimizer.clip_norm=0.5"]
DS_HPZ_QUANTIZED = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
             "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4,
                          "zero_quantized_weights": True, "zero_quantized_gradients": True,
                          "reduce_bucket_size": 1e7},
}
SETS_HPZ_QUANTIZED = [
    "zero.stage=3", "zero.zero3_size=4", "zero.quantize_weights=int8",
    "zero.quantize_grads=int8", "zero.bucket_mb=20",  # 1e7 x 2 bytes in MiB, up
    "precision.param_dtype=fp16", "precision.initial_scale_power=12",
    "precision.loss_scale_window=500", "precision.hysteresis=2", "precision.min_loss_scale=1",
    "train.accum_steps=1", "train.batch_size=32", "optimizer.clip_norm=1.0"]


def run_train(*args, cache: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    # 4 steps are compile-bound: LLVM at level 0, as the suite compiles (the file: 13.6-14.0 s
    # of CPU against 18.4-19.0 at train.py runs' level 1)
    env = {**SUBPROCESS_ENV, **({"JAX_COMPILATION_CACHE_DIR": str(cache)} if cache else {})}
    run = subprocess.run([sys.executable, "train.py", *map(str, args)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The DeepSpeed-config run writing everything, and the --set run writing metrics."""
    d = tmp_path_factory.mktemp("observe")
    ds = d / "ds.json"
    ds.write_text(json.dumps(DS_STAGE2_HF, indent=2))
    # Each run compiles its own program. Loaded from JAX's persistent cache, this stage 2 bf16
    # step with optimizer.schedule=constant deadlocks on the CPU mesh (jax 0.10.2: 4 runs of 4,
    # linear or log warmup; XLA's rendezvous sees devices at an all-reduce and others at a
    # reduce-scatter as the same op and aborts after 40 s); compiled afresh it runs, and the
    # cosine schedule's step runs from the cache too. Not understood yet: docs/limits.md.
    out = run_train("--steps", STEPS, *ONE_LAYER, "--deepspeed-config", ds,
                    "--metrics", d / "m.jsonl", "--report", d / "r.json", "--plot", d / "fig",
                    "--tensorboard", d / "tb", "--profile", d / "prof", "--profile-steps", "2:4",
                    cache=d / "cache-ds")
    sets = [x for s in SETS_STAGE2_HF for x in ("--set", s)]
    run_train("--steps", STEPS, *ONE_LAYER, *sets, "--metrics", d / "m_set.jsonl",
              cache=d / "cache-set")
    return d, out.stdout


def records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def bar_heights(fig) -> dict[str, list[float]]:
    """Each bar series of the figure's axes by its legend label, read off its rectangles."""
    ax = fig.axes[0]
    return {c.get_label(): [p.get_height() for p in c] for c in ax.containers}


@pytest.fixture(scope="module")
def stage0(runs):
    """The runs' config at stage 0 (``--stage 0`` after the DeepSpeed config), compiled here:
    the reference for what --plot compiled for that stage."""
    from zero_jax.state import abstract_state

    d, _ = runs
    args = train.parse_args(["--deepspeed-config", str(d / "ds.json"), *ONE_LAYER,
                             "--steps", str(STEPS), "--stage", "0"])
    exp = train.build(train.load_config(args), args)
    return exp.step.lower(abstract_state(exp.plan, exp.tx), exp.batch_shape).compile()


def test_memory_by_stage_compares_every_stage_compiled(runs, stage0):
    """--plot compiles every stage's step with the run's settings: each bar is what a device
    needs at that stage, its state in device memory (from the shardings) and its compiled temp
    (where the gradients live), the same parts for every stage."""
    d, _ = runs
    r = json.loads((d / "r.json").read_text())
    side = check_files(d / "fig", "memory_by_stage")
    assert side["counts"] == "compiled" and side["parts"] == list(plot.COMPILED_PARTS)
    bars = side["bars"]
    assert [b["stage"] for b in bars] == [0, 1, 2, 3] and all(b["temp"] > 0 for b in bars)
    # The run's own stage: its report's bytes; every stage's state: the stages table's row
    # (no offload in this run), from the shardings alone.
    mine = bars[r["stage"]]
    assert mine["temp"] == r["compiled"]["temp_bytes"]
    state = ("params", "master", "opt_state")
    assert {k: mine[k] for k in state} == {k: r["per_device_bytes"][k] for k in state}
    table = {row["stage"]: row for row in r["stages"] if not row["offload"]}
    for b in bars:
        assert {k: b[k] for k in state} == {k: table[b["stage"]][k] for k in state}
        assert b["host"] == 0
    # Stage 0's temp: the step compiled here from --stage 0.
    assert bars[0]["temp"] == stage0.memory_analysis().temp_size_in_bytes
    fig, data = plot.memory_by_stage(r)
    assert data == side and data["unit"] == "MiB"
    heights = bar_heights(fig)
    assert set(heights) == {plot.PART_LABELS[k] for k in plot.COMPILED_PARTS}  # no host bars
    for key in plot.COMPILED_PARTS:
        assert heights[plot.PART_LABELS[key]] == pytest.approx([b[key] / MiB for b in bars],
                                                               rel=1e-12)
    totals = [float(t.get_text()) for t in fig.axes[0].texts]
    assert totals == [round(sum(b[k] for k in plot.COMPILED_PARTS) / MiB, 1) for b in bars]
    legend = fig.axes[0].get_legend()
    assert legend.get_bbox_to_anchor().x0 >= fig.axes[0].get_window_extent().x1  # outside


def test_memory_by_stage_without_the_compiled_stages_counts_no_temp(runs):
    """A report that holds only its own stage's compiled step (written without --plot): every
    stage's model states as ZeRO counts them, temp for none, the compiled stage's named."""
    d, _ = runs
    r = json.loads((d / "r.json").read_text())
    del r["compiled_stages"]
    fig, data = plot.memory_by_stage(r)
    assert data["counts"] == "model states" and len(data["bars"]) == 8
    assert all("temp" not in b for b in data["bars"])
    assert f"only stage 2 was compiled ({r['compiled']['temp_bytes'] / MiB:.2f} MiB)" in \
        fig.axes[0].get_title()


def test_communication_puts_the_stages_side_by_side(runs, stage0):
    """Each stage's compiled collectives by kind beside ZeRO's theory for that stage: 2 Psi at
    stages 0-1 (gradients reduce-scattered and gathered in the reduce dtype), Psi in the reduce
    dtype and Psi in the compute dtype at 2, and one more gather of the parameters at 3."""
    from zero_jax.hlo import collectives

    d, _ = runs
    r = json.loads((d / "r.json").read_text())
    side = check_files(d / "fig", "communication")
    groups = {g["stage"]: g for g in side["groups"]}
    assert sorted(groups) == [0, 1, 2, 3] and {g["axes"] for g in groups.values()} == {"data"}
    mine = groups[r["stage"]]["measured_bytes"]
    assert mine == {k: sum(g["volume"] for g in r["collectives"] if g["kind"] == k)
                    for k in {g["kind"] for g in r["collectives"]}}
    want: dict = {}
    for x in collectives(stage0.as_text(), 8):
        want[x.kind] = want.get(x.kind, 0) + x.volume
    assert groups[0]["measured_bytes"] == want
    psi, p = r["n_params"], r["precision"]
    c, red = (jnp.dtype(p[k]).itemsize for k in ("param_dtype", "reduce_dtype"))
    assert {s: g["theory_bytes"] for s, g in groups.items()} == \
        {0: 2 * psi * red, 1: 2 * psi * red, 2: psi * (red + c), 3: psi * (red + 2 * c)}
    assert [groups[s]["theory_formula"] for s in range(4)] == ["2 Psi", "2 Psi", "2 Psi",
                                                               "3 Psi"]
    fig, data = plot.communication(r)
    assert data == side
    heights = bar_heights(fig)
    for kind in data["kinds"]:
        label = f"{'_' * (kind in data['too_small_to_see'])}compiled: {kind}"
        assert heights[label] == pytest.approx(
            [groups[s]["measured_bytes"].get(kind, 0) / MiB for s in range(4)], rel=1e-12)
    assert heights["ZeRO's theory (formula above)"] == \
        pytest.approx([groups[s]["theory_bytes"] / MiB for s in range(4)], rel=1e-12)
    # The legend: outside the bars, and only series that can be seen.
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1
    top = ax.get_ylim()[1]
    for text in legend.get_texts():
        if text.get_text().startswith("compiled: "):
            assert max(heights[text.get_text()]) > top / 100, text.get_text()


def test_training_curves_are_the_metrics_file(runs):
    d, _ = runs
    rows = records(d / "m.jsonl")
    side = check_files(d / "fig", "training")
    assert side["step"] == list(range(1, STEPS + 1))
    fig, data = plot.curves(rows)
    assert data == side
    lines = {ax.get_title(): ax.lines[0] for ax in fig.axes if ax.lines}
    for key, title, _ in plot.CURVES[:4]:
        assert list(lines[title].get_ydata()) == [row[key] for row in rows] == side[key]
        assert list(lines[title].get_xdata()) == side["step"]


def test_plot_command_draws_the_same_from_the_files(runs, tmp_path, capsys):
    d, _ = runs
    assert plot.main([str(d / "r.json"), str(d / "m.jsonl"), "--out", str(tmp_path)]) == 0
    for name in ("memory_by_stage", "communication", "training"):
        assert (tmp_path / f"{name}.json").read_text() == (d / "fig" / f"{name}.json").read_text()
    capsys.readouterr()
    assert plot.main([str(d / "m.jsonl"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {d / 'm.jsonl'} is not JSON"), err
    assert not (tmp_path / "x").exists()


def test_tensorboard_holds_each_steps_metrics(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d, _ = runs
    acc = EventAccumulator(str(d / "tb"))
    acc.Reload()
    rows = records(d / "m.jsonl")
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "skipped"):
        events = acc.Scalars(f"train/{key}")
        assert [e.step for e in events] == list(range(1, STEPS + 1))
        # TensorBoard keeps float32.
        assert [e.value for e in events] == [float(np.float32(r[key])) for r in rows]
    text = acc.Tensors("report/text_summary")
    assert len(text) == 1
    r = json.loads((d / "r.json").read_text())
    assert f"| parameters | {r['n_params']:,} |" in text[0].tensor_proto.string_val[0].decode()


def test_profile_traces_the_steps_collectives(runs):
    """The CPU trace names each executed HLO instruction (thunk) after the compiled step's
    instruction, once per device: every collective of the step is there, in each of the two
    steps traced, as often as the report counts it (loop trips included) on 8 devices."""
    d, _ = runs
    prof = d / "prof"
    traces = list(prof.glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert len(traces) == 1 and list(prof.glob("plugins/profile/*/*.xplane.pb"))
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    hlo = (prof / "train_step.hlo.txt").read_text()
    kind_of = {m.group(1): m.group(2) for m in re.finditer(
        r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", hlo, re.M) if m.group(2) in KINDS}
    seen = [e for e in events if e.get("name") in kind_of]
    assert {e["args"]["hlo_module"] for e in seen} == {"jit_step"}
    assert len({e["args"]["run_id"] for e in seen}) == 2  # steps 2 and 3
    assert {e["name"] for e in seen} == set(kind_of)
    assert {e["args"]["device_ordinal"] for e in seen} == {str(i) for i in range(8)}
    r = json.loads((d / "r.json").read_text())
    expected = collections.Counter()
    for g in r["collectives"]:
        expected[g["kind"]] += g["count"] * 2 * 8
    found = collections.Counter(kind_of[e["name"]] for e in seen)
    assert set(found) == set(expected) >= {"all-gather", "reduce-scatter"}
    for kind, n in expected.items():
        # The CPU profiler drops events on a loaded machine: one in a few hundred was seen, and
        # 4 of 256 all-gathers with the whole suite running on 2 cores (2026-11-25). None added.
        assert n - math.ceil(0.03 * n) <= found[kind] <= n, (kind, found[kind], n)


def test_deepspeed_run_trains_as_the_set_flags(runs):
    d, stdout = runs
    ds, sets = records(d / "m.jsonl"), records(d / "m_set.jsonl")
    assert [r["loss"] for r in ds] == [r["loss"] for r in sets]
    assert [r["grad_norm"] for r in ds] == [r["grad_norm"] for r in sets]
    # WarmupDecayLR, log warmup over 2 steps: min + (max - min) log(t + 1) / log(2), then down
    # to min at the run's 4 steps: min + (max - min) (4 - t) / (4 - 2).
    want = [0.0, 3e-3, 3e-3, 1.5e-3]
    assert [r["lr"] for r in ds] == pytest.approx(want, rel=1e-6)
    assert "zero_optimization.stage" in stdout and "-> zero.stage=2" in stdout
    assert "-> auto: train.batch_size=32  (the run's config; 4 per device" in stdout
    assert "ignored, no effect on what is computed: " in stdout
    assert "zero_optimization.contiguous_gradients" in stdout and "steps_per_print" in stdout


@pytest.mark.parametrize("ds, sets", [(DS_STAGE2_BF16, SETS_STAGE2_BF16),
                                      (DS_STAGE2_HF, SETS_STAGE2_HF),
                                      (DS_STAGE3_OFFLOAD, SETS_STAGE3_OFFLOAD),
                                      (DS_HPZ_QUANTIZED, SETS_HPZ_QUANTIZED)],
                         ids=["stage-2-bf16", "stage-2-hf-auto", "stage-3-offload", "hpz-int8"])
def test_deepspeed_config_is_the_set_flags(ds, sets, tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    from_ds = train.load_config(train.parse_args(["--deepspeed-config", str(path)]))
    mapping = capsys.readouterr().out
    from_sets = train.load_config(train.parse_args([x for s in sets for x in ("--set", s)]))
    assert from_ds == from_sets
    assert len([line for line in mapping.splitlines() if "->" in line]) >= len(sets) - 1
    # --set after it overrides it.
    over = train.load_config(train.parse_args(["--deepspeed-config", str(path), "--set",
                                               "optimizer.clip_norm=0.25"]))
    assert over == {**from_sets, "optimizer": {**from_sets["optimizer"], "clip_norm": 0.25}}


def test_curves_draw_the_fp16_loss_scale_and_gaps(runs):
    """fp16 records add the loss scale (log2 axis); a non-finite value (null in the file, as
    train.py writes it) is a gap, not a zero."""
    d, _ = runs
    rows = records(d / "m.jsonl")
    scales = [2.0**16, 2.0**15, 2.0**15, 2.0**15]
    fp16 = [{**r, "loss_scale": s} for r, s in zip(rows, scales, strict=True)]
    fp16[1] = {**fp16[1], "loss": None, "grad_norm": None, "nonfinite": ["loss", "grad_norm"]}
    fig, data = plot.curves(fp16)
    lines = {ax.get_title(): ax for ax in fig.axes if ax.lines}
    scale = lines["fp16 loss scale (log2 axis)"]
    assert scale.get_yscale() == "log" and list(scale.lines[0].get_ydata()) == scales
    loss = list(lines["loss (nats per token)"].lines[0].get_ydata())
    assert math.isnan(loss[1]) and [loss[i] for i in (0, 2, 3)] == \
        [rows[i]["loss"] for i in (0, 2, 3)]
    assert data["loss"][1] is None and data["loss_scale"] == scales


def test_plot_reads_the_capacity_from_a_device_that_reports_it(runs, tmp_path, monkeypatch,
                                                                capsys):
    """``--plot`` asks the first device for its memory (``memory_stats``, which a GPU or TPU
    answers and the CPU mesh does not) and draws its ``bytes_limit`` as the capacity line;
    a device that answers nothing gets no line."""
    import argparse

    from zero_jax.gpt import reports

    d, _ = runs
    r = json.loads((d / "r.json").read_text())

    class Device:  # what a GPU says of itself (jax.Device.memory_stats)
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    for stats, limit in (({"bytes_limit": 16 * MiB, "bytes_in_use": MiB}, 16 * MiB),
                         (None, None)):
        monkeypatch.setattr(reports.jax, "devices", lambda stats=stats: [Device(stats)])
        out = tmp_path / str(limit)
        reports.draw(argparse.Namespace(plot=str(out), metrics=None), r)
        data = json.loads((out / "memory_by_stage.json").read_text())
        assert data["capacity_bytes"] == limit and data["capacity_drawn"] == bool(limit)
    assert "figures: memory_by_stage.png, communication.png" in capsys.readouterr().out


def test_memory_figure_draws_the_capacity(runs):
    """The device's capacity as a line among the bars; one that would flatten them (a GPU's
    beside a small model) named in the title instead."""
    d, _ = runs
    r = json.loads((d / "r.json").read_text())
    fig, data = plot.memory_by_stage(r, capacity=16 * MiB)
    line = next(ln for ln in fig.axes[0].lines if ln.get_label().startswith("device capacity"))
    assert list(line.get_ydata()) == [16, 16] and data["capacity_bytes"] == 16 * MiB
    assert data["capacity_drawn"] and line.get_label() == "device capacity (16.0 MiB)"
    fig, data = plot.memory_by_stage(r, capacity=80 * 2**30)
    assert not fig.axes[0].lines and not data["capacity_drawn"]
    assert data["capacity_bytes"] == 80 * 2**30 and data["unit"] == "MiB"
    assert "device capacity 80.0 GiB: off the scale" in fig.axes[0].get_title()


def test_planner_figure_stars_a_tiled_choice():
    """The planner's tiled layouts (added when nothing fits untiled) share stage, offload, remat
    and T with an untiled one: the star and the labels tell them apart by ``tile_mb``."""
    row = {"stage": 3, "offload": "none", "remat": "full", "tp": 1, "host_bytes_per_host": 0,
           "device_state_bytes": 1 << 20}
    cands = [{**row, "device_bytes": 9 << 20, "fits": False},
             {**row, "tile_mb": 0.25, "device_bytes": 7 << 20, "fits": True}]
    best = {"stage": 3, "offload": "none", "remat": "full", "tp": 1, "tile_mb": 0.25}
    plan = {"candidates": cands, "best": best, "device_memory": 8 << 20,
            "host_memory": 1 << 30, "devices": 8, "devices_per_host": 8}
    fig, _ = plot.planner(plan)
    ax = fig.axes[0]
    star = next(c for c in ax.collections if c.get_label().startswith("chosen"))
    assert star.get_offsets().tolist() == [[7.0, 0.0]]
    assert star.get_label() == "chosen: stage 3, offload none, remat full, tiled within 0.25 MiB"
    assert [t.get_text() for t in ax.texts] == ["full tiled within 0.25 MiB"]  # what fits


def test_planner_figure_names_only_what_fits():
    """A hundred layouts, four that fit: only those are named (a label per spot), and the
    chosen star is drawn over everything else."""
    row = {"offload": "none", "tp": 1, "host_bytes_per_host": 0}
    cands = [{**row, "stage": i % 4, "remat": ("none", "dots", "full")[i % 3],
              "device_bytes": (4 + i) << 20, "fits": i < 4} for i in range(100)]
    best = {k: cands[2][k] for k in ("stage", "offload", "remat", "tp")}
    plan = {"candidates": cands, "best": best, "device_memory": 8 << 20,
            "host_memory": 1 << 30, "devices": 8, "devices_per_host": 8}
    fig, data = plot.planner(plan)
    ax = fig.axes[0]
    named = sorted((t.xy, t.get_text()) for t in ax.texts)
    assert named == sorted(((4.0 + i, 0.0), c["remat"]) for i, c in enumerate(cands[:4]))
    assert data["labels"] == [{"text": c["remat"], "x": 4.0 + i, "y": 0.0}
                              for i, c in enumerate(cands[:4])]
    star = next(c for c in ax.collections if c.get_label().startswith("chosen"))
    assert star.get_offsets().tolist() == [[6.0, 0.0]]
    assert star.get_zorder() > max(a.get_zorder() for a in ax.get_children() if a is not star)
