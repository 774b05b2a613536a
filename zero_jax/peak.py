"""What fills a compiled step's peak memory, read from XLA's own live ranges.

``memory_analysis()`` gives totals; XLA's buffer assignment knows, for the moment memory peaks,
every buffer then live and the operation (by its JAX name stack) that made it. Compiling with
``xla_dump_to`` writes that list (``*-live-range.txt``, "Stack trace breakdown for peak
usage"); ``breakdown`` sorts its buffers into kinds by name stack. The kinds are read from
names, so they are as good as the names: a value the forward made is a "forward activation",
whether the backward still needs it (saved) or the peak is in the forward itself.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax

from zero_jax import internals

# In the order they are tried; the first whose test matches a buffer's name stack wins.
KINDS = ("model states", "gathered weights", "reduced gradients", "logits and loss",
         "gradients", "recomputed activations", "forward activations", "optimizer update",
         "other")
_LINE = re.compile(r"^(?P<indent>[\s│├└─]*)(?P<name>.+?) \([\d.]+%, total: (?P<total>[\d ]+) "
                   r"bytes, current: (?P<current>[\d ]+) bytes")
_LOSS = re.compile(r"softmax|cross_entropy|logsumexp|take_along_axis|log_softmax")
with open(__file__, "rb") as _f:  # how a dump is read: part of a kept split's key (``_kept``)
    _READER = hashlib.sha256(_f.read()).hexdigest()


def compile_with_peak(lowered: Any) -> tuple[Any, dict]:
    """``lowered.compile()``, and what is live at its peak (``breakdown``): one compilation,
    with XLA's buffer dumps written to a temporary directory.

    With JAX's persistent compilation cache on, the breakdown is kept beside it, keyed by the
    program: a program met again loads from the cache and its breakdown from there. (Without
    that, every start of a run compiled its step afresh for the dumps.)"""
    text = lowered.as_text()
    kept = _kept(text)
    if kept and os.path.exists(kept):
        with open(kept) as f:
            return lowered.compile(), json.load(f)
    name = re.search(r"module @([\w.\-]+)", text).group(1)
    # JAX leaves the dump options out of its persistent cache's key: a program compiled before
    # would come from there, dumping nothing. So the cache is not read here, only written: the
    # next plain compile of the program loads this one.
    with tempfile.TemporaryDirectory() as d, internals.compile_afresh():
        compiled = lowered.compile({"xla_dump_to": d, "xla_dump_hlo_pass_re": "^$",
                                    "xla_dump_hlo_module_re": f"^{re.escape(name)}$"})
        found = glob.glob(os.path.join(d, "*after_optimizations-live-range.txt"))
        live_ranges = _read(found[0]) if found else ""
        peak = breakdown(live_ranges)
        if found:
            dumps = [found[0][:-len("live-range.txt")] + suffix for suffix in (
                "buffer-assignment.txt", "buffer-assignment-values.txt")]
            dumps.append(found[0][:-len("-live-range.txt")] + ".txt")  # the optimized HLO
            if all(map(os.path.exists, dumps)):
                assignment, values, hlo = map(_read, dumps)
                peak["temp"] = temp_split(assignment, values, live_ranges, hlo)
    if kept and found:
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(kept), delete=False) as f:
            json.dump(peak, f)
        os.replace(f.name, kept)  # whole or absent, for the processes reading it beside us
    return compiled, peak


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _kept(text: str) -> str | None:
    """Where the breakdown of the program ``text`` is kept: in JAX's persistent cache's
    directory when it is on and local, named by what decides the compiled program (the
    program, the compiler and its flags, the devices) and how it is read (this file); else
    None."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory or "://" in directory:
        return None
    os.makedirs(directory, exist_ok=True)
    key = "\n".join([text, jax.__version__, jax.lib.__version__, _READER,
                     os.environ.get("XLA_FLAGS", ""), jax.devices()[0].device_kind])
    return os.path.join(directory, f"zero_jax-peak-{hashlib.sha256(key.encode()).hexdigest()}.json")


def breakdown(live_ranges: str) -> dict:
    """``{"peak_bytes", "by_kind": {kind: bytes}, "largest": [[name, kind, bytes], ...]}`` from
    the text of an ``*-live-range.txt`` dump: the peak's buffers by kind (``KINDS``), which sum to
    the peak, and the ten largest. Empty figures when the dump has no breakdown."""
    buffers = list(_peak_buffers(live_ranges))
    by_kind = dict.fromkeys(KINDS, 0)
    for name, size in buffers:
        by_kind[kind(name)] += size
    largest = sorted(buffers, key=lambda b: -b[1])[:10]
    return {"peak_bytes": sum(by_kind.values()), "by_kind": by_kind,
            "largest": [[name, kind(name), size] for name, size in largest]}


def _peak_buffers(text: str):
    """``(name stack, bytes)`` of each buffer in the dump's peak breakdown tree: a node's own
    ("current") bytes, its name the path of the labels above it."""
    start = text.find("Stack trace breakdown for peak usage")
    if start < 0:
        return
    stack: list[tuple[int, str]] = []
    for line in text[start:].splitlines()[1:]:
        m = _LINE.match(line)
        if not m:
            break
        depth = len(m.group("indent"))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        stack.append((depth, m.group("name")))
        current = int(m.group("current").replace(" ", ""))
        if current:
            # An operation's label is its whole name stack; an argument's is one part of its
            # path (state/params/...), under the program's root.
            name = m.group("name")
            yield name if "/" in name else "/".join(label for _, label in stack[1:]), current


def temp_split(assignment: str, values: str, live_ranges: str, hlo: str) -> dict:
    """XLA's temp allocation at the moment its buffers fill most of it: ``{"bytes", "at",
    "by_kind", "between buffers"}``, where the kinds and the bytes between buffers sum to the
    allocation. The allocation is one block whose layout XLA fixes at compile time, so a gap
    between the buffers live at that moment is memory the step needs all the same; the live
    set at the step's peak (``breakdown``) leaves it out, and counts the arguments besides.

    Read from the dumps of ``compile_with_peak``: the allocation's buffers (offsets and sizes)
    from the buffer assignment, when each lives from the live ranges, what made it from the
    optimized HLO's names. A value a loop carries (a "phi" of the dataflow's values) is named
    by what the loop body hands to its next iteration."""
    m = re.search(r"^allocation \d+: size (\d+),[^\n]*? preallocated-temp:\n((?: value:.*\n?)*)",
                  assignment, re.M)  # ", page 0," before it from jax 0.11 on
    if not m:
        return {}
    spans = dict((n, (int(a), int(b))) for n, a, b in re.findall(
        r"^\s+(\S+?):(\d+)-(\d+)$", live_ranges.split("BufferLiveRange:")[-1], re.M))
    buffers = [(_value(n), int(size), int(offset)) for n, size, offset in re.findall(
        r" value: <\d+ (.+?) @\d+> \(size=(\d+),offset=(\d+)\)", m.group(2))]
    buffers = [b for b in buffers if b[0] in spans]
    if not buffers:
        return {}

    by_offset = sorted((o, s, n) for n, s, o in buffers)
    live_at = lambda t: [b for b in by_offset if spans[b[2]][0] <= t <= spans[b[2]][1]]
    at = _fullest(buffers, spans, lambda t: sum(_unique(live_at(t))))
    names = _names(values, hlo)
    by_kind = dict.fromkeys(KINDS, 0)
    for (_, _, name), size in zip(live_at(at), _unique(live_at(at)), strict=True):
        by_kind[kind(names.get(name, ""))] += size
    total = int(m.group(1))
    return {"bytes": total, "at": at, "by_kind": by_kind,
            "between buffers": total - sum(by_kind.values())}


def _fullest(buffers: list, spans: dict, occupied: Callable[[int], int]) -> int:
    """The first moment (a buffer's start) at which ``occupied`` is largest. The plain sum of
    the live buffers' sizes bounds it from above and is cheap for every moment at once, so
    only the moments whose sum could beat the best found are measured."""
    change: dict[int, int] = {}
    for name, size, _ in buffers:
        start, end = spans[name]
        change[start] = change.get(start, 0) + size
        change[end + 1] = change.get(end + 1, 0) - size
    total, bound = 0, {}
    for t in sorted(change):
        total += change[t]
        bound[t] = total
    starts = {spans[name][0] for name, _, _ in buffers}
    best, at = -1, 0
    for t in sorted(starts, key=lambda t: (-bound[t], t)):
        if bound[t] < best:
            break
        if (size := occupied(t)) > best or (size == best and t < at):
            best, at = size, t
    return at


def _value(name: str) -> str:
    """A value's name as the live ranges write it: ``copy.3{}``, ``while.1{2}``."""
    name = name.replace(" (phi)", "")
    return name if "{" in name else name + "{}"


def _unique(live: list[tuple[int, int, str]]) -> list[int]:
    """Per buffer (sorted by offset), the bytes no buffer before it covers."""
    end, out = 0, []
    for offset, size, _ in live:
        out.append(max(0, offset + size - max(offset, end)))
        end = max(end, offset + size)
    return out


def _names(values: str, hlo: str) -> dict[str, str]:
    """Each value's name stack (its instruction's ``op_name``). A loop-carried value (a
    parameter of a loop body, or a loop's result) takes the name of what the body's root hands
    on in its place."""
    op_name, operands, roots, bodies, params = {}, {}, {}, {}, {}
    computation = None
    for line in hlo.splitlines():
        if (head := re.match(r"^(?:ENTRY )?%(\S+) \(", line)):
            computation = head.group(1)
            continue
        if not (m := re.match(r"^\s*(ROOT )?%(\S+) = .*? ([a-z][\w\-]*)\((.*?)\)", line)):
            continue
        root, inst, opcode, args = m.groups()
        operands[inst] = (opcode, re.findall(r"%([\w.\-]+)", args),
                          int(i.group(1)) if (i := re.search(r", index=(\d+)", line)) else None)
        if (named := re.search(r'op_name="([^"]*)"', line)):
            op_name[inst] = named.group(1)
        if root and opcode == "tuple":
            roots[computation] = operands[inst][1]
        elif opcode == "parameter":
            params[inst] = computation
        elif opcode == "while" and (body := re.search(r"body=%([\w.\-]+)", line)):
            bodies[inst] = body.group(1)

    handed = lambda body, i: (roots.get(body) or [])[i:i + 1] or [""]  # what the root hands on

    def named(inst: str) -> str:
        """Through copies, bitcasts and a loop body's parameter to an instruction with a name."""
        for _ in range(16):
            if inst in op_name:
                return op_name[inst]
            opcode, args, index = operands.get(inst, ("", [], None))
            if opcode == "get-tuple-element" and args and index is not None and args[0] in params:
                (inst,) = handed(params[args[0]], index)
            elif args and opcode != "parameter":
                inst = args[0]
            else:
                return ""
        return ""

    names = {}
    for m in re.finditer(r"^<\d+ (.+?) @\d+>\n", values, re.M):
        name = _value(m.group(1))
        base, index = re.match(r"(.*?)\{(\d*)", name).groups()
        if " (phi)" in m.group(1) and index:
            (names[name],) = map(named, handed(params.get(base) or bodies.get(base), int(index)))
        else:
            names[name] = named(base)
    return names


def kind(name: str) -> str:
    """The kind of a buffer, from the name stack of the operation that made it."""
    last = name.rsplit("/", 1)[-1]
    if name.startswith(("state", "batch")):
        return "model states"  # the step's arguments: parameters, optimizer state, the batch
    if "all_gather" in last or "all-gather" in last or "/gathered/" in name:
        # A layer's gathered bucket, and the leaves cut out of it (buckets.all_gather's scope).
        return "gathered weights"
    if any(k in last for k in ("reduce_scatter", "psum_scatter", "all_to_all")) or (
            "/reduce_gradients/" in name):
        return "reduced gradients"
    if "/normalize_gradients/" in name:
        return "gradients"  # reduced, scaled to the global batch: the optimizer's input
    if _LOSS.search(name):
        return "logits and loss"
    if "transpose(" in name:
        # The backward: a block's forward run again (remat's, in prefetch's loops too, under
        # transposes of their own), or gradients (of weights before their reduction, of
        # activations).
        rest = re.sub(r"^.*?transpose\(jvp\([^)]*\)\)", "", name)
        if "rematted_computation" in name or ("transpose(" not in rest and "jvp(" in rest):
            return "recomputed activations"
        return "gradients"
    if "jvp(" in name:
        return "forward activations"  # saved for the backward, or the forward's own
    if name.startswith("jit(") and "shard_map" not in name:
        return "optimizer update"  # the update runs on global arrays, outside the shard_map
    return "other"
