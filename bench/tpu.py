"""ZeRO's stages compiled for TPUs with no TPU present: what each chip holds, what it gathers.

    pip install "jax[tpu]==0.10.2"    # libtpu, the TPU compiler; no TPU needed
    python bench/tpu.py [--topology v5e:2x4] [--config gpt2-124m] [--runs '0;3'] [--set K=V]
                        [--save-hlo DIR] [--json PATH]

libtpu compiles for a TPU topology it is only told of (``jax.experimental.topologies``: "v4:2x2x1",
"v5e:2x4", "v5p:2x2x1", "v6e:2x4", ...), as ``bench/gpu.py --compile-for h100`` does for GPUs.
Nothing runs. Each of ``bench/gpu.py``'s runs (stages 0-3, stage 3 without prefetch and by
module) is built as ``train.py`` builds it on a mesh over the topology's chips, lowered and
compiled; per run:

* arguments: the compiled program's argument bytes per chip (``memory_analysis()``: the state's
  shards as the TPU lays them out, and the batch), beside zero_jax's own per-device bytes of the
  state (the report's ``per_device_bytes`` of parameters, master copy and optimizer state: the
  shards' sizes) and their ratio;
* temp: the program's temporary bytes per chip (``memory_analysis()``);
* communication: the bytes each chip moves per step (``zero_jax.hlo``, which reads libtpu's
  loop trip counts from their conditions and its collective fusions), beside ZeRO's theory;
* collectives: how often each collective form appears in the program's text (``gpu.forms``),
  counting the fusions the TPU compiler makes of them (``all-reduce-scatter``): the forms
  differ from the GPU's and the CPU's (docs/benchmarks/tpu-compile.md). Overlap is not read
  from a TPU program.
"""

from __future__ import annotations

import json
import sys

import gpu  # bench/gpu.py, beside this script (its runs; it puts the repository on sys.path)

MiB = 2 ** 20
STATE = ("params", "master", "opt_state")  # what the step takes in (the gradient it makes)


def parse_args():
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5e:2x4", help="libtpu's name of the TPU slice")
    p.add_argument("--config", default="gpt2-124m")
    p.add_argument("--runs", metavar="LABEL;LABEL", help="only these rows (bench/gpu.py's labels)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--save-hlo", metavar="DIR", help="each compiled program's text, gzipped")
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")  # libtpu without a TPU: compile, run nothing
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    from zero_jax import report
    from zero_jax.gpt import config
    from zero_jax.gpt.experiment import Experiment
    from zero_jax.state import abstract_state

    try:
        topology = topologies.get_topology_desc(topology_name=args.topology, platform="tpu")
    except Exception as e:  # noqa: BLE001  (no libtpu, a name it does not know, its lock)
        raise SystemExit(f"error: cannot compile for TPU {args.topology} here "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); libtpu "
                         'comes with pip install "jax[tpu]", and one process at a time holds '
                         "it (/tmp/libtpu_lockfile)") from e
    devices = np.array(topology.devices)
    n = devices.size
    print(f"{args.config} config, compiled (not run) for {args.topology}: {n} x "
          f"{devices.flat[0].device_kind} (libtpu, no TPU present); jax {jax.__version__}\n")
    print("| run | arguments MiB per chip (compiled) | zero_jax's per-device MiB | ratio "
          "| temp MiB | MiB moved per chip and step (ZeRO's theory) | collective forms in the "
          "program |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for label, sets in gpu.chosen(gpu.RUNS, args.runs, gpu.VARIANTS):
        cfg = config.load(args.config, [*args.set, *sets])
        mesh = Mesh(devices.reshape(n), ("data",), axis_types=(AxisType.Auto,))
        exp = Experiment.build(cfg, mesh)
        state = abstract_state(exp.plan, exp.tx)
        lowered = exp.step.lower(state, exp.batch_shape)
        compiled = lowered.compile()
        gpu.save_hlo(args, f"{args.config}-stage-{label}-{args.topology}", compiled)
        rep = report.build(exp.plan, state, lowered, compiled, accum_steps=exp.accum_steps)
        memory = compiled.memory_analysis()
        row = {"run": label, "arguments": memory.argument_size_in_bytes,
               "per_device": sum(rep["per_device_bytes"][k] for k in STATE),
               "temp": memory.temp_size_in_bytes, "forms": gpu.forms(compiled.as_text()),
               "comm": rep["comm_bytes_per_step"], "theory": rep["comm_bytes_theory"]}
        rows.append(row)
        print(f"| {label} | {row['arguments'] / MiB:.1f} | {row['per_device'] / MiB:.1f} "
              f"| {row['arguments'] / row['per_device']:.3f} | {row['temp'] / MiB:.1f} | "
              f"{row['comm'] / MiB:,.1f} ({row['theory'] / MiB:,.1f}) | "
              + ", ".join(f"{k} x{v}" for k, v in sorted(row["forms"].items())) + " |",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "topology": args.topology, "chips": int(n),
                       "device_kind": devices.flat[0].device_kind, "jax": jax.__version__,
                       "runs": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
