"""The train state and the one jit-compiled train step, built from a ``Plan``.

The step has two halves. The gradient half runs under ``shard_map`` over the data axis, so
the collectives are exactly the ones ``zero_jax.gather`` and this module write (XLA's
partitioner on CPU would neither reduce-scatter nor gather weights by itself). The update half
is plain jit-with-shardings: optax sees global arrays laid out by the plan, so any
transformation, global-norm clipping included, computes what it computes on one device, and only
the parameter all-gather of stages 1-2 (updated shards back to whole) is left to the partitioner.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.errors import ScopeParamShapeError
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_jax import buckets, prefetch
from zero_jax.gather import Shard, materialize_tree, per_block
from zero_jax.offload import in_host_memory, on_host_leaves, split_update
from zero_jax.precision import LossScale, update_loss_scale
from zero_jax.rules import Leaf, Plan, path_str

PyTree = Any


class TrainState(NamedTuple):
    step: jax.Array  # steps taken, skipped ones included: the position in the data
    params: PyTree  # the compute copy, in the compute dtype, laid out by ``param_specs``
    master: PyTree | None  # fp32 parameters in the optimizer's layout; None when params are fp32
    opt_state: PyTree
    loss_scale: LossScale | None  # fp16's dynamic loss scale
    skipped: jax.Array  # steps whose gradient was not finite, so the update was skipped


def state_specs(plan: Plan, tx: optax.GradientTransformation) -> TrainState:
    """Partition specs of the whole train state."""
    p = plan.precision
    scale = None if p.loss_scale is None else LossScale(P(), P(), P())
    return TrainState(P(), plan.param_specs, plan.opt_specs if plan.has_master else None,
                      plan.opt_state_specs(tx), scale, P())


def state_shardings(plan: Plan, tx: optax.GradientTransformation) -> TrainState:
    """The shardings of the whole train state, with their memory: ``pinned_host`` for what is
    offloaded (the master and optimizer state of ``Leaf.offload`` leaves, stage 3's parameters
    with ``Offload.params``)."""
    specs = state_specs(plan, tx)
    is_spec = lambda x: isinstance(x, P)

    def put(spec_tree, host):
        host = jax.tree.broadcast(host, spec_tree, is_leaf=is_spec)
        return jax.tree.map(lambda spec, h: NamedSharding(
            plan.mesh, spec, memory_kind="pinned_host" if h else None), spec_tree, host,
            is_leaf=is_spec)

    offload = jax.tree.map(lambda leaf: leaf.offload, plan.leaves, is_leaf=_is_leaf)
    return TrainState(put(specs.step, False), put(specs.params, params_in_host_memory(plan)),
                      None if specs.master is None else put(specs.master, offload),
                      put(specs.opt_state, plan.opt_state_offload(tx)),
                      None if specs.loss_scale is None else put(specs.loss_scale, False),
                      put(specs.skipped, False))


def params_in_host_memory(plan: Plan) -> PyTree:
    """Per parameter, whether its compute copy lives in host memory: with ``Offload.params``,
    the cut ones; whole ones (indivisible, persistent) stay on the device, as DeepSpeed keeps
    its persistent parameters."""
    return jax.tree.map(lambda leaf: plan.offload.params and leaf.axis is not None
                        and not leaf.persistent, plan.leaves, is_leaf=_is_leaf)


def grads_in_host_memory(plan: Plan) -> PyTree:
    """Per parameter, whether its gradient leaves the backward in host memory, layer by layer:
    a cut leaf whose parameter or optimizer is offloaded, at stage 2 or 3 without accumulation
    (ZeRO-Offload's gradient streaming)."""
    streams = plan.rule.shard_grads and plan.accum_steps == 1 and plan.outer is None
    return jax.tree.map(lambda leaf, host: host or (streams and leaf.offload and leaf.axis
                                                    is not None and not leaf.persistent),
                        plan.leaves, params_in_host_memory(plan), is_leaf=_is_leaf)


def _new_state(plan: Plan, params: PyTree, tx: optax.GradientTransformation) -> TrainState:
    p = plan.precision
    compute = jax.tree.map(lambda x: x.astype(p.compute), params)
    return TrainState(jnp.zeros((), jnp.int32), compute, params if plan.has_master else None,
                      plan.optimizer(tx).init(params), p.init_loss_scale(),
                      jnp.zeros((), jnp.int32))


def init_state(plan: Plan, init_params: Callable[[jax.Array], PyTree] | PyTree,
               tx: optax.GradientTransformation, key: jax.Array | None = None) -> TrainState:
    """Create the state directly in its sharded layout; no device ever holds more than its part.

    ``init_params(key)`` returns fp32 parameters; the compute copy is cast from them. Or pass
    the parameters themselves (a pretrained model's, as arrays): each leaf is put straight into
    its shards and enters the compiled init as an argument, never as a constant of the program.
    """
    shardings = state_shardings(plan, tx)
    if callable(init_params):
        return jax.jit(lambda key: _new_state(plan, init_params(key), tx),
                       out_shardings=shardings)(key)
    flat, tree = jax.tree_util.tree_flatten_with_path(init_params)
    if tree != jax.tree.structure(plan.shapes):
        raise ValueError(f"init_state: the parameters' tree is not the plan's: {tree} vs "
                         f"{jax.tree.structure(plan.shapes)}")
    for (path, x), want in zip(flat, jax.tree.leaves(plan.shapes), strict=True):
        if tuple(x.shape) != tuple(want.shape):
            raise ValueError(f"init_state: parameter {path_str(path)} has shape {x.shape}, "
                             f"the plan's is {want.shape}")
    params = jax.device_put(init_params, plan.shardings(plan.opt_specs))
    cast = lambda p: jax.tree.map(lambda x, s: x.astype(s.dtype), p, plan.shapes)
    return jax.jit(lambda p: _new_state(plan, cast(p), tx), out_shardings=shardings,
                   donate_argnums=0)(params)


def abstract_state(plan: Plan, tx: optax.GradientTransformation) -> TrainState:
    """The state as ``ShapeDtypeStruct``s with shardings: for compiling without allocating."""
    shapes = jax.eval_shape(lambda params: _new_state(plan, params, tx), plan.shapes)
    shardings = state_shardings(plan, tx)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def _constrain(tree: PyTree, plan: Plan, specs: PyTree) -> PyTree:
    """Lay ``tree`` out by ``specs``, each array staying in the memory it is in."""
    def one(x, spec):
        host = in_host_memory(x)
        return jax.lax.with_sharding_constraint(x, NamedSharding(
            plan.mesh, spec, memory_kind="pinned_host" if host else None))
    return jax.tree.map(one, tree, specs)


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def _put(flat: list, where: list[int], values: list) -> None:
    """``flat[where[j]] = values[j]``: results of a bucketed collective back in their places."""
    for i, v in zip(where, values, strict=True):
        flat[i] = v


class Weighted(NamedTuple):
    """A loss returned as a sum and what it sums over (say, valid tokens): the step then trains
    on the exact global mean, sum of totals over sum of weights, as one device would."""

    total: jax.Array
    weight: jax.Array


class Route(NamedTuple):
    """What the gradient half does with one parameter: decided once, from its leaf and stage."""

    leaf: Leaf
    cut: bool  # reaches the loss as a Shard; its gradient leaves the backward already cut
    local: tuple[str, ...]  # axes its copy is marked per-device over, so nothing reduces early
    # Whole, in a block, and bucketed: all-reduced inside the backward as its block's
    # backward ends (DDP's buckets), rather than once after it. Not under hierarchical ZeRO,
    # where what crosses groups does so once per step.
    in_backward: bool = False


def routes(plan: Plan) -> PyTree:
    """The ``Route`` of every parameter, as a tree shaped like the parameters."""
    def route(leaf: Leaf) -> Route:
        cut = plan.rule.shard_grads and leaf.axis is not None and not leaf.persistent
        in_backward = (not cut and not leaf.frozen and leaf.block is not None
                       and plan.comm.bucket_bytes > 0 and plan.accum_steps == 1
                       and plan.outer is None)
        local = () if leaf.frozen or in_backward else (plan.outer,) if cut and plan.outer \
            else () if cut else plan.data_axes
        return Route(leaf, cut, local, in_backward)
    return jax.tree.map(route, plan.leaves, is_leaf=_is_leaf)


def device_key(key: jax.Array, device: jax.Array | int, micro: jax.Array | int = 0) -> jax.Array:
    """The key ``loss_fn`` gets on data-parallel device ``device`` (its position in the batch)
    for microbatch ``micro``: a different stream on every device and microbatch."""
    return jax.random.fold_in(jax.random.fold_in(key, device), micro)


def make_grad_fn(plan: Plan, loss_fn: Callable, batch_spec: PyTree = None,
                 has_aux: bool = False):
    """``grads(params, batch, scale=1.0, key=None) -> (loss, grads)``: the data-parallel half of
    the step; ``((loss, aux), grads)`` with ``has_aux``.

    Not jitted. Takes the compute copy in the plan's ``param_specs`` layout and returns the
    gradient of the global mean loss, times ``scale``, in the ``grad_specs`` layout and the
    plan's ``grad_dtype``, moved by the stage's collectives.

    ``loss_fn(params, batch[, key])`` sees whole parameters and one microbatch of this device's
    slice of the global batch; it is given a key (``device_key``) when the step is. It returns
    the mean loss of that batch, or ``Weighted(total, weight)``, with ``has_aux`` paired with a
    dict of metrics (averaged with the loss's weights). ``batch_spec`` (a ``PartitionSpec``, or a
    tree of them over the batch) says how the batch is cut; leaves not cut on dimension 0
    (``P()``) reach every device and microbatch whole.
    """
    k, n, everywhere = plan.accum_steps, plan.dp_size, plan.data_axes
    prec = plan.precision
    batch_spec = batch_spec if batch_spec is not None else P(everywhere)
    route_tree = routes(plan)
    is_route = lambda x: isinstance(x, Route)
    stage2 = plan.rule.shard_grads and not plan.rule.shard_params
    grads_host = grads_in_host_memory(plan)
    # Stage 3 with the optimizer offloaded (parameters on the device): the shard the forward
    # gathers is passed beside the host-memory copy that carries its gradient.
    streamed = jax.tree.map(lambda h, p: h and not p and plan.rule.shard_params, grads_host,
                            params_in_host_memory(plan))
    stage3_streams = plan.rule.shard_params and any(jax.tree.leaves(streamed))
    blocks = plan.blocks

    def prepare(params):
        # A whole parameter is marked per-device before differentiating, so that its gradient
        # stays local until the one all-reduce after the backward (differentiating the
        # replicated value itself, JAX would all-reduce it at every use); likewise a
        # hierarchical shard, whole across groups until the across-group reduce-scatter.
        # ZeRO-Offload at stage 2: the shard of an offloaded leaf is differentiated in host
        # memory, so each layer's gradient shard leaves the device as its backward ends.
        def one(r: Route, p, host):
            p = jax.device_put(p, jax.memory.Space.Host) if host else p
            return jax.lax.pcast(p, r.local, to="varying") if r.local else p
        return jax.tree.map(one, route_tree, params, grads_host, is_leaf=is_route)

    def model_params(params, whole):
        # Cut parameters become Shards (and bucketed whole ones in blocks, whose gradient is
        # all-reduced as the block's backward ends); all but the declared blocks' are made
        # whole here, once, together.
        def wrap(r: Route, p, w=None, streamed=False):
            if r.in_backward:
                return Shard(p, None, None, everywhere, prec.reduce.name, comm=plan.comm)
            if not r.cut:
                return p
            args = (r.leaf.axis - len(r.leaf.shape), plan.axis, prec.reduce.name)
            # Stage 3 streaming to the host: ``p`` carries the gradient, ``w`` is gathered.
            return Shard(p, None if streamed or not stage2 else w, *args,
                         gather_from=w if streamed else None, comm=plan.comm,
                         frozen=r.leaf.frozen)
        if whole is None:
            tree = jax.tree.map(wrap, route_tree, params, is_leaf=is_route)
        else:
            tree = jax.tree.map(wrap, route_tree, params, whole, streamed, is_leaf=is_route)
        outside = jax.tree.map(lambda r, x: None if r.leaf.block else x, route_tree, tree,
                               is_leaf=is_route)
        outside = materialize_tree(outside)
        return jax.tree.map(lambda r, x, o: x if r.leaf.block else o, route_tree, tree, outside,
                            is_leaf=is_route)

    def call_loss(tree, micro, key):
        if prec.autocast_input:
            micro = jax.tree.map(lambda x: x.astype(prec.compute)
                                 if jnp.issubdtype(x.dtype, jnp.floating) else x, micro)
        args = (tree, micro) if key is None else (tree, micro, key)
        prefetched: set[str] = set()
        fetch = prefetch.stacks(frozenset(blocks), prefetched, plan.remat == "offload") \
            if plan.comm.prefetch else contextlib.nullcontext()
        with per_block(blocks, plan.remat) as seen, fetch:
            try:
                out = loss_fn(*args)
            except ScopeParamShapeError as e:
                raise ValueError(f"a parameter reached a module still cut into shards: the "
                                 f"plan's layers= names blocks {blocks}, and a module reading "
                                 f"one of their parameters is not one of them or inside one "
                                 f"({e.__class__.__name__}: {str(e).splitlines()[0]})") from e
        if plan.comm.prefetch and (missing := [b for b in blocks if b not in prefetched]):
            raise ValueError(f"prefetch runs the loop of linen nn.scan stacks; {missing[0]!r} "
                             f"did not run as one (an NNX model, or its nn.scan class made "
                             f"before the step): turn prefetch off")
        if missing := [b for b in blocks if b not in seen | prefetched]:
            raise ValueError(f"layers= names {missing[0]!r}, which never ran as a Flax linen "
                             f"module during the loss; name modules that are called (their "
                             f"paths: {blocks[:3]}...)")
        loss, aux = out if has_aux else (out, {})
        total, weight = loss if isinstance(loss, Weighted) else (loss, jnp.ones((), jnp.float32))
        return (total.astype(jnp.float32), jnp.asarray(weight, jnp.float32),
                jax.tree.map(lambda a: jnp.asarray(a, jnp.float32) * weight, aux))

    def differentiate(params, whole, micro, key, scale):
        # The gradient of this device's share: total * scale / (n k), for a mean loss exactly
        # its share of the global mean; frozen leaves are read, not differentiated.
        def objective(trained):
            mixed = jax.tree.map(lambda r, t, p: p if r.leaf.frozen else t,
                                 route_tree, trained, params, is_leaf=is_route)
            total, weight, aux = call_loss(model_params(mixed, whole), micro, key)
            return total * scale / (n * k), (total, weight, aux)

        grads, stats = jax.grad(objective, has_aux=True)(params)
        # A frozen leaf's (zero) gradient is not kept, nor accumulated: a scalar stands in.
        grads = jax.tree.map(lambda r, g: jnp.zeros((), g.dtype) if r.leaf.frozen else g,
                             route_tree, grads, is_leaf=is_route)
        return stats, grads

    def accumulate(params, whole, batch, key, scale):
        # Each microbatch's cut gradients are reduce-scattered by its backward and summed into
        # a 1/N accumulator; whole ones are summed locally and reduced once, after.
        device = jax.lax.axis_index(everywhere)
        keyed = lambda m: None if key is None else device_key(key, device, m)
        if k == 1:
            return differentiate(params, whole, batch, keyed(0), scale)
        specs = jax.tree.broadcast(batch_spec, batch, is_leaf=lambda x: isinstance(x, P))
        split = jax.tree.map(lambda s, x: x.reshape(k, x.shape[0] // k, *x.shape[1:])
                             if len(s) and s[0] is not None else None, specs, batch,
                             is_leaf=lambda x: isinstance(x, P))
        host, device_space = jax.memory.Space.Host, jax.memory.Space.Device

        def move(tree, space):  # Offload.grads: the accumulator waits in host memory
            return jax.device_put(tree, space) if plan.offload.grads else tree

        def body(carry, xs):
            m, micro = xs
            micro = jax.tree.map(lambda part, x: x if part is None else part, micro, batch,
                                 is_leaf=lambda x: x is None)
            stats, grads = differentiate(params, whole, micro, keyed(m), scale)
            sums, acc = carry
            acc = jax.tree.map(lambda a, g: a + g.astype(prec.accum), move(acc, device_space),
                               grads)
            return (jax.tree.map(jnp.add, sums, stats), move(acc, host)), None

        first = jax.tree.map(lambda part, x: x if part is None else part[0], split, batch,
                             is_leaf=lambda x: x is None)
        shapes = jax.eval_shape(lambda: call_loss(model_params(params, whole), first, keyed(0)))
        stats = jax.tree.map(lambda x: jax.lax.pcast(jnp.zeros(x.shape, x.dtype), everywhere,
                                                     to="varying"), shapes)
        zeros = jax.tree.map(lambda r, p: jnp.zeros((), prec.accum) if r.leaf.frozen
                             else jnp.zeros_like(p, prec.accum), route_tree, params,
                             is_leaf=is_route)
        start = (stats, move(zeros, host))
        (stats, grads), _ = jax.lax.scan(body, start, (jnp.arange(k), split))
        return stats, move(grads, device_space)

    def reduce_once(grads):
        # What the backward left unreduced, reduced once, in buckets: whole gradients
        # all-reduced; hierarchical shards reduce-scattered across groups.
        flat, tree = jax.tree.flatten(grads)
        rs = jax.tree.leaves(route_tree, is_leaf=is_route)
        whole = [i for i, r in enumerate(rs) if not r.leaf.frozen and not r.cut
                 and not r.in_backward]
        across = [i for i, r in enumerate(rs) if not r.leaf.frozen and r.cut and plan.outer]
        _put(flat, whole, buckets.all_reduce([flat[i] for i in whole], everywhere,
                                             prec.reduce.name, plan.comm))
        if across:  # in int8 with quantize_grads: what crosses groups is ZeRO++'s target
            _put(flat, across, buckets.reduce_scatter(
                [flat[i] for i in across], [rs[i].leaf.axis for i in across], plan.outer,
                prec.reduce.name, plan.comm)[0])
        return tree.unflatten(flat)

    def reduce(stats, grads, params):
        total, weight, aux = (jax.lax.psum(x, everywhere) for x in stats)
        grads = reduce_once(grads)

        def one(r: Route, g, p):
            if r.leaf.frozen:  # zeros in the grad_specs layout, never communicated
                shape = list(p.shape)
                if r.cut and plan.outer:
                    shape[r.leaf.axis] //= plan.mesh.shape[plan.outer]
                return jnp.zeros(shape, plan.grad_dtype)
            if in_host_memory(g):  # streamed to the host: scaled there, after the shard_map
                return g
            # From shares of n k to shares of the global weight: exactly 1 for a mean loss.
            return (g * (n * k / weight).astype(g.dtype)).astype(plan.grad_dtype)

        grads = jax.tree.map(one, route_tree, grads, params, is_leaf=is_route)
        loss = total / weight
        loss = (loss, jax.tree.map(lambda a: a / weight, aux)) if has_aux else loss
        return loss, grads, (n * k / weight)

    def local_grads(params, whole, batch, key, scale):
        params = prepare(params)
        stats, grads = accumulate(params, whole, batch, key, scale)
        return reduce(stats, grads, params)

    def on_host_scaled(grads, factor):
        # The gradients that streamed to host memory get the same scaling there, in a host
        # computation: no device op reads host memory.
        scale = lambda gs, f: ([(g * f.astype(g.dtype)).astype(plan.grad_dtype) for g in gs],
                               None)
        return on_host_leaves(scale, grads, factor)[0]

    def grads_fn(params: PyTree, batch: PyTree, scale: jax.Array | float = 1.0,
                 key: jax.Array | None = None):
        # Stage 2 differentiates the shards of its replicated parameters, and passes the whole
        # copy too, which the forward reads as is.
        whole = params if stage2 or stage3_streams else None
        out = ((P(), P()) if has_aux else P(), plan.grad_specs, P())
        loss, grads, factor = jax.shard_map(
            local_grads, mesh=plan.mesh,
            in_specs=(plan.grad_specs if stage2 else plan.param_specs,
                      None if whole is None else plan.param_specs, batch_spec, P(), P()),
            out_specs=out,
        )(params, whole, batch, key, jnp.asarray(scale, jnp.float32))
        return loss, on_host_scaled(grads, factor)

    return grads_fn


def make_train_step(plan: Plan, loss_fn: Callable, tx: optax.GradientTransformation,
                    batch_spec: PyTree = None,
                    lr_schedule: Callable[[jax.Array], jax.Array] | None = None,
                    has_aux: bool = False):
    """``step(state, batch, *, key=None) -> (state, metrics)``, jitted with donated state.

    ``loss_fn``, ``batch_spec`` and ``has_aux`` as for ``make_grad_fn``; the global batch holds
    ``plan.accum_steps`` microbatches. Given a ``key``, ``loss_fn`` gets
    ``device_key(fold_in(key, state.step), device, microbatch)``: new randomness every step,
    on every device. Metrics: ``loss``, ``grad_norm``, ``skipped`` (1 when the gradient was not
    finite and the update was skipped), ``loss_scale`` with fp16 loss scaling, ``lr`` from
    ``lr_schedule(optimizer steps taken)`` when given, and the auxiliary metrics.
    """
    batch_spec = batch_spec if batch_spec is not None else P(plan.data_axes)
    grad_fn = make_grad_fn(plan, loss_fn, batch_spec, has_aux)
    prec = plan.precision
    trained_tx = plan.optimizer(tx)  # frozen leaves: zero update, no state

    def to_params(compute: PyTree) -> PyTree:
        """The updated compute copy, from the optimizer's layout back to the parameters'."""
        if plan.outer is None:  # stages 1-2: the partitioner all-gathers the updated shards
            return _constrain(compute, plan, plan.param_specs)

        # Hierarchical: our own all-gather across groups (and, for leaves whose parameter is
        # whole, within the group too), in the compute dtype, once per step, in buckets; in
        # int8 with quantize_weights (ZeRO++'s qwZ where it matters: the cross-node traffic).
        def gather(tree):
            flat, treedef = jax.tree.flatten(tree)
            leaves = jax.tree.leaves(plan.leaves, is_leaf=_is_leaf)
            for persistent in (False, True):
                axes = (plan.axis, plan.outer) if persistent else plan.outer
                idx = [i for i, leaf in enumerate(leaves)
                       if leaf.axis is not None and bool(leaf.persistent) == persistent]
                # Persistent leaves are small: int8 would save nothing and round norms' gains.
                comm = dataclasses.replace(plan.comm, quantize_weights=False) if persistent \
                    else plan.comm
                _put(flat, idx, buckets.all_gather([flat[i] for i in idx],
                                                   [leaves[i].axis for i in idx], axes, comm,
                                                   to="invarying"))
            return treedef.unflatten(flat)

        return jax.shard_map(gather, mesh=plan.mesh, in_specs=(plan.opt_specs,),
                             out_specs=plan.param_specs)(compute)

    def optimize(grads, opt_state, master):
        updates, opt_state = trained_tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    def update(grads, opt_state, master, finite):
        # A step whose gradient is not finite changes nothing; the compute copy is cast from
        # the new master where the master lives (on the host when offloaded).
        new_master, opt_state = jax.lax.cond(finite, lambda _: optimize(grads, opt_state, master),
                                             lambda _: (master, opt_state), None)
        return new_master, opt_state, jax.tree.map(lambda x: x.astype(prec.compute), new_master)

    if plan.offloads_optimizer:  # ZeRO-Offload: the offloaded leaves are updated on the host
        shapes = abstract_state(plan, tx)
        f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), plan.shapes)
        update = split_update(
            update, optimize, f32, shapes.opt_state, f32, plan.opt_state_offload(tx),
            plan.map_opt_state(tx, lambda *_: False, plan.shapes, True),
            jax.tree.map(lambda leaf: leaf.offload, plan.leaves, is_leaf=_is_leaf),
            params_in_host_memory(plan))

    def unscaled(grads, scale):
        # fp32 and divided by the loss scale; and the sum of their squares. Gradients that
        # streamed to host memory are converted there, in one host computation.
        convert = lambda g: g.astype(jnp.float32) / scale if not in_host_memory(g) else g
        squares = lambda gs: sum((jnp.sum(jnp.square(g)) for g in gs), jnp.zeros(()))
        grads = jax.tree.map(convert, grads)
        on_device = squares(g for g in jax.tree.leaves(grads) if not in_host_memory(g))

        def on_host(gs, scale):
            gs = [g.astype(jnp.float32) / scale for g in gs]
            return gs, squares(gs)
        grads, in_host = on_host_leaves(on_host, grads, scale)
        return grads, on_device if in_host is None else on_device + in_host

    def step(state: TrainState, batch: PyTree, *, key: jax.Array | None = None):
        scale = state.loss_scale.scale if state.loss_scale is not None else 1.0
        if key is not None:
            key = jax.random.fold_in(key, state.step)
        loss, grads = grad_fn(state.params, batch, scale, key)
        loss, aux = loss if has_aux else (loss, {})
        # The update runs on the optimizer's shards, in fp32: stage 1 slices its whole gradient
        # (no communication), stages 1-2 all-gather the updated shards into the compute copy.
        grads, squares = unscaled(_constrain(grads, plan, plan.opt_specs), scale)
        norm = jnp.sqrt(squares)  # optax.tree.norm, over the host's gradients too
        finite = jnp.isfinite(norm)
        if not prec.skip_nonfinite and prec.loss_scale is None:
            finite = jnp.asarray(True)
        master = state.master if plan.has_master else _constrain(state.params, plan,
                                                                   plan.opt_specs)
        new_master, opt_state, compute = update(grads, state.opt_state, master, finite)
        params = to_params(compute)
        loss_scale = state.loss_scale
        if loss_scale is not None:
            loss_scale = update_loss_scale(loss_scale, finite, prec.loss_scale)
        skipped = state.skipped + (~finite).astype(jnp.int32)
        metrics = {**aux, "loss": loss, "grad_norm": norm,
                   "skipped": (~finite).astype(jnp.int32)}
        if loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
        if lr_schedule is not None:
            metrics["lr"] = lr_schedule(state.step - state.skipped)
        new = TrainState(state.step + 1, params, new_master if plan.has_master else None,
                         opt_state, loss_scale, skipped)
        return new, metrics

    shardings = state_shardings(plan, tx)
    replicated = NamedSharding(plan.mesh, P())
    # No in_shardings (jit refuses them beside a keyword argument): the state arrives in its
    # layout, and shard_map cuts the batch by ``batch_spec``; put it there to avoid a copy.
    return jax.jit(step, out_shardings=(shardings, replicated), donate_argnums=(0,))
