"""Prefetch, one mechanism: a block's weights gathered while the block before it computes, its
whole gradient reduce-scattered while the block before it in the backward (the one after it in
the model) computes, as FSDP2 and DeepSpeed ZeRO-3 do; nothing whole kept from a block's forward
to its backward, which gathers again. At most two gathered blocks are live, and in the backward
one whole gradient more: the report's figure.

Every block goes through the same phases: gathered once what it waits for exists
(``gather_after``; the first block of each pass waits for the pass's inputs); run as the remat
policy keeps it (``remat.Saved.linearize``, never keeping the gathered weights); its backward's
recompute waits for its cotangent (``after_cotangent``: else XLA runs it early, beside the next
block's backward, and holds both blocks' activations); its gradient handed on whole and
reduce-scattered one block behind (``shards.reduce_tree``). The three cases differ in how one
block's values reach the next, by the shape the blocks take:

- **a loop** (``run_stack``): a scanned stack's layers meet only in the scan's carry, which is
  the model's, so zero_jax runs the loop itself, a ``custom_vjp`` over the whole stack whose
  forward loop carries the next layer's weights and whose backward loop carries the previous
  layer's weights and the next layer's gradient;
- **handoffs** (``handoff``): blocks called one after another (unrolled linen blocks, NNX blocks
  in a list) meet only in the trace, so each call is a ``custom_vjp`` that returns the next
  block's weights beside its outputs, and whose backward returns, as their cotangents, the next
  block's whole gradient and the block before's weights gathered again;
- **the module before** (``Previous``): gathering by module, a module's gather waits for the
  inputs of the module that ran before it in the block rather than its own; its backward is
  the gather's own (``shards``), within the block's remat.

Where the next block's gather waits differs between a loop and handoffs, for measured reasons
(docs/design.md, "Prefetch"): in a loop's carry a layer's gathered weights are cut out of their
bucket only once the layer before is done with its own, so that XLA writes them in place rather
than copying the carry in and out of the body; between calls the next block's gather waits for
this block's inputs, and the next block starts once it is done, so that XLA cannot merge it
with the next one's. The two are not one driver: a stack run as handoffs inside ``lax.scan``
keeps each layer's residuals (its shards) stacked per layer and sums a stack-sized cotangent per
layer; blocks that differ cannot share a loop's body.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zero_jax import internals
from zero_jax.blocks.remat import Saved
from zero_jax.shards import after_inputs, materialize_tree, reduce_tree

PyTree = Any


def gather_after(shards: PyTree, *waits: Any) -> PyTree:
    """A block's weights made whole once the arrays in ``waits`` exist, and not before (else
    the scheduler may hoist every block's gather to the step's start): waiting for the block
    before's inputs, the gather runs beside that block."""
    return materialize_tree(after_inputs(shards, waits, {}))


def after_cotangent(primals: PyTree, cotangent: PyTree) -> PyTree:
    """``primals`` once ``cotangent`` is computed: a block's recompute waits for its
    cotangent, as remat's barrier makes it wait."""
    ready = [x for x in jax.tree.leaves(cotangent) if isinstance(x, jax.Array)]
    return jax.lax.optimization_barrier((primals, ready))[0]


# The loop. Each iteration's collectives need nothing it computes, so XLA's scheduler can run them
# under its matmuls (on GPU; read from the compiled program in bench/gpu.py). With tensor
# parallelism each rank does this with its slice of the layer over ``data``, as
# ``shards.per_model_rank`` runs every ZeRO collective. What the loops carry is replaced in
# place: each layer is cut out of its bucket once the layer before is done with its weights, and
# each backward iteration starts once the gradient it carried in is packed for its reduction, so
# XLA writes the new value over the old rather than copying both in and out of the carry. The
# first gather of each loop runs before it, the last layer after it, the last layer of the
# backward also before it: nothing is gathered or reduced twice, the bytes are those of the
# plain step.


def _slice(tree: PyTree, i) -> PyTree:
    """Layer ``i`` of a stack (``Shard``s stay ``Shard``s)."""
    return jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, i, keepdims=False), tree)


def _stacked(first: PyTree, rest: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)


def _appended(rest: PyTree, last: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), rest, last)


def _sum(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(jnp.add, a, b)


def _differentiable(cts: PyTree) -> PyTree:
    """Cotangents with those of integer inputs (``float0``: masks, positions) as ``None``, which
    a ``custom_vjp`` backward may return for them, and which loops can carry and stack."""
    return jax.tree.map(lambda g: None if g.dtype == jax.dtypes.float0 else g, cts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def run_stack(layer: Callable, saved: Saved, unroll: int | bool, params_L: PyTree,
              carry: PyTree, xs_L: PyTree, consts: PyTree, keys_L: PyTree
              ) -> tuple[PyTree, PyTree]:
    """``layer(params, carry, x, consts, keys) -> (carry, y)`` over the ``L`` layers of
    ``params_L`` (whose cut leaves are ``Shard``s), ``xs_L`` and ``keys_L`` (random keys by
    stream, one per layer), every layer seeing all of ``consts`` (a scan's broadcast arguments),
    as ``jax.lax.scan`` with ``unroll`` (the stack's own); each layer's weights gathered one
    layer ahead, its gradient reduced one layer behind; what each layer keeps for its backward
    kept as ``saved`` says (its keys too: the backward draws what the forward drew)."""
    return _forward(layer, saved, unroll, params_L, carry, xs_L, consts, keys_L)[0]


def _forward(layer, saved, unroll, params_L, carry, xs_L, consts, keys_L):
    n = jax.tree.leaves(params_L)[0].shape[0]
    # The first gather of each loop waits for the loop's inputs, like every block's gather: else
    # the scheduler may start it anywhere, and XLA may merge the backward's with the forward's.
    whole = gather_after(_slice(params_L, 0), carry, xs_L)

    def one(w, c, i):  # with Pa, c waits cut between layers, as the partitioner keeps it
        (c, y), kept, _ = saved.linearize(layer, w, saved.whole(c), _slice(xs_L, i),
                                          consts, _slice(keys_L, i), in_loop=True)
        return saved.cut(c), y, kept

    def body(state, i):
        c, w = state
        c, y, kept = one(w, c, i)
        # Layer i+1 gathered while layer i computes, cut out of its bucket once layer i is
        # done with its weights: in place of them.
        ahead = materialize_tree(_slice(params_L, i + 1), after=(c, y))
        return (c, ahead), (saved.save(c), kept, y)  # saved: layer i+1's input

    (c, whole), (inputs, kept, ys) = jax.lax.scan(body, (carry, whole), jnp.arange(n - 1),
                                                  unroll=unroll)
    c, y, last = one(whole, c, n - 1)
    return (c, _appended(ys, y)), (params_L, saved.save(carry), inputs, kept, last, xs_L,
                                   consts, keys_L)


def _backward(layer, saved, unroll, residuals, cts):
    params_L, first, inputs, kept_L, last, xs_L, consts, keys_L = residuals
    dc, dys = cts
    n = jax.tree.leaves(params_L)[0].shape[0]

    def one(w, i, c, kept, dc):  # layer i's backward from its input and what it kept
        c, x, keys = saved.load(c), _slice(xs_L, i), _slice(keys_L, i)
        # Remat's own barrier the loop's layers go without (``Saved.linearize``).
        w, c = after_cotangent((w, c), dc)
        dw, dc, dx, dk = saved.backward(layer, kept, w, c, x, consts, keys, in_loop=True)(
            (dc, _slice(dys, i)))[:4]
        return dw, dc, _differentiable(dx), _differentiable(dk)

    reduce = lambda i, dw, hold=(): reduce_tree(_slice(params_L, i), dw, hold)
    whole = gather_after(_slice(params_L, n - 1), *cts)
    if n == 1:
        dw, dc, dx, dk = one(whole, 0, first, last, dc)
        one_layer = lambda tree: jax.tree.map(lambda x: x[None], tree)
        return one_layer(reduce(0, dw)[0]), dc, one_layer(dx), dk, None
    # Layer n-1 before the loop, layer n-2's gather beside it; then iteration i gathers layer
    # i-1 and reduce-scatters layer i+1's gradient while layer i computes.
    behind = gather_after(_slice(params_L, n - 2), *cts)
    dw, dc, dx_last, dk = one(whole, n - 1, _slice(inputs, n - 2), last, dc)

    def body(state, i):
        dc, w, pending, dk = state  # pending: layer i+1's gradient, whole; dk: consts' so far
        c = _slice(inputs, i - 1)  # layer i's input, read in place: scanning a cut copies it
        # Layer i's backward starts (from dc) once layer i+1's gradient is packed into its
        # buckets, and layer i-1's weights are cut out of theirs once it is done: each new
        # value then takes the place of the old one in the loop's carry.
        reduced, dc = reduce(i + 1, pending, dc)
        dw, dc, dx, dk_i = one(w, i, c, _slice(kept_L, i), dc)
        behind = materialize_tree(_slice(params_L, i - 1), after=(dw, dc, dx))
        return (dc, behind, dw, _sum(dk, dk_i)), (reduced, dx)

    (dc, whole, pending, dk), (dps, dxs) = jax.lax.scan(body, (dc, behind, dw, dk),
                                                        jnp.arange(1, n - 1), reverse=True,
                                                        unroll=unroll)
    dw, dc, dx, dk_0 = one(whole, 0, first, _slice(kept_L, 0), dc)
    dps = _stacked(reduce(0, dw)[0], _stacked(reduce(1, pending)[0], dps))
    # No gradient for the keys.
    return dps, dc, _stacked(dx, _appended(dxs, dx_last)), _sum(dk, dk_0), None


run_stack.defvjp(_forward, _backward)


# The handoffs. Block i's call gathers block i+1's weights as it starts (waiting for block i's
# inputs only) and returns them beside its outputs; block i+1 computes with them. The residuals
# are shards and the block's inputs; the backward mirrors the forward through the cotangents:
# block i+1's backward returns, as the cotangent of the weights it was handed, their whole
# gradient, which block i's backward reduce-scatters beside its own compute (one block behind,
# FSDP2's order), and as the cotangent of a second slot handed with them, block i's weights,
# gathered again as block i+1's backward starts. The first block gathers its own weights, the
# last reduces nothing ahead, and in the backward the last gathers its own again and the first
# reduces its own gradient.


def _inexact(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _barrier(tree: PyTree) -> PyTree:
    """``optimization_barrier``, each output typed as its input: the barrier types every output
    as varying over the axes any input varies over, while an all-reduced gradient (a whole
    parameter's, DDP's bucket) is the same on every device and must stay typed so."""
    out = jax.lax.optimization_barrier(tree)
    same = lambda a, b: jax.typeof(a).manual_axis_type == jax.typeof(b).manual_axis_type
    return jax.tree.map(lambda a, b: b if same(a, b) else a, tree, out)


def _again(block: Callable, arrays: list, diff: list[int]) -> Callable:
    """``block(w, arrays)`` as a function of the weights and the inexact ``arrays`` (at
    ``diff``): what is differentiated."""
    def again(w, xs):
        full = list(arrays)
        for i, x in zip(diff, xs, strict=True):
            full[i] = x
        return block(w, full)
    return again


def handoff(block: Callable, names: tuple, saved: Saved, fixed: int) -> Callable:
    """One block's call: ``(behind, shards, ahead, hand, arrays) -> (out, hand)``, ``behind``
    and ``ahead`` the shards of the blocks before and after it, ``hand`` what the block before
    handed over (``(weights, slot)``; None for the first block, which gathers its own).
    ``names``: the three blocks' (None where there is none). The last ``fixed`` arrays are
    state, not differentiated (an NNX block's statistics)."""
    first, last = names[0] is None, names[2] is None
    names = tuple(n or "" for n in names)
    differentiated = lambda arrays: [i for i, x in enumerate(arrays[:len(arrays) - fixed])
                                     if _inexact(x)]

    def fwd(behind, shards, ahead, hand, arrays):
        # Each collective under the name of the block it serves: read back from the program.
        with jax.named_scope(names[1]):
            whole = gather_after(shards, arrays) if first else hand[0]
        with jax.named_scope(names[2]):
            nxt = None if last else gather_after(ahead, arrays)
        with jax.named_scope(names[1]):
            diff = differentiated(arrays)
            out, kept, _ = saved.linearize(_again(block, arrays, diff), whole,
                                           [arrays[i] for i in diff])
            # The next block starts once this gather is done: XLA cannot combine the two.
            out, nxt = jax.lax.optimization_barrier((out, nxt))
        # The slot is never read: its cotangent brings this block's weights back, re-gathered.
        return (out, None if last else (nxt, whole)), (behind, shards, ahead, saved.save(arrays),
                                                        kept)

    def bwd(residuals, cts):
        behind, shards, ahead, arrays, kept = residuals
        dout, dhand = cts
        with jax.named_scope(names[1]):
            whole = gather_after(shards, dout) if last else dhand[1]
        with jax.named_scope(names[0]):
            prev = None if first else gather_after(behind, dout, dhand)
        with jax.named_scope(names[2]):
            # The next block's gradient, reduced one block behind, beside this one's backward.
            d_ahead = None if last else reduce_tree(ahead, dhand[0])[0]
        with jax.named_scope(names[1]):
            arrays = saved.load(arrays)
            diff = differentiated(arrays)
            primals = after_cotangent((whole, [arrays[i] for i in diff]), dout)
            dw, dxs = saved.backward(_again(block, arrays, diff), kept, *primals)(dout)
        # The block before runs once these collectives are done, so XLA cannot combine its own
        # with them (on GPUs it merged every block's reduce-scatter into one, at the end).
        dxs, d_ahead, prev = _barrier((dxs, d_ahead, prev))
        d_arrays: list = [None] * len(arrays)
        for i, dx in zip(diff, dxs, strict=True):
            d_arrays[i] = dx
        d_shards = reduce_tree(shards, dw)[0] if first else None
        return None, d_shards, d_ahead, None if first else (dw, prev), d_arrays

    step = jax.custom_vjp(lambda *a: fwd(*a)[0])
    step.defvjp(fwd, bwd)
    return step


class Previous:
    """Gathering by module with prefetch: the inputs of the module that ran last in the block
    being traced. The next module's gather waits for them rather than for its own inputs, so
    it can run while that module computes: one module ahead, as DeepSpeed ZeRO-3 prefetches
    the next module's parameters. Only within one trace (an inner transform's tracers stay in
    it); a block starts afresh (its first module waits for the block's inputs)."""

    def __init__(self, ahead: bool):
        self.ahead, self.inputs, self.trace = ahead, None, None

    def ran(self, args: tuple, kwargs: dict) -> None:
        self.inputs, self.trace = (args, kwargs), internals.trace_state()

    def after(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """What a module called with ``args``, ``kwargs`` gathers after; it is then the last."""
        same = self.inputs is not None and self.trace == internals.trace_state()
        before = self.inputs if self.ahead and same else (args, kwargs)
        self.ran(args, kwargs)
        return before
