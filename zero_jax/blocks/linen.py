"""Linen blocks, with no change to the model: one method interceptor makes each named
block's ``Shard``s whole as it runs (an unrolled ``h_0``, or inside ``nn.scan`` the scanned
module, one layer's slice at a time), under the remat that decides what its backward recomputes
and gathers again; gathering by module, each module inside a block its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn

from zero_jax.blocks import modules, tiling
from zero_jax.shards import after_inputs, has_shards, is_gathered, materialize_tree, whole_tile


def interceptor(trace: Any) -> Callable:
    """The ``nn.intercept_methods`` interceptor of one trace (``runtime.Trace``).

    A named block runs under a lifted ``map_variables`` that materializes its parameters. When
    that gathers (stage 3), the block is also rematerialized, so the backward gathers again
    instead of keeping whole weights as residuals; on the CPU backend this needs XLA to keep
    remat's optimization barriers (``zero_jax.mesh.keep_remat_barriers``, at import). At stages
    0-2 a block reads the whole copy its ``Shard``s carry (rematerialized too with
    ``remat_all``). With prefetch's chain, a gathering block hands the next one its weights
    (``zero_jax.blocks.prefetch.handoff``); gathering by module, each module with parameters of
    its own makes them whole as it runs (``_gathered_here``)."""
    rt = trace.runtime
    names, seen = frozenset(rt.names), trace.seen

    def intercept(next_fun, args, kwargs, context):
        module, method = context.module, context.method_name
        tiled = tiling.use(module, method, args, kwargs, whole_tile, materialize_tree)
        if tiled is not tiling.UNTILED:
            return tiled
        path = "/".join(module.path) if module.scope is not None else None
        if path in trace.inside or (path not in names
                                    and not (rt.by_module and _has_own(module, context))):
            return next_fun(*args, **kwargs)  # inside: the block's own call, in its remat
        if path not in names:  # gathering by module: a module inside a block
            return _gathered_here(trace, module, method, args, kwargs)
        params = module.variables.get("params", {})
        seen[path] = seen.get(path, False) or is_gathered(params)
        if not seen[path]:  # stages 0-2: reads its whole copy (a replica: all-reduced after)
            if rt.remat_all:
                return _rematerialized(trace, module, method, args, kwargs, materialize_tree)
            return _read_whole(next_fun, module, method, args, kwargs)
        if not has_shards(params):
            return next_fun(*args, **kwargs)  # made whole already (prefetch's loop)
        gather = (lambda v: modules.own_whole(
            v, lambda s: modules.module_whole(s, args, kwargs, True))) if rt.by_module \
            else (lambda params: materialize_tree(after_inputs(params, args, kwargs)))
        plain = lambda: _rematerialized(trace, module, method, args, kwargs, gather)
        if trace.chain is not None:
            return trace.chain.call(path, trace.chain.linen(module, method), args, kwargs, plain)
        return plain()

    return intercept


def _rematerialized(trace: Any, module: nn.Module, method: str, args: tuple, kwargs: dict,
                    whole: Callable) -> Any:
    """A block under its remat (``Saved.linen``), its path ``inside`` meanwhile so that the
    interceptor lets the transform's own call of the block through; a layer of an ``nn.scan``
    stack (``looped``) without remat's barrier."""
    path = "/".join(module.path)
    trace.inside.add(path)
    try:
        return trace.runtime.saved.linen(module, method, args, kwargs, whole,
                                         trace.previous.ran, in_loop=path in trace.looped)
    finally:
        trace.inside.discard(path)


def _read_whole(next_fun: Any, module: nn.Module, method: str, args: tuple,
                kwargs: dict) -> Any:
    """A block at stages 0-2: its ``Shard``s read as the whole copies they carry."""
    if not has_shards(module.variables.get("params", {})):
        return next_fun(*args, **kwargs)  # nothing cut, or already made whole
    run = lambda mdl: getattr(mdl, method)(*args, **kwargs)
    return nn.map_variables(run, "params", trans_in_fn=materialize_tree)(module)


def _has_own(module: nn.Module, context: Any) -> bool:
    """Whether a linen module's call makes parameters of its own whole (``_gathered_here``)."""
    return context.method_name != "setup" and module.scope is not None and \
        bool(modules.own(module.variables.get("params", {})))


def _gathered_here(trace: Any, module: nn.Module, method: str, args: tuple,
                   kwargs: dict) -> Any:
    """``modules.module_call`` for a linen module: its path is ``inside`` while its remat
    runs, so that the interceptor lets the remat's own call of it through."""
    path = "/".join(module.path)

    def remat(run, **options):
        def call(mdl):
            trace.inside.add(path)
            try:
                return nn.remat(run, **options)(mdl)
            finally:
                trace.inside.discard(path)
        return call
    runs = lambda whole, a, k: nn.map_variables(
        lambda mdl: getattr(mdl, method)(*a, **k), "params",
        trans_in_fn=lambda v: modules.own_whole(v, whole))
    own = modules.own(module.variables.get("params", {}))
    return modules.module_call(module, list(own.values()), args, kwargs, trace.previous, runs,
                               remat)
