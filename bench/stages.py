"""ZeRO stages 0-3 side by side, in fp32, bf16 and with accumulation: step time, tokens/s
(ratio to fp32 stage 0), per-device memory and communication.

    python bench/stages.py [--config tiny] [--devices 8] [--steps 20] [--rounds 5]

The stages run interleaved (``bench/harness.py``). Absolute times mean something only on a
real accelerator; on the simulated CPU mesh the ratios do.
"""

from __future__ import annotations

import harness  # bench/harness.py, beside this script

# Each variant runs at stages 0-3; accumulation keeps the global batch and cuts it in 4.
VARIANTS = {"fp32": [], "bf16": ["precision.param_dtype=bf16"],
            "fp32, 4 microbatches": ["train.accum_steps=4"]}


def main() -> None:
    args = harness.parse_args(__doc__.splitlines()[0])

    from zero_jax.gpt import config, data
    from zero_jax.mesh import make_mesh

    mesh = make_mesh(args.devices)
    tokens = data.stdlib_corpus()
    runs = {(variant, stage): harness.build(
                config.load(args.config, [*args.set, *extra, f"zero.stage={stage}"]), mesh,
                tokens, args.steps)
            for variant, extra in VARIANTS.items() for stage in range(4)}
    harness.time_interleaved(list(runs.values()), args.rounds)

    print(harness.header(args.config, mesh, args.rounds, args.steps))
    print("| variant | stage | step ms | tokens/s | vs fp32 stage 0 | model states MiB "
          "| temp MiB | comm / theory |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for (variant, stage), r in runs.items():
        tps = r["exp"].tokens_per_step / r["ms"] * 1e3
        base = base or tps
        rep, mib = r["report"], 2 ** 20
        print(f"| {variant} | {stage} | {r['ms']:.1f} | {tps:,.0f} | {tps / base:.2f} "
              f"| {sum(rep['per_device_bytes'].values()) / mib:.2f} "
              f"| {rep['compiled']['temp_bytes'] / mib:.2f} "
              f"| {rep['comm_bytes_per_step'] / rep['comm_bytes_theory']:.2f} |")


if __name__ == "__main__":
    main()
