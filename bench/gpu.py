"""ZeRO stages 0-3 of GPT-2 small (124M) on every visible GPU, and stage 3 without prefetch: step
time, tokens/s, model FLOPs utilization, the compiled step's collectives, and whether its async
collectives overlap compute.

    python bench/gpu.py [--config gpt2-124m] [--devices N] [--steps 10] [--rounds 5] [--set K=V]
        [--json results.json]
    python bench/gpu.py --allow-cpu     # the same code path on 8 simulated CPU devices (tiny)

Without a GPU (and without ``--allow-cpu``) it says so in one line and exits 0.

* Step time: the median over rounds of the mean step time, stages interleaved
  (``bench/harness.py``); tokens/s from it.
* MFU: model FLOPs per token, 6 N + 12 L d T (N parameters, embeddings included: the head is
  tied, so the embedding matrix is a matmul's weight too; L layers of width d over T positions:
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
  scheduled between start and done, in the entry computation or in a loop body.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

import harness  # bench/harness.py, beside this script (puts the repository on sys.path)

from zero_jax.hlo import KINDS, computations, instruction  # noqa: E402

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
# Stages 0-3 as configured (stage 3 prefetches the next layer's gather by default), and stage 3
# without prefetch: what prefetch buys where collectives can overlap compute.
RUNS = [(str(s), [f"zero.stage={s}"]) for s in range(4)] + [
    ("3, no prefetch", ["zero.stage=3", "zero.prefetch=false"])]
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
    p.add_argument("--allow-cpu", action="store_true",
                   help="no GPU: run on simulated CPU devices (to test this script)")
    args = p.parse_args()
    if args.allow_cpu:  # before jax starts a backend (harness.parse_args always does it)
        from zero_jax.mesh import simulate_cpu_devices

        simulate_cpu_devices(args.devices or 8)
    return args


def peak_flops(device_kind: str) -> float | None:
    kind = device_kind.lower()
    return next((peak for name, peak in PEAK_BF16 if name in kind), None)


def flops_per_token(model) -> float:
    """Model FLOPs per token of a training step (forward and backward), PaLM's accounting."""
    return 6 * model.n_params + 12 * model.n_layers * model.d_model * model.seq_len


# --- reading the compiled HLO text ---------------------------------------------------------

def parsed(hlo_text: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """``{computation: [(name, shape, opcode, rest), ...]}`` in schedule order
    (``zero_jax.hlo``'s reading of the text)."""
    bodies, _ = computations(hlo_text)
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
    them, how many of those are in a loop body, and how many XLA marked synchronous."""
    bodies = parsed(hlo_text)
    loop_bodies = {m.group(1) for body in bodies.values() for _, _, op, rest in body
                   if op == "while" and (m := _BODY.search(rest))}
    out: dict[str, dict[str, int]] = {}
    for name, body in bodies.items():
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
                    between = [b[2] for b in body[j + 1:i]]
                    compute = [b for b in between if b not in NOT_COMPUTE
                               and not re.search(r"-(start|update|done)$", b)]
                    row = out.setdefault(kind, {"pairs": 0, "overlapped": 0, "in_loop": 0,
                                                "overlapped_in_loop": 0, "sync": 0})
                    row["pairs"] += 1
                    row["in_loop"] += name in loop_bodies
                    row["sync"] += bool(re.search(r'"is_sync":\s*true', start_rest))
                    if compute:
                        row["overlapped"] += 1
                        row["overlapped_in_loop"] += name in loop_bodies
                    break
    return out


def forms(hlo_text: str) -> dict[str, int]:
    """How often each collective opcode form appears in the text (static count)."""
    bodies = parsed(hlo_text)
    count: dict[str, int] = collections.Counter()
    for body in bodies.values():
        for _, _, op, rest in body:
            if re.sub(r"-(start|update|done)$", "", op) in KINDS:
                count[op] += 1
            elif op.startswith("async-") and (kind := _collective_of(bodies, "async-start",
                                                                      rest)):
                count[f"{op} ({kind})"] += 1
    return dict(count)


# --- the benchmark -------------------------------------------------------------------------

def main() -> None:
    args = parse_args()

    import jax

    try:
        devices = jax.devices()
    except RuntimeError as e:  # a platform asked for (JAX_PLATFORMS) but not there
        print(f"no GPU found ({str(e).splitlines()[0]}): nothing to measure")
        return
    platform = devices[0].platform
    if platform != "gpu" and not args.allow_cpu:
        print(f"no GPU found (jax sees {len(devices)} {platform} device(s)): nothing to measure; "
              "--allow-cpu runs the same code on simulated CPU devices")
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
    for stage, sets in RUNS:
        cfg = config.load(name, [*args.set, *sets])
        try:
            r = harness.build(cfg, mesh, tokens, args.steps)
            r["state"], _ = r["step"](r["state"], r["batches"][0])  # fails here if no memory
            jax.block_until_ready(r["state"])
        except Exception as e:  # noqa: BLE001  (one stage out of memory: report the others)
            print(f"stage {stage}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                  flush=True)
            continue
        r["stage"] = stage
        runs.append(r)
    if not runs:
        raise SystemExit("error: no stage could run")
    harness.time_interleaved(runs, args.rounds)

    model = runs[0]["exp"].model
    per_token = flops_per_token(model)
    print(f"{model.n_params:,} parameters; model FLOPs per token 6N + 12LdT = "
          f"{per_token / 1e9:.3f} GFLOP; peak dense bf16 per device: "
          + (f"{peak / 1e12:.0f} TFLOP/s ({device.device_kind})" if peak
             else f"unknown for {device.device_kind!r}") + "\n")
    print("| stage | step ms | tokens/s | MFU | collectives per step (count / MiB) "
          "| async pairs overlapping compute |")
    print("|---|---|---|---|---|---|")
    results = []
    for r in runs:
        text = r["step"].as_text()
        tps = r["exp"].tokens_per_step / r["ms"] * 1e3
        mfu = per_token * tps / (peak * mesh.size) if peak else None
        by_kind = harness.collectives_summary(text, mesh.size)
        ov = overlap(text)
        comm = harness.format_collectives(by_kind)
        pairs = ", ".join(f"{harness.SHORT[k]} {v['overlapped']}/{v['pairs']}"
                          for k, v in sorted(ov.items()))
        print(f"| {r['stage']} | {r['ms']:.1f} | {tps:,.0f} | "
              f"{f'{mfu:.1%}' if mfu is not None else 'unknown'} | {comm} "
              f"| {pairs or 'no async collectives'} |")
        results.append({"stage": r["stage"], "step_ms": r["ms"], "tokens_per_s": tps,
                        "mfu": mfu, "collectives": by_kind,
                        "comm_bytes": r["report"]["comm_bytes_per_step"],
                        "comm_theory": r["report"]["comm_bytes_theory"],
                        "overlap": ov, "forms": forms(text),
                        "temp_bytes": r["step"].memory_analysis().temp_size_in_bytes})

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
                  f"between start and done ({v['overlapped_in_loop']} of them in a loop body; "
                  f"{v['in_loop']} pairs in loop bodies), {v['sync']} marked is_sync")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": name, "devices": mesh.size, "device_kind": device.device_kind,
                       "platform": platform, "n_params": model.n_params,
                       "flops_per_token": per_token, "peak_bf16": peak, "steps": args.steps,
                       "rounds": args.rounds, "stages": results}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
