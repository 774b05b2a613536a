"""Making a device's parameter shards whole inside ``shard_map``, and reducing their gradients.

A cut parameter reaches the model as a ``Shard``. ``materialize`` makes the whole array right
where a layer needs it; its backward is the reduce-scatter of that layer's gradient, in
``reduce_dtype``, so each layer's gradient leaves the layer already cut into shards:

- stage 3: the forward all-gathers the shards (in the compute dtype). Under ``remat`` the
  backward runs the forward again, so it gathers again, then reduce-scatters the gradient.
- stage 2: the whole copy is already on the device, so the forward reads it; the backward
  reduce-scatters the gradient.

Parameters that are not cut (every parameter at stages 0 and 1; leaves that do not divide or
are persistent at 2 and 3) are not ``Shard``s: their gradients are summed locally and
all-reduced once, after the backward (``zero_jax.step``).

``per_block`` makes this happen block by block in any Flax linen model, by module path.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Shard:
    """This device's piece of a parameter, cut along ``axis`` (negative: counted from the end)
    over mesh axis ``mesh_axis``."""

    value: jax.Array  # the shard: what the gradient is taken with respect to
    whole: jax.Array | None  # stage 2: the replicated copy, which the forward reads as is
    axis: int = dataclasses.field(metadata=dict(static=True))
    mesh_axis: str = dataclasses.field(metadata=dict(static=True))
    reduce_dtype: str = dataclasses.field(metadata=dict(static=True))
    # Stage 3 streaming its gradient to the host: the device shard the forward gathers, while
    # ``value``, in host memory, only carries the gradient there.
    gather_from: jax.Array | None = None


def is_shard(x) -> bool:
    return isinstance(x, Shard)


def _reduce_scatter(g: jax.Array, like: jax.Array, axis: int, mesh_axis: str,
                    reduce_dtype: str) -> jax.Array:
    """Sum ``g`` over devices in ``reduce_dtype``; keep this device's cut, in ``like``'s dtype."""
    summed = jax.lax.psum_scatter(g.astype(reduce_dtype), mesh_axis, scatter_dimension=axis,
                                  tiled=True)
    return summed.astype(like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather(shard: jax.Array, axis: int, mesh_axis: str, reduce_dtype: str) -> jax.Array:
    return jax.lax.all_gather(shard, mesh_axis, axis=axis, tiled=True)


def _gather_fwd(shard, axis, mesh_axis, reduce_dtype):
    return _gather(shard, axis, mesh_axis, reduce_dtype), jnp.zeros((), shard.dtype)


def _gather_bwd(axis, mesh_axis, reduce_dtype, like, g):
    return (_reduce_scatter(g, like, axis, mesh_axis, reduce_dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _gather_for(shard: jax.Array, carrier: jax.Array, axis: int, mesh_axis: str,
                reduce_dtype: str) -> jax.Array:
    """``shard`` gathered; the gradient goes to ``carrier`` (reduce-scattered), not ``shard``."""
    return jax.lax.all_gather(shard, mesh_axis, axis=axis, tiled=True)


def _gather_for_fwd(shard, carrier, axis, mesh_axis, reduce_dtype):
    return _gather_for(shard, carrier, axis, mesh_axis, reduce_dtype), jnp.zeros((), carrier.dtype)


def _gather_for_bwd(axis, mesh_axis, reduce_dtype, like, g):
    return None, _reduce_scatter(g, like, axis, mesh_axis, reduce_dtype)


_gather_for.defvjp(_gather_for_fwd, _gather_for_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _read_whole(shard: jax.Array, whole: jax.Array, axis: int, mesh_axis: str,
                reduce_dtype: str) -> jax.Array:
    # pcast marks the copy as per-device; without it JAX would all-reduce its gradient before
    # our reduce-scatter and the gradient would come out N times too large.
    return jax.lax.pcast(whole, mesh_axis, to="varying")


def _read_whole_fwd(shard, whole, axis, mesh_axis, reduce_dtype):
    return _read_whole(shard, whole, axis, mesh_axis, reduce_dtype), jnp.zeros((), shard.dtype)


def _read_whole_bwd(axis, mesh_axis, reduce_dtype, like, g):
    return _reduce_scatter(g, like, axis, mesh_axis, reduce_dtype), None


_read_whole.defvjp(_read_whole_fwd, _read_whole_bwd)


def materialize(x: Any) -> Any:
    """The whole parameter for a ``Shard``; anything else is returned unchanged."""
    if not is_shard(x):
        return x
    axis = x.axis % x.value.ndim  # counted from the end: the same in a scan's per-layer slice
    if x.whole is None:
        # Offloaded parameters: this layer's shard is copied to the device right before its
        # gather, and its gradient shard goes back to host memory as its backward ends.
        value = jax.device_put(x.value, jax.memory.Space.Device)
        if x.gather_from is None:
            whole = _gather(value, axis, x.mesh_axis, x.reduce_dtype)
        else:
            whole = _gather_for(jax.lax.stop_gradient(x.gather_from), value, axis, x.mesh_axis,
                                x.reduce_dtype)
        return checkpoint_name(whole, GATHERED)
    # Stage 2 reads its whole copy; the shard only carries the gradient, which, when the shard
    # is in host memory (optimizer offload), goes there as this layer's backward ends.
    value = jax.device_put(x.value, jax.memory.Space.Device)
    return _read_whole(value, jax.lax.stop_gradient(x.whole), axis, x.mesh_axis,
                       x.reduce_dtype)


def materialize_tree(tree: PyTree) -> PyTree:
    return jax.tree.map(materialize, tree, is_leaf=is_shard)


def has_shards(tree: PyTree) -> bool:
    return any(is_shard(x) for x in jax.tree.leaves(tree, is_leaf=is_shard))


def _gathers(tree: PyTree) -> bool:
    """Whether making ``tree`` whole gathers (stage 3), rather than reading a copy (stage 2)."""
    return any(x.whole is None for x in jax.tree.leaves(tree, is_leaf=is_shard) if is_shard(x))


def _after_inputs(tree: PyTree, args: tuple, kwargs: dict) -> PyTree:
    # The block's inputs join its shards in a barrier, so its gathers wait for them: else the
    # scheduler may hoist every block's gather to the start and hold the whole model.
    inputs = [x for x in jax.tree.leaves((args, kwargs)) if isinstance(x, jax.Array)]
    return jax.lax.optimization_barrier((tree, inputs))[0]


# Names for remat policies: a block's input (its per-layer checkpoint) and a gathered weight.
BLOCK_INPUT, GATHERED = "zero_jax_block_input", "zero_jax_gathered"
REMAT = ("full", "dots", "none", "offload")


def remat_policy(name: str, gathers: bool = False) -> Any:
    """The ``jax.checkpoint`` policy of a block for ``model.remat`` ``name``:

    - ``full``: save nothing but the block's input; recompute the rest in the backward;
    - ``dots``: also save every matmul's output;
    - ``none``: save everything, recompute nothing (``gathers``: except the gathered weights,
      which stage 3 gathers again rather than keep whole through the step);
    - ``offload``: as ``full``, with the block's input (named ``BLOCK_INPUT``) saved in host
      memory: ZeRO-R's offloaded activation checkpoints.
    """
    cp = jax.checkpoint_policies
    if name not in REMAT:
        raise ValueError(f"remat policy must be one of {', '.join(REMAT)} (got {name!r})")
    return {"full": cp.nothing_saveable, "dots": cp.dots_saveable,
            "none": cp.save_anything_except_these_names(GATHERED) if gathers
            else cp.everything_saveable,
            "offload": cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=[BLOCK_INPUT],
                offload_src="device", offload_dst="pinned_host")}[name]


def name_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's array inputs named ``BLOCK_INPUT``, for the ``offload`` policy."""
    name = lambda x: checkpoint_name(x, BLOCK_INPUT) if isinstance(x, jax.Array) else x
    return jax.tree.map(name, args), jax.tree.map(name, kwargs)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("zero_jax_blocks", default=None)


@contextlib.contextmanager
def per_block(blocks: Iterable[str], remat: str = "full"):
    """Make each named block's ``Shard``s whole as the block runs; yields the set of blocks
    that ran.

    Linen, with no change to the model: any call of a module whose path is a block (an
    unrolled ``h/0`` or, inside ``nn.scan``, the scanned module, one layer's slice at a time)
    runs under a lifted ``map_variables`` that materializes its parameters. NNX: modules built
    by ``zero_jax.nnx_merge`` do the same in their ``__call__``. When that gathers (stage 3),
    the block is also rematerialized, so the backward gathers again instead of keeping whole
    weights as residuals; on the CPU backend this needs XLA to keep remat's optimization
    barriers (``zero_jax.mesh.simulate_cpu_devices``); ``remat`` names its policy
    (``remat_policy``).
    """
    names, seen = frozenset(blocks), set()
    policy = remat_policy(remat, gathers=True)

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        path = "/".join(module.path) if module.scope is not None else None
        if path not in names:
            return next_fun(*args, **kwargs)
        seen.add(path)
        params = module.variables.get("params", {})
        if not has_shards(params):
            return next_fun(*args, **kwargs)  # nothing cut, or already made whole
        run = lambda mdl: getattr(mdl, context.method_name)(*args, **kwargs)
        if not _gathers(params):  # stage 2: reads its whole copy
            return nn.map_variables(run, "params", trans_in_fn=materialize_tree)(module)
        gather = lambda params: materialize_tree(_after_inputs(params, args, kwargs))

        def named(mdl):  # inside the checkpoint, where the policy sees the names
            a, k = name_inputs(args, kwargs)
            return getattr(mdl, context.method_name)(*a, **k)
        run = nn.map_variables(named, "params", trans_in_fn=gather)
        return nn.remat(run, prevent_cse=True, policy=policy)(module)

    token = _ACTIVE.set((names, seen, policy))
    try:
        with nn.intercept_methods(intercept):
            yield seen
    finally:
        _ACTIVE.reset(token)


def nnx_merge(graphdef: Any, *states: Any) -> Any:
    """``nnx.merge`` for an NNX model in a ZeRO loss: the plan's blocks (``layers=``) become
    whole as they run, one at a time, whether they sit in a list or under ``nnx.scan``."""
    from flax import nnx

    model = nnx.merge(graphdef, *states, copy=True)  # variables of this trace, not the caller's
    active = _ACTIVE.get()
    if active is None:
        return model
    names, seen, _ = active
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and (name := "/".join(map(str, path))) in names:
            node.__class__ = _per_block_class(type(node))
            seen.add(name)
    return model


@functools.cache
def _per_block_class(cls: type) -> type:
    """``cls`` whose ``__call__`` makes its own ``Shard``s whole around the original one."""
    if getattr(cls, "_zero_jax_block", False):
        return cls
    from flax import nnx

    def shard_vars(module):
        return [v for _, v in nnx.iter_graph(module)
                if isinstance(v, nnx.Variable) and is_shard(v.get_raw_value())]

    def run(module, args, kwargs, whole):
        variables = shard_vars(module)
        shards = [v.get_raw_value() for v in variables]
        for v, w in zip(variables, whole(shards), strict=True):
            v.set_raw_value(w)
        try:
            return cls.__call__(module, *args, **kwargs)
        finally:
            for v, shard in zip(variables, shards, strict=True):
                v.set_raw_value(shard)

    def __call__(self, *args, **kwargs):
        active = _ACTIVE.get()
        shards = [v.get_raw_value() for v in shard_vars(self)]
        if active is None or not shards:
            return cls.__call__(self, *args, **kwargs)
        if not _gathers(shards):
            return run(self, args, kwargs, materialize_tree)
        gather = lambda s: materialize_tree(_after_inputs(s, args, kwargs))

        named = lambda m: run(m, *name_inputs(args, kwargs), gather)
        return nnx.remat(named, prevent_cse=True, policy=active[2])(self)

    return type(cls.__name__, (cls,), {"__call__": __call__, "_zero_jax_block": True,
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
