"""The collectives of a compiled program, read from its HLO text.

For each collective: its kind, how many times it runs per step (loop trip counts multiplied
in), its payload bytes, its replica-group size, and whether it sits inside a loop (the layer
scan). Payload follows the ZeRO paper's accounting: the full-size buffer of the operation
(all-gather output, reduce-scatter input, all-reduce operand), and an all-reduce counts twice
in ``volume`` because it is a reduce-scatter plus an all-gather.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}

# A computation's header: at column 0, "[ENTRY ]name[ (signature) -> result] {".
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+)(?: \(.*)? \{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:to_apply|body|condition|calls|branch_computations|called_computations)"
                    r"=(?:\{([^}]*)\}|(%?[\w.\-]+))")
_BODY = re.compile(r" while\(.*\bbody=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Iota form: [groups,size]<=[dims] with an optional transpose T(perm).
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


@dataclasses.dataclass
class Collective:
    kind: str
    dtype: str
    bytes: int  # payload of one execution, full-size side
    group: tuple[int, ...]  # the devices of its first replica group
    in_loop: bool
    count: int  # executions per step
    computation: str  # the HLO computation it sits in (a loop body, or the entry)
    groups: tuple[tuple[int, ...], ...] = ()  # every replica group (multi-process reports)

    @property
    def volume(self) -> int:
        """Bytes per step in ZeRO's units (an all-reduce = reduce-scatter + all-gather); over a
        group of one device (one-device offload's shards), nothing moves."""
        if self.group_size == 1:
            return 0
        return self.count * self.bytes * (2 if self.kind == "all-reduce" else 1)

    @property
    def group_size(self) -> int:
        return len(self.group)


def _arrays(shape: str) -> list[tuple[str, int]]:
    return [(dt, DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(shape)]


_ALL_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
# Mesh form: mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, the devices optionally given as an iota
# (``, device_ids=([4,2]T(1,0))`` before the braces): one group per combination of the axes
# not named in braces.
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                          r"\s*\{([^}]*)\}")


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    """ids 0..prod(dims)-1 laid out as ``dims``, transposed by ``perm``, read row-major."""
    return np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(-1)


def _groups(rest: str, n_devices: int) -> tuple[tuple[int, ...], ...]:
    """Every replica group's device (partition) ids; no groups: all devices in one."""
    ints = lambda text: [int(d) for d in text.split(",")] if text else None
    if m := _GROUPS_IOTA.search(rest):
        ids = _iota(ints(m.group(3)), ints(m.group(4)))
        return tuple(tuple(int(i) for i in g) for g in ids.reshape(int(m.group(1)), -1))
    if m := _GROUPS_MESH.search(rest):
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = (_iota(ints(m.group(2)), ints(m.group(3))) if m.group(2)
               else np.arange(math.prod(sizes))).reshape(sizes)
        within = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        across = [i for i in range(len(names)) if i not in within]
        ids = ids.transpose(across + within).reshape(-1, math.prod(sizes[i] for i in within))
        return tuple(tuple(int(i) for i in g) for g in ids)
    if m := _ALL_GROUPS.search(rest):
        found = re.findall(r"\{([\d,]*)\}", m.group(1))
        if found and found[0]:
            return tuple(tuple(int(d) for d in g.split(",")) for g in found)
    return (tuple(range(n_devices)),)



def _callees(line: str) -> list[str]:
    """The computations an instruction line calls (loop body and condition, fusion, ...)."""
    return [c.strip().lstrip("%") for listed, single in _CALLS.findall(line)
            for c in (listed or single).split(",")]


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """Each computation's instruction lines in text order (in a scheduled module, the order
    they run in), and the entry computation's name."""
    bodies: dict[str, list[str]] = collections.defaultdict(list)
    entry, current = None, None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1).lstrip("%")
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current:
            bodies[current].append(line)
    return bodies, entry


def instruction(line: str) -> tuple[str, str, str, str] | None:
    """``(name, shape, opcode, rest)`` of an instruction line, or None."""
    m = _INSTRUCTION.match(line)
    return m.groups() if m else None


def top_level(shape: str) -> list[str]:
    """The elements of a tuple shape ("((f32[8]{0}), f32[1]{0})" -> ["(f32[8]{0})",
    "f32[1]{0}"]); an array shape is one element."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            out.append(shape[start:i].strip())
            start = i + 1
    return [x for x in out if x]


def _payload(kind: str, op: str, shape: str) -> str:
    """The part of an instruction's shape that is its full-size payload, before multiplying a
    scattered result by the group size. An async start's shape is (operands, results[,
    context]) for every kind but all-reduce, whose start has its results' shape."""
    parts = top_level(shape)
    if not op.endswith("-start") or kind == "all-reduce" or len(parts) < 2:
        return shape
    return parts[0] if kind == "reduce-scatter" else parts[1]


# libtpu writes a reduce-scatter as a fusion of this name: an all-reduce of the whole buffer
# and a slice, which its emitter runs as a reduce-scatter (backend_config's strategy).
_TPU_REDUCE_SCATTER = "all-reduce-scatter"
# libtpu runs an asynchronous collective in steps beside computation, each step a fusion whose
# text holds the whole collective (the same channel): counted once.
_TPU_FUSIONS = ("async_collective_fusion", "fused_computation")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_COMPARE = re.compile(r"compare\(%?([\w.\-]+), %?([\w.\-]+)\), direction=LT")
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+) = s32\[\]\S* constant\((\d+)\)")


def trip_count(line: str, bodies: dict[str, list[str]]) -> int:
    """A while loop's iterations: XLA's ``known_trip_count`` (the CPU and GPU compilers write
    it), else its condition's ``counter < N`` against a constant (libtpu's loops, whose
    counters start at 0 as a scan's do); 1 where neither is there."""
    if trip := _TRIP.search(line):
        return int(trip.group(1))
    condition = _CONDITION.search(line)
    lines = bodies.get(condition.group(1), []) if condition else []
    constants = {m.group(1): int(m.group(2)) for m in map(_CONSTANT.match, lines) if m}
    for ln in lines:
        if ln.lstrip().startswith("ROOT") and (m := _COMPARE.search(ln)):
            return constants.get(m.group(2).lstrip("%"), 1)
    return 1


def collectives(hlo_text: str, n_devices: int) -> list[Collective]:
    """Every collective instruction in ``hlo_text`` (async ``-start`` forms included)."""
    bodies, entry = computations(hlo_text)

    # How often each computation runs per step, and whether it runs inside a loop.
    runs: dict[str, int] = {}
    looped: dict[str, bool] = {}

    def visit(name: str, times: int, in_loop: bool) -> None:
        runs[name] = runs.get(name, 0) + times
        looped[name] = looped.get(name, False) or in_loop
        for line in bodies.get(name, ()):
            body = _BODY.search(line)
            for callee in _callees(line):
                if body and callee == body.group(1):
                    visit(callee, times * trip_count(line, bodies), True)
                elif callee in bodies:
                    visit(callee, times, in_loop)

    if entry is None:
        return []
    visit(entry, 1, False)

    found, channels = [], set()
    for name, lines in bodies.items():
        if name not in runs:
            continue
        for line in lines:
            parsed = instruction(line)
            if not parsed:
                continue
            _, shape, op, rest = parsed
            kind = op.removesuffix("-start")
            if kind not in KINDS:
                continue
            if name.startswith(_TPU_FUSIONS) and (channel := _CHANNEL.search(rest)):
                if channel.group(1) in channels:  # one collective, its steps in several fusions
                    continue
                channels.add(channel.group(1))
            groups = _groups(rest, n_devices)
            group = groups[0]
            arrays = _arrays(_payload(kind, op, shape))
            size = sum(b for _, b in arrays)
            if kind == "reduce-scatter" and not op.endswith("-start"):
                size *= len(group)  # the instruction's shape is the scattered result
            if kind == "all-reduce" and name.startswith(_TPU_REDUCE_SCATTER):
                kind = "reduce-scatter"  # libtpu's, whose all-reduce is the full-size side
            found.append(Collective(kind, arrays[0][0] if arrays else "?", size, group,
                                    looped[name], runs[name], name, groups))
    return found


_NAME = re.compile(r"%([\w.\-]+)")
_MATMULS = ("dot", "convolution")
_GEMM_CALL = re.compile(r'custom_call_target="[^"]*(gemm|matmul|conv)', re.IGNORECASE)


def matmul_finder(bodies: dict[str, list[str]]):
    """``is_matmul(line)`` over the computations ``bodies`` (``computations``' first result):
    whether an instruction line is a dot, a convolution or a GEMM custom call (cuBLAS, on GPU),
    or calls a computation (a fusion's, a loop's) that holds one."""
    @functools.cache
    def holds(name: str) -> bool:
        return any(is_matmul(line) for line in bodies.get(name, ()))

    def is_matmul(line: str) -> bool:
        parsed = instruction(line)
        if parsed and (parsed[2] in _MATMULS
                       or (parsed[2] == "custom-call" and _GEMM_CALL.search(parsed[3]))):
            return True
        return any(holds(c) for c in _callees(line))
    return is_matmul


def gathered_ahead(hlo_text: str) -> dict[str, list[bool]]:
    """For every innermost loop body with all-gathers (a layer loop, not the microbatch loop
    around it): per all-gather, whether its result only travels to the next iteration (the
    body's ROOT, the loop's carry) rather than feeding a matmul in this one. All True: the loop
    gathers one iteration ahead (prefetch)."""
    return {body: [not _reaches(g, users, matmul) for g in found]
            for body, found, users, _, matmul in _layer_loops(hlo_text, ("all-gather",))}


def reduced_behind(hlo_text: str) -> dict[str, list[bool]]:
    """For every innermost loop body with gradient reductions (reduce-scatters, or int8's
    all-to-alls): per reduction, whether its operand comes from the previous iteration (the
    loop's carry) rather than from a matmul in this one. All True: the loop reduces one
    iteration behind, beside the next layer's compute."""
    return {body: [not _reaches(r, operands, matmul) for r in found]
            for body, found, _, operands, matmul in _layer_loops(
                hlo_text, ("reduce-scatter", "all-to-all"))}


def copied_bytes(hlo_text: str, bodies) -> int:
    """Bytes the ``copy`` instructions of the computations ``bodies`` write, summed: for a loop
    body, what each iteration copies (of its carry, above all; prefetch replaces it in place)."""
    lines = computations(hlo_text)[0]
    return sum(size for body in bodies for parsed in map(instruction, lines[body])
               if parsed and parsed[2] == "copy" for _, size in _arrays(parsed[1]))


def _layer_loops(hlo_text: str, kinds: tuple[str, ...]):
    """``(body, collectives of kinds, users, operands, is-matmul)`` of every loop body holding
    a collective of ``kinds`` with no loop inside it that holds one (a layer loop, not the
    microbatch loop around it): the instruction graph both ways."""
    bodies, _ = computations(hlo_text)
    loops = {m.group(1) for lines in bodies.values() for line in lines
             if (m := _BODY.search(line))}

    is_matmul = matmul_finder(bodies)
    inner = {body: {m.group(1) for line in bodies.get(body, ()) if (m := _BODY.search(line))}
             for body in loops}

    @functools.cache
    def holds(body: str) -> bool:  # a collective of kinds, in it or in a loop within it
        return any((p := instruction(line)) and p[2].removesuffix("-start") in kinds
                   for line in bodies.get(body, ())) or any(map(holds, inner[body]))

    for body in sorted(loops):
        if any(map(holds, inner[body])):  # loops inside without collectives (random bits')
            continue  # do not count
        users: dict[str, list[str]] = collections.defaultdict(list)
        operands: dict[str, list[str]] = collections.defaultdict(list)
        matmul: dict[str, bool] = {}
        found = []
        for line in bodies.get(body, ()):
            parsed = instruction(line)
            if not parsed:
                continue
            name, _, op, rest = parsed
            for operand in _NAME.findall(rest):
                users[operand].append(name)
                operands[name].append(operand)
            matmul[name] = is_matmul(line)
            if op.removesuffix("-start") in kinds:
                found.append(name)
        if found:
            yield body, found, users, operands, matmul


def _reaches(start: str, edges: dict[str, list[str]], target: dict[str, bool]) -> bool:
    """Whether any instruction ``edges`` lead to from ``start``, directly or not, is a target
    (``edges``: who uses each result, or, the other way, what each one uses)."""
    todo, seen = [start], {start}
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if target.get(nxt):
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _block_of(line: str, bodies: dict[str, list[str]], blocks: list[str]):
    """``(block index, backward)`` of an instruction line, from its JAX name stack (a
    fusion's: its matmuls'): the block named last in it; None when none is."""
    names = _OP_NAME.findall(line) + [n for c in _callees(line) for inner in bodies.get(c, ())
                                      if matmul_finder(bodies)(inner)
                                      for n in _OP_NAME.findall(inner)]
    for name in names:
        at = [(m.start(), j) for j, block in enumerate(blocks)
              for m in re.finditer(rf"(?<=[/(]){re.escape(block)}(?=[/)])", name)]
        if at:
            return max(at)[1], "transpose(" in name
    return None


def _graph(lines: list[str]):
    """``(order, operands, users)`` of a computation's instructions."""
    order, operands, users = [], {}, collections.defaultdict(list)
    for line in lines:
        if parsed := instruction(line):
            name = parsed[0]
            order.append((name, parsed[2], line))
            operands[name] = _NAME.findall(parsed[3])
            for operand in operands[name]:
                users[operand].append(name)
    return order, operands, users


def _closure(start: str, edges, stop=lambda _: False) -> set[str]:
    """Every instruction ``edges`` lead to from ``start``, not going on past ``stop`` ones."""
    todo, seen = [start], set()
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                if not stop(nxt):
                    todo.append(nxt)
    return seen


def _gathers_waiting(hlo_text: str, blocks: list[str]):
    """Each all-gather of a straight-line program that feeds the matmuls of one of ``blocks``
    (in the order they run, each a part of its matmuls' JAX name stacks), read from the entry
    computation's data flow: ``(block index, the (block, backward) of every matmul it waits
    for)``."""
    bodies, entry = computations(hlo_text)
    order, operands, _ = _graph(bodies[entry])
    is_matmul = matmul_finder(bodies)
    owner = {name: _block_of(line, bodies, blocks) for name, _, line in order
             if is_matmul(line)}
    for name, op, line in order:
        if op.removesuffix("-start") == "all-gather" and \
                (j := (_block_of(line, bodies, blocks) or (None,))[0]) is not None:
            yield j, {owner[a] for a in _closure(name, operands) if owner.get(a)}


def gathered_beside(hlo_text: str, blocks: list[str]) -> dict[str, list[bool]]:
    """``forward``: per block after the first, whether an all-gather feeding its matmuls waits
    for none of the forward matmuls of the block before; ``backward``: per block before the
    last, whether an all-gather of the backward (one that waits for the last block's forward)
    feeding its matmuls waits for none of the backward matmuls of the block after
    (``_gathers_waiting``). All True: every block's weights are gathered while its neighbour
    computes (prefetch)."""
    found = {"forward": [False] * (len(blocks) - 1), "backward": [False] * (len(blocks) - 1)}
    for j, after in _gathers_waiting(hlo_text, blocks):
        if (len(blocks) - 1, False) in after:  # the backward's
            if j < len(blocks) - 1:
                found["backward"][j] |= (j + 1, True) not in after
        elif j > 0:
            found["forward"][j - 1] |= (j - 1, False) not in after
    return found


def forward_waits(hlo_text: str, blocks: list[str]) -> list[set[int]]:
    """Per block (or module) of ``blocks``, the others whose forward matmuls every forward
    all-gather of its weights waits for (``_gathers_waiting``): how far ahead of its use it
    can be gathered."""
    waits: list[set[int] | None] = [None] * len(blocks)
    for j, after in _gathers_waiting(hlo_text, blocks):
        if (len(blocks) - 1, False) not in after:  # not the backward's
            mine = {i for i, backward in after if not backward}
            waits[j] = mine if waits[j] is None else waits[j] & mine
    return [w or set() for w in waits]


def scheduled_ahead(hlo_text: str, blocks: list[str]) -> list[bool]:
    """Per block after the first of a straight-line program (as ``gathered_beside``): whether
    the schedule (the entry computation's instruction order) runs its first forward all-gather
    before the last forward matmul of the block before."""
    bodies, entry = computations(hlo_text)
    is_matmul = matmul_finder(bodies)
    last_matmul, first_gather = {}, {}
    for at, (_, op, line) in enumerate(_graph(bodies[entry])[0]):
        owner = _block_of(line, bodies, blocks)
        if owner is None or owner[1]:
            continue
        if is_matmul(line):
            last_matmul[owner[0]] = at
        if op.removesuffix("-start") == "all-gather":
            first_gather.setdefault(owner[0], at)
    return [j in first_gather and j - 1 in last_matmul and first_gather[j] < last_matmul[j - 1]
            for j in range(1, len(blocks))]
