"""Blocks called one after another: unrolled linen blocks and NNX blocks in a list. They meet only
in the trace, one call after the other, so prefetch runs each call as a handoff
(``zero_jax.blocks.prefetch.handoff``) between the blocks before and after it.

The order the blocks run in is read from the program: the loss is traced once to record it,
then again with the handoffs (``Chain``). A block that runs twice (weights shared across
layers) is in it twice: each call is handed its weights, and the calls' gradients add up. A
block runs as a pure function of its weights: a bound linen block with keys drawn from its
random streams (``_linen``), an NNX block merged anew in each trace (``_nnx``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from zero_jax import internals
from zero_jax.blocks.prefetch import handoff
from zero_jax.blocks.remat import Saved
from zero_jax.shards import is_shard

PyTree = Any
_OFF = "turn prefetch off (Layers(prefetch=False))"


class Chain:
    """The handoffs between the named blocks of one trace of the loss. Without ``order`` it
    records the order they run in (and runs them plainly); with it, runs each as a handoff."""

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
        step = handoff(run, (named(i - 1), name, named(i + 1)), self.saved, len(state))
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
