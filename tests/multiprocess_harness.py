"""Every layout a multi-process test needs, trained in one launch: run as a script under
``zero_jax.launch`` (2 processes x 4 devices), and imported by the test (1 process x 8 devices)
for the references, so both sides run the very same code.

    python tests/multiprocess_harness.py OUT_DIR REFERENCE_CHECKPOINT

Writes, from process 0: ``OUT_DIR/results.json`` (losses per layout, the hierarchical report)
and ``OUT_DIR/*.npz`` (whole states, gathered, for bit-exact comparisons; no pickle).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax
import numpy as np
from jax.sharding import PartitionSpec

from zero_jax import distributed, report
from zero_jax.checkpoint import Checkpoints
from zero_jax.gpt import config as configs
from zero_jax.gpt import data
from zero_jax.gpt.experiment import Experiment, mesh_for
from zero_jax.mesh import simulate_cpu_devices
from zero_jax.state import abstract_state, init_state

TINY = ["model.n_layers=2", "model.d_model=32", "model.d_ff=64", "model.seq_len=16",
        "model.n_heads=2", "train.batch_size=16", "optimizer.warmup_steps=0",
        "optimizer.lr=0.05"]
STEPS = 5
# SGD at every stage (a gradient of the wrong scale shows in its losses; Adam would hide it),
# clipped AdamW where the state is cut most (stage 3, hierarchical): what differs between one
# and two processes (each builds its rows, the mesh spans both) is not the optimizer's.
LAYOUTS = {f"stage{s}-sgd": [f"zero.stage={s}", "optimizer.name=sgd"] for s in range(4)}
LAYOUTS["stage3-adamw"] = ["zero.stage=3", "optimizer.name=adamw"]
LAYOUTS["hier-adamw"] = ["zero.stage=3", "zero.zero3_size=4", "optimizer.name=adamw"]
# Tensor parallelism within a process (its 4 devices one model group), ZeRO across processes.
LAYOUTS["tp4-stage3-sgd"] = ["zero.stage=3", "optimizer.name=sgd", "mesh.tensor_parallel=4",
                             "model.n_heads=4"]
# ZeRO-Infinity's NVMe tier, each process its own files, against the same update in host memory.
ADAMW_HOST = ["zero.stage=2", "optimizer.name=adamw", "optimizer.clip_norm=0",
              "zero.offload_optimizer.device=cpu"]
LAYOUTS["stage2-adamw-host"] = ADAMW_HOST
LAYOUTS["stage2-adamw-nvme"] = [*ADAMW_HOST, "zero.offload_optimizer.device=nvme"]
# Only built, to restore the 2-process checkpoint into: another stage of the same optimizer.
RESTORE_ONLY = {"stage1-adamw": ["zero.stage=1", "optimizer.name=adamw"]}
CKPT_LAYOUT = "stage3-adamw"  # saved after STEPS, restored across process counts


def build(layout: str, out: pathlib.Path | None = None) -> Experiment:
    """The layout's experiment; an NVMe layout keeps its files under ``out/nvme``."""
    nvme = [f"zero.offload_optimizer.nvme_path={out / 'nvme'}"] if layout.endswith("nvme") \
        else []
    cfg = configs.load("tiny", TINY + {**LAYOUTS, **RESTORE_ONLY}[layout] + nvme +
                       [f"train.steps={2 * STEPS}"])
    return Experiment.build(cfg, mesh_for(cfg, None))


def train(exp: Experiment, state, first: int, steps: int, tokens, step=None
          ) -> tuple[object, list]:
    """``steps`` steps from batch ``first``; each process builds only its rows of a batch."""
    step = step or exp.step
    shape = exp.batch_shape.shape
    rows = distributed.local_rows(exp.batch_sharding, shape)
    losses = []
    for i in range(first, first + steps):
        local = data.batch(tokens, i, shape[0], exp.model.seq_len, seed=0, rows=rows)
        state, m = step(state, distributed.global_array(exp.batch_sharding, shape, local))
        losses.append(float(m["loss"]))
    return state, losses


def whole(state) -> dict[str, np.ndarray]:
    """Every leaf of the state, whole, on the host (gathered from all processes). Across
    processes one program replicates every leaf, as ``multihost_utils.process_allgather``
    does leaf by leaf (a program per leaf's shape and layout: dozens of compiles)."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(state._asdict())[0], strict=True)
    if jax.process_count() > 1:
        replicated = [x.sharding.update(spec=PartitionSpec()) for x in leaves]
        leaves = [x.addressable_data(0) for x in
                  jax.jit(lambda xs: xs, out_shardings=replicated)(list(leaves))]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in zip(paths, leaves, strict=True)}


def save(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    if jax.process_index() == 0:
        np.savez(path, **arrays)


def run(out: pathlib.Path, reference_ckpt: str | None) -> dict:
    """Train every layout; save, and resume from ``reference_ckpt`` (the other process count's
    checkpoint, waited for: the other side may still be running; or this side's own). Returns
    results."""
    tokens = data.stdlib_corpus(1 << 16)
    results: dict = {"losses": {}}
    hosts = {}  # the initial parameters, once per model: each layout only places them
    (out / "nvme").mkdir(exist_ok=True)
    for layout in LAYOUTS:
        exp = build(layout, out)
        if exp.model not in hosts:
            hosts[exp.model] = jax.tree.map(np.asarray, jax.jit(exp.init)(jax.random.key(0)))
        host = hosts[exp.model]
        state = init_state(exp.plan, lambda key, host=host: host, exp.tx, jax.random.key(0))
        step = None
        if layout == "hier-adamw":  # train with the program the report reads: one compile
            lowered = exp.step.lower(state, exp.batch_shape)
            step = lowered.compile()
            results["report"] = report.build(exp.plan, state, lowered, step,
                                                 accum_steps=exp.accum_steps)
        state, losses = train(exp, state, 0, STEPS, tokens, step)
        results["losses"][layout] = losses
        if layout == CKPT_LAYOUT:
            ckpts = Checkpoints(out / f"ckpt-{jax.process_count()}p")
            ckpts.save(state, {"layout": layout})
            ckpts.finish()
            ckpts.close()  # releases the writer lock: the other side reads it next
            save(out / f"saved-{jax.process_count()}p.npz", whole(state))
            if jax.process_index() == 0:
                (out / "saved").write_text("")  # the checkpoint is complete
            resume = exp
    if reference_ckpt:
        ready = pathlib.Path(reference_ckpt).parent / "saved"
        deadline = time.monotonic() + 600
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        source = Checkpoints(reference_ckpt, read_only=True)
        restored, _ = source.restore(abstract_state(resume.plan, resume.tx))
        source.close()
        save(out / f"restored-{jax.process_count()}p.npz", whole(restored))
        _, more = train(resume, restored, STEPS, STEPS, tokens)
        results["resumed_losses"] = more
    return results


if __name__ == "__main__":
    simulate_cpu_devices(4)  # the launcher set the device count; this adds the CPU flags
    spec = distributed.settings()
    distributed.initialize(spec, timeout_s=60)
    out = pathlib.Path(sys.argv[1])
    results = run(out, sys.argv[2] if len(sys.argv) > 2 else None)
    if jax.process_index() == 0:
        (out / "results.json").write_text(json.dumps(results, default=float))
