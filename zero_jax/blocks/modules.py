"""Gathering by module (``Layers(gather="module")``), for linen and NNX alike: each module in a
block makes its own parameters whole as it runs, as DeepSpeed ZeRO-3's hooks do, at most one
module's weights whole at a time; with prefetch, one module ahead (``prefetch.Previous``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax

from zero_jax.blocks.prefetch import Previous, gather_after
from zero_jax.blocks.remat import all_but_gathered
from zero_jax.shards import Shard, is_shard

PyTree = Any


def own(params: PyTree) -> dict:
    """A module's own ``Shard``s to make whole (not its children's, nor tiled ones)."""
    return {k: v for k, v in params.items() if is_shard(v) and not v.tile}


def own_whole(variables: dict, whole: Callable) -> dict:
    """``variables`` (``{"params": ...}``, as ``map_variables`` hands them) with the module's
    own ``Shard``s made whole by ``whole``; its children's left to them."""
    params = variables["params"]
    mine = {k: params[k] for k in own(params)}
    return {**variables, "params": {**params, **whole(mine)}}


def module_whole(shards: PyTree, args: tuple, kwargs: dict, heavy: bool) -> PyTree:
    """A module's own ``Shard``s made whole after its inputs. A ``heavy`` one's (weights that
    outweigh its inputs) one leaf per collective: a buffer and the leaves cut out of it would
    be live at once; a light one's (a norm's scale and bias) in the plan's buckets."""
    alone = lambda x: dataclasses.replace(x, comm=dataclasses.replace(x.comm, bucket_bytes=0))
    if heavy:
        shards = jax.tree.map(alone, shards, is_leaf=is_shard)
    return gather_after(shards, args, kwargs)


def _outweighs(shards: Iterable[Shard], args: tuple, kwargs: dict) -> bool:
    """Whether a module's gathered weights hold more elements than its inputs: then its
    backward gathers them again rather than keeping them (``module_call``)."""
    whole = sum(x.value.size * jax.lax.axis_size(x.mesh_axis) for x in shards
                if x.kind == "gather")
    return whole > sum(x.size for x in jax.tree.leaves((args, kwargs))
                       if isinstance(x, jax.Array))


def _held(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A module's array inputs passed through a barrier, for it to compute on. A gather that
    waits for them (``after_inputs``) then waits for values the module uses: XLA's algebraic
    simplifier drops a barrier's unused operand whose producer has no other user, as a norm's
    output fused into the next matmul has not, and the gather would then wait for nothing."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    for i, x in zip(at, jax.lax.optimization_barrier([leaves[i] for i in at]), strict=True):
        leaves[i] = x
    return treedef.unflatten(leaves)


def module_call(module: Any, shards: list[Shard], args: tuple, kwargs: dict,
                previous: Previous, runs: Callable, checkpoint: Callable) -> Any:
    """A module inside a block gathered by module, linen or NNX: its own ``shards`` made whole
    as it runs, after its inputs (with prefetch, the previous module's: ``Previous``; both
    ``_held``). ``runs(whole, args, kwargs)``: the call with ``whole`` making them whole;
    ``checkpoint``: the framework's remat. Where the gathered weights outweigh its inputs, it
    runs under a checkpoint that saves all but them, so that its backward gathers them again
    rather than keeping them from the block's recompute to their use in its backward; lighter
    ones (norm scales, biases) stay as residuals."""
    args, kwargs = _held(args, kwargs)
    after = previous.after(args, kwargs)
    heavy = _outweighs(shards, args, kwargs)
    run = runs(lambda s: module_whole(s, *after, heavy), args, kwargs)
    out = checkpoint(run, prevent_cse=True, policy=all_but_gathered)(module) if heavy \
        else run(module)
    previous.ran(args, kwargs)  # this module, not its children, ran last
    return out
