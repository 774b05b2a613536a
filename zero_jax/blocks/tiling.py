"""ZeRO-Infinity's memory-centric tiling: a block's parameter too large to gather whole is
gathered one tile at a time, by the layer that uses it.

At stage 3 a block's parameters are made whole as the block runs (``zero_jax.blocks``); a
leaf larger than ``Layers.tile_mb`` (``plan.tile_leaf``) is left out of that gather and
reaches its layer still a ``Shard``, marked with its tiles. A Flax ``nn.Dense`` or
``nn.DenseGeneral`` given such a kernel computes its product tile by tile in a loop, each
tile's gather under ``jax.checkpoint``: the forward gathers a tile, multiplies and drops it;
the backward gathers it again and reduce-scatters its gradient into the shard's columns (or
rows), in the layout and dtype the untiled gather's backward leaves. Tiles along an output
dimension are laid side by side; along a contracted one, their products are summed. The working
memory of the layer's weight is then one tile, not the layer. Any other module reading a tiled
leaf is refused, by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

UNTILED = object()  # ``use``: the call has no tiled leaf of its own, it runs as written
DENSE = (nn.Dense, nn.DenseGeneral)


def _tiled(params: Any) -> dict[str, Any]:
    """A module's own parameters (not its children's) that reach it tiled."""
    return {k: v for k, v in params.items() if getattr(v, "tile", None)}


def use(module: nn.Module, method: str, args: tuple, kwargs: dict,
        gather: Callable, whole: Callable) -> Any:
    """The result of ``module.method(*args, **kwargs)`` when the module's own parameters hold
    a tiled leaf: a Dense's product, tile by tile (``gather`` makes one tile's ``Shard`` whole,
    ``whole`` the module's other parameters); ``UNTILED`` when none is tiled."""
    if module.scope is None:
        return UNTILED
    params = module.variables.get("params", {})
    tiled = _tiled(params)
    if not tiled or (method == "setup" and isinstance(module, DENSE)):
        return UNTILED
    name, shard = next(iter(tiled.items()))
    general = isinstance(module, nn.DenseGeneral)
    if (method != "__call__" or not isinstance(module, DENSE) or set(tiled) != {"kernel"}
            or (general and module.batch_dims) or len(args) != 1 or kwargs):
        n = jax.lax.axis_size(shard.mesh_axis)
        raise ValueError(f"parameter {'/'.join(module.path)}/{name} is larger than "
                         f"Layers(tile_mb=...) ({n * shard.value.nbytes / 2**20:.2f} MB whole) "
                         f"and reaches {type(module).__name__}.{method}: only nn.Dense and "
                         f"nn.DenseGeneral (no batch_dims) compute a kernel tile by tile; raise "
                         f"tile_mb above its size, or leave it out of layers=")
    bias = whole(params["bias"]) if "bias" in params else None
    return dense(module, args[0], shard, bias, gather)


def split(x: jax.Array, dim: int, k: int) -> jax.Array:
    """``x`` cut along ``dim`` into ``k`` equal tiles, stacked first."""
    return jnp.moveaxis(x.reshape(*x.shape[:dim], k, x.shape[dim] // k, *x.shape[dim + 1:]),
                        dim, 0)


def merge(tiles: jax.Array, dim: int) -> jax.Array:
    """The inverse of ``split``: tiles (stacked first) side by side along ``dim``."""
    x = jnp.moveaxis(tiles, 0, dim)
    return x.reshape(*x.shape[:dim], -1, *x.shape[dim + 2:])


def dense(module: nn.Module, x: jax.Array, shard: Any, bias: jax.Array | None,
          gather: Callable) -> jax.Array:
    """``module``'s (an ``nn.Dense`` or ``nn.DenseGeneral``) output, its kernel (``shard``, a
    device's piece of it) gathered one tile at a time, as the module computes it."""
    axis = module.axis if isinstance(module, nn.DenseGeneral) else -1
    axis = tuple(sorted(a % x.ndim for a in (axis if isinstance(axis, tuple | list) else
                                              (axis,))))
    dims = ((axis, tuple(range(len(axis)))), ((), ()))
    d, k = shard.tile[0] % shard.value.ndim, shard.tile[1]
    dot = module.dot_general_cls() if module.dot_general_cls is not None else \
        module.dot_general or jax.lax.dot_general
    x, _, bias = module.promote_dtype(x, jnp.zeros((), shard.value.dtype), bias,
                                      dtype=module.dtype)

    @jax.checkpoint  # saves the tile's shard and input: the backward gathers the tile again
    def product(piece: jax.Array, xs: jax.Array) -> jax.Array:
        w = gather(dataclasses.replace(shard, value=piece, tile=None))
        _, w, _ = module.promote_dtype(xs, w, None, dtype=module.dtype)
        return dot(xs, w, dims, precision=module.precision)

    pieces = split(shard.value, d, k)
    if d >= len(axis):  # an output dimension: the tiles' products side by side
        out = merge(jax.lax.map(lambda p: product(p, x), pieces), x.ndim - 2 * len(axis) + d)
    else:  # a contracted dimension: the tiles' products summed, in order
        xs = split(x, axis[d], k)
        out = jax.lax.scan(lambda acc, px: (acc + product(*px), None),
                           product(pieces[0], xs[0]), (pieces[1:], xs[1:]))[0]
    if bias is not None:
        out = out + bias.reshape((1,) * (out.ndim - bias.ndim) + bias.shape)
    return out
