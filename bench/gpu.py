"""ZeRO stages 0-3 of GPT-2 small (124M) on every visible GPU, stage 3 without prefetch and
gathering by module: step time, tokens/s, model FLOPs utilization, the estimate of the same
compiled step beside it (H100 and H200), the compiled step's collectives, and whether its async
collectives overlap compute.

    python bench/gpu.py [--config gpt2-124m] [--devices N] [--steps 10] [--rounds 5] [--set K=V]
        [--runs '0;3'] [--json results.json] [--trace DIR] [--save-hlo DIR]
    python bench/gpu.py --allow-cpu     # the same code path on 8 simulated CPU devices (tiny)
    python bench/gpu.py --compile-for h100 [--devices 8]   # no GPU needed: compile, not run
    python bench/gpu.py --compile-for h100 --devices 64 --nodes 8   # 8 nodes, hierarchical too

Without a GPU (and without ``--allow-cpu`` or ``--compile-for``) it says so in one line and
exits 0.

* ``--compile-for h100``: XLA's GPU compiler, given an H100's description (``TARGETS``) and a
  topology of ``--devices`` GPUs on one host, compiles the same steps on a machine with no GPU
  (deviceless ahead-of-time compilation; it needs jax's CUDA plugin installed, e.g.
  ``pip install "jax[cuda13]"``, not a driver). Nothing runs: the table has no times, only what
  the compiled program says (collectives, overlap, temp memory). Runs of the variants too, and
  the GSPMD FSDP baseline of ``bench/peers.py`` compiled the same way (bf16 compute from fp32
  parameters). Then an **estimate** per run (``bench/estimate.py``, its method there): step
  time, exposed communication and MFU from the program's ops in schedule order, over stated
  H100 figures and link bandwidths, which it prints. With ``--nodes K`` the devices are K nodes
  (their collectives across nodes go over the network): stages 0 and 3, hierarchical ZeRO with
  one node per ZeRO-3 group, and the baseline.

* Step time: the median over rounds of the mean step time, stages interleaved
  (``bench/harness.py``); tokens/s from it. Beside it, ``bench/estimate.py``'s estimate of the
  program that ran (measured / estimate), and XLA's ``cost_analysis()`` FLOPs beside the
  estimate's count (a scanned stack's body counts once in XLA's).
* MFU: model FLOPs per token, 6 N + 12 L d T (N parameters, embeddings included: the head is
  tied, so the embedding matrix is a matmul's weight too; with experts, only those a token
  takes: ``GPTConfig.active_params``; L layers of width d over T positions:
  the attention scores and their use), times tokens/s, over the devices' peak dense bf16 FLOP/s
  (``PEAK_BF16``, by ``device_kind``; "unknown" for a device not in it). Remat's recomputation
  is not counted: that is hardware FLOPs, not model FLOPs.
* Collectives: ``zero_jax.hlo`` on the compiled step, per kind, executions and payload per step;
  then the bytes read per step against ZeRO's theory for the stage (the report's
  ``comm_bytes_per_step`` and ``comm_bytes_theory``): a real GPU compile whose async forms the
  reader misread shows as ratios away from those of the CPU mesh (1.00, 1.50, 1.00, 0.98).
* Overlap: on GPU, XLA runs collectives asynchronously, as ``all-gather-start`` /
  ``all-gather-done`` pairs (``async-start`` / ``async-done`` around a reduce-scatter). The
  compiled module is scheduled, so its text order is the execution order: a pair overlaps
  compute when other compute instructions (fusions, custom calls such as GEMMs, loops, ...) are
  scheduled between start and done, in the entry computation or in a loop body. A layer norm
  between them hides little: the column counts the pairs with a matmul between start and done
  (a dot, or a fusion or GEMM custom call doing one), the work that can hide a layer's gather.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import re
import sys

# isort: off
import harness  # bench/harness.py, beside this script (puts the repository on sys.path)
import estimate  # bench/estimate.py: imports zero_jax, so after harness
# isort: on

from zero_jax.hlo import KINDS, computations, instruction, matmul_finder  # noqa: E402

# Peak dense bf16 FLOP/s, by a lowercase substring of ``device.device_kind``; the first match
# wins ("NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" not).
PEAK_BF16 = [("h100 pcie", 756e12), ("h100 nvl", 835e12), ("h100", 989e12),
             ("gh200", 989e12), ("h200", 989e12), ("a100", 312e12), ("b200", 2250e12),
             ("l40s", 362e12)]

# Instructions that are no work of their own: between a start and its done they hide nothing.
NOT_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
               "add-dependency", "opt-barrier", "partition-id", "replica-id", "async-start",
               "async-update", "async-done"}
MiB = 2 ** 20
# Stages 0-3 as configured (stage 3 prefetches the next layer's gather by default), stage 3
# without prefetch (what prefetch buys where collectives can overlap compute) and gathering by
# module.
RUNS = [(str(s), [f"zero.stage={s}"]) for s in range(4)] + [
    ("3, no prefetch", ["zero.stage=3", "zero.prefetch=false"]),
    ("3, by module", ["zero.stage=3", "zero.gather=module"])]
# Compiled only (--compile-for), so cheap: buckets off, by module without prefetch, ZeRO++'s
# int8.
VARIANTS = [("3, no buckets", ["zero.stage=3", "zero.bucket_mb=0"]),
            ("3, by module, no prefetch", ["zero.stage=3", "zero.gather=module",
                                           "zero.prefetch=false"]),
            ("3, int8 weights", ["zero.stage=3", "zero.quantize_weights=int8"]),
            ("3, int8 grads", ["zero.stage=3", "zero.quantize_grads=int8"])]
# What XLA's GPU compiler needs to know of a device to compile for it without one: an H100
# SXM's figures, as XLA's own gpu_specs/h100_sxm lists them.
TARGETS = {"h100": """\
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""}
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="default gpt2-124m on GPU, tiny with --allow-cpu on CPU")
    p.add_argument("--devices", type=int, help="default: every visible GPU")
    p.add_argument("--steps", type=int, default=10, help="steps per run per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--runs", metavar="LABEL;LABEL",
                   help="only these rows, by their table labels (e.g. '0;3'; with "
                        "--compile-for, no baseline): a large model's compiles take minutes; "
                        "'0, unrolled' only when named")
    p.add_argument("--allow-cpu", action="store_true",
                   help="no GPU: run on simulated CPU devices (to test this script)")
    p.add_argument("--compile-for", choices=sorted(TARGETS),
                   help="no GPU: compile (not run) for --devices (default 8) GPUs of this kind")
    p.add_argument("--nodes", type=int, default=1,
                   help="with --compile-for: the --devices spread over this many nodes (their "
                        "collectives estimated over the network): stages 0 and 3, hierarchical "
                        "ZeRO (zero3_size = one node) and the GSPMD FSDP baseline")
    p.add_argument("--save-hlo", metavar="DIR",
                   help="also write each compiled program's text, gzipped")
    p.add_argument("--trace", metavar="DIR",
                   help="after timing, one more round of each run under jax.profiler, its "
                        "kernels' timeline in DIR/<run>.trace.json.gz (Perfetto's format)")
    args = p.parse_args()
    if args.compile_for:  # the CUDA plugin without a driver: skip its checks, run nothing on it
        import jax

        from zero_jax.internals import CSE_BARRIER_PASS

        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        jax.config.update("jax_platforms", "cpu")
        # import zero_jax keeps remat's barriers for a CPU run when JAX_PLATFORMS=cpu is set;
        # the GPU compiler then meets them in its code generation ("Unsupported instruction
        # opcode: opt-barrier", stage 3): its own pass must run.
        os.environ["XLA_FLAGS"] = " ".join(_without_pass(f, CSE_BARRIER_PASS) for f in
                                           os.environ.get("XLA_FLAGS", "").split())
    if args.allow_cpu:  # before jax starts a backend (harness.parse_args always does it)
        from zero_jax.mesh import simulate_cpu_devices

        simulate_cpu_devices(args.devices or 8)
    return args


def _without_pass(flag: str, name: str) -> str:
    """``flag``, less ``name`` if it is XLA's list of disabled passes."""
    key, _, passes = flag.partition("=")
    if key != "--xla_disable_hlo_passes":
        return flag
    kept = [p for p in passes.split(",") if p and p != name]
    return f"{key}={','.join(kept)}" if kept else ""


def peak_flops(device_kind: str) -> float | None:
    kind = device_kind.lower()
    return next((peak for name, peak in PEAK_BF16 if name in kind), None)


def flops_per_token(model) -> float:
    """Model FLOPs per token of a training step (forward and backward), PaLM's accounting."""
    return 6 * model.active_params + 12 * model.n_layers * model.d_model * model.seq_len


# --- reading the compiled HLO text ---------------------------------------------------------

def parsed(bodies: dict[str, list[str]]) -> dict[str, list[tuple[str, str, str, str]]]:
    """``{computation: [(name, shape, opcode, rest), ...]}`` in schedule order, from
    ``zero_jax.hlo.computations``' lines."""
    return {name: [i for i in map(instruction, lines) if i] for name, lines in bodies.items()}


def _collective_of(bodies: dict, op: str, rest: str) -> str | None:
    """The kind of a collective, its async start, or an async-start wrapping one; else None."""
    if op.removesuffix("-start") in KINDS:
        return op.removesuffix("-start")
    if op == "async-start" and (m := _CALLS.search(rest)):
        return next((inner[2] for inner in bodies.get(m.group(1), ()) if inner[2] in KINDS),
                    None)
    return None


def overlap(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per collective kind: async start/done pairs, how many have compute scheduled between
    them, how many a matmul, how many of those are in a loop body, and how many XLA marked
    synchronous."""
    text, _ = computations(hlo_text)
    bodies = parsed(text)
    is_matmul = matmul_finder(text)
    loop_bodies = {m.group(1) for body in bodies.values() for _, _, op, rest in body
                   if op == "while" and (m := _BODY.search(rest))}
    out: dict[str, dict[str, int]] = {}
    for name, body in bodies.items():
        lines = {p[0]: line for line in text[name] if (p := instruction(line))}
        starts: dict[str, tuple[str, int, str]] = {}  # start or update name -> (kind, index)
        for i, (inst, _, op, rest) in enumerate(body):
            operands = set(re.findall(r"%?([\w.\-]+)", rest))
            if op.endswith("-start") or op == "async-start":
                if kind := _collective_of(bodies, op, rest):
                    starts[inst] = (kind, i, rest)
            elif op.endswith("-update") or op == "async-update":
                for o in operands & starts.keys():
                    starts[inst] = starts[o]
            elif op.endswith("-done") or op == "async-done":
                for o in operands & starts.keys():
                    kind, j, start_rest = starts[o]
                    between = body[j + 1:i]
                    compute = [b for b in between if b[2] not in NOT_COMPUTE
                               and not re.search(r"-(start|update|done)$", b[2])]
                    row = out.setdefault(kind, dict.fromkeys(
                        ("pairs", "overlapped", "in_loop", "overlapped_in_loop", "matmul",
                         "matmul_in_loop", "sync"), 0))
                    row["pairs"] += 1
                    row["in_loop"] += name in loop_bodies
                    row["sync"] += bool(re.search(r'"is_sync":\s*true', start_rest))
                    if compute:
                        row["overlapped"] += 1
                        row["overlapped_in_loop"] += name in loop_bodies
                    if any(is_matmul(lines[b[0]]) for b in compute):
                        row["matmul"] += 1
                        row["matmul_in_loop"] += name in loop_bodies
                    break
    return out


# A fusion that runs a collective, as libtpu makes them: "calls=%all-reduce-scatter.3".
_FUSED = re.compile(r"\bcalls=%?((?:all-reduce-scatter|all-gather|reduce-scatter|all-reduce)"
                    r"[\w-]*?)(?:\.\d+)?[,\s]")


def forms(hlo_text: str) -> dict[str, int]:
    """How often each collective opcode form appears in the text (static count), with the
    async wrappers and fusions that run one."""
    bodies = parsed(computations(hlo_text)[0])
    count: dict[str, int] = collections.Counter()
    for body in bodies.values():
        for _, _, op, rest in body:
            if re.sub(r"-(start|update|done)$", "", op) in KINDS:
                count[op] += 1
            elif op.startswith("async-") and (kind := _collective_of(bodies, "async-start",
                                                                      rest)):
                count[f"{op} ({kind})"] += 1
            elif op == "fusion" and (m := _FUSED.search(rest + " ")):
                count[f"{m.group(1)} fusion"] += 1
    return dict(count)


# --- the benchmark -------------------------------------------------------------------------

def compile_for(args: argparse.Namespace) -> None:
    """``--compile-for``: every run compiled for GPUs this machine does not have; the program's
    collectives, overlap and temp memory, no times."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    from zero_jax import report
    from zero_jax.gpt import config
    from zero_jax.gpt.experiment import Experiment
    from zero_jax.state import abstract_state

    n, nodes = args.devices or 8, args.nodes
    per_node = n // nodes
    try:
        if n % nodes:
            raise ValueError(f"{nodes} nodes do not divide {n} devices")
        topology = topologies.get_topology_desc(platform="cuda", topology=f"{nodes}x1x{per_node}",
                                                target_config=TARGETS[args.compile_for])
    except Exception as e:  # noqa: BLE001  (no CUDA plugin, or one too old for this)
        raise SystemExit(f"error: cannot compile for {args.compile_for} here "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); install jax's "
                         'CUDA plugin into this environment: pip install "jax[cuda13]"') from e
    devices = np.array(topology.devices)

    def mesh_of(cfg: dict) -> Mesh:
        """train.py's mesh on these devices: (replica x) data (x model, T adjacent)."""
        group, t = cfg["zero"]["zero3_size"], cfg["mesh"]["tensor_parallel"]
        axes = {**({"replica": n // t // group, "data": group} if group else {"data": n // t}),
                **({"model": t} if t > 1 else {})}
        return Mesh(devices.reshape(tuple(axes.values())), tuple(axes),
                    axis_types=(AxisType.Auto,) * len(axes))

    hw = dataclasses.replace(estimate.H100, gpus_per_node=per_node)
    name = args.config or "gpt2-124m"
    where = f"{nodes} nodes of {per_node}" if nodes > 1 else f"{n}"
    print(f"{name} config, compiled (not run) for {where} x {topology.devices[0].device_kind} "
          f"(XLA's GPU compiler, no GPU present); jax {jax.__version__}\n")
    print("| stage | temp MiB | collectives per step (count / MiB) | read / ZeRO theory "
          "| async pairs with a matmul between start and done (in loop bodies) |")
    print("|---|---|---|---|---|")
    runs = RUNS + VARIANTS if nodes == 1 else [
        ("0", ["zero.stage=0"]), ("3", ["zero.stage=3"]),
        (f"3, hierarchical (zero3_size {per_node})", ["zero.stage=3",
                                                      f"zero.zero3_size={per_node}"])]
    results = []
    for stage, sets in chosen(runs, args.runs, on_request(config.load(name, args.set))):
        cfg = config.load(name, [*args.set, *sets])
        exp = Experiment.build(cfg, mesh_of(cfg))
        state = abstract_state(exp.plan, exp.tx)
        lowered = exp.step.lower(state, exp.batch_shape)
        compiled = lowered.compile()
        save_hlo(args, f"{name}-stage-{stage}", compiled)
        res = program(stage, compiled, report.build(exp.plan, state, lowered, compiled,
                                                     accum_steps=exp.accum_steps), n, hw,
                      _model_flops(exp, n))
        results.append(res)
        _row(res)
    # the baseline beside the rows, unless --runs names the rows to compile
    baseline = [] if args.runs else [_baseline(args, name, n, hw, mesh_of)]
    details(results)
    estimates(exp.model, hw, n, nodes, [*results, *baseline])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": name, "devices": n, "nodes": nodes,
                       "compiled_for": args.compile_for, "hardware": dataclasses.asdict(hw),
                       "device_kind": topology.devices[0].device_kind,
                       "stages": [*results, *baseline]}, f, indent=1)


def _baseline(args: argparse.Namespace, name: str, n: int, hw, mesh_of) -> dict:
    """The GSPMD FSDP baseline of ``bench/peers.py``, compiled as the rows are."""
    import peers  # the same model and optimizer, as GSPMD FSDP

    from zero_jax.gpt import config

    cfg = config.load(name, args.set)
    exp, lowered = peers.fsdp_lowered(cfg, mesh_of(cfg))
    compiled = lowered.compile()
    save_hlo(args, f"{name}-gspmd-fsdp", compiled)
    text = compiled.as_text()
    baseline = {"stage": "GSPMD FSDP (MaxText style)", "temp_bytes":
                compiled.memory_analysis().temp_size_in_bytes,
                "collectives": harness.collectives_summary(text, n), "overlap": overlap(text),
                "estimate": estimate.estimate(text, hw, n, _model_flops(exp, n))}
    _row(baseline)
    return baseline


def on_request(cfg: dict) -> list:
    """Rows made only where ``--runs`` names them: stage 0 with the config's layer loop unrolled
    whole (``model.scan_unroll`` its layers: no stacks for ``dots`` to zero and copy into, and
    XLA merges remat's recompute away; docs/benchmarks/history/gpu-compile-hbm.md)."""
    return [("0, unrolled", ["zero.stage=0", f"model.scan_unroll={cfg['model']['n_layers']}"])]


def chosen(runs: list, names: str | None, extra: list = ()) -> list:
    """``--runs``: the rows of ``runs`` and ``extra`` whose labels it names (without it, all of
    ``runs``)."""
    wanted = names.split(";") if names else None
    picked = list(runs) if wanted is None else [r for r in [*runs, *extra] if r[0] in wanted]
    if not picked:
        raise SystemExit(f"error: --runs {names!r} names none of "
                         f"{'; '.join(label for label, _ in [*runs, *extra])}")
    return picked


def program(stage: str, compiled, rep: dict, n_devices: int, hw=None,
            model_flops: float = 0.0) -> dict:
    """What one compiled step says: collectives, the reader's bytes against theory, overlap;
    with ``hw`` (``estimate.Hardware``) its estimated step time too, from the same text."""
    text = compiled.as_text()
    res = {"stage": stage, "collectives": harness.collectives_summary(text, n_devices),
           "comm_bytes": rep["comm_bytes_per_step"], "comm_theory": rep["comm_bytes_theory"],
           "overlap": overlap(text), "forms": forms(text),
           "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}
    if hw:
        res["estimate"] = estimate.estimate(text, hw, n_devices, model_flops)
    return res


def _row(res: dict) -> None:
    """One run's row of the compiled-program table."""
    theory = res.get("comm_theory")
    ratio = f"{res['comm_bytes'] / theory:.2f}" if theory else "-"
    pairs = ", ".join(f"{harness.SHORT[k]} {v['matmul']}/{v['pairs']} "
                      f"({v['matmul_in_loop']}/{v['in_loop']})"
                      for k, v in sorted(res["overlap"].items()))
    print(f"| {res['stage']} | {res['temp_bytes'] / MiB:.2f} "
          f"| {harness.format_collectives(res['collectives'])} | {ratio} "
          f"| {pairs or 'no async collectives'} |", flush=True)


def save_hlo(args: argparse.Namespace, name: str, compiled) -> None:
    """``--save-hlo``: the compiled program's text, gzipped."""
    if args.save_hlo:
        os.makedirs(args.save_hlo, exist_ok=True)
        path = os.path.join(args.save_hlo,
                            re.sub(r"[^\w.]+", "-", name).strip("-") + ".hlo.gz")
        with gzip.open(path, "wt") as f:
            f.write(compiled.as_text())


def _trace(out: str, name: str, r: dict) -> None:
    """One round of a run's steps under the profiler; its Perfetto trace copied to ``out``."""
    import glob
    import shutil
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for b in r["batches"]:
                r["state"], metrics = r["step"](r["state"], b)
            jax.block_until_ready(metrics)
        found = glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)
        os.makedirs(out, exist_ok=True)
        for path in found[:1]:
            shutil.copy(path, os.path.join(out, re.sub(r"[^\w.]+", "-", name) + ".trace.json.gz"))
        if not found:
            print(f"{name}: the profiler wrote no Perfetto trace", flush=True)


def _cost_flops(compiled) -> float | None:
    """The compiled program's own FLOP count (None where XLA gives none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]) if cost and "flops" in cost else None


def _model_flops(exp, n_devices: int) -> float:
    """Model FLOPs of one step, per device."""
    return flops_per_token(exp.model) * exp.tokens_per_step / n_devices


def estimates(model, hw, n: int, nodes: int, results: list[dict]) -> None:
    """The estimate table (``bench/estimate.py``), its inputs first."""
    print(f"\nEstimate, not a measurement (bench/estimate.py reads the compiled program: "
          f"per op max(FLOPs / peak, bytes / HBM) in schedule order, each async collective's "
          f"link time hidden by the compute between its start and done). Inputs: "
          f"{hw.name}, peak dense bf16 {hw.peak_flops / 1e12:.0f} TFLOP/s, HBM "
          f"{hw.hbm / 1e12:.2f} TB/s, NVLink {hw.nvlink / 1e9:.0f} GB/s per GPU per direction "
          f"within a node of {hw.gpus_per_node}, network {hw.network / 1e9:.0f} GB/s per GPU "
          f"across nodes ({hw.network * 8 / 1e9:.0f} Gb/s); {n} GPUs"
          + (f" on {nodes} nodes" if nodes > 1 else ", one node")
          + f"; {model.active_params:,} parameters a token computes with, model FLOPs per "
          "token 6N + 12LdT = "
          f"{flops_per_token(model) / 1e9:.3f} GFLOP.\n")
    print("| run | est. step ms | est. compute ms | est. comm ms (link) | est. exposed comm ms "
          "| est. MFU | est. step / stage 0 |")
    print("|---|---|---|---|---|---|---|")
    base = next((r["estimate"]["step_s"] for r in results if r["stage"] == "0"), None)
    for r in results:
        e = r["estimate"]
        ratio = f"{e['step_s'] / base:.2f}" if base else "-"
        print(f"| {r['stage']} | {e['step_s'] * 1e3:.2f} | {e['compute_s'] * 1e3:.2f} "
              f"| {e['comm_s'] * 1e3:.2f} | {e['exposed_s'] * 1e3:.2f} | {e['mfu']:.1%} "
              f"| {ratio} |")
    if once := max(r["estimate"]["loops_counted_once"] for r in results):
        print(f"\n{once} loops whose trip count is known only when they run (the experts' "
              f"tiles) are counted once: these estimates are too low.")


def details(results: list[dict]) -> None:
    print("\nThe reader on this compile: opcode forms in the text, and the bytes zero_jax.hlo "
          "reads per step against ZeRO's theory for the stage (on the CPU mesh: 1.00, 1.50, 1.00, "
          "0.98 for stages 0-3; stage 1 all-reduces, then gathers the updated parameters):")
    for res in results:
        print(f"  stage {res['stage']}: forms "
              + (", ".join(f"{k} x{v}" for k, v in sorted(res["forms"].items())) or "none"))
        theory = res["comm_theory"]
        print(f"    read {res['comm_bytes'] / MiB:.2f} MiB, theory {theory / MiB:.2f} MiB"
              + (f", ratio {res['comm_bytes'] / theory:.2f}" if theory else ""))
        for kind, v in sorted(res["overlap"].items()):
            print(f"    {kind:<19} async pairs {v['pairs']}: {v['overlapped']} with compute "
                  f"between start and done, {v['matmul']} with a matmul ({v['in_loop']} pairs "
                  f"in loop bodies: {v['overlapped_in_loop']} with compute, "
                  f"{v['matmul_in_loop']} with a matmul), {v['sync']} marked is_sync")


def main() -> None:
    args = parse_args()
    if args.compile_for:
        return compile_for(args)

    import jax

    try:
        devices = jax.devices()
    except RuntimeError as e:  # a platform asked for (JAX_PLATFORMS) but not there
        print(f"no GPU found ({str(e).splitlines()[0]}): nothing to measure")
        return
    platform = devices[0].platform
    if platform != "gpu" and not args.allow_cpu:
        print(f"no GPU found (jax sees {len(devices)} {platform} device(s)): nothing to measure; "
              "--allow-cpu runs the same code on simulated CPU devices, --compile-for h100 "
              "compiles for GPUs without running")
        return

    from zero_jax.gpt import config, data
    from zero_jax.mesh import make_mesh

    name = args.config or ("gpt2-124m" if platform == "gpu" else "tiny")
    mesh = make_mesh(args.devices)
    device = mesh.devices.flat[0]
    peak = peak_flops(device.device_kind)
    print(harness.header(name, mesh, args.rounds, args.steps), flush=True)

    tokens = data.stdlib_corpus()
    runs = []
    for stage, sets in chosen(RUNS, args.runs, on_request(config.load(name, args.set))):
        cfg = config.load(name, [*args.set, *sets])
        if r := harness.try_build(f"stage {stage}", cfg, mesh, tokens, args.steps):
            r["stage"] = stage
            runs.append(r)
    if not runs:
        raise SystemExit("error: no stage could run")
    harness.time_interleaved(runs, args.rounds)
    for r in runs:
        save_hlo(args, f"{name}-stage-{r['stage']}", r["step"])
        if args.trace:
            _trace(args.trace, f"{name}-stage-{r['stage']}", r)

    model = runs[0]["exp"].model
    per_token = flops_per_token(model)
    print(f"{model.n_params:,} parameters; model FLOPs per token 6N + 12LdT = "
          f"{per_token / 1e9:.3f} GFLOP; peak dense bf16 per device: "
          + (f"{peak / 1e12:.0f} TFLOP/s ({device.device_kind})" if peak
             else f"unknown for {device.device_kind!r}") + "\n")
    hw = estimate.hardware_of(device.device_kind)
    if hw:  # one node: every collective over NVLink
        hw = dataclasses.replace(hw, gpus_per_node=mesh.size)
    print("| stage | step ms | tokens/s | MFU | estimate ms (measured / estimate) "
          "| collectives per step (count / MiB) "
          "| async pairs with a matmul between start and done |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for r in runs:
        res = program(r["stage"], r["step"], r["report"], mesh.size, hw,
                      _model_flops(r["exp"], mesh.size))
        tps = r["exp"].tokens_per_step / r["ms"] * 1e3
        mfu = per_token * tps / (peak * mesh.size) if peak else None
        res.update(step_ms=r["ms"], tokens_per_s=tps, mfu=mfu, cost_flops=_cost_flops(r["step"]))
        results.append(res)
        pairs = ", ".join(f"{harness.SHORT[k]} {v['matmul']}/{v['pairs']}"
                          for k, v in sorted(res["overlap"].items()))
        est = res.get("estimate")
        print(f"| {r['stage']} | {r['ms']:.1f} | {tps:,.0f} | "
              f"{f'{mfu:.1%}' if mfu is not None else 'unknown'} | "
              + (f"{est['step_s'] * 1e3:.1f} ({r['ms'] / (est['step_s'] * 1e3):.2f})"
                 if est else f"no figures for {device.device_kind!r}")
              + f" | {harness.format_collectives(res['collectives'])} "
              f"| {pairs or 'no async collectives'} |")
    if hw:
        estimates(model, hw, mesh.size, 1, results)
        print("\nFLOPs per step per device, the estimate's count (dots and GEMMs) against the "
              "compiled program's cost_analysis():")
        for res in results:
            print(f"  stage {res['stage']}: {res['estimate']['hlo_flops'] / 1e12:.3f} TFLOP"
                  + (f" vs {res['cost_flops'] / 1e12:.3f}" if res["cost_flops"] else ""))
    details(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": name, "devices": mesh.size, "device_kind": device.device_kind,
                       "platform": platform, "n_params": model.n_params,
                       "flops_per_token": per_token, "peak_bf16": peak, "steps": args.steps,
                       "rounds": args.rounds, "stages": results}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
