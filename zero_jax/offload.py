"""Running part of the step on the host (ZeRO-Offload's update), and proving that splitting the
optimizer between host and device computes what it computes whole.

``on_host`` is ``jax.experimental.compute_on("device_host")`` for functions that create
constants (any optax transformation does). JAX types an array in host memory as such, and
refuses an op that mixes it with a constant, which is typed "device". So the function is traced
on device-typed stand-ins of its arguments, and that jaxpr is bound as the host computation over
the real, host-resident, arguments: the program is the host computation one would write by hand
(``_xla_compute_type="host"`` on the call, its operands and results in ``pinned_host``), with no
copy inside it. Trying ``device_put(x, Device)`` inside the host function instead lowers to
nothing on CPU but to a host-to-device annotation on GPU and TPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from zero_jax.internals import compute_on_primitive

PyTree = Any
MiB = 1 << 20
HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def in_host_memory(x: jax.Array) -> bool:
    return jax.typeof(x).memory_space == HOST


def on_host_leaves(fn: Callable, tree: PyTree, *args: Any) -> tuple[PyTree, Any]:
    """``fn(host_leaves, *args) -> (new_host_leaves, extra)`` as one host computation over the
    leaves of ``tree`` in host memory (the others are kept); returns the tree with them
    replaced, in host memory, and ``extra`` on the device. ``(tree, None)`` if none is."""
    flat, structure = jax.tree.flatten(tree)
    host = [in_host_memory(x) for x in flat]
    if not any(host):
        return tree, None
    on_device = lambda shapes: ([True] * len(shapes[0]), jax.tree.map(lambda _: False, shapes[1]))
    new, extra = on_host(fn, on_device)(
        [x for h, x in zip(host, flat, strict=True) if h], *args)
    new = iter(new)
    return jax.tree.unflatten(structure, [next(new) if h else x
                                          for h, x in zip(host, flat, strict=True)]), extra


def to_host(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.device_put(x, HOST), tree)


def on_host(fn: Callable, out_on_host: Callable[[PyTree], PyTree]) -> Callable:
    """``fn`` as one host computation. Its arguments are moved to host memory first; each result
    stays in host memory where ``out_on_host(result shapes)`` says True, else returns to the
    device."""
    def call(*args):
        flat, tree = jax.tree.flatten(to_host(args))
        stand_ins = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
        closed, shapes = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)),
                                        return_shape=True)(*stand_ins)
        spaces = tuple(HOST if h else DEVICE for h in jax.tree.leaves(out_on_host(shapes)))
        outs = compute_on_primitive().bind(*flat, jaxpr=closed, compute_type="device_host",
                                 out_memory_spaces=spaces, compiler_options_json=None)
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)
    return call


def dependencies(fn: Callable, *args: Any) -> list[set[int]]:
    """For each output leaf of ``fn(*args)``, the flat indices of the input leaves it is
    computed from (read off the jaxpr; control flow counts as depending on all its inputs)."""
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    closed = jax.make_jaxpr(fn)(*plain)
    return _jaxpr_deps(closed.jaxpr, [{i} for i in range(len(closed.jaxpr.invars))])


def _jaxpr_deps(jaxpr, in_deps: Sequence[set[int]]) -> list[set[int]]:
    deps = dict(zip(jaxpr.invars, in_deps, strict=True))
    get = lambda v: set() if isinstance(v, jex_core.Literal) else deps.get(v, set())
    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr")
        if eqn.primitive.name in ("pjit", "jit", "closed_call") and inner is not None:
            inner = getattr(inner, "jaxpr", inner)
            outs = _jaxpr_deps(inner, ins)
        else:
            every = set().union(*ins) if ins else set()
            outs = [every] * len(eqn.outvars)
        deps.update(zip(eqn.outvars, outs, strict=True))
    return [get(v) for v in jaxpr.outvars]


class Owners(NamedTuple):
    """Which leaves the host's part of a split update owns (bools, by tree): of the optimizer
    state, those both parts read (shared counters), of the master, and of the compute copy
    that stays in host memory."""

    state_host: PyTree
    state_shared: PyTree
    master_host: PyTree
    compute_host: PyTree


def split_update(update: Callable, raw: Callable, grads: PyTree, opt_state: PyTree,
                 master: PyTree, owners: Owners) -> Callable:
    """``update(grads, opt_state, master, finite) -> (master, opt_state, compute)`` run in two
    parts: the leaves marked host by the host, the rest by the device. ``raw(grads, opt_state,
    master) -> (master, opt_state)`` is the optimizer alone, whose jaxpr is checked. The new
    compute copy of a leaf stays in host memory where ``owners.compute_host`` says so.

    Each part runs the whole ``update`` on every gradient, its own leaves of the state and
    master, the shared counters and zeros for the other part's leaves, and keeps only its own
    results: exact when no result reads the other part's state or master (``_check_separable``;
    global-norm clipping reads every gradient, which both parts have).
    """
    (s_tree, s_shapes), (m_tree, m_shapes) = (
        (jax.tree.structure(t), jax.tree.leaves(t)) for t in (opt_state, master))
    s_host, s_shared, m_host, c_host = map(jax.tree.leaves, owners)
    if len(set(s_host + m_host)) > 1:  # both parts own something: check the split is exact
        _check_separable(raw, grads, opt_state, master, s_host, s_shared, m_host)

    def part(host_side: bool):
        mine_s = [h == host_side for h in s_host]
        mine_m = [h == host_side for h in m_host]
        reads_s = [m or shared for m, shared in zip(mine_s, s_shared, strict=True)]

        def fill(flags, values, shapes):  # this part's values, zeros for the other part's
            values = iter(values)
            return [next(values) if f else jnp.zeros(x.shape, x.dtype)
                    for f, x in zip(flags, shapes, strict=True)]

        def run(grads, state, master, finite):
            new_m, new_s, compute = update(
                grads, jax.tree.unflatten(s_tree, fill(reads_s, state, s_shapes)),
                jax.tree.unflatten(m_tree, fill(mine_m, master, m_shapes)), finite)
            return (_pick(mine_m, new_m), _pick(mine_s, new_s), _pick(mine_m, compute))

        def call(grads, opt_state, master, finite):
            args = (grads, _pick(reads_s, opt_state), _pick(mine_m, master), finite)
            if not host_side:  # gradients already in host memory come back (if read)
                return run(jax.tree.map(lambda g: jax.device_put(g, DEVICE), grads), *args[1:])
            return on_host(run, lambda shapes: (
                [True] * len(shapes[0]), [True] * len(shapes[1]), _pick(mine_m, c_host)))(*args)

        return call, mine_s, mine_m

    parts = [p for p in (part(True), part(False)) if any(p[1]) or any(p[2])]

    def split(grads, opt_state, master, finite):
        new_s, new_m, compute = ([None] * len(x) for x in (s_shapes, m_shapes, m_shapes))
        for call, mine_s, mine_m in parts:
            m, s, c = call(grads, opt_state, master, finite)
            for flags, out, values in ((mine_s, new_s, s), (mine_m, new_m, m),
                                       (mine_m, compute, c)):
                values = iter(values)
                for i, f in enumerate(flags):
                    if f:
                        out[i] = next(values)
        return (jax.tree.unflatten(m_tree, new_m), jax.tree.unflatten(s_tree, new_s),
                jax.tree.unflatten(m_tree, compute))
    return split


def _check_separable(raw: Callable, grads: PyTree, opt_state: PyTree, master: PyTree,
                     s_host: list[bool], s_shared: list[bool], m_host: list[bool]) -> None:
    """Raise unless every result of ``raw`` reads only its own part's state and master (and
    the gradients and shared counters, which both parts have)."""
    # The owner of each input: True host, False device, None both (gradients, counters).
    owner = ([None] * len(jax.tree.leaves(grads)) +
             [None if shared else h for h, shared in zip(s_host, s_shared, strict=True)] +
             m_host)
    names = ([f"the master of parameter {i}" for i in range(len(m_host))] +
             [f"optimizer state leaf {i}" for i in range(len(s_host))])
    deps = dependencies(raw, grads, opt_state, master)
    for mine, name, reads in zip(m_host + s_host, names, deps, strict=True):
        if any(owner[i] is not None and owner[i] != mine for i in reads):
            raise ValueError(
                f"offload_optimizer below 1 splits the update between host and device, but "
                f"this optimizer computes {name} from state or parameters of the other "
                f"part; it is not separable by leaves: use offload_optimizer 1 (the whole "
                f"update on the host) or 0")


def _pick(flags: list[bool], tree: PyTree) -> list:
    return [x for f, x in zip(flags, jax.tree.leaves(tree), strict=True) if f]


@dataclasses.dataclass(frozen=True)
class Nvme:
    """Where and how the NVMe tier keeps the optimizer's state (``Offload.nvme``).

    ``path``: an existing, writable directory on a local disk; each process writes only under
    ``path/process<i>``. ``chunk_mb``: the size of a band, the rows of every parameter's master
    and state read, updated and written together (DeepSpeed's ``buffer_size``). ``buffers``:
    bands alive at once (at least 3: one read ahead, one updated, one being written;
    DeepSpeed's ``buffer_count``)."""

    path: str
    chunk_mb: float = 64.0
    buffers: int = 4
    # A 4 KiB page: the disk reads and writes no less, and bands of a few bytes are a band
    # (a Python loop's turn, a read, a write) per element of the state: hours per step.
    MIN_CHUNK_MB: ClassVar[float] = 4 / 1024

    def __post_init__(self):
        if not self.path:
            raise ValueError("Nvme.path is empty: name a directory on a local disk")
        if not self.MIN_CHUNK_MB <= self.chunk_mb < math.inf:  # nan fails too
            raise ValueError(f"Nvme.chunk_mb is the size of one band in MiB, a finite number "
                             f"of at least {self.MIN_CHUNK_MB:g} (4 KiB, a disk page) (got "
                             f"{self.chunk_mb})")
        if self.buffers < 3:
            raise ValueError(f"Nvme.buffers must be at least 3 (one band read ahead, one "
                             f"updated, one written back), got {self.buffers}")

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * MiB))


@dataclasses.dataclass(frozen=True)
class Offload:
    """What lives in host memory (ZeRO-Offload, and ZeRO-Infinity's CPU tier).

    ``optimizer``: the fraction (0..1) of the optimizer's bytes whose fp32 master and state live
    in host memory and are updated there, largest leaves first (DeepSpeed's ZeRO-Offload++,
    Megatron's offload fraction). ``params``: stage 3's parameter shards in host memory, each
    copied to the device as it is gathered; the gradients then reach the host layer by layer,
    so the whole update runs there (``optimizer`` 1). ``grads``: the gradient accumulator waits
    in host memory between microbatches. ``nvme``: ZeRO-Infinity's NVMe tier, the master and
    optimizer state in files on a local disk instead of host memory (``zero_jax.nvme``).
    """

    optimizer: float = 0.0
    params: bool = False
    grads: bool = False
    nvme: Nvme | None = None

    def __post_init__(self):
        if not 0.0 <= self.optimizer <= 1.0:
            raise ValueError(f"Offload.optimizer is the fraction of optimizer state in host "
                             f"memory, 0 to 1 (got {self.optimizer})")
        if self.nvme is not None and self.optimizer != 1.0:
            raise ValueError("Offload.nvme keeps the whole optimizer in files and updates it on "
                             "the host: it needs Offload(optimizer=1.0)")
        if self.params and self.optimizer != 1.0:
            raise ValueError("Offload.params brings each layer's gradient to the host, where "
                             "the whole update must then run: it needs Offload(optimizer=1.0)")

    @property
    def any(self) -> bool:
        """Whether anything of the optimizer or parameters is in host memory."""
        return bool(self.optimizer or self.params)
