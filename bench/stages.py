"""ZeRO stages 0-3 side by side, in fp32, bf16 and with accumulation: step time, tokens/s
(ratio to fp32 stage 0), per-device memory and communication.

    python bench/stages.py [--config tiny] [--devices 8] [--steps 20] [--rounds 5]

The stages run interleaved, round after round, in one process, so a noisy shared machine
slows them alike; each stage's time is the median over rounds of its mean step time.
Absolute times mean something only on a real accelerator; on the simulated CPU mesh the
ratios do.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from train import simulate_cpu_devices  # noqa: E402  (imports no jax)

# Each variant runs at stages 0-3; accumulation keeps the global batch and cuts it in 4.
VARIANTS = {"fp32": [], "bf16": ["precision.param_dtype=bf16"],
            "fp32, 4 microbatches": ["train.accum_steps=4"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--devices", type=int)
    p.add_argument("--steps", type=int, default=20, help="steps per stage per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    simulate_cpu_devices(args.devices or 8)

    import jax

    from zero_jax import config, data, report
    from zero_jax.experiment import Experiment
    from zero_jax.mesh import make_mesh
    from zero_jax.step import init_state

    mesh = make_mesh(args.devices)
    tokens = data.stdlib_corpus()
    runs = {}
    for variant, extra in VARIANTS.items():
        for stage in range(4):
            cfg = config.load(args.config, [*args.set, *extra, f"zero.stage={stage}"])
            exp = Experiment.build(cfg, mesh)
            state = init_state(exp.plan, exp.init, exp.tx, jax.random.key(0))
            lowered = exp.step.lower(state, exp.batch_shape)
            step = lowered.compile()
            t = cfg["train"]
            batches = [jax.device_put(data.batch(tokens, i, t["batch_size"], exp.model.seq_len,
                                                 0), exp.batch_sharding)
                       for i in range(args.steps)]
            runs[variant, stage] = dict(exp=exp, step=step, state=state, batches=batches,
                                        times=[], report=report.build(exp.plan, state, lowered,
                                                                      step))

    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for r in runs.values():
            jax.block_until_ready(r["state"])
            start = time.perf_counter()
            for b in r["batches"]:
                r["state"], metrics = r["step"](r["state"], b)
            jax.block_until_ready(metrics)
            r["times"].append((time.perf_counter() - start) / args.steps)

    device = mesh.devices.flat[0]
    print(f"{args.config} config, {mesh.size} x {device.device_kind} ({device.platform}), "
          f"host {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"jax {jax.__version__}; median of {args.rounds} rounds x {args.steps} steps\n")
    print("| variant | stage | step ms | tokens/s | vs fp32 stage 0 | model states MiB "
          "| temp MiB | comm / theory |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for (variant, stage), r in runs.items():
        ms = statistics.median(r["times"][1:]) * 1e3
        tps = r["exp"].tokens_per_step / ms * 1e3
        base = base or tps
        rep, mib = r["report"], 2 ** 20
        print(f"| {variant} | {stage} | {ms:.1f} | {tps:,.0f} | {tps / base:.2f} "
              f"| {sum(rep['per_device_bytes'].values()) / mib:.2f} "
              f"| {rep['compiled']['temp_bytes'] / mib:.2f} "
              f"| {rep['comm_bytes_per_step'] / rep['comm_bytes_theory']:.2f} |")


if __name__ == "__main__":
    main()
