"""What a compiled ZeRO step really holds and moves, per device, next to ZeRO's accounting.

Bytes come from the arrays' own shardings (``sharding.shard_shape``), memory from XLA's
``memory_analysis()``, communication from the collectives in the compiled HLO.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from zero_jax.hlo import collectives
from zero_jax.rules import Plan

PyTree = Any
MiB = 1 << 20


def shard_bytes(tree: PyTree) -> int:
    """Bytes one device holds of a tree of arrays or ``ShapeDtypeStruct``s with shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def total_bytes(tree: PyTree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def build(plan: Plan, state: PyTree, compiled: Any) -> dict:
    """The report of one compiled step; ``state`` is the (abstract or real) train state."""
    mesh, n = plan.mesh, plan.mesh.shape[plan.axis]
    params = state.params
    grads = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                         params, plan.shardings(plan.grad_specs))
    psi = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
    item = jax.tree.leaves(params)[0].dtype.itemsize
    k_opt = total_bytes(state.opt_state) / psi  # optimizer bytes per parameter (Adam fp32: 8)
    rule = plan.rule

    def theory(bytes_per_param: float, sharded: bool) -> float:
        return bytes_per_param * psi / (n if sharded else 1)

    memory = compiled.memory_analysis()
    found = collectives(compiled.as_text(), mesh.size)
    groups: dict[tuple, dict] = {}
    for c in found:
        key = (c.kind, c.dtype, c.group_size, c.in_loop)
        g = groups.setdefault(key, {"kind": c.kind, "dtype": c.dtype, "group_size": c.group_size,
                                    "in_loop": c.in_loop, "count": 0, "bytes": 0, "volume": 0})
        g["count"] += c.count
        g["bytes"] += c.count * c.bytes
        g["volume"] += c.volume
    comm = sum(c.volume for c in found)
    return {
        "stage": plan.stage,
        "rule": rule.moves,
        "mesh": dict(mesh.shape),
        "platform": mesh.devices.flat[0].platform,
        "n_params": psi,
        "param_bytes": psi * item,  # one whole copy of the parameters: the unit Psi in bytes
        "per_device_bytes": {"params": shard_bytes(params), "grads": shard_bytes(grads),
                             "opt_state": shard_bytes(state.opt_state)},
        "zero_formula_bytes": {"params": theory(item, rule.shard_params),
                               "grads": theory(item, rule.shard_grads),
                               "opt_state": theory(k_opt, rule.shard_opt_state)},
        "compiled": {"argument_bytes": memory.argument_size_in_bytes,
                     "output_bytes": memory.output_size_in_bytes,
                     "temp_bytes": memory.temp_size_in_bytes,
                     "alias_bytes": memory.alias_size_in_bytes},
        "collectives": sorted(groups.values(), key=lambda g: (g["kind"], g["in_loop"])),
        "comm_bytes_per_step": comm,
        "comm_bytes_theory": (3 if rule.shard_params else 2) * psi * item,
        "replicated": [{"path": leaf.path, "shape": list(leaf.shape), "reason": leaf.reason}
                       for leaf in plan.replicated],
    }


def format_table(r: dict) -> str:
    """The report as text for a terminal."""
    psi, unit = r["n_params"], r["param_bytes"]
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [f"ZeRO stage {r['stage']} on {r['platform']} mesh {mesh}, {psi:,} parameters",
             f"  {r['rule']}", "",
             f"  {'per device':<12}{'actual MiB':>12}{'ZeRO formula':>14}"]
    for key in ("params", "grads", "opt_state"):
        lines.append(f"  {key:<12}{r['per_device_bytes'][key] / MiB:>12.2f}"
                     f"{r['zero_formula_bytes'][key] / MiB:>14.2f}")
    c = r["compiled"]
    lines += ["", f"  compiled step: arguments {c['argument_bytes'] / MiB:.2f} MiB, outputs "
              f"{c['output_bytes'] / MiB:.2f} MiB, temp {c['temp_bytes'] / MiB:.2f} MiB", "",
              f"  {'collective':<16}{'dtype':<7}{'group':>6}{'in loop':>9}{'count':>7}"
              f"{'MiB/step':>10}"]
    for g in r["collectives"]:
        lines.append(f"  {g['kind']:<16}{g['dtype']:<7}{g['group_size']:>6}"
                     f"{'yes' if g['in_loop'] else 'no':>9}{g['count']:>7}"
                     f"{g['bytes'] / MiB:>10.2f}")
    lines += ["", f"  communication per step: {r['comm_bytes_per_step'] / MiB:.2f} MiB = "
              f"{r['comm_bytes_per_step'] / unit:.2f} Psi; ZeRO theory "
              f"{r['comm_bytes_theory'] / unit:.0f} Psi = {r['comm_bytes_theory'] / MiB:.2f} MiB"
              " (an all-reduce counted as reduce-scatter + all-gather)"]
    if r["replicated"]:
        lines += ["", f"  kept replicated ({len(r['replicated'])} leaves):"]
        lines += [f"    {x['path']} {tuple(x['shape'])}: {x['reason']}" for x in r["replicated"]]
    return "\n".join(lines)
