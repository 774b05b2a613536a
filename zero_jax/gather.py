"""Where in a model the shards become whole: block by block or module by module, under remat.

``per_block`` intercepts any Flax linen model (``nnx_merge`` an NNX one) at the blocks a plan
names, by module path, and makes each block's ``Shard``s whole as it runs
(``zero_jax.shards``), under the remat policy that decides what its backward recomputes and
gathers again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from zero_jax import internals, tiling
from zero_jax.mesh import MODEL
from zero_jax.shards import (
    GATHERED,
    Shard,
    after_inputs,
    has_shards,
    is_gathered,
    is_shard,
    materialize_tree,
    whole_tile,
)

PyTree = Any


# The name of a block's input (its per-layer checkpoint), for remat policies.
BLOCK_INPUT = "zero_jax_block_input"
REMAT = ("full", "dots", "none", "offload")
GATHER = ("block", "module")


@dataclasses.dataclass(frozen=True)
class Layers:
    """The model's blocks and what each keeps for its backward, declared together as FSDP2
    wraps each block once: ``pattern``, a regular expression over module paths (unrolled
    blocks "h_\\d+", or an ``nn.scan`` stack "blocks"); ``remat``, the policy of the blocks
    stage 3 rematerializes (``REMAT``, ``remat_policy``); ``partition``, their saved inputs cut
    over the ``model`` axis (ZeRO-R's partitioned activation checkpoints; needs tensor
    parallelism and stage 3); ``tile_mb``, a bound in MB above which a block's parameter is
    never gathered whole but one tile at a time by the layer that uses it (ZeRO-Infinity's
    memory-centric tiling, ``zero_jax.tiling``; stage 3); ``gather``, what stage 3 gathers
    together (``GATHER``): the whole ``block`` as it runs and again for its backward (FSDP2's
    unit), or each ``module`` in it with parameters of its own, as that module runs (DeepSpeed
    ZeRO-3's hooks, the partitioner's FSDP): at most one module's weights whole at a time,
    for up to a third more gathering (``_module_call``); ``prefetch`` (stage 3), the next
    block's weights gathered while this one computes (``zero_jax.prefetch``,
    ``zero_jax.handoff``; by module, the next module's: ``_Previous``), so that the gather
    hides behind compute, for one more block (or module) held whole."""

    pattern: str
    remat: str = "full"
    partition: bool = False
    tile_mb: float | None = None
    gather: str = "block"
    prefetch: bool = False

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Layers needs a regular expression over module paths (got "
                             f"{self.pattern!r})")
        if self.remat not in REMAT:
            raise ValueError(f"remat must be one of {', '.join(REMAT)} (got {self.remat!r})")
        if self.gather not in GATHER:
            raise ValueError(f"Layers: gather must be one of {', '.join(GATHER)} (got "
                             f"{self.gather!r})")
        if self.tile_mb is not None and (isinstance(self.tile_mb, bool) or not isinstance(
                self.tile_mb, int | float) or self.tile_mb <= 0):
            raise ValueError(f"Layers: tile_mb must be a positive number of MB, or None "
                             f"(got {self.tile_mb!r})")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"Layers: prefetch must be True or False (got {self.prefetch!r})")

    @property
    def tile_bytes(self) -> int:
        """The tile bound in bytes; 0: no tiling."""
        return 0 if self.tile_mb is None else int(self.tile_mb * 2**20)


def remat_policy(name: str, gathers: bool = False) -> Any:
    """The ``jax.checkpoint`` policy of a block for ``model.remat`` ``name``:

    - ``full``: save nothing but the block's input; recompute the rest in the backward;
    - ``dots``: also save every matmul's output;
    - ``none``: save everything, recompute nothing (``gathers``: except the gathered weights
      and their reshapes and casts, which stage 3 gathers again rather than keep whole through
      the step);
    - ``offload``: as ``full``, with the block's input (named ``BLOCK_INPUT``) saved in host
      memory: ZeRO-R's offloaded activation checkpoints.
    """
    cp = jax.checkpoint_policies
    if name not in REMAT:
        raise ValueError(f"remat policy must be one of {', '.join(REMAT)} (got {name!r})")
    return {"full": cp.nothing_saveable, "dots": cp.dots_saveable,
            "none": _all_but_gathered if gathers else cp.everything_saveable,
            "offload": cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=[BLOCK_INPUT],
                offload_src="device", offload_dst="pinned_host")}[name]


# Ops that only lay a value out again: recomputed from their input rather than saved, so that a
# gathered weight's reshapes and casts are not saved in its place.
_LAYOUT = frozenset({"reshape", "transpose", "convert_element_type", "broadcast_in_dim",
                     "squeeze", "expand_dims", "slice", "copy", "copy_p", "optimization_barrier"})


def _all_but_gathered(prim, *_, **params) -> bool:
    """Remat ``none`` at stage 3: save everything but the gathered weights (the output of
    zero_jax's gather, a ``custom_vjp`` that all-gathers, and of what only lays it out again),
    which the backward gathers again, as FSDP does."""
    if prim.name == "name":
        return params["name"] != GATHERED
    if prim.name == "custom_vjp_call":
        return not any(e.primitive.name == "all_gather" for e in params["call_jaxpr"].eqns)
    return prim.name not in _LAYOUT


def name_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's array inputs named ``BLOCK_INPUT``, for the ``offload`` policy."""
    name = lambda x: checkpoint_name(x, BLOCK_INPUT) if isinstance(x, jax.Array) else x
    return jax.tree.map(name, args), jax.tree.map(name, kwargs)


class _Active(NamedTuple):
    """``per_block``'s settings, for the NNX blocks that run under it."""

    names: frozenset[str]
    seen: dict[str, bool]
    policy: Any
    chain: Any
    partition: bool
    remat_all: bool
    by_module: bool
    previous: Any  # _Previous


def partitioned(x: Any, cut: bool) -> Any:
    """ZeRO-R's partitioned activation checkpoints (Pa): a block input (batch, sequence, ...)
    laid out cut over ``model`` along its sequence when ``cut``, whole again when not. Saved
    cut, it costs each tensor-parallel rank 1/T; the recompute gathers it."""
    if not isinstance(x, jax.Array) or x.ndim < 2:
        return x
    spec = P(None, MODEL) if cut else P()
    return jax.lax.with_sharding_constraint(x, spec)


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a block keeps for its backward in the loops prefetch runs itself (what remat does
    for a plain block): ``remat``, the policy (``REMAT``) of what it saves besides its input;
    its input ``offload``ed to host memory (remat ``offload``); ``partition``, cut over
    ``model`` (ZeRO-R's Pa)."""

    remat: str = "full"
    partition: bool = False

    @property
    def offload(self) -> bool:
        return self.remat == "offload"

    def _move(self, x: Any, space: Any) -> Any:
        inexact = isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)
        return jax.device_put(x, space) if self.offload and inexact else x

    def cut(self, tree: PyTree) -> PyTree:
        """Pa: laid out cut over ``model`` (as it waits between blocks, too)."""
        return jax.tree.map(lambda x: partitioned(x, True), tree) if self.partition else tree

    def whole(self, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: partitioned(x, False), tree) if self.partition else tree

    def save(self, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: self._move(x, jax.memory.Space.Host), self.cut(tree))

    def load(self, tree: PyTree) -> PyTree:
        return self.whole(jax.tree.map(lambda x: self._move(x, jax.memory.Space.Device), tree))

    def linearize(self, fn: Any, *args: PyTree) -> tuple[Any, list, Any]:
        """``fn(*args)`` run as the remat policy says: ``(out, kept, how)``, ``kept`` what the
        policy saves for the backward less ``args`` themselves (which the backward has again:
        the weights gathered again, the input as ``save``d), ``how`` (static) the backward's
        shape (``backward``). ``offload`` keeps what ``full`` does: the input, moved by
        ``save``."""
        policy = remat_policy("full" if self.offload else self.remat, gathers=True)
        out, pull = jax.vjp(jax.checkpoint(fn, policy=policy), *args)
        leaves, treedef = jax.tree.flatten(pull)
        # A residual that is an argument is that argument: the same tracer.
        known = {id(x): (a, j) for a, arg in enumerate(args)
                 for j, x in enumerate(jax.tree.leaves(arg))}
        where, kept = [], []
        for leaf in leaves:
            if id(leaf) not in known:
                known[id(leaf)] = (len(args), len(kept))
                kept.append(leaf)
            where.append(known[id(leaf)])
        return out, kept, (treedef, tuple(where))

    def backward(self, fn: Any, kept: list, *args: PyTree) -> Any:
        """``fn``'s backward at ``args`` from what ``linearize`` kept. Its shape comes from
        linearizing ``fn`` again here: work nothing reads, which XLA drops."""
        _, fresh, (treedef, where) = self.linearize(fn, *args)
        if len(fresh) != len(kept):
            raise AssertionError("a block linearized twice kept different values")
        known = [*(jax.tree.leaves(a) for a in args), kept]
        return treedef.unflatten([known[a][j] for a, j in where])


def _checkpointed_inputs(args: tuple, kwargs: dict, partition: bool):
    """A block's inputs as its checkpoint saves them (Pa: cut over ``model``), and a function,
    to call inside the checkpoint, that gives them back named (``name_inputs``) and whole."""
    saved = jax.tree.map(lambda x: partitioned(x, True), (args, kwargs)) if partition \
        else (args, kwargs)

    def inside():
        a, k = name_inputs(*saved)
        return jax.tree.map(lambda x: partitioned(x, False), (a, k)) if partition else (a, k)
    return inside


@dataclasses.dataclass(frozen=True)
class _Remat:
    """How a linen block runs under ``nn.remat``: with ``policy``, its inputs cut over
    ``model`` at the checkpoint where ``partition`` (Pa), its path in ``inside`` meanwhile (so
    that the interceptor lets the transforms' own call of the block through), and
    ``previous`` told its inputs (gathering by module with prefetch)."""

    policy: Any
    partition: bool
    inside: set[str]
    previous: _Previous

    def __call__(self, module: nn.Module, method: str, args: tuple, kwargs: dict,
                 whole: Any) -> Any:
        """The block's ``method``, its parameters made whole by ``whole`` inside the
        checkpoint; with Pa its inputs reach the checkpoint cut (what it saves, or offloads)
        and are made whole inside it."""
        inputs = _checkpointed_inputs(args, kwargs, self.partition)

        def named(mdl):  # inside the checkpoint, where the policy sees the names
            a, k = inputs()
            self.previous.ran(a, k)  # by module with prefetch: the first module waits for these
            return getattr(mdl, method)(*a, **k)
        run = nn.map_variables(named, "params", trans_in_fn=whole)
        path = "/".join(module.path)
        self.inside.add(path)
        try:
            return nn.remat(run, prevent_cse=True, policy=self.policy)(module)
        finally:
            self.inside.discard(path)


def _own(params: PyTree) -> dict:
    """A module's own ``Shard``s to make whole (not its children's, nor tiled ones)."""
    return {k: v for k, v in params.items() if is_shard(v) and not v.tile}


def _own_whole(variables: dict, whole: Any) -> dict:
    """``variables`` (``{"params": ...}``, as ``map_variables`` hands them) with the module's
    own ``Shard``s made whole by ``whole``; its children's left to them."""
    params = variables["params"]
    own = {k: params[k] for k in _own(params)}
    return {**variables, "params": {**params, **whole(own)}}


def _module_whole(shards: PyTree, args: tuple, kwargs: dict, heavy: bool) -> PyTree:
    """A module's own ``Shard``s made whole after its inputs. A ``heavy`` one's (weights that
    outweigh its inputs) one leaf per collective: a buffer and the leaves cut out of it would
    be live at once; a light one's (a norm's scale and bias) in the plan's buckets."""
    alone = lambda x: dataclasses.replace(x, comm=dataclasses.replace(x.comm, bucket_bytes=0))
    if heavy:
        shards = jax.tree.map(alone, shards, is_leaf=is_shard)
    return materialize_tree(after_inputs(shards, args, kwargs))


def _outweighs(shards: Iterable[Shard], args: tuple, kwargs: dict) -> bool:
    """Whether a module's gathered weights hold more elements than its inputs: then its
    backward gathers them again rather than keeping them (``_module_call``)."""
    whole = sum(x.value.size * jax.lax.axis_size(x.mesh_axis) for x in shards
                if x.kind == "gather")
    return whole > sum(x.size for x in jax.tree.leaves((args, kwargs))
                       if isinstance(x, jax.Array))


class _Previous:
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
        bool(_own(module.variables.get("params", {})))


def _held(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A module's array inputs passed through a barrier, for it to compute on. A gather that
    waits for them (``after_inputs``) then waits for values the module uses: XLA's algebraic
    simplifier drops a barrier's unused operand whose producer has no other user, as a norm's
    output fused into the next matmul has not, and the gather would then wait for nothing."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    for i, x in zip(at, jax.lax.optimization_barrier([leaves[i] for i in at]), strict=True):
        leaves[i] = x
    return treedef.unflatten(leaves)


def _module_call(module: Any, shards: list[Shard], args: tuple, kwargs: dict,
                 previous: _Previous, runs: Any, checkpoint: Any) -> Any:
    """A module inside a block gathered by module (``Layers.gather``), linen or NNX: its own
    ``shards`` made whole as it runs, after its inputs (with prefetch, the previous module's:
    ``_Previous``; both ``_held``). ``runs(whole, args, kwargs)``: the call with ``whole``
    making them whole; ``checkpoint``: the framework's remat. Where the gathered weights
    outweigh its inputs, it runs under a checkpoint that saves all but them, so that its
    backward gathers them again rather than keeping them from the block's recompute to their
    use in its backward; lighter ones (norm scales, biases) stay as residuals."""
    args, kwargs = _held(args, kwargs)
    after = previous.after(args, kwargs)
    heavy = _outweighs(shards, args, kwargs)
    run = runs(lambda s: _module_whole(s, *after, heavy), args, kwargs)
    out = checkpoint(run, prevent_cse=True, policy=_all_but_gathered)(module) if heavy \
        else run(module)
    previous.ran(args, kwargs)  # this module, not its children, ran last
    return out


def _gathered_here(module: nn.Module, method: str, args: tuple, kwargs: dict,
                   inside: set[str], previous: _Previous) -> Any:
    """``_module_call`` for a linen module: its path is ``inside`` while its remat runs, so
    that the interceptor lets the remat's own call of it through."""
    path = "/".join(module.path)

    def remat(run, **options):
        def call(mdl):
            inside.add(path)
            try:
                return nn.remat(run, **options)(mdl)
            finally:
                inside.discard(path)
        return call
    runs = lambda whole, a, k: nn.map_variables(
        lambda mdl: getattr(mdl, method)(*a, **k), "params",
        trans_in_fn=lambda v: _own_whole(v, whole))
    own = _own(module.variables.get("params", {}))
    return _module_call(module, list(own.values()), args, kwargs, previous, runs, remat)


@contextlib.contextmanager
def per_block(blocks: Iterable[str], remat: str = "full", partition: bool = False,
              chain: Any = None, remat_all: bool = False, by_module: bool = False,
              ahead: bool = False):
    """Make each named block's ``Shard``s whole as the block runs; yields the blocks that ran,
    each with whether it gathered. ``chain`` (``zero_jax.handoff.Chain``): prefetch's handoffs.

    Linen, with no change to the model: any call of a module whose path is a block (an
    unrolled ``h/0`` or, inside ``nn.scan``, the scanned module, one layer's slice at a time)
    runs under a lifted ``map_variables`` that materializes its parameters. NNX: modules built
    by ``zero_jax.nnx_merge`` do the same in their ``__call__``. When that gathers (stage 3),
    the block is also rematerialized, so the backward gathers again instead of keeping whole
    weights as residuals; on the CPU backend this needs XLA to keep remat's optimization
    barriers (``zero_jax.mesh.keep_remat_barriers``, at import); ``remat`` names its policy
    (``remat_policy``); ``partition``: the block's saved inputs are cut over ``model``
    (``partitioned``). ``remat_all``: blocks that do not gather are rematerialized too (Pa
    at stages 0-2: their saved inputs are cut only if zero_jax's remat saves them).
    ``by_module`` (``Layers.gather``): each module in a block gathers its own parameters as it
    runs (``_gathered_here``; NNX: ``_per_module_class``), ``ahead`` one module ahead.
    """
    names, seen, inside = frozenset(blocks), {}, set()
    policy = remat_policy(remat, gathers=True)
    previous = _Previous(ahead)

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        tiled = tiling.use(module, context.method_name, args, kwargs, whole_tile, materialize_tree)
        if tiled is not tiling.UNTILED:
            return tiled
        path = "/".join(module.path) if module.scope is not None else None
        if path in inside or (path not in names and not (by_module and _has_own(module, context))):
            return next_fun(*args, **kwargs)  # inside: the block's own call, in its remat
        if path not in names:  # gathering by module: a module inside a block
            return _gathered_here(module, context.method_name, args, kwargs, inside, previous)
        params = module.variables.get("params", {})
        seen[path] = seen.get(path, False) or is_gathered(params)
        if not seen[path]:  # stages 0-2: reads its whole copy (a replica: all-reduced after)
            if remat_all:
                return rematerialize(module, context.method_name, args, kwargs,
                                     materialize_tree)
            return _read_whole(next_fun, module, context.method_name, args, kwargs)
        if not has_shards(params):
            return next_fun(*args, **kwargs)  # made whole already (prefetch's loop)
        gather = (lambda v: _own_whole(v, lambda s: _module_whole(s, args, kwargs, True))) \
            if by_module else (lambda params: materialize_tree(after_inputs(params, args, kwargs)))
        plain = lambda: rematerialize(module, context.method_name, args, kwargs, gather)
        if chain is not None:
            return chain.call(path, chain.linen(module, context.method_name), args, kwargs,
                              plain)
        return plain()

    rematerialize = _Remat(policy, partition, inside, previous)
    token = internals.BLOCKS.set(_Active(names, seen, policy, chain, partition, remat_all,
                                         by_module, previous))
    try:
        with nn.intercept_methods(intercept):
            yield seen
    finally:
        internals.BLOCKS.reset(token)


def nnx_merge(graphdef: Any, *states: Any) -> Any:
    """``nnx.merge`` for an NNX model in a ZeRO loss: the plan's blocks (``layers=``) become
    whole as they run, one at a time, whether they sit in a list or under ``nnx.scan``."""
    from flax import nnx

    model = nnx.merge(graphdef, *states, copy=True)  # variables of this trace, not the caller's
    active = internals.BLOCKS.get()
    if active is None:
        return model
    names, seen, chain = active.names, active.seen, active.chain
    for path, node in nnx.iter_graph(model):
        name = "/".join(map(str, path))
        if active.by_module and isinstance(node, nnx.Module) and name not in names and \
                any(name.startswith(b + "/") for b in names) and _own_vars(node):
            internals.set_class(node, _per_module_class(type(node)))
        if isinstance(node, nnx.Module) and name in names:
            internals.set_class(node, _per_block_class(type(node)))
            seen[name] = seen.get(name, False) or is_gathered(
                [v.get_raw_value() for _, v in nnx.iter_graph(node) if isinstance(v, nnx.Variable)])
            if chain is not None:
                chain.modules[name] = node
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


def _run_whole(call: Any, module: Any, variables: list, args: tuple, kwargs: dict,
               whole: Any) -> Any:
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
    own ``Shard``s whole as it runs (``_module_call``)."""
    from flax import nnx

    def __call__(self, *args, **kwargs):
        own, active = _own_vars(self), internals.BLOCKS.get()
        if active is None or not own:
            return cls.__call__(self, *args, **kwargs)
        runs = lambda whole, a, k: lambda m: _run_whole(cls.__call__, m, _own_vars(m), a, k,
                                                        whole)
        return _module_call(self, [v.get_raw_value() for v in own], args, kwargs,
                            active.previous, runs, nnx.remat)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


@functools.cache
def _per_block_class(cls: type) -> type:
    """``cls`` whose ``__call__`` makes its own ``Shard``s whole around the original one."""
    if getattr(cls, "_zero_jax_block", False):
        return cls
    from flax import nnx

    def run(module, args, kwargs, whole):
        # By module: the block's own leaves; each child makes its own whole (_per_module_class).
        active = internals.BLOCKS.get()
        active.previous.ran(args, kwargs)
        variables = _own_vars(module) if active.by_module else _shard_vars(module)
        return _run_whole(cls.__call__, module, variables, args, kwargs, whole)

    def __call__(self, *args, **kwargs):
        active = internals.BLOCKS.get()
        shards = [v.get_raw_value() for v in _shard_vars(self)]
        if any(s.tile for s in shards):
            raise ValueError(f"Layers(tile_mb=...) tiles linen nn.Dense layers; the NNX block "
                             f"{cls.__name__} holds a leaf above the bound: turn tiling off")
        if active is None or not (shards or active.remat_all):
            return cls.__call__(self, *args, **kwargs)
        inputs = _checkpointed_inputs(args, kwargs, active.partition)
        remat = lambda whole: nnx.remat(lambda m: run(m, *inputs(), whole), prevent_cse=True,
                                        policy=active.policy)(self)
        if not is_gathered(shards):  # stages 0-2
            return remat(materialize_tree) if active.remat_all else \
                run(self, args, kwargs, materialize_tree)
        plain = lambda: remat(lambda s: materialize_tree(after_inputs(s, args, kwargs)))
        chain = active.chain
        # Not the model's own module (a copy made by nnx.scan): no neighbours to hand to.
        name = next((n for n, m in (chain.modules if chain else {}).items() if m is self), None)
        if name is None:
            return plain()
        return chain.call(name, chain.nnx(self, cls.__call__), args, kwargs, plain)

    return type(cls.__name__, (cls,), {"__call__": __call__, "_zero_jax_block": True,
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
