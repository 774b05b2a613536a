"""ZeRO stages 0-3 of GPT-2 small (124M) on every visible GPU: step time, tokens/s, model FLOPs
utilization, the compiled step's collectives, and whether its async collectives overlap compute.

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
  then this script's own independent reading of the same text (``own_reading``) beside it, so a
  real GPU compile shows whether the reader understands the forms the GPU backend prints.
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
import math
import re
import sys

import harness  # bench/harness.py, beside this script (puts the repository on sys.path)

# Peak dense bf16 FLOP/s, by a lowercase substring of ``device.device_kind``; the first match
# wins ("NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" not).
PEAK_BF16 = [("h100 pcie", 756e12), ("h100 nvl", 835e12), ("h100", 989e12),
             ("gh200", 989e12), ("h200", 989e12), ("a100", 312e12), ("b200", 2250e12),
             ("l40s", 362e12)]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A",
         "collective-permute": "CP"}
# Instructions that are no work of their own: between a start and its done they hide nothing.
NOT_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
               "add-dependency", "opt-barrier", "partition-id", "replica-id", "async-start",
               "async-update", "async-done"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
MiB = 2 ** 20

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+)(?: \(.*)? \{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CALLEES = re.compile(r"\b(?:to_apply|calls|branch_computations|true_computation|"
                      r"false_computation)=(?:\{([^}]*)\}|%?([\w.\-]+))")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")


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

def computations(hlo_text: str) -> tuple[dict[str, list[tuple]], str | None]:
    """``{name: [(instruction, shape, op, rest), ...]}`` in text (= schedule) order, and the
    entry's name."""
    bodies: dict[str, list[tuple]] = collections.defaultdict(list)
    entry = current = None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1)
            entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif current and (m := _INSTRUCTION.match(line)):
            bodies[current].append(m.groups())
    return bodies, entry


def top_level(shape: str) -> list[str]:
    """The elements of a tuple shape ("((f32[8]{0}), f32[1]{0})" -> ["(f32[8]{0})",
    "f32[1]{0}"]); an array shape is one element."""
    shape = re.sub(r"/\*.*?\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            out.append(shape[start:i].strip())
            start = i + 1
    return [x for x in out if x]


def nbytes(shape: str) -> int:
    return sum(DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _ARRAY.findall(shape))


def group_size(rest: str, n_devices: int) -> int:
    if m := _GROUPS_IOTA.search(rest):
        return int(m.group(2))
    if (m := _GROUPS_LIST.search(rest)) and m.group(1):
        return len(m.group(1).split(","))
    return n_devices


def _collective_of(bodies: dict, op: str, rest: str) -> tuple[str, tuple] | None:
    """(kind, the instruction doing it) of a collective or async start, else None."""
    if op in KINDS or (op.endswith("-start") and op.removesuffix("-start") in KINDS):
        return op.removesuffix("-start"), None
    if op == "async-start" and (m := _CALLS.search(rest)):
        for inner in bodies.get(m.group(1), ()):
            if inner[2] in KINDS:
                return inner[2], inner
    return None


def payload(op: str, shape: str, rest: str, n_devices: int) -> int:
    """Bytes of one execution, the full-size side (as zero_jax.hlo means it): an all-gather's
    result, a reduce-scatter's input, an all-reduce's operand."""
    kind = op.removesuffix("-start")
    parts = top_level(shape)
    if op.endswith("-start") and kind != "all-reduce" and len(parts) > 1:
        # async forms: (operands, results[, context]); all-reduce-start's shape is its results
        if kind == "reduce-scatter":
            return nbytes(parts[0])  # the operands: the full-size input
        return nbytes(parts[1])
    if kind == "reduce-scatter":
        return nbytes(shape) * group_size(rest, n_devices)
    return nbytes(shape)


def own_reading(hlo_text: str, n_devices: int) -> dict[str, list[int]]:
    """``{kind: [executions per step, payload bytes per step]}``, read independently of
    zero_jax.hlo: async starts by their operand/result halves, wrapped async collectives by
    the instruction inside, loops by their known trip counts; done/update halves ignored."""
    bodies, entry = computations(hlo_text)
    runs: dict[str, int] = collections.Counter()

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for _, _, op, rest in bodies.get(name, ()):
            if op == "while" and (m := _BODY.search(rest)):
                trip = _TRIP.search(rest)
                visit(m.group(1), times * (int(trip.group(1)) if trip else 1))
            elif op in ("call", "conditional"):  # every branch, as zero_jax.hlo counts them
                for listed, single in _CALLEES.findall(rest):
                    for callee in (c.strip().lstrip("%") for c in (listed or single).split(",")):
                        if callee in bodies:
                            visit(callee, times)

    if entry is not None:
        visit(entry, 1)
    out: dict[str, list[int]] = {}
    for name, times in runs.items():
        for _, shape, op, rest in bodies[name]:
            found = _collective_of(bodies, op, rest)
            if not found:
                continue
            kind, inner = found
            if inner is not None:  # async-start around the collective: read the collective
                _, shape, op, rest = inner
            size = payload(op, shape, rest, n_devices)
            if group_size(rest, n_devices) > 1:
                acc = out.setdefault(kind, [0, 0])
                acc[0] += times
                acc[1] += times * size
    return out


def overlap(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per collective kind: async start/done pairs, how many have compute scheduled between
    them, how many of those are in a loop body, and how many XLA marked synchronous."""
    bodies, _ = computations(hlo_text)
    loop_bodies = {m.group(1) for body in bodies.values() for _, _, op, rest in body
                   if op == "while" and (m := _BODY.search(rest))}
    out: dict[str, dict[str, int]] = {}
    for name, body in bodies.items():
        starts: dict[str, tuple[str, int, str]] = {}  # start or update name -> (kind, index)
        for i, (inst, _, op, rest) in enumerate(body):
            operands = set(re.findall(r"%?([\w.\-]+)", rest))
            if op.endswith("-start") or op == "async-start":
                found = _collective_of(bodies, op, rest)
                if found:
                    starts[inst] = (found[0], i, rest)
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
    bodies, _ = computations(hlo_text)
    count: dict[str, int] = collections.Counter()
    for body in bodies.values():
        for _, _, op, rest in body:
            if re.sub(r"-(start|update|done)$", "", op) in KINDS:
                count[op] += 1
            elif op.startswith("async-") and (found := _collective_of(bodies, "async-start",
                                                                       rest)):
                count[f"{op} ({found[0]})"] += 1
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
    from zero_jax.hlo import collectives
    from zero_jax.mesh import make_mesh

    name = args.config or ("gpt2-124m" if platform == "gpu" else "tiny")
    mesh = make_mesh(args.devices)
    device = mesh.devices.flat[0]
    peak = peak_flops(device.device_kind)
    print(harness.header(name, mesh, args.rounds, args.steps), flush=True)

    tokens = data.stdlib_corpus()
    runs = []
    for stage in range(4):
        cfg = config.load(name, [*args.set, f"zero.stage={stage}"])
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
        by_kind: dict[str, list[int]] = {}
        for c in collectives(text, mesh.size):
            if c.group_size > 1:
                acc = by_kind.setdefault(c.kind, [0, 0])
                acc[0] += c.count
                acc[1] += c.count * c.bytes
        mine, ov = own_reading(text, mesh.size), overlap(text)
        comm = ", ".join(f"{SHORT[k]} {n} / {b / MiB:.3g}"
                         for k, (n, b) in sorted(by_kind.items()))
        pairs = ", ".join(f"{SHORT[k]} {v['overlapped']}/{v['pairs']}"
                          for k, v in sorted(ov.items()))
        print(f"| {r['stage']} | {r['ms']:.1f} | {tps:,.0f} | "
              f"{f'{mfu:.1%}' if mfu is not None else 'unknown'} | {comm or 'none'} "
              f"| {pairs or 'no async collectives'} |")
        results.append({"stage": r["stage"], "step_ms": r["ms"], "tokens_per_s": tps,
                        "mfu": mfu, "collectives": by_kind, "own_reading": mine,
                        "overlap": ov, "forms": forms(text),
                        "temp_bytes": r["step"].memory_analysis().temp_size_in_bytes})

    print("\nThe reader on this compile: opcode forms in the text, and zero_jax.hlo's count and "
          "payload per step beside this script's independent reading:")
    for res in results:
        print(f"  stage {res['stage']}: forms "
              + (", ".join(f"{k} x{v}" for k, v in sorted(res["forms"].items())) or "none"))
        for kind in sorted(set(res["collectives"]) | set(res["own_reading"])):
            a = res["collectives"].get(kind, [0, 0])
            b = res["own_reading"].get(kind, [0, 0])
            verdict = "agree" if a == b else "DISAGREE"
            print(f"    {kind:<19} zero_jax.hlo {a[0]:>5} / {a[1] / MiB:>9.2f} MiB   "
                  f"own {b[0]:>5} / {b[1] / MiB:>9.2f} MiB   {verdict}")
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
