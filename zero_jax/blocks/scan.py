"""Scanned stacks: the named ``nn.scan`` and ``nnx.scan`` stacks, found while the loss is traced.
With prefetch each runs as prefetch's loop (``zero_jax.blocks.prefetch.run_stack``), its
arguments split into the scanned and the broadcast ones; without, its name is marked while its
loop body is traced (``looping``), so that its layers' remat leaves out the barrier the loop
makes needless.

A stack whose blocks draw random numbers (dropout) gets one key per layer and stream, drawn from
the stack's scope (``_layer_keys``); each layer's backward recomputes with the key its forward
drew.

Linen gives no hook at a scan's boundary (``intercept_methods`` sees only the per-layer calls),
so ``stacks`` wraps ``flax.core.lift.scan`` while the loss is traced: the scans of the named
blocks that it can run run as the loop; for every other scan it changes nothing. NNX's
``nnx.scan`` is wrapped likewise (``nnx_stacks``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import flax.core
import jax
import jax.numpy as jnp

from zero_jax import internals
from zero_jax.blocks.prefetch import run_stack
from zero_jax.blocks.remat import Saved
from zero_jax.shards import is_shard

PyTree = Any


def _layer_keys(scope, split_rngs: dict, n: int) -> dict:
    """A key per layer for each random stream the stack's blocks draw from (dropout): drawn
    from the stack's scope once, then split ``n`` ways where ``nn.scan`` splits the stream, the
    same key for every layer where it does not. Not the keys ``nn.scan`` itself would give each
    layer: the same distribution, other draws."""
    keys = {}
    for stream in scope.rngs:
        key = scope.make_rng(stream)
        split = split_rngs.get(stream, split_rngs.get(True, False))
        keys[stream] = jax.random.split(key, n) if split else jnp.stack([key] * n)
    return keys


def _stacked_args(in_axes: Any, n: int) -> tuple[bool, ...] | None:
    """Which of a linen scan's ``n`` arguments are scanned over (axis 0) and which broadcast
    (``nn.broadcast``, for one or for all); ``None``: another ``in_axes``."""
    axes = (in_axes,) * n if in_axes is flax.core.broadcast or in_axes == 0 else in_axes
    if not isinstance(axes, (tuple, list)) or len(axes) != n:
        return None
    if not all(a is flax.core.broadcast or (isinstance(a, int) and a == 0) for a in axes):
        return None
    return tuple(a is not flax.core.broadcast for a in axes)


# The scan arguments ``_refusal`` reads from flax's own call (tests/test_internals.py checks
# flax.core.lift.scan still takes them).
_SCAN_ARGS = ("variable_axes", "variable_broadcast", "variable_carry", "in_axes", "out_axes",
              "reverse", "unroll")


def _refusal(scopes, carry, xs, how: dict) -> str | None:
    """Why this ``nn.scan`` cannot run as a prefetching loop (``None``: it can); ``how``: the
    scan's own arguments, by name."""
    scope = scopes[0] if isinstance(scopes, (list, tuple)) and len(scopes) == 1 else None
    if scope is None:
        return "it takes modules as arguments"
    if set(scope.variables()) != {"params"}:
        return "it uses collections besides params"
    if (dict(how["variable_axes"]) not in ({"params": 0}, {True: 0})
            or how["variable_broadcast"] or how["variable_carry"]
            or _stacked_args(how["in_axes"], len(xs)) is None or how["out_axes"] != 0
            or how["reverse"]):
        return ("prefetch runs scans with variable_axes={'params': 0}, in axes 0 or "
                "nn.broadcast, out axes 0, forward")
    if not all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(carry)):
        return "its carry holds integers"
    return None


def _split_args(stacked: tuple[bool, ...], args: tuple) -> tuple[tuple, tuple]:
    """A scan's arguments as (scanned over, broadcast)."""
    return (tuple(a for a, s in zip(args, stacked, strict=True) if s),
            tuple(a for a, s in zip(args, stacked, strict=True) if not s))


def _merge_args(stacked: tuple[bool, ...], xs: tuple, consts: tuple) -> list:
    """``_split_args`` undone: one layer's arguments in the scan's order."""
    xs, consts = iter(xs), iter(consts)
    return [next(xs) if s else next(consts) for s in stacked]


@contextlib.contextmanager
def _linen_scans(names: frozenset[str], named: Callable) -> Iterator[None]:
    """While tracing: an ``nn.scan`` over a stack named in ``names`` (applied, not initialized)
    runs as ``named(name, plain, fn, how, scopes, carry, xs)``, ``plain`` the scan as Flax runs
    it and ``how`` its arguments by name; every other scan as Flax runs it. (It swaps a module
    attribute of Flax's: trace one such loss at a time.)"""
    def wrap(original):
        def scan(fn, *args, **kwargs):
            plain = original(fn, *args, **kwargs)
            how = inspect.signature(original).bind(fn, *args, **kwargs)
            how.apply_defaults()

            def run(scopes, carry, *xs):
                scope = scopes[0] if isinstance(scopes, (list, tuple)) else scopes
                name = "/".join(scope.path)
                if name not in names or scope.is_mutable_collection("params"):  # or initializing
                    return plain(scopes, carry, *xs)
                return named(name, plain, fn, how.arguments, scopes, carry, xs)
            return run
        return scan

    with internals.flax_lift("scan", wrap):
        yield


def stacks(names: frozenset[str], seen: set[str], saved: Saved):
    """While tracing: the ``nn.scan`` stacks named in ``names`` run as ``run_stack`` (their
    layer inputs kept as ``saved`` says); each one that does is added to ``seen``. A named
    stack that cannot raises ``ValueError``."""
    def named(name, plain, fn, how, scopes, carry, xs):
        why = _refusal(scopes, carry, xs, how)
        if why:
            raise ValueError(f"prefetch cannot run the layer stack {name!r}: {why}; turn "
                             f"prefetch off (Layers(prefetch=False))")
        seen.add(name)
        scope = scopes[0]
        n = jax.tree.leaves(scope.variables()["params"])[0].shape[0]
        stacked = _stacked_args(how["in_axes"], len(xs))

        def layer(params, c, x, consts, keys):
            per_layer = lambda s, c, *args: fn([s], c, *args)
            return flax.core.apply(per_layer)(
                {"params": params}, c, *_merge_args(stacked, x, consts), rngs=keys or None)
        return run_stack(layer, saved, how["unroll"], scope.variables()["params"], carry,
                         *_split_args(stacked, xs), _layer_keys(scope, how["split_rngs"], n))
    return _linen_scans(names, named)


def looping(names: frozenset[str], looped: set[str]):
    """While tracing without prefetch: the path of a named ``nn.scan`` stack is in ``looped``
    while its loop body is traced, so that its layers' remat can leave out the barrier the
    loop makes needless (``Saved.barrier``): a block's call alone does not say it runs in a
    loop."""
    def named(name, plain, fn, how, scopes, carry, xs):
        return _marked(looped, name, plain, scopes, carry, *xs)
    return _linen_scans(names, named)


def _marked(looped: set[str], name: str, plain: Callable, *args: Any) -> Any:
    """``plain(*args)`` with ``name`` in ``looped`` meanwhile."""
    looped.add(name)
    try:
        return plain(*args)
    finally:
        looped.discard(name)


def _nnx_refusal(args: tuple, kwargs: dict, at: int, n: int, rest: list) -> str | None:
    """Why this ``nnx.scan`` over a named stack (``args[at]``) cannot run as a prefetching
    loop."""
    from flax import nnx

    axes = kwargs.get("in_axes")
    if (not isinstance(axes, tuple) or len(axes) != len(args) or axes[at] != 0
            or sum(a is nnx.Carry for a in axes) != 1
            or not all(a is nnx.Carry or a in (0, None) for a in axes)):
        return ("prefetch runs nnx.scan with the stack at in axis 0, one nnx.Carry, and the "
                "other arguments at 0 or None (broadcast)")
    if kwargs.get("out_axes") not in (nnx.Carry, (nnx.Carry, 0)) or kwargs.get("reverse"):
        return "prefetch runs scans with out_axes nnx.Carry or (nnx.Carry, 0), forward"
    if kwargs.get("length") not in (None, n) or any(x.shape[:1] != (n,) for x in rest):
        return "its state is not stacked along the layers"
    if not all(jnp.issubdtype(x.dtype, jnp.inexact)
               for x in jax.tree.leaves(args[axes.index(nnx.Carry)])):
        return "its carry holds integers"
    graph = lambda x: isinstance(x, (nnx.Module, nnx.Variable))
    others = [a for j, a in enumerate(args) if axes[j] is not nnx.Carry and j != at]
    if any(map(graph, jax.tree.leaves(others, is_leaf=graph))):
        return "an argument besides the stack holds NNX modules or variables"
    return None


def _run_nnx_stack(name: str, f: Callable, kwargs: dict, saved: Saved, args: tuple, at: int):
    """``nnx.scan(f, **kwargs)(*args)``, the stack ``args[at]``, as ``run_stack``: each layer a
    copy of the stack's module merged from its slice of the parameters and of the rest of its
    state (random streams, stacked as ``nnx.scan`` slices them), which comes back stacked, as
    the call left it, and is set back into the stack."""
    from flax import nnx

    graphdef, params, rest = nnx.split(args[at], nnx.Param, ...)
    values, tree = jax.tree.flatten(params, is_leaf=is_shard)
    state, state_tree = jax.tree.flatten(rest)
    why = _nnx_refusal(args, kwargs, at, jax.tree.leaves(values)[0].shape[0], state)
    if why:
        raise ValueError(f"prefetch cannot run the NNX stack {name!r}: {why}; turn prefetch "
                         f"off (Layers(prefetch=False))")
    ys_too = kwargs["out_axes"] != nnx.Carry
    axes = kwargs["in_axes"]
    carry_at = axes.index(nnx.Carry)
    others = [j for j in range(len(args)) if j not in (at, carry_at)]
    stacked = tuple(axes[j] == 0 for j in others)

    def layer(w, c, x, consts, st):
        call = list(args)
        call[at] = nnx.merge(graphdef, tree.unflatten(w), state_tree.unflatten(st))
        call[carry_at] = c
        for j, a in zip(others, _merge_args(stacked, x, consts), strict=True):
            call[j] = a
        out = f(*call)
        after = jax.tree.leaves(nnx.state(call[at], nnx.Not(nnx.Param)))
        return (out[0], (out[1], after)) if ys_too else (out, after)

    c, ys = run_stack(layer, saved, kwargs.get("unroll", 1), values, args[carry_at],
                      *_split_args(stacked, [args[j] for j in others]), state)
    ys, after = ys if ys_too else (None, ys)
    nnx.update(args[at], state_tree.unflatten(after))
    return (c, ys) if ys_too else c


@contextlib.contextmanager
def _nnx_scans(modules: dict[str, Any], named: Callable) -> Iterator[None]:
    """While tracing: ``nnx.scan`` over one of the named NNX stacks in ``modules`` (the model's
    own modules, by name, as ``zero_jax.nnx_merge`` recorded them) runs as ``named(name,
    plain, f, how, args, at)``, ``plain`` the scan as NNX runs it, ``how`` its arguments by
    name, the stack ``args[at]``; every other scan as NNX runs it. Without ``flax.nnx``
    imported no NNX model exists: nothing to swap, and a linen model's trace does not import it
    (0.16 s of a ``train.py`` start)."""
    if "flax.nnx" not in sys.modules:
        yield
        return
    from flax import nnx
    from flax.typing import Missing

    def wrap(original):
        def scan(f=Missing, **kwargs):
            if f is Missing:
                return lambda f: scan(f, **kwargs)
            plain = original(f, **kwargs)
            how = {"in_axes": (nnx.Carry, 0), "out_axes": (nnx.Carry, 0), **kwargs}

            def run(*args):
                name, at = next(((k, at) for at, a in enumerate(args)
                                 for k, m in modules.items() if m is a), (None, None))
                if name is None:
                    return plain(*args)
                return named(name, plain, f, how, args, at)
            return run
        return scan

    with internals.nnx_scan(wrap):
        yield


def nnx_stacks(modules: dict[str, Any], seen: set[str], saved: Saved):
    """While tracing: ``nnx.scan`` over one of the named NNX stacks in ``modules`` runs as
    ``run_stack``; each that does is added to ``seen``. One that cannot raises
    ``ValueError``."""
    def named(name, plain, f, how, args, at):
        seen.add(name)
        return _run_nnx_stack(name, f, how, saved, args, at)
    return _nnx_scans(modules, named)


def nnx_looping(modules: dict[str, Any], looped: set[str]):
    """``looping`` for NNX: a named stack's name is in ``looped`` while ``nnx.scan`` traces
    its loop body."""
    def named(name, plain, f, how, args, at):
        return _marked(looped, name, plain, *args)
    return _nnx_scans(modules, named)
