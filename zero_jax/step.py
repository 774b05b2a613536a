"""The train state and the one jit-compiled train step, built from a ``Plan``.

The step has two halves. The gradient half runs under ``shard_map`` over the data axis, so
the collectives are exactly the ones ``zero_jax.gather`` and this module write (XLA's
partitioner on CPU would neither reduce-scatter nor gather weights by itself). The update half
is plain jit-with-shardings: optax sees global arrays laid out by the plan, so any
transformation, global-norm clipping included, computes what it computes on one device, and only
the parameter all-gather of stages 1-2 (updated shards back to whole) is left to the partitioner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_jax.gather import Shard, materialize
from zero_jax.precision import LossScale, update_loss_scale
from zero_jax.rules import Leaf, Plan

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


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
    return TrainState(P(), plan.param_specs, plan.opt_specs if p.has_master else None,
                      plan.opt_state_specs(tx), scale, P())


def _new_state(plan: Plan, params: PyTree, tx: optax.GradientTransformation) -> TrainState:
    p = plan.precision
    compute = jax.tree.map(lambda x: x.astype(p.compute), params)
    return TrainState(jnp.zeros((), jnp.int32), compute, params if p.has_master else None,
                      plan.optimizer(tx).init(params), p.init_loss_scale(),
                      jnp.zeros((), jnp.int32))


def init_state(plan: Plan, init_params: Callable[[jax.Array], PyTree],
               tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
    """Create the state directly in its sharded layout; no device ever holds more than its part.

    ``init_params(key)`` returns fp32 parameters; the compute copy is cast from them."""
    shardings = plan.shardings(state_specs(plan, tx))
    return jax.jit(lambda key: _new_state(plan, init_params(key), tx),
                   out_shardings=shardings)(key)


def abstract_state(plan: Plan, tx: optax.GradientTransformation) -> TrainState:
    """The state as ``ShapeDtypeStruct``s with shardings: for compiling without allocating."""
    shapes = jax.eval_shape(lambda params: _new_state(plan, params, tx), plan.shapes)
    shardings = plan.shardings(state_specs(plan, tx))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def _constrain(tree: PyTree, plan: Plan, specs: PyTree) -> PyTree:
    return jax.lax.with_sharding_constraint(tree, plan.shardings(specs))


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def make_grad_fn(plan: Plan, loss_fn: LossFn, batch_spec: P | None = None):
    """``grads(params, batch, scale=1.0) -> (loss, grads)``: the data-parallel half of the step.

    Not jitted. Takes the compute copy in the plan's ``param_specs`` layout and returns the
    gradient of the global mean loss, times ``scale``, in the ``grad_specs`` layout and the
    plan's ``grad_dtype``, moved by the stage's collectives. ``loss_fn(params, batch)`` returns
    the mean loss over the batch it is given: here, one microbatch of this device's slice of the
    global batch (cut along dimension 0), with whole parameters, except the stacked layers
    declared in the plan, which reach ``zero_jax.layer`` as shards. Frozen leaves get zeros,
    computed and communicated by nobody.
    """
    axis, rule, prec, k = plan.axis, plan.rule, plan.precision, plan.accum_steps
    n, everywhere = plan.dp_size, plan.data_axes
    batch_spec = batch_spec if batch_spec is not None else P(everywhere)

    def cut(leaf: Leaf) -> bool:
        return rule.shard_grads and leaf.axis is not None and not leaf.persistent

    def zero_grad(leaf: Leaf, p: jax.Array) -> jax.Array:
        # A frozen leaf's gradient, in the grad_specs layout: zeros, never communicated.
        shape = list(p.shape)
        if cut(leaf) and plan.outer:
            shape[leaf.axis] //= plan.mesh.shape[plan.outer]
        return jnp.zeros(shape, plan.grad_dtype)

    def local_grads(params, whole, batch, scale):
        # A whole parameter is marked per-device before differentiating, so that its gradient
        # stays local until the one all-reduce after the backward (differentiating the
        # replicated value itself, JAX would all-reduce it at every use).
        # Likewise a hierarchical shard, whole across groups until the across-group
        # reduce-scatter after the backward.
        def per_device(leaf: Leaf, p):
            axes = everywhere if not cut(leaf) else (plan.outer,) if plan.outer else ()
            return jax.lax.pcast(p, axes, to="varying") if axes and not leaf.frozen else p

        params = jax.tree.map(per_device, plan.leaves, params, is_leaf=_is_leaf)

        def micro_loss(params, micro):
            def wrap(leaf: Leaf, p, w=None):
                if cut(leaf):
                    return Shard(p, w, leaf.axis - leaf.stacked, axis, prec.reduce.name)
                return p

            rest = () if whole is None else (whole,)
            tree = jax.tree.map(wrap, plan.leaves, params, *rest, is_leaf=_is_leaf)
            # Everything but the layer stacks is made whole once, here; the stacks, per layer.
            tree = jax.tree.map(lambda leaf, x: x if leaf.stacked else materialize(x),
                                plan.leaves, tree, is_leaf=_is_leaf)
            if prec.autocast_input:
                micro = jax.tree.map(
                    lambda x: x.astype(prec.compute) if jnp.issubdtype(x.dtype, jnp.floating)
                    else x, micro)
            loss = loss_fn(tree, micro).astype(jnp.float32)
            return loss * scale / (n * k), loss / (n * k)

        def trained_loss(trained, micro):
            # Frozen leaves are read from ``params``, not differentiated: no gradient, no
            # collective in the backward.
            mixed = jax.tree.map(lambda leaf, t, p: p if leaf.frozen else t,
                                 plan.leaves, trained, params, is_leaf=_is_leaf)
            return micro_loss(mixed, micro)

        def micro_grads(micro):
            grads, loss = jax.grad(trained_loss, has_aux=True)(params, micro)
            # A frozen leaf's (zero) gradient is not kept, nor accumulated: a scalar stands in.
            grads = jax.tree.map(lambda leaf, g: jnp.zeros((), g.dtype) if leaf.frozen else g,
                                 plan.leaves, grads, is_leaf=_is_leaf)
            return loss, grads

        if k == 1:
            loss, grads = micro_grads(batch)
        else:
            # Each microbatch's cut gradients are reduce-scattered by its backward and summed
            # into a 1/N accumulator; whole ones are summed locally and reduced below, once.
            micros = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

            def move(tree, space):  # offload_grads: the accumulator waits in host memory
                return jax.device_put(tree, space) if plan.offload_grads else tree

            host, device = jax.memory.Space.Host, jax.memory.Space.Device

            def body(carry, micro):
                loss, grads = micro_grads(micro)
                total, acc = carry
                acc = jax.tree.map(lambda a, g: a + g.astype(prec.accum), move(acc, device),
                                   grads)
                return (total + loss, move(acc, host)), None

            zeros = jax.tree.map(
                lambda leaf, p: jnp.zeros((), prec.accum) if leaf.frozen
                else jnp.zeros_like(p, prec.accum), plan.leaves, params, is_leaf=_is_leaf)
            start = (jax.lax.pcast(jnp.zeros((), jnp.float32), everywhere, to="varying"),
                     move(zeros, host))
            (loss, grads), _ = jax.lax.scan(body, start, micros)
            grads = move(grads, device)

        def all_reduce(leaf: Leaf, g, p):
            if leaf.frozen:
                return zero_grad(leaf, p)
            if not cut(leaf):
                return jax.lax.psum(g.astype(prec.reduce), everywhere).astype(plan.grad_dtype)
            if plan.outer:  # hierarchical: once per step, the across-group reduce-scatter
                g = jax.lax.psum_scatter(g.astype(prec.reduce), plan.outer,
                                         scatter_dimension=leaf.axis, tiled=True)
            return g.astype(plan.grad_dtype)

        grads = jax.tree.map(all_reduce, plan.leaves, grads, params, is_leaf=_is_leaf)
        return jax.lax.psum(loss, everywhere), grads

    def grads_fn(params: PyTree, batch: PyTree, scale: jax.Array | float = 1.0):
        # Stage 2 differentiates the shards of its replicated parameters, and passes the whole
        # copy too, which the forward reads as is.
        stage2 = rule.shard_grads and not rule.shard_params
        whole = params if stage2 else None
        return jax.shard_map(
            local_grads, mesh=plan.mesh,
            in_specs=(plan.grad_specs if stage2 else plan.param_specs,
                      None if whole is None else plan.param_specs, batch_spec, P()),
            out_specs=(P(), plan.grad_specs),
        )(params, whole, batch, jnp.asarray(scale, jnp.float32))

    return grads_fn


def make_train_step(plan: Plan, loss_fn: LossFn, tx: optax.GradientTransformation,
                    batch_spec: P | None = None,
                    lr_schedule: Callable[[jax.Array], jax.Array] | None = None):
    """``step(state, batch) -> (state, metrics)``, jitted with donated state.

    ``loss_fn`` and ``batch_spec`` as for ``make_grad_fn``; the global batch holds
    ``plan.accum_steps`` microbatches. Metrics: ``loss``, ``grad_norm``, ``skipped`` (1 when
    the gradient was not finite and the update was skipped), ``loss_scale`` with fp16 loss
    scaling, and ``lr`` from ``lr_schedule(optimizer steps taken)`` when given.
    """
    batch_spec = batch_spec if batch_spec is not None else P(plan.data_axes)
    grad_fn = make_grad_fn(plan, loss_fn, batch_spec)
    prec = plan.precision
    trained_tx = plan.optimizer(tx)  # frozen leaves: zero update, no state

    def to_params(compute: PyTree) -> PyTree:
        """The updated compute copy, from the optimizer's layout back to the parameters'."""
        if plan.outer is None:  # stages 1-2: the partitioner all-gathers the updated shards
            return _constrain(compute, plan, plan.param_specs)

        # Hierarchical: our own all-gather across groups (and, for leaves whose parameter is
        # whole, within the group too), in the compute dtype, once per step.
        def gather(leaf: Leaf, x):
            if leaf.axis is None:
                return x
            axes = (plan.axis, plan.outer) if leaf.persistent else plan.outer
            return jax.lax.all_gather(x, axes, axis=leaf.axis, tiled=True, to="invarying")

        return jax.shard_map(lambda t: jax.tree.map(gather, plan.leaves, t, is_leaf=_is_leaf),
                             mesh=plan.mesh, in_specs=(plan.opt_specs,),
                             out_specs=plan.param_specs)(compute)

    def step(state: TrainState, batch: PyTree):
        scale = state.loss_scale.scale if state.loss_scale is not None else 1.0
        loss, grads = grad_fn(state.params, batch, scale)
        # The update runs on the optimizer's shards, in fp32: stage 1 slices its whole gradient
        # (no communication), stages 1-2 all-gather the updated shards into the compute copy.
        grads = _constrain(jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads),
                           plan, plan.opt_specs)
        norm = optax.tree.norm(grads)
        finite = jnp.isfinite(norm)
        if not prec.skip_nonfinite and prec.loss_scale is None:
            finite = jnp.asarray(True)
        master = state.master if prec.has_master else state.params
        master = _constrain(master, plan, plan.opt_specs)

        def update(_):
            updates, opt_state = trained_tx.update(grads, state.opt_state, master)
            return optax.apply_updates(master, updates), opt_state

        new_master, opt_state = jax.lax.cond(finite, update,
                                             lambda _: (master, state.opt_state), None)
        params = to_params(jax.tree.map(lambda x: x.astype(prec.compute), new_master))
        loss_scale = state.loss_scale
        if loss_scale is not None:
            loss_scale = update_loss_scale(loss_scale, finite, prec.loss_scale)
        skipped = state.skipped + (~finite).astype(jnp.int32)
        metrics = {"loss": loss, "grad_norm": norm, "skipped": (~finite).astype(jnp.int32)}
        if loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
        if lr_schedule is not None:
            metrics["lr"] = lr_schedule(state.step - state.skipped)
        new = TrainState(state.step + 1, params, new_master if prec.has_master else None,
                         opt_state, loss_scale, skipped)
        return new, metrics

    state_shardings = plan.shardings(state_specs(plan, tx))
    replicated = NamedSharding(plan.mesh, P())
    return jax.jit(step, in_shardings=(state_shardings, NamedSharding(plan.mesh, batch_spec)),
                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))
