"""The gradient half of the step: a pipeline of named phases over a per-leaf record.

It runs under ``shard_map`` over the data axes, so the collectives are exactly the ones
``zero_jax.shards`` and this module write (XLA's partitioner on CPU would neither
reduce-scatter nor gather weights by itself). Each parameter's ``Route`` is decided once, from
its ``Leaf`` and the stage; the phases only read it:

    prepare -> [accumulate: record once, then per microbatch differentiate(wrap -> run_loss)]
            -> reduce -> normalize

``run_loss`` traces the user's loss under the plan's block runtime (``zero_jax.blocks``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero_jax import buckets, internals
from zero_jax.blocks import Runtime, Saved
from zero_jax.buckets import Comm
from zero_jax.offload import in_host_memory, on_host_leaves
from zero_jax.plan import Leaf, Plan
from zero_jax.shards import Shard, materialize_tree, per_model_rank
from zero_jax.state import grads_in_host_memory, params_in_host_memory

PyTree = Any


class Weighted(NamedTuple):
    """A loss returned as a sum and what it sums over (say, valid tokens): the step then trains
    on the exact global mean, sum of totals over sum of weights, as one device would."""

    total: jax.Array
    weight: jax.Array


def batch_sum(x: PyTree) -> PyTree:
    """``x`` summed over every device's share of the batch while zero_jax traces a loss (the
    plan's data axes, each microbatch's), ``x`` itself elsewhere (one device, a reference): for
    a loss of whole-batch statistics, such as a mixture of experts' load balance over the
    global batch. Its gradient is then the whole batch's, as on one device."""
    trace = internals.BLOCKS.get()
    axes = trace.runtime.batch_axes if trace is not None else ()
    return jax.lax.psum(x, axes) if axes else x


class Route(NamedTuple):
    """What the gradient half does with one parameter: decided once, from its leaf and stage."""

    leaf: Leaf
    cut: bool  # reaches the loss as a Shard; its gradient leaves the backward already cut
    local: tuple[str, ...]  # axes its copy is marked per-device over, so nothing reduces early
    # Whole, in a block, and bucketed: all-reduced inside the backward as its block's
    # backward ends (DDP's buckets), rather than once after it. Not under hierarchical ZeRO,
    # where what crosses groups does so once per step.
    in_backward: bool = False
    host: bool = False  # its gradient leaves the backward in host memory (ZeRO-Offload)
    # Stage 3 with its optimizer offloaded, parameters on the device: the shard the forward
    # gathers is passed beside the host-memory copy that carries the gradient.
    streamed: bool = False


def routes(plan: Plan, accum_steps: int) -> PyTree:
    """The ``Route`` of every parameter, as a tree shaped like the parameters."""
    def route(leaf: Leaf, host: bool, param_host: bool) -> Route:
        cut = plan.rule.shard_grads and leaf.axis is not None and not leaf.persistent
        in_backward = (not cut and not leaf.frozen and leaf.block is not None
                       and plan.comm.bucket_bytes > 0 and accum_steps == 1
                       and plan.outer is None)
        local = () if leaf.frozen or in_backward else (plan.outer,) if cut and plan.outer \
            else () if cut else plan.data_axes
        streamed = host and not param_host and plan.rule.shard_params
        return Route(leaf, cut, local, in_backward, host, streamed)
    return jax.tree.map(route, plan.leaves, grads_in_host_memory(plan, accum_steps),
                        params_in_host_memory(plan), is_leaf=_is_leaf)


class GradStep(NamedTuple):
    """Everything the phases read: the plan, the routes, and the user's loss."""

    plan: Plan
    routes: PyTree
    loss_fn: Callable
    has_aux: bool
    batch_spec: PyTree
    blocks: Runtime  # the block runtime every trace of the loss runs under
    accum_steps: int  # microbatches per step: the global batch is cut into that many

    @property
    def grad_dtype(self) -> jnp.dtype:
        return self.plan.precision.grad_dtype(self.accum_steps)

    def map(self, fn: Callable, *trees: PyTree) -> PyTree:
        """``fn(route, *leaves)`` over the parameters."""
        return jax.tree.map(fn, self.routes, *trees, is_leaf=_is_route)

    @property
    def stage2(self) -> bool:
        """Whole parameters, cut gradients: the shards are differentiated, the whole copy read."""
        return self.plan.rule.shard_grads and not self.plan.rule.shard_params

    @property
    def needs_whole(self) -> bool:
        """Whether the forward reads a second copy beside the differentiated one."""
        return self.stage2 or any(r.streamed for r in jax.tree.leaves(
            self.routes, is_leaf=_is_route))


def device_key(key: jax.Array, device: jax.Array | int, micro: jax.Array | int = 0) -> jax.Array:
    """The key ``loss_fn`` gets on data-parallel device ``device`` (its position in the batch)
    for microbatch ``micro``: a different stream on every device and microbatch."""
    return jax.random.fold_in(jax.random.fold_in(key, device), micro)


def prepare(g: GradStep, params: PyTree) -> PyTree:
    """Mark what must not be reduced early, and move offloaded shards to the host.

    A whole parameter is marked per-device before differentiating, so that its gradient stays
    local until the one all-reduce after the backward (differentiating the replicated value
    itself, JAX would all-reduce it at every use); likewise a hierarchical shard, whole across
    groups until the across-group reduce-scatter. ZeRO-Offload at stage 2: the shard of an
    offloaded leaf is differentiated in host memory, so each layer's gradient shard leaves the
    device as its backward ends."""
    def one(r: Route, p):
        p = jax.device_put(p, jax.memory.Space.Host) if r.host else p
        return jax.lax.pcast(p, r.local, to="varying") if r.local else p
    return g.map(one, params)


def wrap(g: GradStep, params: PyTree, whole: PyTree | None) -> PyTree:
    """What the model sees: cut parameters as ``Shard``s (and bucketed whole ones in blocks,
    whose gradient is all-reduced as the block's backward ends); all but the declared blocks'
    are made whole here, once, together."""
    plan, reduce = g.plan, g.plan.precision.reduce.name

    def comm(r: Route) -> Comm:  # tiling: no gather of a block above the bound, buckets too
        if not plan.tile_bytes or r.leaf.block is None:
            return plan.comm
        return dataclasses.replace(plan.comm, bucket_bytes=min(plan.comm.bucket_bytes,
                                                               plan.tile_bytes))

    def one(r: Route, p, w=None):
        model_dim = None if r.leaf.model_dim is None or not plan.model else \
            r.leaf.model_dim - len(r.leaf.shape)
        if r.in_backward:
            return Shard(p, None, None, plan.data_axes, reduce, comm=plan.comm,
                         model_dim=model_dim)
        if not r.cut:
            return p
        # Cut over model x data along one dimension: split in two (Plan.split_model), whose
        # whole is merged back for the model
        split = r.leaf.split
        if split and w is not None and w.ndim < p.ndim:  # stage 2's whole copy, split alike
            w = w.reshape(*p.shape[:r.leaf.axis + 1], -1, *w.shape[r.leaf.axis + 1:])
        args = (r.leaf.axis - len(r.leaf.shape), plan.axis, reduce)
        # (tiling refuses tensor parallelism, so a tiled leaf is never split)
        tile = r.leaf.tile and (r.leaf.tile[0] - len(r.leaf.shape), r.leaf.tile[1])
        # Stage 3 streaming to the host: ``p`` carries the gradient, ``w`` is gathered.
        return Shard(p, None if r.streamed or not g.stage2 else w, *args,
                     gather_from=w if r.streamed else None, comm=comm(r),
                     frozen=r.leaf.frozen, model_dim=args[0] - 1 if split else model_dim,
                     split=split, tile=tile)

    tree = g.map(one, params) if whole is None else g.map(one, params, whole)
    outside = materialize_tree(g.map(lambda r, x: None if r.leaf.block else x, tree))
    return g.map(lambda r, x, o: x if r.leaf.block else o, tree, outside)


def run_loss(g: GradStep, tree: PyTree, micro: PyTree, key: jax.Array | None,
             order: tuple[str, ...] | None):
    """The user's loss on one microbatch, each declared block gathered as it runs:
    ``((total, weight, aux * weight)`` in fp32, the order its blocks ran in)``. ``order``: as
    ``Runtime.run``'s (``None``: recorded by this trace)."""
    plan = g.plan
    if plan.precision.autocast_input:
        micro = jax.tree.map(lambda x: x.astype(plan.precision.compute)
                             if jnp.issubdtype(x.dtype, jnp.floating) else x, micro)
    args = (tree, micro) if key is None else (tree, micro, key)
    out, order = g.blocks.run(g.loss_fn, args, order)
    loss, aux = out if g.has_aux else (out, {})
    total, weight = loss if isinstance(loss, Weighted) else (loss, jnp.ones((), jnp.float32))
    return (total.astype(jnp.float32), jnp.asarray(weight, jnp.float32),
            jax.tree.map(lambda a: jnp.asarray(a, jnp.float32) * weight, aux)), order


def record(g: GradStep, params: PyTree, whole: PyTree | None, micro: PyTree,
           key: jax.Array | None):
    """The loss traced once, for what the traces that follow need of it: the shapes of what
    it returns (the microbatch loop's carry), and the order its blocks ran in (by which
    prefetch hands each block the next one's weights). Nothing of it reaches the program."""
    recorded = []

    def stats(args):
        out, order = run_loss(g, wrap(g, args[0], whole), *args[1:], None)
        recorded.append(order)
        return out
    return jax.eval_shape(stats, (params, micro, key)), recorded[0]


def runtime(plan: Plan) -> Runtime:
    """The plan's block runtime. Pa at stages 0-2: the blocks' saved inputs are cut if
    zero_jax's remat saves them."""
    return Runtime(tuple(plan.blocks), Saved(plan.remat, plan.partition_activations),
                   plan.gather, plan.prefetch,
                   plan.partition_activations and not plan.rule.shard_params, plan.data_axes)


def differentiate(g: GradStep, params: PyTree, whole: PyTree | None, micro: PyTree,
                  key: jax.Array | None, scale: jax.Array, order: tuple[str, ...]):
    """The gradient of this device's share: total * scale / (n k), for a mean loss exactly its
    share of the global mean; frozen leaves are read, not differentiated."""
    n, k = g.plan.dp_size, g.accum_steps

    def objective(trained):
        mixed = g.map(lambda r, t, p: p if r.leaf.frozen else t, trained, params)
        (total, weight, aux), _ = run_loss(g, wrap(g, mixed, whole), micro, key, order)
        return total * scale / (n * k), (total, weight, aux)

    with internals.exact_residuals():
        grads, stats = jax.grad(objective, has_aux=True)(params)
    # A frozen leaf's (zero) gradient is not kept, nor accumulated: a scalar stands in.
    return stats, g.map(lambda r, x: jnp.zeros((), x.dtype) if r.leaf.frozen else x, grads)


def accumulate(g: GradStep, params: PyTree, whole: PyTree | None, batch: PyTree,
               key: jax.Array | None, scale: jax.Array):
    """Each microbatch's cut gradients are reduce-scattered by its backward and summed into a
    1/N accumulator; whole ones are summed locally and reduced once, after."""
    plan, k = g.plan, g.accum_steps
    device = jax.lax.axis_index(plan.data_axes)
    keyed = lambda m: None if key is None else device_key(key, device, m)
    split = _microbatches(g, batch) if k > 1 else None
    first = batch if k == 1 else jax.tree.map(lambda part, x: x if part is None else part[0],
                                              split, batch, is_leaf=lambda x: x is None)
    # One trace for shapes (the loop's carry) and prefetch's order, where either is needed.
    shapes, order = record(g, params, whole, first, keyed(0)) \
        if k > 1 or plan.block_prefetch else (None, ())
    if k == 1:
        return differentiate(g, params, whole, batch, keyed(0), scale, order)
    # Offload.grads: the accumulator waits in host memory between microbatches.
    move = lambda tree, space: jax.device_put(tree, space) if plan.offload.grads else tree
    host, on_device = jax.memory.Space.Host, jax.memory.Space.Device
    whole_batch = lambda part, x: x if part is None else part

    def body(carry, xs):
        m, micro = xs
        micro = jax.tree.map(whole_batch, micro, batch, is_leaf=lambda x: x is None)
        stats, grads = differentiate(g, params, whole, micro, keyed(m), scale, order)
        sums, acc = carry
        acc = jax.tree.map(lambda a, x: a + x.astype(plan.precision.accum),
                           move(acc, on_device), grads)
        return (jax.tree.map(jnp.add, sums, stats), move(acc, host)), None

    stats = jax.tree.map(lambda x: jax.lax.pcast(jnp.zeros(x.shape, x.dtype), plan.data_axes,
                                                 to="varying"), shapes)
    zeros = g.map(lambda r, p: jnp.zeros((), plan.precision.accum) if r.leaf.frozen
                  else jnp.zeros_like(p, plan.precision.accum), params)
    (stats, grads), _ = jax.lax.scan(body, (stats, move(zeros, host)), (jnp.arange(k), split))
    return stats, move(grads, on_device)


def _microbatches(g: GradStep, batch: PyTree) -> PyTree:
    """The cut leaves of ``batch`` as ``(k, rows / k, ...)``; ``None`` for those every
    microbatch reads whole."""
    k, is_spec = g.accum_steps, lambda x: isinstance(x, P)
    specs = jax.tree.broadcast(g.batch_spec, batch, is_leaf=is_spec)
    return jax.tree.map(lambda s, x: x.reshape(k, x.shape[0] // k, *x.shape[1:])
                        if len(s) and s[0] is not None else None, specs, batch, is_leaf=is_spec)


def reduce(g: GradStep, grads: PyTree) -> PyTree:
    """What the backward left unreduced, reduced once, in buckets: whole gradients all-reduced;
    hierarchical shards reduce-scattered across groups (in int8 with quantize_grads: what
    crosses groups is ZeRO++'s target)."""
    plan = g.plan
    flat, tree = jax.tree.flatten(grads)
    rs = jax.tree.leaves(g.routes, is_leaf=_is_route)
    whole = [i for i, r in enumerate(rs) if not r.leaf.frozen and not r.cut and not r.in_backward]
    across = [i for i, r in enumerate(rs) if not r.leaf.frozen and r.cut and plan.outer]
    reduce_dtype = plan.precision.reduce.name
    dims = lambda idx: tuple(rs[i].leaf.model_dim if plan.model else None for i in idx)
    put(flat, whole, per_model_rank(lambda gs: buckets.all_reduce(
        gs, plan.data_axes, reduce_dtype, plan.comm), [flat[i] for i in whole], dims(whole)))
    if across:
        # A leaf cut over model x data arrives split in two (Plan.split_model): model's
        # dimension, then the data axes'
        put(flat, across, per_model_rank(lambda gs: buckets.reduce_scatter(
            gs, [rs[i].leaf.axis + rs[i].leaf.split for i in across], plan.outer,
            reduce_dtype, plan.comm)[0], [flat[i] for i in across], dims(across)))
    return tree.unflatten(flat)


def normalize(g: GradStep, stats: tuple, grads: PyTree, params: PyTree):
    """From shares of n k to shares of the global weight (exactly 1 for a mean loss), in the
    ``grad_specs`` layout and dtype: ``(loss, grads, factor)``. ``stats``: the global
    ``(total, weight, aux)``."""
    plan, nk = g.plan, g.plan.dp_size * g.accum_steps
    total, weight, aux = stats

    def one(r: Route, x, p):
        if r.leaf.frozen:  # zeros in the grad_specs layout, never communicated
            shape = list(p.shape)
            if r.cut and plan.outer:
                shape[r.leaf.axis + r.leaf.split] //= plan.mesh.shape[plan.outer]
            return jnp.zeros(shape, g.grad_dtype)
        if in_host_memory(x):  # streamed to the host: scaled there, after the shard_map
            return x
        return (x * (nk / weight).astype(x.dtype)).astype(g.grad_dtype)

    loss = total / weight
    loss = (loss, jax.tree.map(lambda a: a / weight, aux)) if g.has_aux else loss
    return loss, g.map(one, grads, params), nk / weight


def local_grads(g: GradStep, params: PyTree, whole: PyTree | None, batch: PyTree,
                key: jax.Array | None, scale: jax.Array):
    """One device's whole pipeline, inside ``shard_map``."""
    params = prepare(g, params)
    stats, grads = accumulate(g, params, whole, batch, key, scale)
    stats = tuple(jax.lax.psum(x, g.plan.data_axes) for x in stats)
    # Named, so that the report's memory split (zero_jax.peak) can tell these phases' buffers.
    with jax.named_scope("reduce_gradients"):
        grads = reduce(g, grads)
    with jax.named_scope("normalize_gradients"):
        return normalize(g, stats, grads, params)


def on_host_scaled(g: GradStep, grads: PyTree, factor: jax.Array) -> PyTree:
    """The gradients that streamed to host memory get ``normalize``'s scaling there, in a host
    computation: no device op reads host memory."""
    dtype = g.grad_dtype
    scale = lambda xs, f: ([(x * f.astype(x.dtype)).astype(dtype) for x in xs], None)
    return on_host_leaves(scale, grads, factor)[0]


def make_grad_fn(plan: Plan, loss_fn: Callable, batch_spec: PyTree = None,
                 has_aux: bool = False, accum_steps: int = 1):
    """``grads(params, batch, scale=1.0, key=None) -> (loss, grads)``: the data-parallel half of
    the step; ``((loss, aux), grads)`` with ``has_aux``.

    Not jitted. Takes the compute copy in the plan's ``param_specs`` layout and returns the
    gradient of the global mean loss, times ``scale``, in the ``grad_specs`` layout, moved by
    the stage's collectives, in the compute dtype (the accumulator's with microbatches).

    ``loss_fn(params, batch[, key])`` sees whole parameters and one microbatch of this device's
    slice of the global batch; it is given a key (``device_key``) when the step is. It returns
    the mean loss of that batch, or ``Weighted(total, weight)``, with ``has_aux`` paired with a
    dict of metrics (averaged with the loss's weights). ``batch_spec`` (a ``PartitionSpec``, or a
    tree of them over the batch) says how the batch is cut; leaves not cut on dimension 0
    (``P()``) reach every device and microbatch whole.

    ``accum_steps``: the microbatches each device's slice is cut into, run one after another
    and their gradients summed (gradient accumulation: a global batch k times what fits).
    """
    check_accum_steps(plan, accum_steps)
    batch_spec = batch_spec if batch_spec is not None else P(plan.data_axes)
    g = GradStep(plan, routes(plan, accum_steps), loss_fn, has_aux, batch_spec, runtime(plan),
                 accum_steps)

    def grads_fn(params: PyTree, batch: PyTree, scale: jax.Array | float = 1.0,
                 key: jax.Array | None = None):
        check_batch(plan, batch, batch_spec, accum_steps)
        # Stage 2 differentiates the shards of its replicated parameters, and passes the whole
        # copy too, which the forward reads as is.
        whole = params if g.needs_whole else None
        given = plan.grad_specs if g.stage2 else plan.param_specs
        manual = lambda specs: plan.manual(plan.split_model(specs))
        loss, grads, factor = jax.shard_map(
            lambda *args: local_grads(g, *args), mesh=plan.mesh,
            in_specs=(manual(given), None if whole is None else manual(plan.param_specs),
                      batch_spec, P(), P()),
            out_specs=((P(), P()) if has_aux else P(), manual(plan.grad_specs), P()),
            axis_names=set(plan.data_axes),
        )(plan.to_split(params, given),
          None if whole is None else plan.to_split(whole, plan.param_specs),
          batch, key, jnp.asarray(scale, jnp.float32))
        return loss, plan.from_split(on_host_scaled(g, grads, factor), plan.grad_specs)

    return grads_fn


def check_accum_steps(plan: Plan, accum_steps: int) -> None:
    """Microbatches per step: a positive integer, and not with the update on the host."""
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an integer of at least 1 (got {accum_steps!r})")
    if plan.offload.params and accum_steps > 1:
        raise ValueError("Offload.params runs the whole update on the host as each layer's "
                         "gradient arrives: it is not built for accumulation (accum_steps > 1) "
                         "yet")


def check_batch(plan: Plan, batch: PyTree, batch_spec: PyTree, accum_steps: int) -> None:
    """Each cut batch leaf divides into the data devices' slices and their microbatches (said
    here in one line, where ``shard_map`` would name an argument index)."""
    is_spec = lambda x: isinstance(x, P)
    specs = jax.tree.broadcast(batch_spec, batch, is_leaf=is_spec)
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    for (path, leaf), spec in zip(flat, jax.tree.leaves(specs, is_leaf=is_spec), strict=True):
        axes = spec[0] if len(spec) and spec[0] is not None else ()
        axes = axes if isinstance(axes, tuple) else (axes,)
        devices = math.prod(plan.mesh.shape[a] for a in axes)
        need = devices * accum_steps
        rows = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        if axes and (rows is None or rows % need):
            micro = f" times accum_steps {accum_steps}" if accum_steps > 1 else ""
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has {rows} rows, which do not divide over "
                f"the {devices} devices of the mesh's {'/'.join(axes)} axis{micro}: pass a "
                f"batch of a multiple of {need} rows")


def put(flat: list, where: list[int], values: list) -> None:
    """``flat[where[j]] = values[j]``: results of a bucketed collective back in their places."""
    for i, v in zip(where, values, strict=True):
        flat[i] = v


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def _is_route(x) -> bool:
    return isinstance(x, Route)
