"""The train state: what it holds, where each part lives, and how it is born sharded.

Built with ``jax.eval_shape`` and ``jax.jit(..., out_shardings=...)`` so that no device ever
holds more than its part, not even while the state is created.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_jax.plan import Leaf, Plan, path_str
from zero_jax.precision import LossScale

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


def grads_in_host_memory(plan: Plan, accum_steps: int) -> PyTree:
    """Per parameter, whether its gradient leaves the backward in host memory, layer by layer:
    a cut leaf whose parameter or optimizer is offloaded, at stage 2 or 3 in a step of one
    microbatch (ZeRO-Offload's gradient streaming)."""
    streams = plan.rule.shard_grads and accum_steps == 1 and plan.outer is None
    return jax.tree.map(lambda leaf, host: host or (streams and leaf.offload and leaf.axis
                                                    is not None and not leaf.persistent),
                        plan.leaves, params_in_host_memory(plan), is_leaf=_is_leaf)


def _new_state(plan: Plan, params: PyTree, tx: optax.GradientTransformation) -> TrainState:
    p = plan.precision
    compute = jax.tree.map(lambda x: x.astype(p.compute), params)
    return TrainState(jnp.zeros((), jnp.int32), compute, params if plan.has_master else None,
                      plan.optimizer(tx).init(params), p.init_loss_scale(),
                      jnp.zeros((), jnp.int32))


def _born(plan: Plan, state: TrainState) -> TrainState:
    """A new state as ``init_state`` returns it (or its shardings): with the NVMe tier, no
    optimizer state, which the step's first call writes to the files band by band with the
    master (``Tier.start``), never whole in memory."""
    return state._replace(opt_state=None) if plan.offload.nvme else state


def init_state(plan: Plan, init_params: Callable[[jax.Array], PyTree] | PyTree,
               tx: optax.GradientTransformation, key: jax.Array | None = None) -> TrainState:
    """Create the state directly in its sharded layout; no device ever holds more than its part.

    ``init_params(key)`` returns fp32 parameters; the compute copy is cast from them. Or pass
    the parameters themselves (a pretrained model's, as arrays): each leaf is put straight into
    its shards and enters the compiled init as an argument, never as a constant of the program.
    """
    shardings = state_shardings(plan, tx)
    if callable(init_params):
        # The model's own init alone: its random draws are most of the init's compile time, and
        # this program depends only on the model and where its parameters go, so JAX's caches
        # reuse it whatever the optimizer, precision or offload (0.47 -> 0.05 s per state).
        init_params = jax.jit(init_params, out_shardings=plan.shardings(plan.opt_specs))(key)
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
    with warnings.catch_warnings():
        # Donated so that XLA may write the state over them; where no output has their layout
        # (offloaded to host memory, or cut otherwise than the optimizer's), it cannot, and
        # JAX warns: harmless, the state is the same, those buffers are only not reused.
        warnings.filterwarnings("ignore", "Some donated buffers were not usable", UserWarning)
        return jax.jit(lambda p: _born(plan, _new_state(plan, cast(p), tx)),
                       out_shardings=_born(plan, shardings), donate_argnums=0)(params)


def abstract_state(plan: Plan, tx: optax.GradientTransformation) -> TrainState:
    """The state as ``ShapeDtypeStruct``s with shardings: for compiling without allocating."""
    shapes = jax.eval_shape(lambda params: _new_state(plan, params, tx), plan.shapes)
    shardings = state_shardings(plan, tx)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)



def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)
