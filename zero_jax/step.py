"""The one jit-compiled train step, built from a ``Plan``: the gradient half, then the update.

The gradient half (``zero_jax.grads``) runs under ``shard_map`` with the collectives we write.
The update half is plain jit-with-shardings: optax sees global arrays laid out by the plan, so
any transformation, global-norm clipping included, computes what it computes on one device, and
only the parameter all-gather of stages 1-2 (updated shards back to whole) is left to the
partitioner. Its phases: unscale, update (skipped when the gradient is not finite), gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_jax import buckets
from zero_jax.grads import make_grad_fn, put
from zero_jax.nvme import Tier
from zero_jax.offload import Owners, in_host_memory, on_host_leaves, split_update
from zero_jax.plan import Leaf, Plan
from zero_jax.precision import update_loss_scale
from zero_jax.state import TrainState, abstract_state, params_in_host_memory, state_shardings

PyTree = Any


def constrain(tree: PyTree, plan: Plan, specs: PyTree) -> PyTree:
    """Lay ``tree`` out by ``specs``, each array staying in the memory it is in."""
    def one(x, spec):
        host = in_host_memory(x)
        return jax.lax.with_sharding_constraint(x, NamedSharding(
            plan.mesh, spec, memory_kind="pinned_host" if host else None))
    return jax.tree.map(one, tree, specs)


def unscale(grads: PyTree, scale: jax.Array) -> tuple[PyTree, jax.Array]:
    """fp32 and divided by the loss scale; and the sum of their squares. Gradients that
    streamed to host memory are converted there, in one host computation."""
    convert = lambda g: g.astype(jnp.float32) / scale if not in_host_memory(g) else g
    squares = lambda gs: sum((jnp.sum(jnp.square(g)) for g in gs), jnp.zeros(()))
    grads = jax.tree.map(convert, grads)
    on_device = squares(g for g in jax.tree.leaves(grads) if not in_host_memory(g))

    def on_host(gs, scale):
        gs = [g.astype(jnp.float32) / scale for g in gs]
        return gs, squares(gs)
    grads, in_host = on_host_leaves(on_host, grads, scale)
    return grads, on_device if in_host is None else on_device + in_host


def selects_in_place(plan: Plan) -> bool:
    """Whether the update skips a non-finite step with a select per leaf rather than a cond.
    XLA's GPU compiler fuses the select into the update and writes the donated state in place,
    where a cond's branches need the state's size again (8 H100s, d_model 512: stage 0's temp
    186 -> 40 MiB, stage 2's 33 -> 24); its CPU compiler the other way round (the default
    model's stage 0: 8.7 -> 10.9 MiB), so the CPU keeps the cond."""
    return plan.mesh.devices.flat[0].platform != "cpu"


def make_update(plan: Plan, tx: optax.GradientTransformation) -> Callable:
    """``update(grads, opt_state, master, finite) -> (master, opt_state, compute)``.

    A step whose gradient is not finite changes nothing; the compute copy is cast from the new
    master where the master lives. With ZeRO-Offload the offloaded leaves are updated on the
    host (``split_update``)."""
    trained_tx = plan.optimizer(tx)  # frozen leaves: zero update, no state

    def optimize(grads, opt_state, master):
        updates, opt_state = trained_tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    select = selects_in_place(plan)

    def update(grads, opt_state, master, finite):
        if select:
            new = optimize(grads, opt_state, master)
            new_master, opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new,
                                                 (master, opt_state))
        else:
            new_master, opt_state = jax.lax.cond(
                finite, lambda _: optimize(grads, opt_state, master),
                lambda _: (master, opt_state), None)
        compute = jax.tree.map(lambda x: x.astype(plan.precision.compute), new_master)
        return new_master, opt_state, compute

    if not plan.offloads_optimizer:
        return update
    f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), plan.shapes)
    return split_update(update, optimize, f32, abstract_state(plan, tx).opt_state, f32, Owners(
        plan.opt_state_offload(tx), plan.map_opt_state(tx, lambda *_: False, plan.shapes, True),
        jax.tree.map(lambda leaf: leaf.offload, plan.leaves, is_leaf=_is_leaf),
        params_in_host_memory(plan)))


def to_params(plan: Plan, compute: PyTree) -> PyTree:
    """The updated compute copy, from the optimizer's layout back to the parameters'."""
    if plan.outer is None:  # stages 1-2: the partitioner all-gathers the updated shards
        return constrain(compute, plan, plan.param_specs)

    # Hierarchical: our own all-gather across groups (and, for leaves whose parameter is whole,
    # within the group too), in the compute dtype, once per step, in buckets; in int8 with
    # quantize_weights (ZeRO++'s qwZ where it matters: the cross-node traffic).
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
            put(flat, idx, buckets.all_gather(  # a leaf cut over model x data: split in two
                [flat[i] for i in idx], [leaves[i].axis + leaves[i].split for i in idx], axes,
                comm, to="invarying"))
        return treedef.unflatten(flat)

    # With tensor parallelism a bucket mixes leaves cut over ``model`` with whole ones, which
    # come out the same on every rank but cannot be inferred so (``shards.per_model_rank``).
    split = plan.opt_specs
    gathered = jax.shard_map(
        gather, mesh=plan.mesh, in_specs=(plan.split_model(split),),
        out_specs=plan.split_model(plan.param_specs, like=split),
        check_vma=not plan.model)(plan.to_split(compute, split))
    return plan.from_split(gathered, split)


def make_train_step(plan: Plan, loss_fn: Callable, tx: optax.GradientTransformation,
                    batch_spec: PyTree = None,
                    lr_schedule: Callable[[jax.Array], jax.Array] | None = None,
                    has_aux: bool = False, accum_steps: int = 1) -> TrainStep:
    """``step(state, batch, *, key=None) -> (state, metrics)``, with donated state: a
    ``JitStep``, or with the NVMe tier (``Offload.nvme``) an ``NvmeStep``; both keep the
    ``TrainStep`` contract.

    ``loss_fn``, ``batch_spec``, ``has_aux`` and ``accum_steps`` as for ``make_grad_fn``: the
    global batch holds ``accum_steps`` microbatches per device. Given a ``key``, ``loss_fn`` gets
    ``device_key(fold_in(key, state.step), device, microbatch)``: new randomness every step,
    on every device. Metrics: ``loss``, ``grad_norm``, ``skipped`` (1 when the gradient was not
    finite and the update was skipped), ``loss_scale`` with fp16 loss scaling, ``lr`` from
    ``lr_schedule(optimizer steps taken)`` when given, and the auxiliary metrics.
    """
    grad_fn = make_grad_fn(plan, loss_fn, batch_spec, has_aux, accum_steps)
    prec = plan.precision

    def gradients(state: TrainState, batch: PyTree, key: jax.Array | None):
        """The gradient half: fp32 gradients in the optimizer's layout, whether they are
        finite, the step's metrics and the next loss scale."""
        scale = state.loss_scale.scale if state.loss_scale is not None else 1.0
        key = None if key is None else jax.random.fold_in(key, state.step)
        loss, grads = grad_fn(state.params, batch, scale, key)
        loss, aux = loss if has_aux else (loss, {})
        # The update runs on the optimizer's shards, in fp32: stage 1 slices its whole gradient
        # (no communication), stages 1-2 all-gather the updated shards into the compute copy.
        grads, squares = unscale(constrain(grads, plan, plan.opt_specs), scale)
        norm = jnp.sqrt(squares)  # optax.tree.norm, over the host's gradients too
        finite = jnp.isfinite(norm) if prec.skip_nonfinite or prec.loss_scale is not None else \
            jnp.asarray(True)
        loss_scale = state.loss_scale if state.loss_scale is None else \
            update_loss_scale(state.loss_scale, finite, prec.loss_scale)
        metrics = {**aux, "loss": loss, "grad_norm": norm, "skipped": (~finite).astype(jnp.int32)}
        if loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
        if lr_schedule is not None:
            metrics["lr"] = lr_schedule(state.step - state.skipped)
        return grads, finite, metrics, loss_scale

    replicated = NamedSharding(plan.mesh, P())
    if plan.offload.nvme is not None:
        return NvmeStep(plan, tx, gradients, accum_steps=accum_steps)
    update = make_update(plan, tx)

    def step(state: TrainState, batch: PyTree, *, key: jax.Array | None = None):
        grads, finite, metrics, loss_scale = gradients(state, batch, key)
        master = state.master if plan.has_master else constrain(state.params, plan,
                                                                  plan.opt_specs)
        new_master, opt_state, compute = update(grads, state.opt_state, master, finite)
        new = TrainState(state.step + 1, to_params(plan, compute),
                         new_master if plan.has_master else None, opt_state, loss_scale,
                         state.skipped + metrics["skipped"])
        return new, metrics

    # No in_shardings (jit refuses them beside a keyword argument): the state arrives in its
    # layout, and shard_map cuts the batch by ``batch_spec``; put it there to avoid a copy.
    return JitStep(jax.jit(step, out_shardings=(state_shardings(plan, tx), replicated),
                           donate_argnums=(0,)), accum_steps)


def make_eval_step(plan: Plan, loss_fn: Callable, batch_spec: PyTree = None,
                   has_aux: bool = False) -> Callable[[PyTree, PyTree], dict]:
    """``evaluate(params, batch) -> metrics``: ``loss`` (and the auxiliary metrics) of a
    held-out batch at the compute copy ``state.params``, jitted, nothing updated.

    It is the train step's gradient half with its gradients unread, so the loss is computed
    exactly as training reports it (each block gathered as it runs, offloaded shards fetched,
    the global weighted mean) and no second forward path exists to drift from it; XLA removes
    the unread backward and its reductions from the compiled program (``tests/test_eval.py``
    reads it: no reduce-scatter, a third of the step's FLOPs). ``loss_fn`` is called without a
    key (no dropout); ``batch_spec`` and ``has_aux`` as for ``make_grad_fn``."""
    grad_fn = make_grad_fn(plan, loss_fn, batch_spec, has_aux)

    def evaluate(params: PyTree, batch: PyTree) -> dict:
        loss, _ = grad_fn(params, batch)
        loss, aux = loss if has_aux else (loss, {})
        return {**aux, "loss": loss}

    return jax.jit(evaluate)


class TrainStep(Protocol):
    """What ``make_train_step`` returns, whichever kind: a loop, a checkpoint and the report
    use these and never ask which kind it is."""

    accum_steps: int  # microbatches per step; ``lower``'s result carries it to the report

    def __call__(self, state: TrainState, batch: PyTree, *,
                 key: jax.Array | None = None) -> tuple[TrainState, dict]:
        """One optimizer step: the new state and the step's metrics."""

    def lower(self, state: TrainState, batch: PyTree, *, key: jax.Array | None = None) -> Any:
        """Ahead of time: ``lower(state, batch).compile()`` is a step with the same call. The
        result's ``accum_steps`` is the step's, which ``report.build`` reads."""

    def whole(self, state: TrainState) -> TrainState:
        """``state`` as a checkpoint saves it: all of it on the devices or the host."""

    def close(self) -> None:
        """Release what the step holds outside the process (the NVMe tier's directory)."""


class JitStep:
    """The step as one jitted program (stages 0-3, host offload): every state it returns is
    whole, and it holds nothing to release."""

    def __init__(self, fn: Callable, accum_steps: int = 1):
        self.fn = fn  # the jitted step, for what jax.jit offers beyond the contract
        self.accum_steps = accum_steps

    def __call__(self, state: TrainState, batch: PyTree, *, key: jax.Array | None = None):
        return self.fn(state, batch) if key is None else self.fn(state, batch, key=key)

    def lower(self, state: TrainState, batch: PyTree, *, key: jax.Array | None = None):
        lowered = self.fn.lower(state, batch) if key is None else \
            self.fn.lower(state, batch, key=key)
        lowered.accum_steps = self.accum_steps  # jax's Lowered: the report reads it there
        return lowered

    def whole(self, state: TrainState) -> TrainState:
        return state

    def close(self) -> None:
        pass


class NvmeStep:
    """The step with ZeRO-Infinity's NVMe tier: a compiled gradient half, the update through
    the files (``zero_jax.nvme.Tier``), a compiled gather of the new compute copy. The state's
    master and optimizer state live in the files: the first call moves them there, and
    ``step.whole(state)`` reads them back.

    Like a jitted step it can be lowered and compiled ahead of time (``step.lower(state,
    batch).compile()``): what is lowered is the gradient half, the one program that runs on
    the devices between two updates."""

    def __init__(self, plan: Plan, tx: optax.GradientTransformation, gradients: Callable,
                 grads_program: Callable | None = None, tier: Tier | None = None,
                 compiler_options: dict | None = None, accum_steps: int = 1):
        self.plan, self.tx, self.gradients = plan, tx, gradients
        self.accum_steps = accum_steps
        self.tier = tier or Tier(plan, tx)
        self.grads_program = grads_program or jax.jit(gradients)
        self._opt = jax.tree.leaves(plan.shardings(plan.opt_specs))
        self._shapes = jax.tree.leaves(plan.shapes)
        # Options given to ``compile`` reach the update and the gather as well.
        self._band_program = jax.jit(self.tier.band_fn, compiler_options=compiler_options) \
            if compiler_options else None  # None: the tier's own
        self._params_program = jax.jit(self._new_params, compiler_options=compiler_options,
                                       out_shardings=state_shardings(plan, tx).params)

    def _new_params(self, compute: list, params: PyTree) -> PyTree:
        kept = jax.tree.leaves(constrain(params, self.plan, self.plan.opt_specs))
        flat = [kept[i] if c is None else c for i, c in enumerate(compute)]  # frozen: kept
        return to_params(self.plan, jax.tree.unflatten(jax.tree.structure(self.plan.shapes),
                                                       flat))

    def whole(self, state: TrainState) -> TrainState:
        return self.tier.give(state, state_shardings(self.plan, self.tx))

    def close(self) -> None:
        self.tier.close()

    def lower(self, state: TrainState, batch: PyTree, *, key: jax.Array | None = None):
        lowered = self.grads_program.lower(state._replace(master=None, opt_state=None), batch,
                                           key)
        return _Lowered(lowered, self)

    def __call__(self, state: TrainState, batch: PyTree, *, key: jax.Array | None = None):
        if state.opt_state is not None:  # a whole state (restored): it moves to the files
            state = self.tier.take(state)
        elif state.master is not None:  # a new state: its master and tx.init's, band by band
            state = self.tier.start(state)
        grads, finite, metrics, loss_scale = self.grads_program(state, batch, key)
        params = state.params
        if bool(finite):
            compute: list = [None] * len(self._shapes)
            for i, arrays in self.tier.update(grads, self._band_program).items():
                compute[i] = jax.make_array_from_single_device_arrays(
                    self._shapes[i].shape, self._opt[i], arrays)
            params = self._params_program(compute, params)
        return TrainState(state.step + 1, params, None, None, loss_scale,
                          state.skipped + metrics["skipped"]), metrics


class _Lowered:
    """The gradient half lowered; ``compile`` gives the whole step, compiled."""

    def __init__(self, lowered, step: NvmeStep):
        self._lowered, self._step = lowered, step
        self.accum_steps = step.accum_steps

    def compile(self, compiler_options: dict | None = None) -> _Compiled:
        return _Compiled(self._lowered.compile(compiler_options), self._step, compiler_options)

    def __getattr__(self, name: str):
        return getattr(self._lowered, name)


class _Compiled:
    """The NVMe step around its compiled gradient half, which answers for the program
    (``memory_analysis``, ``as_text``)."""

    def __init__(self, compiled, step: NvmeStep, compiler_options: dict | None):
        self._compiled, self.tier = compiled, step.tier
        self._step = NvmeStep(step.plan, step.tx, step.gradients,
                              lambda state, batch, key: compiled(state, batch, key), step.tier,
                              compiler_options, step.accum_steps)

    def __call__(self, state: TrainState, batch: PyTree):
        return self._step(state, batch)

    def __getattr__(self, name: str):
        return getattr(self._compiled, name)


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)
