"""Prefetch for blocks that run one after another: unrolled linen blocks and NNX blocks.

A scanned stack's layers meet in a loop zero_jax runs (``zero_jax.blocks.scan``); blocks built in a
Python loop meet only in the trace, one call after the other. So each block call becomes a
``custom_vjp`` that hands the next call its weights: block i's call gathers block i+1's weights
as it starts (waiting for block i's inputs only, so the gather runs beside block i's compute)
and returns them beside its outputs; block i+1 computes with them. Nothing whole is saved for
the backward (the residuals are shards and the block's inputs); the backward mirrors the
forward through the cotangents: block i+1's backward returns, as the cotangent of the weights
it was handed, their whole gradient, which block i's backward reduce-scatters beside its own
compute (one block behind, FSDP2's order), and as the cotangent of a second slot handed with
them, block i's weights, gathered again as block i+1's backward starts. A forward then holds
two gathered blocks, a backward two and one whole gradient held for its reduction: a scanned
stack's cost. The first block gathers its own weights, the last reduces nothing ahead, and
in the backward the last gathers its own again and the first reduces its own gradient.

The order the blocks run in is read from the program: the loss is traced once to record it,
then again with the handoffs (``Chain``). A block that runs twice (weights shared across
layers) is in it twice: each call is handed its weights, and the calls' gradients add up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax import internals
from zero_jax.blocks.remat import Saved
from zero_jax.shards import after_inputs, is_shard, materialize_tree, reduce_tree

PyTree = Any
_OFF = "turn prefetch off (Layers(prefetch=False))"


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


def _step(block: Callable, names: tuple, saved: Saved, fixed: int) -> Callable:
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
            whole = materialize_tree(after_inputs(shards, (arrays,), {})) if first else hand[0]
        with jax.named_scope(names[2]):
            nxt = None if last else materialize_tree(after_inputs(ahead, (arrays,), {}))
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
            whole = materialize_tree(after_inputs(shards, (dout,), {})) if last else dhand[1]
        with jax.named_scope(names[0]):
            prev = None if first else materialize_tree(after_inputs(behind, (dout, dhand), {}))
        with jax.named_scope(names[2]):
            # The next block's gradient, reduced one block behind, beside this one's backward.
            d_ahead = None if last else reduce_tree(ahead, dhand[0])[0]
        with jax.named_scope(names[1]):
            arrays = saved.load(arrays)
            diff = differentiated(arrays)
            # The recompute waits for the cotangents, as remat's does: else XLA may run it
            # ahead, beside the next block's backward, and hold both blocks' activations.
            ready = [x for x in jax.tree.leaves(dout) if isinstance(x, jax.Array)]
            primals = jax.lax.optimization_barrier(((whole, [arrays[i] for i in diff]),
                                                    ready))[0]
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


class Chain:
    """The handoffs between the named blocks of one trace of the loss. Without ``order`` it
    records the order they run in (and runs them plainly); with it, runs each as ``_step``."""

    def __init__(self, order: list[str] | None, saved: Saved):
        self.order, self.saved = order, saved
        self.recorded: list[str] = []
        self.modules: dict[str, Any] = {}  # NNX: the block modules of this trace, by name
        self.position = 0
        self.hand: PyTree = None

    def call(self, name: str, adapter: Callable[[], tuple], args: tuple,
             kwargs: dict, plain: Callable[[], Any]) -> Any:
        """Block ``name`` run on ``args`` and ``kwargs``; while recording, ``plain()``.
        ``adapter()``: ``(block, weights_of, state, advance)``: ``block(weights, state, *args,
        **kwargs)``, the block as a pure function, gives ``(out, state)``, ``state`` the rest
        of its state (NNX: random streams, statistics; arrays) as the call left it, which
        ``advance`` sets back; ``weights_of(name)`` a block's shard tree."""
        if self.order is None:
            self.recorded.append(name)
            return plain()
        i, n = self.position, len(self.order)
        if i >= n or self.order[i] != name:
            raise ValueError(f"prefetch hands each block the next one's weights in the order "
                             f"they ran when traced ({self.order}); {name!r} ran out of that "
                             f"order; {_OFF}")
        self.position += 1
        block, weights_of, state, advance = adapter()
        near = lambda j: weights_of(self.order[j]) if 0 <= j < n else None
        leaves, tree = jax.tree.flatten((args, kwargs))
        at = [j for j, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]

        def run(weights, arrays):
            # The rest of the block's state rides with the inputs (the backward's recompute
            # closes over the forward's: the same keys) and comes back beside the outputs.
            arrays, now = arrays[:len(at)], arrays[len(at):]
            full = list(leaves)
            for j, x in zip(at, arrays, strict=True):
                full[j] = x
            a, k = tree.unflatten(full)
            return block(weights, now, *a, **k)

        named = lambda j: self.order[j] if 0 <= j < n else None
        step = _step(run, (named(i - 1), name, named(i + 1)), self.saved, len(state))
        (out, state), self.hand = step(near(i - 1), near(i), near(i + 1), self.hand,
                                       [leaves[j] for j in at] + state)
        advance(state)
        return out

    def check_done(self) -> None:
        """Every recorded block ran: else a handoff was left unread."""
        if self.order is not None and self.position != len(self.order):
            raise ValueError(f"prefetch hands each block the next one's weights in the order "
                             f"they ran when traced ({self.order}); only "
                             f"{self.order[:self.position]} ran; {_OFF}")


    def linen(self, module: Any, method: str) -> Callable[[], tuple]:
        """``call``'s adapter for a bound linen block (its random streams drawn as keys)."""
        return lambda: _linen(module, method)

    def nnx(self, module: Any, call: Callable) -> Callable[[], tuple]:
        """``call``'s adapter for an NNX block whose class's own ``__call__`` is ``call``."""
        return lambda: _nnx(self.modules, module, call)


def _linen(module: Any, method: str) -> tuple[Callable, Callable, list, Callable]:
    """A bound linen block's ``method`` as a pure function of its parameters (with keys drawn
    from its random streams); ``weights_of`` reads a block's off the model's root scope."""
    if set(module.variables) != {"params"}:
        raise ValueError(f"prefetch runs block {'/'.join(module.path)!r} as a pure function "
                         f"of its parameters; it uses other collections; {_OFF}")
    rngs = {k: module.make_rng(k) for k in module.scope.rngs if k != "params"}
    unbound = module.clone(parent=None)
    root = module.scope.root.variables()["params"]

    def block(params, state, *args, **kwargs):
        return unbound.apply({"params": params}, *args, method=method, rngs=rngs,
                             **kwargs), state

    def weights_of(path: str):
        tree = root
        for part in path.split("/"):
            tree = tree.get(part) if hasattr(tree, "get") else None
        if tree is None:  # the root of a transform's scope (the model's own nn.vmap, ...)
            raise ValueError(f"prefetch hands block {path!r} its weights from the block before; "
                             f"it runs inside a Flax transform of the model's own (nn.vmap, ...), "
                             f"which no value may leave; {_OFF}")
        return tree
    return block, weights_of, [], lambda _: None


def _values(module: Any) -> tuple[list, Any, Any]:
    """An NNX block's parameter values (``Shard``s as leaves), their tree, and its graph with
    the rest of its state (random streams, statistics)."""
    from flax import nnx

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    values, tree = jax.tree.flatten(params, is_leaf=is_shard)
    return values, tree, (graphdef, rest)


def _nnx(modules: dict, module: Any, call: Callable) -> tuple[Callable, Callable, list,
                                                                Callable]:
    """An NNX block as a pure function of its parameters' values and the rest of its state
    (random streams, statistics), merged anew in each trace (NNX refuses a variable set from
    another trace level); that state now, and what sets it back into ``module`` as the call
    left it (streams advanced, statistics updated)."""
    from flax import nnx

    _, tree, (graphdef, rest) = _values(module)
    state, state_tree = jax.tree.flatten(rest)

    def block(values, state, *args, **kwargs):
        copy = nnx.merge(graphdef, tree.unflatten(values), state_tree.unflatten(state))
        out = call(copy, *args, **kwargs)
        return out, jax.tree.leaves(nnx.state(copy, nnx.Not(nnx.Param)))

    advance = lambda new: nnx.update(module, state_tree.unflatten(new))
    return block, lambda name: _values(modules[name])[0], state, advance


@contextlib.contextmanager
def own_remat_lifted(names: frozenset[str]) -> Iterator[None]:
    """While tracing: a named linen block under the model's own ``nn.remat`` (the class made
    while the loss runs, as in ``setup`` or ``__call__``) runs without it, so that its weights
    can be handed on; prefetch recomputes it as the plan's remat policy says, once."""
    def wrap(original):
        def checkpoint(fn, *args, **kwargs):
            lifted = original(fn, *args, **kwargs)

            def run(scopes, *a, **k):
                scope = scopes[0] if isinstance(scopes, (list, tuple)) else scopes
                if "/".join(scope.path) in names and not scope.is_mutable_collection("params"):
                    return fn(scopes, *a, **k)
                return lifted(scopes, *a, **k)
            return run
        return checkpoint

    with internals.flax_lift("checkpoint", wrap):
        yield
