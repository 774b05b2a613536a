"""The experts' matmuls tile by tile (``zero_jax.gpt.moe.grouped_matmul``) beside
``jax.lax.ragged_dot``, which jax 0.10.2 compiles for CPUs and GPUs as a GEMM over every
expert's weights, and beside batched GEMMs with a capacity (``model.expert_capacity_factor``
``--capacity``, the pairs past it dropped): step time, tokens/s, temp memory and the last
loss, the same steps from the same initialization.

    python bench/experts.py [--config llama] [--devices 8] [--steps 20] [--rounds 5]
        [--capacity 1.25] [--set model.n_experts=8 --set model.experts_per_token=2 ...]

The three run interleaved (``bench/harness.py``); on the simulated CPU mesh their ratios mean
something, not their times.
"""

from __future__ import annotations

import harness  # bench/harness.py, beside this script

EXPERTS = ["model.n_experts=8", "model.experts_per_token=2"]  # --set overrides them


def main() -> None:
    args = harness.parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--capacity", type=float, default=1.25, help="the capacity factor of the third run"))
    import jax

    from zero_jax.gpt import config, data, moe
    from zero_jax.mesh import make_mesh

    mesh = make_mesh(args.devices)
    tokens = data.stdlib_corpus()
    name = args.config if args.config != "tiny" else "llama"  # the default model has no experts
    cfg = config.load(name, [*EXPERTS, *args.set])
    capped = config.load(name, [*EXPERTS, *args.set,
                                f"model.expert_capacity_factor={args.capacity}"])
    runs = {}
    for run, matmul, c in (("grouped_matmul", moe.grouped_matmul, cfg),
                           ("ragged_dot", jax.lax.ragged_dot, cfg),
                           (f"capacity {args.capacity}", moe.grouped_matmul, capped)):
        default, moe.grouped_matmul = moe.grouped_matmul, matmul  # while the step is traced
        try:
            runs[run] = harness.build(c, mesh, tokens, args.steps)
        finally:
            moe.grouped_matmul = default
    harness.time_interleaved(list(runs.values()), args.rounds)

    m = cfg["model"]
    print(harness.header(name, mesh, args.rounds, args.steps))
    print(f"{m['n_experts']} experts, top {m['experts_per_token']}, stage "
          f"{cfg['zero']['stage']}\n")
    print("| experts' matmuls | step ms | tokens/s | vs ragged_dot | temp MiB | last loss |")
    print("|---|---|---|---|---|---|")
    for run, r in runs.items():
        tps = r["exp"].tokens_per_step / r["ms"] * 1e3
        print(f"| {run} | {r['ms']:.1f} | {tps:,.0f} | {runs['ragged_dot']['ms'] / r['ms']:.2f} "
              f"| {r['report']['compiled']['temp_bytes'] / 2 ** 20:.2f} | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
