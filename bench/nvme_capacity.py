"""The largest model this machine trains with the NVMe tier against host-memory offload.

    python bench/nvme_capacity.py --params-m 256,1024 [--path DIR] [--steps 2]

Each size and tier (``cpu``: ``Offload(optimizer=1.0)``; ``nvme``: the same with the master
and AdamW's moments in files under ``--path``) trains an MLP (8192 wide, bf16 compute, one
device, stage 0) for ``--steps`` steps in a process of its own, which reports its peak resident
memory (``ru_maxrss``), the time of its last step and its losses. A run whose peak, predicted
from the same tier's bytes per parameter at a smaller size, would not fit in this machine's
available memory is not started: it is printed as needing that much, so that the table shows
where each tier stops without driving the machine out of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

WIDTH = 8192


def train(params_m: float, tier: str, path: str, steps: int) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import zero_jax as zj

    layers = max(1, round(params_m * 1e6 / WIDTH ** 2))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x_BxD):
            for _ in range(layers):
                x_BxD = jnp.tanh(nn.Dense(WIDTH, use_bias=False)(x_BxD))
            return x_BxD

    model, x_BxD = MLP(), jnp.ones((2, WIDTH))
    init = lambda key: model.init(key, x_BxD)  # noqa: E731
    loss_fn = lambda p, x: jnp.mean(jnp.square(model.apply(p, x) - 0.5))  # noqa: E731
    tx = optax.adamw(1e-4)
    nvme = zj.Nvme(path, chunk_mb=256, buffers=4) if tier == "nvme" else None
    plan = zj.make_plan(jax.eval_shape(init, jax.random.key(0)), zj.make_mesh(1), 0,
                        precision=zj.Precision(param_dtype="bf16"),
                        offload=zj.Offload(optimizer=1.0, nvme=nvme))
    step = zj.make_train_step(plan, loss_fn, tx)
    state = zj.init_state(plan, init, tx, jax.random.key(0))
    losses, seconds = [], 0.0
    for _ in range(steps):
        start = time.perf_counter()
        state, m = step(state, x_BxD)
        losses.append(float(m["loss"]))
        seconds = time.perf_counter() - start
    n = sum(x.size for x in jax.tree.leaves(state.params))
    return {"params": n, "tier": tier, "peak_bytes": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "last_step_s": seconds, "losses": losses}


def available() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-m", default="256,1024")
    p.add_argument("--path", default=None, help="a directory on the disk for the NVMe tier")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--one", nargs=2, metavar=("PARAMS_M", "TIER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(train(float(args.one[0]), args.one[1], args.path, args.steps)))
        return
    path = args.path or tempfile.mkdtemp(prefix="zero_jax-capacity-", dir=".")
    per_param: dict[str, float] = {}
    print(f"one CPU device, {os.cpu_count()} cores, {available() / 2**30:.1f} GiB available; "
          f"MLP {WIDTH} wide, bf16 compute, AdamW, {args.steps} steps")
    print("| parameters | tier | peak resident GiB | bytes / parameter | last step s | losses |")
    print("|---|---|---|---|---|---|")
    for size in (float(s) for s in args.params_m.split(",")):
        for tier in ("cpu", "nvme"):
            need = per_param.get(tier, 0) * size * 1e6
            if need > 0.9 * available():
                print(f"| {size:.0f} M | {tier} | needs ~{need / 2**30:.1f} | | not run | |")
                continue
            run = subprocess.run([sys.executable, __file__, "--one", str(size), tier, "--path",
                                  path, "--steps", str(args.steps)], capture_output=True,
                                 text=True)
            if run.returncode:
                print(f"| {size:.0f} M | {tier} | failed: {run.stderr.strip().splitlines()[-1]}"
                      f" | | | |")
                continue
            r = json.loads(run.stdout.splitlines()[-1])
            per_param[tier] = r["peak_bytes"] / r["params"]
            print(f"| {r['params'] / 1e6:.0f} M | {tier} | {r['peak_bytes'] / 2**30:.2f} | "
                  f"{per_param[tier]:.1f} | {r['last_step_s']:.1f} | "
                  f"{', '.join(f'{x:.5f}' for x in r['losses'])} |")
            for f in os.listdir(os.path.join(path, "process0")) if tier == "nvme" else ():
                os.remove(os.path.join(path, "process0", f))


if __name__ == "__main__":
    main()
