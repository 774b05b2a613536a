"""What the benchmarks share: build a configured run, then time runs interleaved.

Runs are timed round after round in one process, so a noisy shared machine slows them alike;
each run's time is the median over rounds of its mean step time (the first round warms up and
is dropped).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from zero_jax.mesh import simulate_cpu_devices  # noqa: E402  (before any backend starts)


def parse_args(description: str,
               extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    """The benchmarks' flags, and a script's own (``extra`` adds them); simulates the CPU
    devices before jax is imported."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", default="tiny")
    p.add_argument("--devices", type=int)
    p.add_argument("--steps", type=int, default=20, help="steps per run per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--compile-only", action="store_true",
                   help="compile, do not time: memory per device and the peak's breakdown")
    if extra is not None:
        extra(p)
    args = p.parse_args()
    simulate_cpu_devices(args.devices or 8)
    return args


def build(cfg: dict, mesh, tokens, steps: int) -> dict:
    """Compile the step a config describes and prepare ``steps`` batches for it."""
    import jax

    from zero_jax import report
    from zero_jax.gpt import data
    from zero_jax.gpt.experiment import Experiment
    from zero_jax.state import init_state

    exp = Experiment.build(cfg, mesh)
    state = init_state(exp.plan, exp.init, exp.tx, jax.random.key(0))
    lowered = exp.step.lower(state, exp.batch_shape)
    step = lowered.compile()
    t = cfg["train"]
    batches = [jax.device_put(data.batch(tokens, i, t["batch_size"], exp.model.seq_len, 0),
                              exp.batch_sharding) for i in range(steps)]
    return dict(exp=exp, step=step, state=state, batches=batches, times=[],
                report=report.build(exp.plan, state, lowered, step,
                                            accum_steps=exp.accum_steps))


def try_build(name: str, cfg: dict, mesh, tokens, steps: int) -> dict | None:
    """``build`` and one step, or None after one line saying why (out of memory, a compiler
    that refuses the layout): one run that fails does not hide the others' results."""
    import jax

    try:
        r = build(cfg, mesh, tokens, steps)
        r["state"], _ = r["step"](r["state"], r["batches"][0])
        jax.block_until_ready(r["state"])
    except Exception as e:  # noqa: BLE001
        print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        return None
    return r


def time_interleaved(runs: list[dict], rounds: int) -> None:
    """Fill each run's ``ms``: the median over rounds of its mean step time; and ``loss``: its
    last step's (runs from the same init over the same batches can be compared by it)."""
    import jax

    for _ in range(rounds + 1):
        for r in runs:
            jax.block_until_ready(r["state"])
            start = time.perf_counter()
            for b in r["batches"]:
                r["state"], metrics = r["step"](r["state"], b)
            jax.block_until_ready(metrics)
            r["times"].append((time.perf_counter() - start) / len(r["batches"]))
            r["loss"] = float(metrics["loss"])
    for r in runs:
        r["ms"] = statistics.median(r["times"][1:]) * 1e3


def header(config: str, mesh, rounds: int, steps: int) -> str:
    import jax

    device = mesh.devices.flat[0]
    return (f"{config} config, {mesh.size} x {device.device_kind} ({device.platform}), "
            f"host {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
            f"jax {jax.__version__}; median of {rounds} rounds x {steps} steps\n")


SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A",
         "collective-permute": "CP"}


def collectives_summary(hlo_text: str, n_devices: int) -> dict[str, tuple[int, int]]:
    """``{kind: (executions per step, payload bytes per step)}`` of the collectives that move
    data (groups of more than one device), read by ``zero_jax.hlo``."""
    from zero_jax.hlo import collectives

    out: dict[str, tuple[int, int]] = {}
    for c in collectives(hlo_text, n_devices):
        if c.group_size > 1:
            count, size = out.get(c.kind, (0, 0))
            out[c.kind] = (count + c.count, size + c.count * c.bytes)
    return out


def format_collectives(summary: dict[str, tuple[int, int]]) -> str:
    """"AG 9 / 6.21 MiB, RS 5 / 3.18 MiB": executions and MiB per step, per kind."""
    return ", ".join(f"{SHORT.get(kind, kind)} {count} / {size / 2 ** 20:.3g} MiB"
                     for kind, (count, size) in sorted(summary.items())) or "none"
