"""Hierarchical ZeRO vs stage 3 on the same devices: communication within and across groups,
beside the theory, and step time side by side.

    python bench/hierarchical.py [--config tiny] [--devices 8] [--steps 20] [--rounds 5]

Rows: plain stage 3 (every device one group), then zero3_size K = 1, 2, 4, ..., N; each with
one and with 4 microbatches per step. Within a group stage 3 moves 3 Psi per microbatch (two
parameter all-gathers, one gradient reduce-scatter); across groups, once per step, the
gradient's 1/K shards are reduce-scattered and the updated parameters' gathered back: 2 Psi/K
(fp32 bytes here; payload = the full-size buffer, as ZeRO counts). Times run interleaved
(``bench/harness.py``); on the simulated CPU mesh only the ratios mean something.
"""

from __future__ import annotations

import harness  # bench/harness.py, beside this script


def main() -> None:
    args = harness.parse_args(__doc__.splitlines()[0])

    from zero_jax.gpt import config, data
    from zero_jax.gpt.experiment import mesh_for

    tokens = data.stdlib_corpus()
    n = mesh_for(config.load(args.config, args.set), args.devices).size
    sizes = [0] + [k for k in range(1, n + 1) if n % k == 0]  # 0: plain stage 3
    runs = {}
    for accum in (1, 4):
        for k in sizes:
            cfg = config.load(args.config, [*args.set, "zero.stage=3", f"zero.zero3_size={k}",
                                            f"train.accum_steps={accum}"])
            runs[accum, k] = harness.build(cfg, mesh_for(cfg, args.devices), tokens,
                                           args.steps)
    harness.time_interleaved(list(runs.values()), args.rounds)

    any_run = next(iter(runs.values()))
    print(harness.header(args.config, any_run["exp"].mesh, args.rounds, args.steps))
    print("| microbatches | layout | within groups MiB (theory) | across groups MiB (theory) "
          "| whole mesh MiB | params MiB/device | optimizer MiB/device | step ms | vs stage 3 |")
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 2 ** 20
    for (accum, k), r in runs.items():
        rep = r["report"]
        measured, theory = rep["comm_bytes_by_axes"], rep["comm_bytes_theory_by_axes"]
        # "data" is the group's axis; on the flat mesh of plain stage 3, one group of N.
        whole = measured.get("replica+data", 0)
        layout = f"stage 3 (one group of {n})" if k == 0 else f"zero3_size {k}"
        base = runs[accum, 0]["ms"]
        print(f"| {accum} | {layout} | {measured.get('data', 0) / mib:.2f} "
              f"({theory['data'] / mib:.2f}) "
              f"| {measured.get('replica', 0) / mib:.2f} ({theory.get('replica', 0) / mib:.2f}) "
              f"| {whole / mib:.2f} "
              f"| {rep['per_device_bytes']['params'] / mib:.3f} "
              f"| {rep['per_device_bytes']['opt_state'] / mib:.3f} "
              f"| {r['ms']:.1f} | {r['ms'] / base:.2f} |")


if __name__ == "__main__":
    main()
