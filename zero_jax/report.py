"""What a compiled ZeRO step really holds and moves, per device, next to ZeRO's accounting.

Bytes come from the arrays' own shardings (``sharding.shard_shape``), memory from XLA's
``memory_analysis()``, communication from the collectives in the compiled HLO.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.distributed import processes_spanned
from zero_jax.hlo import DTYPE_BYTES, collectives
from zero_jax.mesh import MODEL
from zero_jax.peak import compile_with_peak
from zero_jax.plan import Plan, held_once, path_str
from zero_jax.state import abstract_state, grads_in_host_memory

PyTree = Any
MiB = 1 << 20


def shard_bytes(tree: PyTree, memory: str | None = None) -> int:
    """Bytes one device holds of a tree of arrays or ``ShapeDtypeStruct``s with shardings; with
    ``memory`` ("device", "pinned_host"), only those in that memory."""
    kind = lambda x: x.sharding.memory_kind or "device"
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree) if memory is None or kind(x) == memory)


def total_bytes(tree: PyTree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def model_states(plan: Plan, state: PyTree,
                 accum_steps: int = 1) -> tuple[dict, dict, dict, dict]:
    """Per-device bytes of each copy of the model state in device memory and in host memory,
    from the shardings, and ZeRO's formulas for both (Psi parameters, N devices, K bytes of
    optimizer state each; ZeRO-Offload moves the offloaded fraction of master and optimizer
    state to the host); the gradients in their dtype for a step of ``accum_steps``
    microbatches."""
    n, rule, prec = plan.dp_size, plan.rule, plan.precision
    grad_dtype = prec.grad_dtype(accum_steps)
    host_grads = grads_in_host_memory(plan, accum_steps)
    # Hierarchical: the backward reduce-scatters within the group (1/K, the accumulator's
    # layout too); the across-group cut to 1/N follows the last microbatch.
    grad_specs = plan.param_specs if plan.outer else plan.grad_specs
    grads = jax.tree.map(
        lambda p, s, host: jax.ShapeDtypeStruct(p.shape, grad_dtype, sharding=s if not host
                                                else s.with_memory_kind("pinned_host")),
        state.params, plan.shardings(grad_specs), host_grads)
    # Per tensor-parallel rank: a leaf cut over ``model`` counts 1/T (ZeRO's rule holds per rank).
    psi = per_rank(plan)
    c, g = prec.compute.itemsize, jnp.dtype(grad_dtype).itemsize
    whole = sum(math.prod(p.shape) for p in jax.tree.leaves(state.params))
    k_opt = total_bytes(state.opt_state) / whole  # optimizer bytes per parameter (Adam fp32: 8)
    leaves = jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "offload"))
    fraction = lambda flags: sum(math.prod(x.shape) / (plan.tp_size if x.model_dim is not None
                                                         else 1)
                                 for x, f in zip(leaves, flags, strict=True) if f) / psi
    host = fraction(x.offload for x in leaves)  # master and optimizer state offloaded
    grads_host = fraction(jax.tree.leaves(host_grads))  # streamed gradients

    def formula(bytes_per_param: float, sharded: bool) -> float:
        return bytes_per_param * psi / (n if sharded else 1)

    copies = {"params": state.params, "grads": grads, "master": state.master,
              "opt_state": state.opt_state}
    on_device = {k: shard_bytes(v, "device") if v is not None else 0 for k, v in copies.items()}
    on_host = {k: shard_bytes(v, "pinned_host") if v is not None else 0
               for k, v in copies.items()}
    group = plan.mesh.shape[plan.axis]  # hierarchical: parameters are cut within a group only
    master = formula(4 * plan.has_master, rule.shard_opt_state)
    opt = formula(k_opt, rule.shard_opt_state)
    params = c * psi / (group if rule.shard_params else 1)
    grads = g * psi / group if plan.outer else formula(g, rule.shard_grads)
    zero = {"params": 0 if plan.offload.params else params, "grads": grads * (1 - grads_host),
            "master": master * (1 - host), "opt_state": opt * (1 - host)}
    zero_host = {"params": params if plan.offload.params else 0, "grads": grads * grads_host,
                 "master": master * host, "opt_state": opt * host}
    return on_device, zero, on_host, zero_host


def per_rank(plan: Plan) -> float:
    """The parameters one tensor-parallel rank holds: Psi / T of the leaves cut over ``model``,
    all of the others (Psi without tensor parallelism)."""
    return sum(math.prod(leaf.shape) / (plan.tp_size if leaf.model_dim is not None else 1)
               for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "offload")))


def stages_table(plan: Plan, tx: Any, accum_steps: int = 1) -> list[dict]:
    """Model-state bytes per device at each stage, for this model, mesh and precision, in device
    and host memory; each stage also with its whole optimizer offloaded (ZeRO-Offload)."""
    rows = []
    for stage in range(4):
        for offload in (False, True):
            leaves = jax.tree.map(
                lambda leaf, o=offload: dataclasses.replace(leaf, offload=o and not leaf.frozen),
                plan.leaves, is_leaf=lambda x: hasattr(x, "offload"))
            no_params = dataclasses.replace(plan.offload, params=False)
            other = dataclasses.replace(plan, stage=stage, leaves=leaves, offload=no_params)
            device, zero, host, zero_host = model_states(other, abstract_state(other, tx),
                                                         accum_steps)
            rows.append({"stage": stage, "offload": offload, **device,
                         "total": sum(device.values()),
                         "zero_formula_total": sum(zero.values()),
                         "host": sum(host.values()), "zero_formula_host": sum(zero_host.values())})
    return rows


def format_stages(rows: list[dict], n_params: int, devices: int) -> str:
    unit, div = ("GiB", 1 << 30) if rows[0]["total"] >= 1 << 30 else ("MiB", MiB)
    lines = [f"  model states per device at each stage, Psi = {n_params:,}, N = {devices} "
             f"({unit}); offload: master and optimizer state in host memory (ZeRO-Offload):",
             f"  {'stage':<11}{'params':>9}{'grads':>9}{'master':>9}{'optimizer':>11}"
             f"{'device':>9}{'ZeRO formula':>14}{'host':>9}{'formula':>9}"]
    for r in rows:
        name = f"{r['stage']}" + (" offload" if r.get("offload") else "")
        lines.append(f"  {name:<11}{r['params'] / div:>9.2f}{r['grads'] / div:>9.2f}"
                     f"{r['master'] / div:>9.2f}{r['opt_state'] / div:>11.2f}"
                     f"{r['total'] / div:>9.2f}{r['zero_formula_total'] / div:>14.2f}"
                     f"{r['host'] / div:>9.2f}{r['zero_formula_host'] / div:>9.2f}")
    return "\n".join(lines)


def stage_summary(r: dict) -> dict:
    """One stage's compiled step as the figures compare the stages (``r`` its report): the
    state it keeps in device memory (parameters, master, optimizer state, from the shardings),
    its compiled temp (where its gradients, activations and gathered layers live: ZeRO's
    gradient bytes are inside it, so they are not added again), its host memory, and per mesh
    axes its collectives by kind (an all-reduce counted twice) beside ZeRO's theory."""
    measured: dict[str, dict[str, int]] = {}
    for g in r["collectives"]:
        kinds = measured.setdefault(g["axes"], {})
        kinds[g["kind"]] = kinds.get(g["kind"], 0) + g["volume"]
    state = {k: r["per_device_bytes"][k] for k in ("params", "master", "opt_state")}
    return {"stage": r["stage"], **state, "temp": r["compiled"]["temp_bytes"],
            "device": sum(state.values()) + r["compiled"]["temp_bytes"],
            "host": sum(r["per_device_host_bytes"].values()),
            "comm_bytes": measured, "comm_bytes_theory": r["comm_bytes_theory_by_axes"],
            "comm_theory_formula": r["comm_theory_formula"]}


def format_compiled(rows: list[dict]) -> str:
    """``stage_summary``'s rows as a table: the stages compiled on equal terms."""
    lines = ["  each stage's step compiled with this run's settings, per device (MiB): state "
             "(parameters, master, optimizer) + compiled temp (gradients, activations, gathered "
             "layers):",
             f"  {'stage':<7}{'state':>9}{'temp':>9}{'device':>9}{'host':>9}{'comm/step':>11}"
             f"{'ZeRO theory':>13}"]
    for r in rows:
        comm = sum(v for kinds in r["comm_bytes"].values() for v in kinds.values())
        lines.append(f"  {r['stage']:<7}{(r['device'] - r['temp']) / MiB:>9.2f}"
                     f"{r['temp'] / MiB:>9.2f}{r['device'] / MiB:>9.2f}{r['host'] / MiB:>9.2f}"
                     f"{comm / MiB:>11.2f}{sum(r['comm_bytes_theory'].values()) / MiB:>13.2f}"
                     f" ({r['comm_theory_formula']})")
    return "\n".join(lines)


def mesh_axes(group: tuple[int, ...], mesh: Any) -> str:
    """The mesh axes a replica group spans ("data", "replica", "replica+data"): a collective's
    partition ids are positions in the mesh's device order."""
    coords = [np.unravel_index(i, mesh.devices.shape) for i in group]
    spanned = [name for d, name in enumerate(mesh.axis_names)
               if len({c[d] for c in coords}) > 1]
    return "+".join(spanned) or "none"


def build(plan: Plan, state: PyTree, lowered: Any, compiled: Any | None = None,
          peak: dict | None = None, block_input: jax.ShapeDtypeStruct | None = None,
          accum_steps: int | None = None) -> dict:
    """The report of one step, from ``lowered = step.lower(state, batch)`` and its compilation;
    ``state`` is the (abstract or real) train state; ``peak``: what is live at the compiled
    step's peak (``zero_jax.peak``), found here when the step is compiled here. Microbatches:
    the step's, read off ``lowered`` (lowered otherwise: ``accum_steps``, or one)."""
    k = _microbatches(lowered, accum_steps)
    if compiled is None:
        compiled, peak = compile_with_peak(lowered)
    mesh, rule, prec = plan.mesh, plan.rule, plan.precision
    psi = sum(math.prod(p.shape) for p in jax.tree.leaves(state.params))
    actual, zero, host, zero_host = model_states(plan, state, k)
    nvme = nvme_files(plan, host, zero_host)  # takes its bytes out of the host tables
    memory = compiled.memory_analysis()
    found = collectives(compiled.as_text(), mesh.size)
    groups = collective_groups(found, mesh)
    by_axes, formula = comm_theory(plan, block_input, accum_steps=k)
    return {
        "stage": plan.stage,
        "rule": rule.moves + (
            f"; hierarchical: parameters cut within groups of {mesh.shape[plan.axis]}, "
            "gradients reduce-scattered across groups and parameters all-gathered back once "
            "per step" if plan.outer else ""),
        "mesh": dict(mesh.shape),
        "platform": mesh.devices.flat[0].platform,
        "n_params": psi,
        "param_bytes": psi * prec.compute.itemsize,  # one whole compute copy of the parameters
        "precision": {"param_dtype": prec.compute.name, "reduce_dtype": prec.reduce.name,
                      "grad_dtype": jnp.dtype(prec.grad_dtype(k)).name,
                      "master": plan.has_master, "accum_steps": k,
                      "loss_scale": prec.loss_scale is not None},
        "per_device_bytes": actual,  # in device memory
        "zero_formula_bytes": zero,
        "per_device_host_bytes": host,  # in the host memory beside each device (offloaded)
        "zero_formula_host_bytes": zero_host,
        "offload": {"optimizer_leaves": [leaf.path for leaf in jax.tree.leaves(
                        plan.leaves, is_leaf=lambda x: hasattr(x, "offload")) if leaf.offload],
                    "params": plan.offload.params, "nvme": nvme},
        # XLA's figures; the CPU backend counts host buffers as device ones (its host_* are 0).
        "compiled": {f"{k}_bytes": getattr(memory, f"{k}_size_in_bytes") for k in (
            "argument", "output", "temp", "alias", "host_argument", "host_output", "host_temp")},
        "collectives": sorted(groups.values(), key=lambda x: (x["kind"], x["in_loop"])),
        **as_requested(plan, lowered, found, block_input, k),
        "comm_bytes_per_step": sum(x.volume for x in found),
        # Several processes (hosts): what crosses between them, the figure that sets the pace.
        "processes": len({d.process_index for d in mesh.devices.flat}),
        "comm_bytes_across_processes": sum(g["volume"] for g in groups.values()
                                           if g["processes"] > 1),
        # Hierarchical: "data" is within a group, "replica" across groups.
        "comm_bytes_by_axes": {axes: sum(g["volume"] for g in groups.values()
                                         if g["axes"] == axes)
                               for axes in sorted({g["axes"] for g in groups.values()})},
        "comm_bytes_theory": sum(by_axes.values()),
        "comm_theory_formula": formula,
        "comm_bytes_theory_by_axes": by_axes,
        "peak": None if peak is None else {**peak, "expected": peak_expected(plan, k)},
        **layout(plan, state, found, held_whole(plan, peak, psi * prec.compute.itemsize), k),
        **saved_activations(plan, block_input, k),
    }


def _microbatches(lowered: Any, given: int | None) -> int:
    """The step's microbatches: ``lowered``'s (``TrainStep.lower`` sets them), else ``given``
    or one; a ``given`` that contradicts the step is refused."""
    own = getattr(lowered, "accum_steps", None)
    if own is not None and given is not None and given != own:
        raise ValueError(f"report.build: accum_steps={given}, but the step was made with "
                         f"{own} microbatches; leave accum_steps out")
    return own or given or 1


def nvme_files(plan: Plan, host: dict, zero_host: dict) -> dict | None:
    """With the NVMe tier, per device: the bytes of master and optimizer state in files (taken
    out of the host tables, where they only stream through), read and written once a step,
    and the host buffers per process."""
    nvme = plan.offload.nvme
    if nvme is None:
        return None
    in_files = {k: host[k] for k in ("master", "opt_state")}
    for table in (host, zero_host):
        table.update(master=0, opt_state=0)
    return {"path": nvme.path, "file_bytes": in_files,
            "swapped_bytes_per_step": 2 * sum(in_files.values()),
            "buffer_bytes": nvme.buffers * nvme.chunk_bytes}


def layout(plan: Plan, state: PyTree, found: list, more: list[str] = (),
           accum_steps: int = 1) -> dict:
    """The report's view of the plan: what is not cut as the rule says, and how leaves travel;
    ``more`` warnings found elsewhere (the compiled peak's)."""
    c = plan.precision.compute.itemsize
    return {
        "replicated": [{"path": leaf.path, "shape": list(leaf.shape), "reason": leaf.reason}
                       for leaf in plan.replicated],
        "n_leaves": len(jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "offload"))),
        "frozen": [leaf.path for leaf in plan.frozen],
        "blocks": plan.blocks,
        "gather": plan.gather,
        "prefetch": plan.prefetch,
        "comm": dataclasses.asdict(plan.comm),
        # What prefetch holds more: the largest layer (or unrolled block) gathered, and its
        # whole gradient waiting a layer to be reduced, both in the compute dtype; gathering by
        # module, the largest module gathered.
        "prefetch_bytes": (1 if plan.gather == "module" else 2) * c * max(
            block_elements(plan, plan.gather == "module").values(), default=0)
        if plan.prefetch else 0,
        "opt_state_whole": whole_opt_state(plan, state),
        **tiled(plan, found),
        "warnings": [*held_once(plan), *one_big_block(plan),
                     *gathered_once(plan, found, accum_steps), *more],
    }


def collective_groups(found: list, mesh: Any) -> dict[tuple, dict]:
    """The program's collectives summed by kind, dtype, mesh axes, loop and processes."""
    groups: dict[tuple, dict] = {}
    for x in found:
        axes = mesh_axes(x.group, mesh)
        spans = processes_spanned(x.groups, mesh)
        key = (x.kind, x.dtype, axes, x.in_loop, spans)
        grp = groups.setdefault(key, {"kind": x.kind, "dtype": x.dtype, "axes": axes,
                                      "group_size": x.group_size, "in_loop": x.in_loop,
                                      "processes": spans, "count": 0, "bytes": 0, "volume": 0})
        grp["count"] += x.count
        grp["bytes"] += x.count * x.bytes
        grp["volume"] += x.volume
    return groups


def layers_of(plan: Plan) -> int:
    """The layers the blocks run: a scanned stack's length, one per unrolled block."""
    stacks: dict[str, int] = {}
    for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "stacked")):
        if leaf.block:
            stacks[leaf.block] = leaf.shape[0] if leaf.stacked else 1
    return sum(stacks.values())


def activation_bytes(plan: Plan, block_input: jax.ShapeDtypeStruct, accum_steps: int) -> int:
    """One block input (global batch, sequence, ...) per device and microbatch: the batch is
    cut over the data axes and the microbatches."""
    per = math.prod(block_input.shape) // (plan.dp_size * accum_steps)
    return per * jnp.dtype(block_input.dtype).itemsize


def saved_activations(plan: Plan, block_input: jax.ShapeDtypeStruct | None,
                      accum_steps: int = 1) -> dict:
    """What the blocks save for their backward per device (their inputs, under remat), given
    the global shape of a block's input, which only the model knows: layers x local batch x
    sequence x width, 1/T of it with ZeRO-R's Pa (cut along the sequence over ``model``)."""
    if block_input is None or not plan.blocks:
        return {}
    whole = layers_of(plan) * activation_bytes(plan, block_input, accum_steps)
    return {"saved_activation_bytes": {"without_pa": whole,
                                       "with_pa": whole // plan.tp_size if plan.model else whole,
                                       "partition_activations": plan.partition_activations}}


def model_theory(plan: Plan, block_input: jax.ShapeDtypeStruct,
                 accum_steps: int) -> tuple[int, str]:
    """Megatron's tensor-parallel traffic per device per step for a transformer block: per
    block 2 all-reduces of its activations (batch x sequence x width) forward and 2 backward;
    1 more where stage 3 rematerializes the block (attention's: the MLP's makes the block's
    output, which its backward never reads, and XLA drops it); plus the vocabulary-parallel
    embedding's forward and the tied head's input gradient. An all-reduce counts twice, as in
    ``hlo.Collective``."""
    remat = plan.rule.shard_params and plan.remat != "none"
    per_block = 4 + remat
    count = layers_of(plan) * per_block + 2
    return (2 * count * activation_bytes(plan, block_input, accum_steps) * accum_steps,
            f"{per_block} all-reduces of b s d per layer + 2")


def as_requested(plan: Plan, lowered: Any, found: list,
                 block_input: jax.ShapeDtypeStruct | None, accum_steps: int) -> dict:
    """The collectives' dtypes the program asks for, before XLA's passes (the CPU backend, for
    one, runs bf16 collectives in f32; GPUs and TPUs keep them), and where every 16-bit one
    ran wider, that dtype and the theory in it."""
    requested = collectives(lowered.as_text(dialect="hlo"), plan.mesh.size)
    widened = widened_to(requested, found)
    return {"requested_dtypes": sorted({f"{x.kind} {x.dtype}" for x in requested}),
            "collectives_run_in": widened,
            "comm_bytes_theory_as_run": sum(comm_theory(plan, block_input, widened,
                                                        accum_steps)[0].values())
            if widened else None}


def widened_to(requested: list, found: list) -> str | None:
    """The dtype the compiled program runs 16-bit collectives in, when the backend widened
    them all (the CPU backend: f32), else None."""
    sixteen = {"bf16", "f16"}
    if {x.dtype for x in requested} & sixteen and not {x.dtype for x in found} & sixteen:
        return "f32"
    return None


def comm_theory(plan: Plan, block_input: jax.ShapeDtypeStruct | None = None,
                widened: str | None = None, accum_steps: int = 1) -> tuple[dict[str, int], str]:
    """ZeRO's bytes per device per step by mesh axis, and the formula.

    Phase by phase, each in its dtype: a gradient reduce-scatter, then an all-gather (of
    gradients at stage 0, of updated parameters at 1-2, per layer at 3). With k microbatches
    stage 2 reduce-scatters, and stage 3 also gathers, once per microbatch. With tensor
    parallelism each rank's ZeRO moves its part, and ``model`` carries Megatron's all-reduces
    (``model_theory``) when the caller gives a block input's shape. ``widened``: every phase
    in that dtype instead (``widened_to``)."""
    mesh, prec, k = plan.mesh, plan.precision, accum_steps
    c, r = prec.compute.itemsize, prec.reduce.itemsize
    if widened:
        c = r = DTYPE_BYTES[widened]
        if block_input is not None and jnp.dtype(block_input.dtype).itemsize < c:
            block_input = jax.ShapeDtypeStruct(block_input.shape, jnp.float32)
    rank = round(per_rank(plan))
    theory = {0: rank * (r + r), 1: rank * (r + r), 2: rank * (r * k + c),
              3: rank * (c + c + r) * k}
    formula = {0: "2 Psi", 1: "2 Psi", 2: f"{k + 1} Psi", 3: f"{3 * k} Psi"}[plan.stage]
    if plan.stage == 3 and plan.gather == "module":
        formula += f" + up to {k} Psi (modules gathered again in their backward)"
    by_axes = {plan.axis: theory[plan.stage] if plan.dp_size > 1 else 0}
    if plan.outer:
        # Hierarchical: stage 3 within a group of K; across groups, once per step, the gradient
        # shards (Psi/K) reduce-scattered and the updated parameter shards all-gathered back.
        group = mesh.shape[plan.axis]
        by_axes = {plan.axis: theory[3] if group > 1 else 0,
                   plan.outer: rank * (r + c) // group if mesh.shape[plan.outer] > 1 else 0}
        formula = f"{3 * k} Psi within a group + 2 Psi/K across"
    if plan.model and block_input is not None and plan.blocks:
        by_axes[MODEL], megatron = model_theory(plan, block_input, k)
        formula += f"; on model: {megatron}"
    return by_axes, formula


def peak_expected(plan: Plan, accum_steps: int = 1) -> dict[str, int]:
    """ZeRO's figures for two kinds of the peak: from stage 2 on the backward holds one
    block's whole gradient before its reduce-scatter (beside the shards reduced so far and the
    gradients of its activations, which ZeRO does not count), and stage 3 the largest block
    gathered (one more with prefetch); gathering by module, the largest module's."""
    if not (plan.rule.shard_grads and plan.blocks):
        return {}
    largest = max(block_elements(plan, plan.gather == "module").values())
    grads = {"gradients": largest * jnp.dtype(plan.precision.grad_dtype(accum_steps)).itemsize}
    if not plan.rule.shard_params:
        return grads
    return {"gathered weights": (1 + plan.prefetch) * largest
            * plan.precision.compute.itemsize, **grads}


def block_elements(plan: Plan, by_module: bool = False) -> dict[str, int]:
    """Elements each block (``by_module``: each module in a block) gathers at a time (one layer
    of a scanned stack), on each tensor-parallel rank (its slice of the leaves cut over
    ``model``): with tiling, its leaves within the bound and the largest tile of the others
    (gathered one at a time)."""
    t = plan.mesh.shape.get(MODEL, 1)
    out: dict[str, int] = {}
    tile: dict[str, int] = {}
    for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "stacked")):
        if leaf.block:
            layer = leaf.layer_elements // (t if leaf.model_dim is not None else 1)
            unit = leaf.path.rpartition("/")[0] if by_module else leaf.block
            if leaf.tile:
                tile[unit] = max(tile.get(unit, 0), layer // leaf.tile[1])
            out[unit] = out.get(unit, 0) + (0 if leaf.tile else layer)
    return {b: n + tile.get(b, 0) for b, n in out.items()}


def tiled(plan: Plan, found: list) -> dict:
    """Memory-centric tiling: the leaves gathered tile by tile, and the largest all-gather of
    the compiled step (a tile, or a bucket within the bound, unless outside the blocks)."""
    leaves = [leaf for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "tile"))
              if leaf.tile]
    return {"tile_bytes": plan.tile_bytes,
            "tiled": [{"path": leaf.path, "shape": list(leaf.shape), "dim": leaf.tile[0],
                       "tiles": leaf.tile[1]} for leaf in leaves],
            "largest_gather_bytes": max((x.bytes for x in found if x.kind == "all-gather"),
                                        default=0)}


def whole_opt_state(plan: Plan, state: PyTree) -> list[dict]:
    """Optimizer-state leaves kept whole because they are not shaped like their parameter
    (Adafactor's factored moments, SM3's per-dimension accumulators): found by the longest
    parameter path their own path holds."""
    if not plan.rule.shard_opt_state:
        return []
    params = {leaf.path: leaf for leaf in jax.tree.leaves(plan.leaves,
                                                          is_leaf=lambda x: hasattr(x, "axis"))}
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        name = path_str(path)
        inside = [p for p in params if f"/{p}/" in f"/{name}/"]
        leaf = params[max(inside, key=len)] if inside else None
        if leaf is not None and leaf.axis is not None and tuple(x.shape) != leaf.shape \
                and math.prod(x.shape) > 1:
            out.append({"path": name, "shape": list(x.shape)})
    return out


def one_big_block(plan: Plan) -> list[str]:
    """An unrolled block holding most of the cut parameters is gathered whole at once: stage 3
    then holds most of the model, as stage 2 does. Its parts are the blocks to name."""
    leaves = [leaf for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "block"))
              if leaf.axis is not None and not leaf.persistent]
    cut = sum(math.prod(leaf.shape) for leaf in leaves)
    sizes: dict[str, int] = {}
    for leaf in leaves:
        if leaf.block and not leaf.stacked:
            sizes[leaf.block] = sizes.get(leaf.block, 0) + math.prod(leaf.shape)
    big = [b for b, size in sizes.items() if cut and size > cut / 2]
    return [f"the block {b!r} holds {sizes[b] / cut:.0%} of the cut parameters, which stage 3 "
            f"gathers all at once: name its parts instead (layers='{re.escape(b)}/[^/]+', or "
            "the repeated modules inside it)" for b in big if plan.rule.shard_params]


def held_whole(plan: Plan, peak: dict | None, param_bytes: int) -> list[str]:
    """The compiled stage-3 step against stage 2's rule: at its peak it should hold a block or
    two of gathered weights, not as much as the whole parameters stage 2 keeps."""
    if not (plan.rule.shard_params and peak):
        return []
    held = peak["by_kind"].get("gathered weights", 0)
    whole = param_bytes // plan.mesh.shape.get(MODEL, 1)
    if held < whole:
        return []
    return [f"the compiled stage-3 step holds {held / MiB:.2f} MiB of gathered weights at its "
            f"peak, as much as the whole parameters ({whole / MiB:.2f} MiB) that stage 2 keeps "
            "on every device: it saves nothing on parameters (name smaller blocks, see the "
            "peak's largest buffers)"]


def gathered_once(plan: Plan, found: list, accum_steps: int = 1) -> list[str]:
    """Stage 3 gathers each block in its forward and again in its backward. A program that
    gathers the blocks about once per step keeps each block's whole weights from forward to
    backward (XLA merged the two gathers): it holds more than stage 2 would."""
    if not (plan.rule.shard_params and plan.blocks) or plan.mesh.shape[plan.axis] == 1:
        return []  # one device on the axis: XLA drops its collectives, nothing is gathered
    t = plan.mesh.shape.get(MODEL, 1)
    cut = [leaf for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "block"))
           if leaf.axis is not None and not leaf.persistent]
    elements = lambda leaves: sum(math.prod(leaf.shape) // (t if leaf.model_dim is not None
                                                            else 1) for leaf in leaves)
    blocks = elements([leaf for leaf in cut if leaf.block]) * accum_steps
    # The data axis's gathers (not hierarchical ZeRO's across groups), less the once-per-step
    # gathers of the leaves outside blocks.
    gathered = sum(x.count * x.bytes // DTYPE_BYTES[x.dtype] for x in found
                   if x.kind == "all-gather" and mesh_axes(x.group, plan.mesh) == plan.axis)
    gathered = max(0, gathered - elements([leaf for leaf in cut if not leaf.block])
                   * accum_steps)
    if not blocks or gathered >= 1.5 * blocks:
        return []
    return [f"stage 3 gathers the blocks' {blocks:,} parameters {gathered / blocks:.2f} times "
            "per step, not twice (forward and backward): the compiler kept each block's whole "
            "weights from its forward to its backward, as stage 2 does"]


def format_table(r: dict) -> str:
    """The report as text for a terminal."""
    return "\n".join(_states_lines(r) + _activation_lines(r) + _peak_lines(r) + _comm_lines(r)
                     + _layout_lines(r))


def _activation_lines(r: dict) -> list[str]:
    """The blocks' saved inputs per device, with and without ZeRO-R's Pa."""
    saved = r.get("saved_activation_bytes")
    if not saved:
        return []
    on = "on" if saved["partition_activations"] else "off"
    return ["", f"  saved block inputs per device: {saved['without_pa'] / MiB:.2f} MiB without "
                f"partitioned activations, {saved['with_pa'] / MiB:.2f} MiB with them ({on})"]


def _states_lines(r: dict) -> list[str]:
    """The headline and the model states per device against ZeRO's formula."""
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    p = r["precision"]
    offloaded = sum(r["per_device_host_bytes"].values()) > 0
    run_in = r.get("collectives_run_in")
    lines = [f"ZeRO stage {r['stage']} on {r['platform']} mesh {mesh}, {r['n_params']:,} "
             f"parameters; compute {p['param_dtype']}, gradient collectives {p['reduce_dtype']}"
             + (f" (run in {run_in} by the {r['platform']} backend)" if run_in else "")
             + (f", {p['accum_steps']} microbatches per step" if p["accum_steps"] > 1 else "")
             + (", fp16 loss scaling" if p["loss_scale"] else ""),
             *_whole_headline(r), f"  {r['rule']}", "",
             f"  {'per device':<12}{'actual MiB':>12}{'ZeRO formula':>14}"
             + (f"{'host MiB':>12}{'formula':>12}" if offloaded else "")]
    host, zero_host = r["per_device_host_bytes"], r["zero_formula_host_bytes"]
    for key, actual in r["per_device_bytes"].items():
        if key == "master" and not p["master"]:
            continue
        lines.append(f"  {key:<12}{actual / MiB:>12.2f}{r['zero_formula_bytes'][key] / MiB:>14.2f}"
                     + (f"{host[key] / MiB:>12.2f}{zero_host[key] / MiB:>12.2f}"
                        if offloaded else ""))
    total = sum(r["per_device_bytes"].values())
    lines.append(f"  {'total':<12}{total / MiB:>12.2f}"
                 f"{sum(r['zero_formula_bytes'].values()) / MiB:>14.2f}"
                 + (f"{sum(host.values()) / MiB:>12.2f}{sum(zero_host.values()) / MiB:>12.2f}"
                    if offloaded else ""))
    nvme, leaves = r["offload"]["nvme"], r["offload"]["optimizer_leaves"]
    if nvme:
        lines.append(f"  in files under {nvme['path']} (the NVMe tier): master and optimizer "
                     f"state of {len(leaves)} leaves, "
                     f"{sum(nvme['file_bytes'].values()) / MiB:.2f} MiB per device, read and "
                     f"written once a step through {nvme['buffer_bytes'] / MiB:.0f} MiB of "
                     f"host buffers per process")
    elif offloaded:
        lines.append(f"  offloaded to host memory: master and optimizer state of {len(leaves)} "
                     f"leaves (updated there)" + (", parameter shards" if r["offload"]["params"]
                                                  else ""))
    return lines


def _whole_headline(r: dict) -> list[str]:
    """Most leaves kept whole (persistent, or with no dimension the devices divide): the stage
    then holds them as a lower stage does, which the headline says first."""
    whole, n = r["replicated"], r.get("n_leaves", 0)
    if not r["stage"] or not n or 2 * len(whole) <= n:
        return []
    persistent = [x for x in whole if x["reason"].startswith("persistent")]
    size = sum(math.prod(x["shape"]) for x in whole) / r["n_params"]
    parts = ([f"{len(persistent)} persistent (parameters and gradients whole, optimizer state "
              f"cut: stage {min(r['stage'], 1)} for them)"] if persistent else []) \
        + ([f"{len(whole) - len(persistent)} whole everywhere (stage 0 for them: "
            + ", ".join(sorted({x['reason'] for x in whole if x not in persistent})) + ")"]
           if len(persistent) < len(whole) else [])
    return [f"  {len(whole)} of {n} leaves stay whole ({size:.0%} of the parameters), so stage "
            f"{r['stage']} cuts only the rest: {'; '.join(parts)}"]


def _comm_lines(r: dict) -> list[str]:
    """The compiled step's memory and its collectives against ZeRO's theory."""
    c = r["compiled"]
    lines = ["", f"  compiled step: arguments {c['argument_bytes'] / MiB:.2f} MiB, outputs "
              f"{c['output_bytes'] / MiB:.2f} MiB, temp {c['temp_bytes'] / MiB:.2f} MiB", "",
              f"  {'collective':<16}{'dtype':<7}{'axes':<14}{'group':>6}{'in loop':>9}"
              f"{'count':>7}{'MiB/step':>10}"]
    for g in r["collectives"]:
        lines.append(f"  {g['kind']:<16}{g['dtype']:<7}{g['axes']:<14}{g['group_size']:>6}"
                     f"{'yes' if g['in_loop'] else 'no':>9}{g['count']:>7}"
                     f"{g['bytes'] / MiB:>10.2f}")
    lines.append(f"  dtypes as requested, before XLA's passes: {', '.join(r['requested_dtypes'])}")
    measured, theory = r["comm_bytes_per_step"], r["comm_bytes_theory"]
    formula, run_in = r["comm_theory_formula"], r.get("collectives_run_in")
    if run_in:  # the theory in the dtype the program runs; as requested beside it
        formula += (f", in {run_in} as the {r['platform']} backend runs the 16-bit collectives;"
                    f" {theory / MiB:.2f} MiB in the dtypes requested")
        theory = r["comm_bytes_theory_as_run"]
    lines += ["", f"  communication per step: {measured / MiB:.2f} MiB, ZeRO theory "
              f"{theory / MiB:.2f} MiB ({formula}), ratio "
              f"{measured / theory if theory else 1:.2f} "
              "(an all-reduce counted as reduce-scatter + all-gather)"]
    comm = r["comm"]
    int8 = [what for what, on in (("weights", comm["quantize_weights"]),
                                  ("gradients", comm["quantize_grads"])) if on]
    how = "one collective per leaf" if not comm["bucket_bytes"] else \
        f"each layer in flat buffers of at most {comm['bucket_bytes'] / MiB:g} MiB"
    if comm["bucket_bytes"] and r.get("gather") == "module":
        how += " (a block's modules heavier than their inputs: one collective per leaf)"
    if int8:
        how += f"; int8 {' and '.join(int8)} (one f32 scale per {comm['quantize_block']} elements)"
    lines.append(f"  buckets: {how}")
    prefetch = "off"
    if r["prefetch"] and r.get("gather") == "module":
        prefetch = (f"module i+1 gathered while module i computes (in the forward and the "
                    f"blocks' recompute): one more gathered module, "
                    f"{r['prefetch_bytes'] / MiB:.2f} MiB")
    elif r["prefetch"]:
        prefetch = (f"layer i+1 gathered while layer i computes (i-1 in the backward, while "
                    f"layer i+1's gradient is reduce-scattered): one more gathered layer and "
                    f"one more whole layer gradient, {r['prefetch_bytes'] / MiB:.2f} MiB")
        if comm["bucket_bytes"]:
            prefetch += " (with buckets up to a layer more: its flat buffer too)"
    lines.append(f"  prefetch: {prefetch}")
    if len(r["mesh"]) > 1:
        names = {"data": "within groups", "replica": "across groups",
                 "replica+data": "whole mesh"}
        for axes, v in r["comm_bytes_by_axes"].items():
            expected = r["comm_bytes_theory_by_axes"].get(axes)
            lines.append(f"    {names.get(axes, axes) + f' ({axes})':<30}{v / MiB:>8.2f} MiB"
                         + (f", theory {expected / MiB:.2f} MiB" if expected is not None else ""))
    if r.get("processes", 1) > 1:
        crossing = [g for g in r["collectives"] if g["processes"] > 1]
        lines.append(f"  across {r['processes']} processes (hosts): "
                     f"{r['comm_bytes_across_processes'] / MiB:.2f} MiB per step, in "
                     + (", ".join(f"{g['count']} {g['kind']} ({g['axes']}"
                                  f"{', in loop' if g['in_loop'] else ''})" for g in crossing)
                        or "nothing"))
    return lines


def _peak_lines(r: dict) -> list[str]:
    """What is live when the compiled step's memory peaks, by kind, beside ZeRO's figures."""
    peak = r.get("peak")
    if not peak or not peak["peak_bytes"]:
        return []
    temp = r["compiled"]["temp_bytes"]
    why = (": more than is live at once, as XLA lays out buffers live at different times once, "
           "with gaps between them" if temp > peak["peak_bytes"] else "")
    return ["", f"  at the compiled step's peak ({peak['peak_bytes'] / MiB:,.2f} MiB per device, "
                f"arguments included; XLA's temp allocation {temp / MiB:,.2f} MiB{why}):",
            *peak_split(peak)]


def peak_split(peak: dict, unit: str = "MiB", div: int = MiB) -> list[str]:
    """One line per kind live at the peak, beside ZeRO's figure where it has one; then the
    same for the temp allocation at its fullest, with the bytes between its buffers."""
    lines = _kinds(peak["by_kind"], peak["expected"], unit, div)
    temp = peak.get("temp")
    if temp:
        lines += [f"  what fills XLA's temp allocation ({temp['bytes'] / div:.2f} {unit}) when its "
                  "buffers take the most of it:",
                  *_kinds(temp["by_kind"], peak["expected"], unit, div),
                  f"    {'between buffers':<24}{temp['between buffers'] / div:>8.2f} {unit}   "
                  "(the layout XLA fixed when compiling leaves these free then)"]
    return lines


# Why a kind holds more than ZeRO's figure for it.
WHY = {"gradients": "one block's weight gradient; the rest are gradients of activations, which "
                    "ZeRO does not count: the logits' is batch x sequence x vocabulary"}


def _kinds(by_kind: dict, expected: dict, unit: str, div: int) -> list[str]:
    lines = []
    for kind, size in by_kind.items():
        zero = expected.get(kind)
        if size or zero is not None:
            lines.append(f"    {kind:<24}{size / div:>8.2f} {unit}"
                         + (f"   ZeRO: {zero / div:.2f} {unit}" if zero is not None else "")
                         + (f" ({WHY[kind]})" if zero is not None and size > zero and kind in WHY
                            else ""))
    return lines


def _layout_lines(r: dict) -> list[str]:
    """What is not cut as the rule says: whole, frozen, blocks, whole optimizer state."""
    lines = []
    if r["replicated"]:
        lines += ["", f"  kept whole ({len(r['replicated'])} leaves):"]
        lines += [f"    {x['path']} {tuple(x['shape'])}: {x['reason']}" for x in r["replicated"]]
    if r["frozen"]:
        lines += ["", f"  frozen, no gradient and no optimizer state ({len(r['frozen'])} leaves): "
                  + ", ".join(r["frozen"])]
    if r["blocks"] and r["stage"] == 3:  # below stage 3 nothing is gathered
        shown = ", ".join(r["blocks"][:4]) + (", ..." if len(r["blocks"]) > 4 else "")
        unit = "module by module within" if r.get("gather") == "module" else "block by block"
        count = f"{len(r['blocks'])} block{'s' * (len(r['blocks']) != 1)}"
        lines += ["", f"  gathered {unit} ({count}): {shown}"]
    if r.get("tiled"):
        lines += ["", f"  tiled within {r['tile_bytes'] / MiB:.3g} MiB ({len(r['tiled'])} leaves, "
                  f"their layers gather one tile at a time; the step's largest all-gather "
                  f"{r['largest_gather_bytes'] / MiB:.3g} MiB, leaves outside the blocks "
                  f"whole): "
                  + ", ".join(f"{x['path']} in {x['tiles']}" for x in r["tiled"][:4])
                  + (", ..." if len(r["tiled"]) > 4 else "")]
    if r["opt_state_whole"]:
        lines += ["", f"  optimizer state kept whole, not shaped like its parameter "
                  f"({len(r['opt_state_whole'])} leaves): "
                  + ", ".join(f"{x['path']} {tuple(x['shape'])}" for x in r["opt_state_whole"][:6])
                  + (", ..." if len(r["opt_state_whole"]) > 6 else "")]
    lines += [f"\n  warning: {w}" for w in r["warnings"]]
    return lines
