"""The compiled step's report, the dry run, the planner and --plot's figures."""

from __future__ import annotations

import argparse
import json
import os

import jax

from zero_jax import distributed, planner, plot, report
from zero_jax.gpt import layouts, sweep
from zero_jax.gpt.cli import build
from zero_jax.gpt.experiment import Experiment
from zero_jax.gpt.resume import jax_primary
from zero_jax.loop import OutputError
from zero_jax.peak import compile_with_peak
from zero_jax.state import abstract_state

# For steps compiled only to be measured: LLVM's optimizations act below the HLO, so the
# buffers and collectives are the same without them (tests/flags.py).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_parallel_codegen_split_count": 1}


def compile_report(exp, state, peak: bool = True) -> tuple[dict, object]:
    """The step compiled for ``state`` (abstract arrays: nothing allocated), and its report;
    with ``peak``, what is live at the step's memory peak too (a compile that dumps XLA's
    buffers, asked for by a report file, the figures or a dry run only)."""
    lowered = exp.step.lower(state, exp.batch_shape)
    compiled, peak = compile_with_peak(lowered) if peak else (lowered.compile(), None)
    r = report.build(exp.plan, state, lowered, compiled, peak, exp.block_input)
    print(report.format_table(r))
    return r, compiled


def without_dots(exp, cfg: dict, args: argparse.Namespace,
                 problem: str | None) -> Experiment | None:
    """``model.remat: auto`` promises ``dots`` where memory allows: where it chose ``dots``
    (cuDNN's attention) and that step does not fit (``problem``), the run built again with
    ``full``, which keeps only each block's input (the first run's NVMe tier, if any, released
    first); else None. Every process must build the same step: one whose devices differ in
    what fits stops them all (``distributed.agree``)."""
    if cfg["model"]["remat"] != "auto" or exp.cfg["model"]["remat"] != "dots":
        return None
    distributed.agree("fit of remat dots", {"fits": problem is None}, args.peer_timeout)
    if problem is None:
        return None
    print(f"model.remat auto: with dots {problem}; trying full", flush=True)
    exp.step.close()
    return build({**cfg, "model": {**cfg["model"], "remat": "full"}}, args)


def write_json(path: str | None, obj: dict) -> None:
    if path and jax_primary():
        try:
            with open(path, "w") as f:
                json.dump(obj, f, indent=1)
        except OSError as e:
            raise OutputError("--report", path, e) from None


def dry_run(exp, args: argparse.Namespace) -> int:
    """The report of the compiled step, and the flat stages side by side on the same mesh."""
    plan = exp.plan
    r, _ = compile_report(exp, abstract_state(plan, exp.tx))
    if plan.outer is None:
        r["stages"] = report.stages_table(plan, exp.tx, exp.accum_steps)
        print("\n" + report.format_stages(r["stages"], r["n_params"], plan.dp_size))
    if args.plot and plan.outer is None:
        r["compiled_stages"] = compiled_stages(exp, r)
    write_json(args.report, r)
    draw(args, r)
    return 0


def compiled_stages(exp, r: dict) -> list[dict]:
    """For --plot's figures, every flat stage's step compiled with this run's other settings
    (``layouts.at_stage``), so that the stages compare on equal terms: this run's stage from its
    report ``r``, the others compiled here on abstract arrays, on the CPU with LLVM's
    optimizations off (the same buffers and collectives, in about 0.6x the time)."""
    others = [s for s in range(4) if s != exp.plan.stage]
    print(f"\ncompiling stages {', '.join(map(str, others))} for the figures", flush=True)
    cpu = exp.mesh.devices.flat[0].platform == "cpu"
    rows = {exp.plan.stage: report.stage_summary(r)}
    for stage in others:
        try:
            e = Experiment.build(layouts.at_stage(exp.cfg, stage), exp.mesh)
        except ValueError as err:  # a setting not built at that stage: the figures go without
            print(f"  stage {stage} not compiled: {err}")
            continue
        state = abstract_state(e.plan, e.tx)
        lowered = e.step.lower(state, e.batch_shape)
        compiled = lowered.compile(FAST_COMPILE if cpu else None)
        rows[stage] = report.stage_summary(report.build(
            e.plan, state, lowered, compiled, block_input=e.block_input))
    rows = [rows[s] for s in sorted(rows)]
    print(report.format_compiled(rows))
    return rows


def plan_layouts(exp, cfg: dict, args: argparse.Namespace) -> int:
    """The planner: the layouts this config leaves open that can change the answer, compiled on
    abstract arrays, against --device-memory and --host-memory (``zero_jax.gpt.sweep``)."""
    if exp.plan.outer is not None:
        raise ValueError("the planner compares the flat stages; drop zero3_size")
    per_host, n = args.devices_per_host or jax.local_device_count(), exp.mesh.size

    def measure(e, state, layout: dict):
        compiled, peak = compile_with_peak(e.step.lower(state, e.batch_shape))
        return planner.measure(layout, e.plan, state, compiled, peak, e.accum_steps)

    machine = sweep.Machine(args.device_memory, args.host_memory, per_host, args.nvme_memory or 0)
    search = sweep.Search(cfg, args.set, args.stage, args.tensor_parallel, n, machine,
                          lambda c: build(c, args), measure,
                          planner.largest_block_leaf_bytes(exp.plan))
    best = search.run()
    rows = search.rows + search.nvme
    untried = layouts.untried(cfg, args.set, [r.layout for r in rows]) if best is None else []
    print(("\n" + search.summary() if search.summary() else "") + "\n"
          + planner.format_table(rows, best, args.device_memory, args.host_memory, per_host,
                                 exp.model.n_params, n, untried)
          + (f": {layouts.flags(best.layout)}" if best else ""))
    verdict = planner.as_json(rows, best, args.device_memory, args.host_memory, per_host, n)
    write_json(args.report, verdict)
    draw(args, verdict)
    return 0


def draw(args: argparse.Namespace, r: dict, records: list[dict] | None = None) -> None:
    """--plot: the figures of the report (or the planner's) and of the metrics; a resumed
    run's curves from its whole metrics file."""
    if not (args.plot and jax_primary()):
        return


    if args.metrics and records is not None and os.path.exists(args.metrics):
        records = plot.read_records(args.metrics)
    stats = jax.devices()[0].memory_stats() or {}
    paths = plot.draw(r, records, args.plot, stats.get("bytes_limit"))
    print(f"figures: {', '.join(p.name for p in paths if p.suffix == '.png')} in {args.plot}")


def headline(r: dict) -> str:
    """The report's headline figures, as Markdown for TensorBoard's text tab."""
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    rows = [("ZeRO stage", r["stage"]), ("mesh", f"{mesh} ({r['platform']})"),
            ("parameters", f"{r['n_params']:,}"),
            ("model states per device", f"{mib(sum(r['per_device_bytes'].values()))} (ZeRO "
             f"formula {mib(sum(r['zero_formula_bytes'].values()))})"),
            ("host memory per device", mib(sum(r["per_device_host_bytes"].values()))),
            ("compiled temp per device", mib(r["compiled"]["temp_bytes"])),
            ("communication per step", f"{mib(r['comm_bytes_per_step'])} (ZeRO theory "
             f"{mib(r['comm_bytes_theory'])}, {r['comm_theory_formula']})")]
    if r.get("peak"):
        rows.append(("peak per device", mib(r["peak"]["peak_bytes"])))
    return "| figure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
