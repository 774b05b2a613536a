"""ZeRO-Offload side by side: each stage with and without the optimizer in host memory, stage 3
with the parameters there too, and the remat policies: step time (ratio to the same stage
without offload), device and host model states, temp, and the last step's loss against the same
stage's without offload (every run starts from the same state and steps over the same batches).

    python bench/offload.py [--config tiny] [--devices 8] [--steps 20] [--rounds 5]
                            [--stages 0,1,2,3]

The runs are interleaved (``bench/harness.py``). On the simulated CPU mesh "device" and
"pinned_host" are the same RAM, so the ratio measures the cost of the host computation and of
the program's shape, not of PCIe transfers: those need a GPU.
"""

from __future__ import annotations

import harness  # bench/harness.py, beside this script

OPTIMIZER = ["zero.offload_optimizer.device=cpu"]
RUNS = {**{(f"stage {s}", offload): [f"zero.stage={s}", *extra]
           for s in range(4) for offload, extra in (("none", []), ("optimizer", OPTIMIZER))},
        ("stage 3", "optimizer + params"): ["zero.stage=3", *OPTIMIZER,
                                            "zero.offload_params=cpu"],
        **{("stage 3", f"none, remat {p}"): ["zero.stage=3", f"model.remat={p}"]
           for p in ("dots", "none", "offload")}}


def main() -> None:
    args = harness.parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--stages", default="0,1,2,3", help="the stages whose rows to run (comma-separated)"))

    from zero_jax.gpt import config, data
    from zero_jax.mesh import make_mesh

    mesh = make_mesh(args.devices)
    tokens = data.stdlib_corpus()
    runs = {key: harness.try_build(" ".join(key), config.load(args.config, [*args.set, *extra]),
                                   mesh, tokens, args.steps) for key, extra in RUNS.items()
            if key[0].removeprefix("stage ") in args.stages.split(",")}
    runs = {key: r for key, r in runs.items() if r}  # a failed one said why
    harness.time_interleaved(list(runs.values()), args.rounds)

    print(harness.header(args.config, mesh, args.rounds, args.steps))
    print("| stage | offload | step ms | vs no offload | device MiB | host MiB | temp MiB "
          "| loss | vs no offload |")
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 2 ** 20
    for (stage, offload), r in runs.items():
        rep, base = r["report"], runs.get((stage, "none"))
        ratio, delta = (f"{r['ms'] / base['ms']:.2f}", f"{r['loss'] - base['loss']:+.1e}") \
            if base else ("-", "-")  # the stage's run without offload failed
        print(f"| {stage} | {offload} | {r['ms']:.1f} | {ratio} "
              f"| {sum(rep['per_device_bytes'].values()) / mib:.2f} "
              f"| {sum(rep['per_device_host_bytes'].values()) / mib:.2f} "
              f"| {rep['compiled']['temp_bytes'] / mib:.2f} "
              f"| {r['loss']:.6f} | {delta} |")


if __name__ == "__main__":
    main()
