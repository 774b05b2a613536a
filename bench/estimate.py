"""An estimate, not a measurement: the step time of a compiled GPU program, read from its text.

XLA's ``cost_analysis()`` returns None on a deviceless GPU compile (jax 0.10.2, both the lowered
and the compiled step), so the costs here come from the scheduled HLO text itself:

1. ``op_cost``: each instruction of the entry computation and of the loop bodies it runs, in
   schedule order, costs max(FLOPs / peak, bytes / HBM bandwidth). FLOPs: 2 x the result's
   elements x the contracted size of every dot (in fusions too: Triton GEMMs) and cuBLAS GEMM
   custom call, and cuDNN's flash attention (``_attention_flops``); convolutions and
   elementwise work are not counted. Bytes: the operands and result of each fusion, custom
   call or unfused op (a fusion's operand read only through slices counts the slices; a
   buffer updated in place by a dynamic-update-slice counts the update). No launch gaps, no
   caches.
2. ``comm_time``: a collective over a group of n devices moves its full-size payload (as
   ``zero_jax.hlo`` counts it) x (n-1)/n (all-reduce twice that; a permute all of it) over the
   link: NVLink when every device of the group is on one node, else the network per GPU.
3. ``walk``: async collectives run on one link, one after another, from their start; compute
   goes on; at the done the program waits for whatever is left: that wait is exposed
   communication. Synchronous collectives (no start/done pair, or ``is_sync``) are exposed
   whole. A loop costs its body's time x its trip count; a conditional its dearest branch.
4. ``estimate``: step time = compute + exposed communication; MFU = model FLOPs / (step time x
   peak).
"""

from __future__ import annotations

import dataclasses
import math
import re

from zero_jax.hlo import (
    _TRIP,
    KINDS,
    _arrays,
    _groups,
    _payload,
    computations,
    instruction,
    top_level,
)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The figures the estimate uses: per GPU, and its links."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm: float  # bytes/s
    nvlink: float  # bytes/s per GPU per direction, within a node
    network: float  # bytes/s per GPU per direction, across nodes
    gpus_per_node: int = 8


# H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 at 450 GB/s per direction;
# across nodes one 400 Gb/s NIC per GPU (50 GB/s).
H100 = Hardware("H100 SXM", 989e12, 3.35e12, 450e9, 50e9)
# H200 SXM: the H100's compute and links, 4.8 TB/s HBM3e.
H200 = Hardware("H200 SXM", 989e12, 4.8e12, 450e9, 50e9)


def hardware_of(device_kind: str) -> Hardware | None:
    """The figures for a GPU that jax names ``device_kind`` (None: not one of ours)."""
    kind = device_kind.lower()
    if "h100" in kind and "pcie" not in kind and "nvl" not in kind:
        return H100
    return H200 if "h200" in kind else None

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "add-dependency", "opt-barrier", "partition-id", "replica-id"}
_CALLED = re.compile(r"\bcalls=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|(?:true_computation|false_computation"
                       r"|to_apply)=%?([\w.\-]+))")
_GEMM = re.compile(r'custom_call_target="__cublas\$(lt\$matmul|gemm)')
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha\w*?(Backward)?"')
_SCORES = re.compile(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*'
                     r'"dimensions":\s*\[([^\]]*)\]')
_DIMS = re.compile(r"\[([\d,]*)\]")


@dataclasses.dataclass
class Cost:
    """What a stretch of the program adds up to (seconds, FLOPs, bytes)."""

    time: float = 0.0  # compute + exposed communication
    compute: float = 0.0
    comm: float = 0.0  # link time of every collective
    exposed: float = 0.0  # of which the program waits for
    flops: float = 0.0
    bytes: float = 0.0

    def add(self, other: Cost, times: int = 1) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + times * getattr(other, f.name))


def _dims(shape: str) -> list[int]:
    m = _DIMS.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _nbytes(shape: str) -> int:
    return sum(b for _, b in _arrays(shape))


def operands(rest: str) -> list[str]:
    """The operand names of an instruction (``rest``: after its opcode's parenthesis)."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", rest[:i])
    return []


class Program:
    """The parsed text: computations, each instruction's shape by name."""

    def __init__(self, hlo_text: str):
        lines, self.entry = computations(hlo_text)
        self.bodies = {c: [i for i in map(instruction, ls) if i] for c, ls in lines.items()}
        self.shapes = {c: {i[0]: i[1] for i in body} for c, body in self.bodies.items()}
        self._flops: dict[str, float] = {}

    def flops(self, comp: str) -> float:
        """FLOPs of every dot in a computation and what it calls."""
        if comp not in self._flops:
            self._flops[comp] = sum(
                (dot_flops(self.shapes[comp], shape, op, rest) if op in ("dot", "custom-call")
                 else 0.0) + sum(self.flops(c) for c in _CALLED.findall(rest))
                for _, shape, op, rest in self.bodies.get(comp, ()))
        return self._flops[comp]


def dot_flops(shapes: dict[str, str], shape: str, op: str, rest: str) -> float:
    """2 x result elements x contracted size, for a dot or a cuBLAS GEMM custom call."""
    if op == "custom-call" and (fmha := _FMHA.search(rest)):
        return _attention_flops(shape, rest, backward=bool(fmha.group(1)))
    if op == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    elif _GEMM.search(rest):
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
        shape = top_level(shape)[0]  # (result, workspace)
    else:
        return 0.0
    lhs = _dims(shapes.get(operands(rest)[0], ""))
    contracted = [int(d.strip('"')) for d in m.group(1).split(",") if d.strip('"')] if m else []
    return 2.0 * math.prod(_dims(shape)) * math.prod(lhs[d] for d in contracted if d < len(lhs))


def _attention_flops(shape: str, rest: str, backward: bool) -> float:
    """cuDNN's flash attention: the scores' (batch, heads, t, s) x head dim, times 2 matmuls
    of 2 FLOPs forward (QK^T, PV) and 5 backward (the scores again, dV, dP, dQ, dK); a causal
    mask skips about half of them."""
    m = _SCORES.search(rest)
    if not m:
        return 0.0
    scores = math.prod(int(d.strip('" ')) for d in m.group(1).split(",") if d.strip('" '))
    head_dim = _dims(top_level(shape)[0])[-1]
    causal = 0.5 if re.search(r'"mask_type":\s*"(PADDING_)?CAUSAL"', rest) else 1.0
    return (10.0 if backward else 4.0) * scores * head_dim * causal


def fusion_bytes(prog: Program, comp: str, shape: str, rest: str) -> float:
    """HBM bytes of a fusion: its operands and result, less what it only slices or updates in
    place."""
    called = _CALLED.search(rest).group(1)
    body = prog.bodies.get(called, [])
    params = {int(re.match(r"(\d+)", r).group(1)): n for n, _, op, r in body if op == "parameter"}
    users: dict[str, list] = {}
    for inst in body:
        for i, o in enumerate(operands(inst[3])):
            users.setdefault(o, []).append((inst, i))
    root = body[-1] if body else None
    out = [root] if root and root[2] != "tuple" else [
        next(i for i in body if i[0] == o) for o in operands(root[3])] if root else []
    total = 0.0
    for k, name in enumerate(operands(rest)):
        uses = users.get(params.get(k), [])
        if uses and all(u[2] in ("slice", "dynamic-slice") and i == 0 for u, i in uses):
            total += sum(_nbytes(u[1]) for u, _ in uses)  # reads only the slices
        elif uses and all(u[2] == "dynamic-update-slice" and i == 0 for u, i in uses):
            continue  # updated in place: the update is counted as the result
        else:
            total += _nbytes(prog.shapes[comp].get(name, ""))
    for inst in out:
        if inst[2] == "dynamic-update-slice":
            total += _nbytes(prog.shapes[called].get(operands(inst[3])[1], ""))
        else:
            total += _nbytes(inst[1])
    return total


def op_cost(prog: Program, comp: str, inst: tuple, hw: Hardware) -> Cost:
    """Step 1: one instruction's compute time, max(FLOPs / peak, bytes / HBM)."""
    name, shape, op, rest = inst
    if op in FREE or re.search(r"-(start|update|done)$", op):
        return Cost()
    if op == "fusion":
        flops, nbytes = prog.flops(_CALLED.search(rest).group(1)), fusion_bytes(
            prog, comp, shape, rest)
    else:
        flops = dot_flops(prog.shapes[comp], shape, op, rest) if op in ("dot", "custom-call") \
            else 0.0
        result = top_level(shape)[0] if op == "custom-call" else shape
        ins = [_nbytes(prog.shapes[comp].get(o, "")) for o in operands(rest)]
        if op == "dynamic-update-slice":  # in place
            nbytes = 2 * ins[1]
        elif op == "dynamic-slice":
            nbytes = 2 * _nbytes(shape)
        else:
            nbytes = sum(ins) + _nbytes(result)
    t = max(flops / hw.peak_flops, nbytes / hw.hbm)
    return Cost(time=t, compute=t, flops=flops, bytes=nbytes)


def comm_time(kind: str, nbytes: float, group: tuple[int, ...], hw: Hardware) -> float:
    """Step 2: link seconds of one collective: payload x (n-1)/n (all-reduce 2x, a permute
    all of it) over NVLink within a node, else over the network."""
    n = len(group)
    if n <= 1:
        return 0.0
    factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)
    one_node = len({d // hw.gpus_per_node for d in group}) == 1
    return nbytes * factor / (hw.nvlink if one_node else hw.network)


def _collective(prog: Program, inst: tuple, n_devices: int) -> tuple[str, float, tuple] | None:
    """(kind, payload bytes, first replica group) of a collective, its start, or an
    async-start wrapping one; else None."""
    _, shape, op, rest = inst
    if op == "async-start" and (m := _CALLED.search(rest)):
        inner = next((i for i in prog.bodies.get(m.group(1), ()) if i[2] in KINDS), None)
        return _collective(prog, inner, n_devices) if inner else None
    kind = op.removesuffix("-start")
    if kind not in KINDS:
        return None
    group = _groups(rest, n_devices)[0]
    size = _nbytes(_payload(kind, op, shape))
    if kind == "reduce-scatter" and not op.endswith("-start"):
        size *= len(group)  # its shape is the scattered result
    return kind, size, group


def _branches(rest: str) -> list[str]:
    """The computations a call or conditional runs (a conditional runs one of them)."""
    return [c.strip().lstrip("%") for m in _BRANCHES.finditer(rest)
            for c in (m.group(1) or m.group(2)).split(",")]


def walk(prog: Program, comp: str, hw: Hardware, n_devices: int) -> Cost:
    """Step 3: a computation in schedule order; async collectives on one link, each exposed
    by what its done still waits for."""
    total, link_free = Cost(), 0.0
    pending: dict[str, float] = {}  # start (or update) name -> when its transfer ends
    for inst in prog.bodies.get(comp, ()):
        name, _, op, rest = inst
        if op == "while":
            trips = int(m.group(1)) if (m := _TRIP.search(rest)) else 1
            body = walk(prog, _BODY.search(rest).group(1), hw, n_devices)
            total.add(body, trips)
            continue
        if op in ("call", "conditional"):
            costs = [walk(prog, c, hw, n_devices) for c in _branches(rest)]
            if costs:
                total.add(max(costs, key=lambda c: c.time))
            continue
        if op.endswith("-done"):
            for o in operands(rest):
                if o in pending:
                    wait = max(0.0, pending.pop(o) - total.time)
                    total.time += wait
                    total.exposed += wait
            continue
        if op.endswith("-update"):
            for o in operands(rest):
                if o in pending:
                    pending[name] = pending.pop(o)
            continue
        found = _collective(prog, inst, n_devices) if (
            op.endswith("-start") or op in KINDS) else None
        if found:
            seconds = comm_time(found[0], found[1], found[2], hw)
            total.comm += seconds
            begin = max(total.time, link_free)
            link_free = begin + seconds
            if op.endswith("-start") and not re.search(r'"is_sync":\s*true', rest):
                pending[name] = link_free
            else:  # synchronous: the program waits for all of it
                total.exposed += link_free - total.time
                total.time = link_free
            continue
        total.add(op_cost(prog, comp, inst, hw))
    return total


def estimate(hlo_text: str, hw: Hardware, n_devices: int, model_flops: float) -> dict:
    """Step 4: the whole step, per device. ``model_flops``: per device per step (6N + 12LdT
    per token)."""
    prog = Program(hlo_text)
    cost = walk(prog, prog.entry, hw, n_devices)
    # a loop whose trip count the program does not know (a mixture of experts' tiles, run as
    # many times as the routing fills) counts once: the estimate is then low
    unknown = sum(1 for body in prog.bodies.values() for _, _, op, rest in body
                  if op == "while" and not _TRIP.search(rest))
    return {"step_s": cost.time, "compute_s": cost.compute, "comm_s": cost.comm,
            "exposed_s": cost.exposed, "hlo_flops": cost.flops, "hbm_bytes": cost.bytes,
            "mfu": model_flops / (cost.time * hw.peak_flops) if cost.time else None,
            "loops_counted_once": unknown}
