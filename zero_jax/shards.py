"""A device's parameter shards made whole inside ``shard_map``, and their gradients reduced.

A cut parameter reaches the model as a ``Shard``. ``materialize_tree`` makes the whole array right
where a layer needs it; its backward is the reduce-scatter of that layer's gradient, in
``reduce_dtype``, so each layer's gradient leaves the layer already cut into shards:

- stage 3: the forward all-gathers the shards (in the compute dtype). Under ``remat`` the
  backward runs the forward again, so it gathers again, then reduce-scatters the gradient.
- stage 2: the whole copy is already on the device, so the forward reads it; the backward
  reduce-scatters the gradient.

Parameters that are not cut (every parameter at stages 0 and 1; leaves that do not divide or
are persistent at 2 and 3) are, inside a block and with buckets on, ``Shard``s without an axis
("replicas"): read as they are, their gradient all-reduced as the block's backward ends (DDP's
buckets). Elsewhere they are plain arrays, their gradients summed locally and all-reduced once,
after the backward (``zero_jax.grads``). The leaves one block makes whole together share their
collectives (``zero_jax.buckets``). Where in a model this happens is ``zero_jax.blocks``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from zero_jax import buckets
from zero_jax.buckets import Comm
from zero_jax.mesh import MODEL
from zero_jax.offload import in_host_memory

PyTree = Any
# The name a gathered weight carries, for remat policies that must not save it
# (``zero_jax.blocks.remat``'s).
GATHERED = "zero_jax_gathered"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Shard:
    """A parameter as a block receives it: this device's piece, cut along ``axis`` (negative:
    counted from the end) over mesh axis ``mesh_axis``; ``axis`` None: a whole parameter whose
    gradient is all-reduced inside the backward (stages 0-1, DDP's buckets)."""

    value: jax.Array  # the shard: what the gradient is taken with respect to
    whole: jax.Array | None  # stage 2: the replicated copy, which the forward reads as is
    axis: int | None = dataclasses.field(metadata=dict(static=True))
    mesh_axis: str | tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    reduce_dtype: str = dataclasses.field(metadata=dict(static=True))
    # Stage 3 streaming its gradient to the host: the device shard the forward gathers, while
    # ``value``, in host memory, only carries the gradient there.
    gather_from: jax.Array | None = None
    comm: Comm = dataclasses.field(default=Comm(), metadata=dict(static=True))
    # Not trained: it travels in buckets of its own, whose gradient reduction is then dead code
    # that XLA drops, as it drops a lone leaf's; in a shared bucket it would be reduced.
    frozen: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # Tensor parallelism: the dimension (negative) cut over the ``model`` axis, which the
    # partitioner places; ZeRO's collectives run on each tensor-parallel rank's piece.
    model_dim: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Memory-centric tiling: (dimension counted from the end, tiles). Never made whole: its
    # layer gathers it tile by tile (``zero_jax.blocks.tiling``).
    tile: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    # ``model_dim`` cut over model x data, split in two (``Plan.split_model``): ``model``'s
    # piece at ``model_dim``, the data axes' after it; the whole leaf merges them back.
    split: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def kind(self) -> str:
        return "replica" if self.axis is None else "read" if self.whole is not None else "gather"


class _How(NamedTuple):
    """What one ``_whole`` call does, for leaves that share it (static)."""

    kind: str  # gather (stage 3), read (stage 2: the whole copy), replica (stages 0-1)
    axes: tuple[int | None, ...]
    mesh_axis: str | tuple[str, ...]
    reduce_dtype: str
    dtypes: tuple[str, ...]  # the targets', which their gradients come back in
    comm: Comm
    model_dims: tuple[int | None, ...]  # each leaf's tensor-parallel dimension (negative)


def per_model_rank(fn, xs: list[jax.Array], model_dims: tuple[int | None, ...]) -> list:
    """``fn(xs)``, a ZeRO collective over the data axes, run on each tensor-parallel rank's
    own pieces: ``shard_map`` over ``model`` inside the data-parallel one. Left to the
    partitioner, a collective over ``data`` first gathers its operand over ``model``."""
    if all(d is None for d in model_dims):
        return fn(xs)
    specs = [P() if d is None else P(*[MODEL if i == d % x.ndim else None
                                       for i in range(x.ndim)])
             for x, d in zip(xs, model_dims, strict=True)]
    # A bucket may mix leaves cut over ``model`` with whole ones; those come out the same on
    # every tensor-parallel rank (the same bytes moved, summed in the same order), which
    # shard_map cannot infer through the bucket's concatenation: it is told, not checked. The
    # results are then typed as the collective types them (varying over the data axes or not).
    want = jax.eval_shape(fn, xs)
    out = jax.shard_map(fn, in_specs=(specs,), out_specs=specs, axis_names={MODEL},
                        check_vma=False)(xs)
    varying = lambda x: x.manual_axis_type.varying
    return [y if not (extra := tuple(varying(w) - varying(jax.typeof(y))))
            else jax.lax.pcast(y, extra, to="varying") for y, w in zip(out, want, strict=True)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _whole(targets: list, sources: list, how: _How, after: tuple) -> list:
    """The whole leaves: ``sources`` gathered (stage 3) or read as they are; the gradients go
    to ``targets`` (reduce-scattered, or all-reduced for replicas), never to ``sources`` nor
    ``after`` (``buckets.all_gather``'s)."""
    if how.kind == "gather":  # each bucket cut into all its leaves before any is used
        # (buckets._cut; stage 3 without prefetch, temp per device: wide 46.07 -> 38.18 MiB,
        # tiny 6.91 -> 6.16, the unrolled GPT 6.66 -> 5.90)
        return per_model_rank(lambda xs: buckets.all_gather(
            xs, list(how.axes), how.mesh_axis, how.comm, after=after),
            sources, how.model_dims)
    # pcast marks the copy as per-device; without it JAX would all-reduce its gradient before
    # our reduce and the gradient would come out N times too large.
    return [jax.lax.pcast(s, how.mesh_axis, to="varying") for s in sources]


def _whole_fwd(targets, sources, how, after):
    return _whole(targets, sources, how, after), None


def _reduce(how: _How, gs: list, hold: PyTree = ()) -> tuple[list, PyTree]:
    """The gradients of whole leaves back to their targets: reduce-scattered into shards, or
    all-reduced for replicas, in the targets' dtypes; and ``hold`` (``buckets.reduce_scatter``)."""
    if how.kind == "replica":
        summed = per_model_rank(lambda gs: buckets.all_reduce(
            gs, how.mesh_axis, how.reduce_dtype, how.comm), gs, how.model_dims)
    else:  # each tensor-parallel rank's pieces; ``hold`` is whole on ``model``
        held, tree = jax.tree.flatten(hold)
        n = len(gs)

        def scatter(xs):
            out, kept = buckets.reduce_scatter(xs[:n], list(how.axes), how.mesh_axis,
                                               how.reduce_dtype, how.comm, tree.unflatten(xs[n:]))
            return out + jax.tree.leaves(kept)
        out = per_model_rank(scatter, gs + held, how.model_dims + (None,) * len(held))
        summed, hold = out[:n], tree.unflatten(out[n:])
    return [g.astype(d) for g, d in zip(summed, how.dtypes, strict=True)], hold


def _whole_bwd(how, _, gs):
    return _reduce(how, gs)[0], None, None


_whole.defvjp(_whole_fwd, _whole_bwd)


def _how(xs: list[Shard]) -> _How:
    first = xs[0]
    axes = tuple(None if x.axis is None else x.axis % x.value.ndim for x in xs)
    return _How(first.kind, axes, first.mesh_axis, first.reduce_dtype,
                tuple(x.value.dtype.name for x in xs), first.comm,
                tuple(x.model_dim for x in xs))


def _groups(leaves: list) -> list[list[int]]:
    """The ``Shard``s among ``leaves`` that travel together: same kind, axes, dtypes, comm,
    and trained or frozen."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        if is_shard(x) and not x.tile:
            key = (x.kind, x.mesh_axis, x.reduce_dtype, x.comm, x.frozen,
                   (x.gather_from if x.gather_from is not None else x.value).dtype)
            groups.setdefault(key, []).append(i)
    return list(groups.values())


def _materialize_group(xs: list[Shard], after: tuple) -> list[jax.Array]:
    """Leaves that travel together made whole in one call."""
    first = xs[0]
    # Offloaded parameters: each shard is copied to the device right before its gather, and
    # its gradient shard goes back to host memory as the layer's backward ends; likewise the
    # host-memory shard of stage 2 that only carries the gradient.
    targets = [jax.device_put(x.value, jax.memory.Space.Device) if in_host_memory(x.value)
               else x.value for x in xs]
    if first.kind == "gather":
        sources = [t if x.gather_from is None else x.gather_from
                   for x, t in zip(xs, targets, strict=True)]
    elif first.kind == "read":
        sources = [x.whole for x in xs]
    else:
        sources = targets
    wholes = _whole(targets, [jax.lax.stop_gradient(s) for s in sources], _how(xs),
                    jax.lax.stop_gradient(after))
    wholes = [_merged(w, x.model_dim) if x.split else w for x, w in zip(xs, wholes, strict=True)]
    if first.kind == "gather":  # the per-layer checkpoint name of remat policies
        wholes = [checkpoint_name(w, GATHERED) for w in wholes]
    return wholes


def _merged(w: jax.Array, model_dim: int) -> jax.Array:
    k = model_dim % w.ndim
    return w.reshape(*w.shape[:k], -1, *w.shape[k + 2:])


def _split(g: jax.Array, x: Shard) -> jax.Array:
    """A whole leaf's gradient split as ``x`` is (``_merged`` undone)."""
    if not x.split:
        return g
    k = x.model_dim % x.value.ndim
    return g.reshape(*g.shape[:k], x.value.shape[k], -1, *g.shape[k + 1:])


def whole_tile(x: Shard) -> jax.Array:
    """One tile of a tiled leaf made whole (``zero_jax.blocks.tiling``): its gradient
    reduce-scattered as any gathered leaf's."""
    return _materialize_group([x], ())[0]


def materialize_tree(tree: PyTree, after: tuple = ()) -> PyTree:
    """Every ``Shard`` in ``tree`` made whole; leaves that travel alike share buckets. Gathered
    leaves are cut out of their buckets only once ``after`` is computed (``buckets.all_gather``:
    for a loop that carries them)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_shard)
    after = tuple(x for x in jax.tree.leaves(after) if isinstance(x, jax.Array))
    for members in _groups(leaves):
        for i, w in zip(members, _materialize_group([leaves[i] for i in members], after),
                        strict=True):
            leaves[i] = w
    return treedef.unflatten(leaves)


def reduce_tree(tree: PyTree, grads: PyTree, hold: PyTree = ()) -> tuple[PyTree, PyTree]:
    """The gradient of ``tree`` (with ``Shard``s) from ``grads``, that of its whole leaves as
    ``materialize_tree`` made them: what the backward of ``materialize_tree`` does, for a loop
    that differentiates the whole leaves itself (``zero_jax.blocks.prefetch``). Returns it and
    ``hold``, passed back once the gradients are packed into their buckets (for a loop that
    carries them: ``buckets.reduce_scatter``)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_shard)
    out = list(jax.tree.leaves(grads))
    for members in _groups(leaves):
        xs = [leaves[i] for i in members]
        reduced, hold = _reduce(_how(xs), [_split(out[i], leaves[i]) for i in members], hold)
        for i, x, g in zip(members, xs, reduced, strict=True):
            # An offloaded shard's gradient goes back to host memory, as ``_whole``'s does.
            g = jax.device_put(g, jax.memory.Space.Host) if in_host_memory(x.value) else g
            out[i] = dataclasses.replace(x, value=g, whole=None, gather_from=None)
    return treedef.unflatten(out), hold


def is_shard(x) -> bool:
    return isinstance(x, Shard)


def has_shards(tree: PyTree) -> bool:
    """Whether ``tree`` holds a ``Shard`` still to make whole (a tiled one never is)."""
    return any(is_shard(x) and not x.tile for x in jax.tree.leaves(tree, is_leaf=is_shard))


def is_gathered(tree: PyTree) -> bool:
    """Whether making ``tree`` whole gathers (stage 3), rather than reading a copy (stage 2)."""
    return any(x.kind == "gather" for x in jax.tree.leaves(tree, is_leaf=is_shard) if is_shard(x))


def after_inputs(tree: PyTree, args: tuple, kwargs: dict) -> PyTree:
    """``tree`` (a block's ``Shard``s) made to wait for the arrays in ``args`` and ``kwargs``
    (the block's inputs), so that its gathers do too: else the scheduler may hoist every
    block's gather to the start and hold the whole model."""
    # Only what is gathered: a barrier marks its outputs per-device, and a replica (a whole
    # parameter all-reduced in the backward) must stay the same on every device. The inputs
    # only order the barrier: without stop_gradient their zero gradient came back through
    # its transpose and was added to the real one (an input-sized buffer per block).
    inputs = [jax.lax.stop_gradient(x) for x in jax.tree.leaves((args, kwargs))
              if isinstance(x, jax.Array)]
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_shard)
    waiting = [i for i, x in enumerate(leaves) if not is_shard(x) or x.kind != "replica"]
    done = jax.lax.optimization_barrier(([leaves[i] for i in waiting], inputs))[0]
    for i, x in zip(waiting, done, strict=True):
        leaves[i] = x
    return treedef.unflatten(leaves)
