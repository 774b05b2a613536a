"""NNX blocks: ``nnx_merge`` gives the plan's blocks (and, gathering by module, the modules in
them) a class whose ``__call__`` makes their ``Shard``s whole as they run, on the loss's own
copy of the model. NNX has no method interceptor; the classes find the trace they run in
through ``internals.BLOCKS``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from zero_jax import internals
from zero_jax.blocks import modules
from zero_jax.shards import after_inputs, is_gathered, is_shard, materialize_tree


def nnx_merge(graphdef: Any, *states: Any) -> Any:
    """``nnx.merge`` for an NNX model in a ZeRO loss: the plan's blocks (``layers=``) become
    whole as they run, one at a time, whether they sit in a list or under ``nnx.scan``."""
    from flax import nnx

    model = nnx.merge(graphdef, *states, copy=True)  # variables of this trace, not the caller's
    trace = internals.BLOCKS.get()
    if trace is None:
        return model
    names = frozenset(trace.runtime.names)
    for path, node in nnx.iter_graph(model):
        name = "/".join(map(str, path))
        if trace.runtime.by_module and isinstance(node, nnx.Module) and name not in names and \
                any(name.startswith(b + "/") for b in names) and _own_vars(node):
            internals.set_class(node, _per_module_class(type(node)))
        if isinstance(node, nnx.Module) and name in names:
            internals.set_class(node, _per_block_class(type(node)))
            trace.seen[name] = trace.seen.get(name, False) or is_gathered(
                [v.get_raw_value() for _, v in nnx.iter_graph(node) if isinstance(v, nnx.Variable)])
            trace.modules[name] = node
    return model


def _shard_vars(module: Any) -> list:
    """An NNX module's variables that hold ``Shard``s, its children's included."""
    from flax import nnx

    return [v for _, v in nnx.iter_graph(module)
            if isinstance(v, nnx.Variable) and is_shard(v.get_raw_value())]


def _own_vars(module: Any) -> list:
    """An NNX module's own variables (not its children's) holding ``Shard``s to make whole."""
    from flax import nnx

    return [v for v in vars(module).values() if isinstance(v, nnx.Variable)
            and is_shard(v.get_raw_value()) and not v.get_raw_value().tile]


def _run_whole(call: Callable, module: Any, variables: list, args: tuple, kwargs: dict,
               whole: Callable) -> Any:
    """``call(module, ...)`` with ``variables`` (an NNX module's ``Shard``s) made whole by
    ``whole``, and set back to their shards after."""
    shards = [v.get_raw_value() for v in variables]
    for v, w in zip(variables, whole(shards), strict=True):
        v.set_raw_value(w)
    try:
        return call(module, *args, **kwargs)
    finally:
        for v, shard in zip(variables, shards, strict=True):
            v.set_raw_value(shard)


@functools.cache
def _per_module_class(cls: type) -> type:
    """``cls``, a module inside an NNX block gathered by module, whose ``__call__`` makes its
    own ``Shard``s whole as it runs (``modules.module_call``)."""
    from flax import nnx

    def __call__(self, *args, **kwargs):
        own, trace = _own_vars(self), internals.BLOCKS.get()
        if trace is None or not own:
            return cls.__call__(self, *args, **kwargs)
        runs = lambda whole, a, k: lambda m: _run_whole(cls.__call__, m, _own_vars(m), a, k,
                                                        whole)
        return modules.module_call(self, [v.get_raw_value() for v in own], args, kwargs,
                                   trace.previous, runs, nnx.remat)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


@functools.cache
def _per_block_class(cls: type) -> type:
    """``cls`` whose ``__call__`` makes its own ``Shard``s whole around the original one."""
    if getattr(cls, "_zero_jax_block", False):
        return cls

    def run(module, args, kwargs, whole):
        # By module: the block's own leaves; each child makes its own whole (_per_module_class).
        trace = internals.BLOCKS.get()
        trace.previous.ran(args, kwargs)
        variables = _own_vars(module) if trace.runtime.by_module else _shard_vars(module)
        return _run_whole(cls.__call__, module, variables, args, kwargs, whole)

    def __call__(self, *args, **kwargs):
        trace = internals.BLOCKS.get()
        shards = [v.get_raw_value() for v in _shard_vars(self)]
        if any(s.tile for s in shards):
            raise ValueError(f"Layers(tile_mb=...) tiles linen nn.Dense layers; the NNX block "
                             f"{cls.__name__} holds a leaf above the bound: turn tiling off")
        if trace is None or not (shards or trace.runtime.remat_all):
            return cls.__call__(self, *args, **kwargs)
        saved = trace.runtime.saved
        # Inside nnx.scan over a named stack (a layer's copy): in a loop (``Saved.barrier``).
        remat = lambda whole: saved.nnx(self, lambda m, a, k: run(m, a, k, whole), args, kwargs,
                                        in_loop=bool(trace.looped))
        if not is_gathered(shards):  # stages 0-2
            return remat(materialize_tree) if trace.runtime.remat_all else \
                run(self, args, kwargs, materialize_tree)
        plain = lambda: remat(lambda s: materialize_tree(after_inputs(s, args, kwargs)))
        chain = trace.chain
        # Not the model's own module (a copy made by nnx.scan): no neighbours to hand to.
        name = next((n for n, m in trace.modules.items() if m is self), None) if chain else None
        if name is None:
            return plain()
        return chain.call(name, chain.nnx(self, cls.__call__), args, kwargs, plain)

    return type(cls.__name__, (cls,), {"__call__": __call__, "_zero_jax_block": True,
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
