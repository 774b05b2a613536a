"""The train state and the one jit-compiled train step, built from a ``Plan``.

The step has two halves. The gradient half runs under ``shard_map`` over the data axis, so
the collectives are exactly the ones ``zero_jax.gather`` writes (XLA's partitioner on CPU
would neither reduce-scatter nor gather weights by itself). The update half is plain
jit-with-shardings: optax sees global arrays laid out by the plan, so any transformation,
global-norm clipping included, computes what it computes on one device, and only the
parameter all-gather of stages 1-2 (shards back to replicated) is left to the partitioner.
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
from zero_jax.rules import Leaf, Plan

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


class TrainState(NamedTuple):
    step: jax.Array
    params: PyTree
    opt_state: PyTree


def state_specs(plan: Plan, tx: optax.GradientTransformation) -> TrainState:
    """Partition specs of the whole train state."""
    return TrainState(P(), plan.param_specs, plan.opt_state_specs(tx))


def init_state(plan: Plan, init_params: Callable[[jax.Array], PyTree],
               tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
    """Create the state directly in its sharded layout; no device ever holds more than its part."""
    shardings = plan.shardings(state_specs(plan, tx))

    def init(key):
        params = init_params(key)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    return jax.jit(init, out_shardings=shardings)(key)


def abstract_state(plan: Plan, tx: optax.GradientTransformation) -> TrainState:
    """The state as ``ShapeDtypeStruct``s with shardings: for compiling without allocating."""
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), plan.shapes,
                        jax.eval_shape(tx.init, plan.shapes))
    shardings = plan.shardings(state_specs(plan, tx))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def _constrain(tree: PyTree, plan: Plan, specs: PyTree) -> PyTree:
    return jax.lax.with_sharding_constraint(tree, plan.shardings(specs))


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def make_grad_fn(plan: Plan, loss_fn: LossFn, batch_spec: P | None = None):
    """``grads(params, batch) -> (loss, grads)``: the data-parallel half of the step.

    Not jitted; takes parameters in the plan's ``param_specs`` layout and returns gradients of
    the global mean loss in its ``grad_specs`` layout, moved by the stage's collectives.
    ``loss_fn(params, batch)`` returns the mean loss over the batch it is given; here it sees
    this device's slice of the global batch (cut along dimension 0) and whole parameters,
    except the stacked layers declared in the plan, which reach ``zero_jax.layer`` as shards.
    """
    axis, rule = plan.axis, plan.rule
    n = plan.mesh.shape[axis]
    batch_spec = batch_spec if batch_spec is not None else P(axis)

    def local_grads(params, whole, batch):
        def local_loss(params):
            def wrap(leaf: Leaf, p, w=None):
                if leaf.axis is None or leaf.persistent or not rule.shard_grads:
                    return p
                return Shard(p, w, leaf.axis - leaf.stacked, axis)

            def at_root(leaf: Leaf, x):
                # Everything but the layer stacks is made whole once, here. A replicated leaf
                # is marked per-device here too, so that its gradient is all-reduced once even
                # when it is used twice (a tied embedding).
                if leaf.stacked:
                    return x
                if isinstance(x, Shard):
                    return materialize(x)
                return jax.lax.pcast(x, axis, to="varying")

            rest = () if whole is None else (whole,)
            tree = jax.tree.map(wrap, plan.leaves, params, *rest, is_leaf=_is_leaf)
            tree = jax.tree.map(at_root, plan.leaves, tree, is_leaf=_is_leaf)
            return loss_fn(tree, batch) / n

        loss, grads = jax.value_and_grad(local_loss)(params)
        return jax.lax.psum(loss, axis), grads

    def grads(params: PyTree, batch: PyTree):
        # Parameters enter in the layout their gradients leave in. Stage 2 also passes the
        # replicated copy, which the forward reads as is.
        whole = params if rule.shard_grads and not rule.shard_params else None
        return jax.shard_map(
            local_grads, mesh=plan.mesh,
            in_specs=(plan.grad_specs, None if whole is None else plan.param_specs, batch_spec),
            out_specs=(P(), plan.grad_specs),
        )(params, whole, batch)

    return grads


def make_train_step(plan: Plan, loss_fn: LossFn, tx: optax.GradientTransformation,
                    batch_spec: P | None = None,
                    lr_schedule: Callable[[jax.Array], jax.Array] | None = None):
    """``step(state, batch) -> (state, metrics)``, jitted with donated state.

    ``loss_fn`` and ``batch_spec`` as for ``make_grad_fn``; ``lr_schedule(step)``, if given,
    is reported as ``metrics["lr"]``.
    """
    batch_spec = batch_spec if batch_spec is not None else P(plan.axis)
    grad_fn = make_grad_fn(plan, loss_fn, batch_spec)

    def step(state: TrainState, batch: PyTree):
        loss, grads = grad_fn(state.params, batch)
        # The update runs on the optimizer's shards: stage 1 slices its replicated gradient
        # (no communication), and stages 1-2 all-gather the updated shards into parameters.
        grads = _constrain(grads, plan, plan.opt_specs)
        params = _constrain(state.params, plan, plan.opt_specs)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        params = _constrain(optax.apply_updates(params, updates), plan, plan.param_specs)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if lr_schedule is not None:
            metrics["lr"] = lr_schedule(state.step)
        return TrainState(state.step + 1, params, opt_state), metrics

    state_shardings = plan.shardings(state_specs(plan, tx))
    replicated = NamedSharding(plan.mesh, P())
    return jax.jit(step, in_shardings=(state_shardings, NamedSharding(plan.mesh, batch_spec)),
                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))
