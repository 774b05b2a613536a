"""Turning a device's parameter shards into whole parameters, inside ``shard_map``.

A sharded parameter reaches the model as a ``Shard``: the local piece, the axis it was cut
along, and, at stage 2 only, the whole replicated copy. ``materialize`` makes the whole array
right where a layer needs it, and its transpose in the backward pass is the gradient
reduce-scatter, so each layer's gradient leaves the layer already cut into shards:

- stage 3: ``all_gather`` of the shards. Under ``remat`` the backward gathers again, and
  autodiff transposes the gather into ``psum_scatter`` (a reduce-scatter) per layer.
- stage 2: the whole copy is already here, so the forward is free; a ``custom_vjp`` makes the
  backward a ``psum_scatter`` of that layer's gradient.
- stages 0 and 1: parameters enter ``shard_map`` replicated and no ``Shard`` is made; JAX
  all-reduces their gradients itself (the transpose of broadcasting an invariant value).

``layer`` wraps a Flax linen layer so this happens per layer inside ``nn.scan``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Shard:
    """This device's piece of a parameter cut along ``axis`` of mesh axis ``mesh_axis``."""

    value: jax.Array
    whole: jax.Array | None  # stage 2: the replicated copy, used as is in the forward
    axis: int = dataclasses.field(metadata=dict(static=True))
    mesh_axis: str = dataclasses.field(metadata=dict(static=True))


def is_shard(x) -> bool:
    return isinstance(x, Shard)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _read_whole(shard: jax.Array, whole: jax.Array, axis: int, mesh_axis: str) -> jax.Array:
    # pcast marks the copy as per-device; without it JAX would all-reduce its gradient before
    # our reduce-scatter and the gradient would come out N times too large.
    return jax.lax.pcast(whole, mesh_axis, to="varying")


def _read_whole_fwd(shard, whole, axis, mesh_axis):
    return _read_whole(shard, whole, axis, mesh_axis), None


def _read_whole_bwd(axis, mesh_axis, _, g):
    return jax.lax.psum_scatter(g, mesh_axis, scatter_dimension=axis, tiled=True), None


_read_whole.defvjp(_read_whole_fwd, _read_whole_bwd)


def materialize(x: Any) -> Any:
    """The whole parameter for a ``Shard``; anything else is returned unchanged."""
    if not is_shard(x):
        return x
    if x.whole is None:
        return jax.lax.all_gather(x.value, x.mesh_axis, axis=x.axis, tiled=True)
    return _read_whole(x.value, jax.lax.stop_gradient(x.whole), x.axis, x.mesh_axis)


def materialize_tree(tree: PyTree) -> PyTree:
    return jax.tree.map(materialize, tree, is_leaf=is_shard)


def layer(module_cls: type[nn.Module]) -> type[nn.Module]:
    """A linen layer class whose parameters are made whole as the layer runs.

    Use it under ``nn.scan`` (and ``nn.remat``) in place of the layer class, and name the scan's
    parameters in ``layers=`` of the plan. Outside a ZeRO train step it changes nothing.
    """
    return nn.map_variables(module_cls, "params", trans_in_fn=materialize_tree, init=True)
