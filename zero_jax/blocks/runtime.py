"""The block runtime: built once per step from the plan, entered once per trace of the loss.

``Runtime`` holds what the plan says of its blocks; ``Runtime.run`` traces the loss under one
context manager (``tracing``) that installs every Flax/NNX hook together and removes them
together: the linen interceptor (``zero_jax.blocks.linen``), NNX's blocks
(``zero_jax.blocks.nnx``, through ``internals.BLOCKS``, the one piece of context: an NNX model is
merged by the user's loss, which passes nothing to it), and with prefetch the layer loops of
scanned stacks (``zero_jax.blocks.scan``) and the blocks called one after another
(``zero_jax.blocks.chain``). What one trace learns lives in its ``Trace``.

Prefetch is one mechanism with three cases, by the shape the blocks take
(``zero_jax.blocks.prefetch``): a scanned stack's loop carries layer i+1's weights, blocks
called one after another hand them on (in the order a first trace recorded, ``chain``), and
gathering by module each module's gather waits for the module before it (``Previous``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
from flax.errors import ScopeParamShapeError

from zero_jax import internals
from zero_jax.blocks import chain as chains
from zero_jax.blocks import linen, scan
from zero_jax.blocks.prefetch import Previous
from zero_jax.blocks.remat import Saved

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The plan's blocks (module paths, ``names``) and what the runtime does with them:
    ``saved``, what each keeps for its backward (remat policy, Pa); ``gather``, ``block`` or
    ``module``; ``prefetch``, gathers one block (or module) ahead; ``remat_all``, blocks that
    do not gather are rematerialized too (Pa at stages 0-2: their saved inputs are cut only if
    zero_jax's remat saves them); ``batch_axes``, the mesh axes the batch is cut over, which
    ``zero_jax.batch_sum`` sums over."""

    names: tuple[str, ...]
    saved: Saved = Saved()
    gather: str = "block"
    prefetch: bool = False
    remat_all: bool = False
    batch_axes: tuple[str, ...] = ()

    @property
    def by_module(self) -> bool:
        return self.gather == "module"

    @property
    def chained(self) -> bool:
        """Whole blocks prefetched: scanned stacks by ``scan``, the others by ``chain``."""
        return self.prefetch and not self.by_module

    @contextlib.contextmanager
    def tracing(self, chain: chains.Chain | None = None) -> Iterator[Trace]:
        """Every hook of one trace installed, and removed after."""
        trace = Trace(self, chain)
        names = frozenset(self.names)
        token = internals.BLOCKS.set(trace)
        try:
            with contextlib.ExitStack() as hooks:
                hooks.enter_context(nn.intercept_methods(linen.interceptor(trace)))
                if not self.chained:
                    hooks.enter_context(scan.looping(names, trace.looped))
                    hooks.enter_context(scan.nnx_looping(trace.modules, trace.looped))
                else:
                    hooks.enter_context(scan.stacks(names, trace.prefetched, self.saved))
                    hooks.enter_context(chains.own_remat_lifted(names))
                    hooks.enter_context(scan.nnx_stacks(trace.modules, trace.prefetched,
                                                        self.saved))
                yield trace
        finally:
            internals.BLOCKS.reset(token)

    def run(self, loss_fn: Callable, args: tuple,
            order: tuple[str, ...] | None) -> tuple[Any, tuple[str, ...]]:
        """``loss_fn(*args)``, each block made whole as it runs: ``(out, order)``. ``order``:
        the order the blocks ran in, which prefetch hands each block the next one's weights by,
        as a trace before recorded it; ``None`` records it (a trace for shapes only: the
        blocks run plainly, checked in the trace that uses it)."""
        chain = chains.Chain(order, self.saved) if self.chained else None
        with self.tracing(chain) as trace:
            try:
                out = loss_fn(*args)
            except ScopeParamShapeError as e:
                if not self._in_block(str(e)):  # the module's input, as on one device
                    raise
                raise ValueError(f"a parameter reached a module still cut into shards: the "
                                 f"plan's layers= names blocks {list(self.names)}, and a "
                                 f"module reading one of their parameters is not one of them "
                                 f"or inside one ({e.__class__.__name__}: "
                                 f"{str(e).splitlines()[0]})") from e
        if order is None:
            return out, tuple(chain.recorded) if chain else ()
        if chain is not None:
            chain.check_done()
            trace.prefetched |= set(chain.order)
        trace.check()
        return out, order

    def _in_block(self, message: str) -> bool:
        """Whether flax's shape error names a module in a declared block, whose parameters
        alone arrive cut; elsewhere the module's input does not fit its parameter."""
        where = re.search(r'in "/([^"]*)"', message)
        return where is None or any(where.group(1) == b or where.group(1).startswith(b + "/")
                                    for b in self.names)


class Trace:
    """What one trace of the loss has seen: the blocks that ran (``seen``: each with whether
    it gathered), those a prefetching loop ran (``prefetched``), the linen blocks whose own
    call runs inside their remat (``inside``), the named stacks whose loop body is being
    traced (``looped``), NNX's block modules by name (``modules``), by module the last
    module's inputs (``previous``), and prefetch's handoffs (``chain``)."""

    def __init__(self, runtime: Runtime, chain: chains.Chain | None):
        self.runtime, self.chain = runtime, chain
        self.seen: dict[str, bool] = {}
        self.prefetched: set[str] = set()
        self.inside: set[str] = set()
        self.looped: set[str] = set()
        self.modules: dict[str, Any] = chain.modules if chain else {}  # NNX: blocks by name
        self.previous = Previous(runtime.prefetch and runtime.by_module)

    def check(self) -> None:
        """Every named block ran, as prefetch ran it where it is on."""
        rt = self.runtime
        if rt.chained and (missing := [b for b in rt.names if self.seen.get(b)
                                       and b not in self.prefetched]):
            raise ValueError(f"prefetch runs linen and NNX scanned stacks, unrolled linen "
                             f"blocks and NNX blocks in a list; {missing[0]!r} did not run as "
                             f"one (its nnx.scan bound before the step, or applied at import): "
                             f"turn prefetch off (Layers(prefetch=False))")
        if missing := [b for b in rt.names if b not in self.seen and b not in self.prefetched]:
            raise ValueError(f"layers= names {missing[0]!r}, which never ran as a Flax linen "
                             f"module during the loss; name modules that are called (their "
                             f"paths: {list(rt.names)[:3]}...)")
