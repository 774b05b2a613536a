"""Every private or unstable API zero_jax relies on, in one place.

Each was checked with jax 0.10.2, flax 0.12.8 and orbax-checkpoint 0.12.8 (``pyproject.toml``
bounds the versions); ``tests/test_internals.py`` names the one that broke when an upgrade
breaks one. Nothing else in the library reaches into these packages' internals.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Callable, Iterator
from typing import Any

CHECKED = {"jax": "0.10.2", "flax": "0.12.8", "orbax-checkpoint": "0.12.8"}

# The trace of the loss under way (``zero_jax.blocks.runtime.Trace``): read by ``nnx_merge``,
# which the user's loss calls, and inside the NNX blocks' ``__call__``, which Flax calls: neither
# has a way to be handed it. The library's one piece of process-wide state, set and reset around
# one trace by ``Runtime.tracing``.
BLOCKS: contextvars.ContextVar = contextvars.ContextVar("zero_jax_blocks", default=None)

# XLA's pass that turns remat's optimization barriers into plain ops on the CPU backend, where
# CSE would then merge a block's backward re-gather into its forward gather (stage 3 would hold
# every block's whole weights). Disabled by ``zero_jax.mesh.keep_remat_barriers``; the GPU
# compiler refuses the flag and needs no such help.
CSE_BARRIER_PASS = "cse_barrier_expander"

# Orbax's files: a step directory it completed holds ``_CHECKPOINT_METADATA``; each item (a
# PyTree saved with OCDBT) its ``_METADATA`` and ``manifest.ocdbt``; a JSON item ``metadata``.
ORBAX_STEP_FILE = "_CHECKPOINT_METADATA"
ORBAX_TREE_FILES = ("_METADATA", "manifest.ocdbt")
ORBAX_JSON_FILE = "metadata"
# What a failed save leaves behind: the writes that failed name orbax's temporary directory
# (``orbax.checkpoint._src.path.atomicity_types.TMP_DIR_SUFFIX``) in their errors, and the
# writes never started are this coroutine of ``async_serialize_from_host``, never awaited.
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"
ORBAX_WRITE_COROUTINE = "write_fragment"
# A failed restore: the first array read that fails raises, and the reads still pending are
# this coroutine of orbax's ``serialization`` module (``_read_and_create_array`` awaits
# them), each raising its own error when the garbage collector closes it.
ORBAX_READ_COROUTINE = "_read_array_index_and_device_put"


def trace_state() -> Any:
    """``jax.extend.core.get_opaque_trace_state``: a token of the trace now running, equal
    for two points of one trace (as Flax checks its own), so that a value from another one (an
    inner transform's tracer) is never used here (``zero_jax.blocks.prefetch.Previous``)."""
    import jax.extend

    return jax.extend.core.get_opaque_trace_state(convention="flax")


def compute_on_primitive() -> Any:
    """``jax._src.compute_on.compute_on_p``: the primitive behind
    ``jax.experimental.compute_on``, bound directly so that a host computation's jaxpr can be
    traced on device-typed stand-ins (``zero_jax.offload.on_host``)."""
    from jax._src.compute_on import compute_on_p

    return compute_on_p


def distributed_client() -> Any:
    """``jax._src.distributed.global_state.client``: the coordination service's key-value
    store, through which the processes of a run agree on their settings and watch each other
    (``zero_jax.distributed``); None before ``jax.distributed.initialize``."""
    from jax._src.distributed import global_state

    return global_state.client


def coordinator_address() -> str | None:
    """``jax._src.distributed.global_state.coordinator_address``: where process 0's
    coordination service listens, also when JAX detected it (SLURM, Cloud TPU)."""
    from jax._src.distributed import global_state

    return global_state.coordinator_address


@contextlib.contextmanager
def _swapped(module: str, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """``module.name`` replaced by ``wrap(original)`` while the block runs, then restored. A
    module-level swap: one such block at a time."""
    owner = importlib.import_module(module)
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def compile_afresh() -> contextlib.AbstractContextManager:
    """JAX's persistent compilation cache not read while the block compiles
    (``jax._src.compiler._cache_read`` finds nothing), but written: a program with XLA's dumps
    requested must compile, since the dump options are not in the cache's key and a program
    loaded from the cache dumps nothing; the program it compiles is the one a later plain
    compile loads (``zero_jax.peak.compile_with_peak``)."""
    return _swapped("jax._src.compiler", "_cache_read", lambda _: lambda *a, **k: (None, None))


def exact_residuals() -> contextlib.AbstractContextManager:
    """While the block traces, the residuals a checkpoint saves in float32 or float64 are not
    rounded to their own dtype (``jax._src.ad_checkpoint._insert_reduce_precision``; bf16 and
    other narrow ones still are). JAX rounds them so that a backward recomputing from a
    residual never sees it kept in excess precision (jax PR 22244: bf16 on GPU); a float32 or
    float64 value has none, so the rounding changes no bit, but the CPU compiler gives each one
    a buffer of its own. Gathering by module, whose checkpoints save each module's inputs, held
    0.30 MiB of such copies at the default model's peak (6.08 MiB of temp, 5.78 without)."""
    return _swapped("jax._src.ad_checkpoint", "_insert_reduce_precision", _wide_unrounded)


def _wide_unrounded(insert: Callable) -> Callable:
    """``insert`` (jax's), then its float32/float64 roundings taken out again: each inserted
    ``v = reduce_precision(fresh)`` goes, and ``fresh`` is named ``v`` where it was made."""
    import numpy as np

    wide = (np.dtype(np.float32), np.dtype(np.float64))

    def inserted(jaxpr: Any, num_res: int) -> Any:
        out = insert(jaxpr, num_res)
        kept = set(map(id, jaxpr.eqns))
        rounded = [e for e in out.eqns if id(e) not in kept
                   and e.primitive.name == "reduce_precision" and e.outvars[0].aval.dtype in wide]
        if not rounded:
            return out
        back, dropped = {e.invars[0]: e.outvars[0] for e in rounded}, set(map(id, rounded))
        names = lambda vs: [back.get(v, v) for v in vs]
        eqns = [e.replace(outvars=names(e.outvars)) if any(v in back for v in e.outvars) else e
                for e in out.eqns if id(e) not in dropped]
        return out.replace(invars=names(out.invars), constvars=names(out.constvars),
                           eqns=eqns)
    return inserted


@contextlib.contextmanager
def flax_lift(name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """``flax.core.lift.<name>`` replaced by ``wrap(original)`` while the block runs: how
    ``zero_jax.blocks.scan`` runs the layer loop of a linen ``nn.scan`` stack itself (``scan``),
    and ``zero_jax.blocks.chain`` a block under the model's own ``nn.remat`` (``checkpoint``). Linen
    reads the attribute when the transformed class is made (``nn.scan(Block)``); a class made
    before (at import) holds it in its methods' closures, which are swapped too. Trace one such
    loss at a time."""
    import flax.core.lift

    original = getattr(flax.core.lift, name)
    cells = _captured(original)  # before the wrapper, which holds it too, exists
    wrapped = wrap(original)
    setattr(flax.core.lift, name, wrapped)
    for cell in cells:
        cell.cell_contents = wrapped
    try:
        yield
    finally:
        setattr(flax.core.lift, name, original)
        for cell in cells:
            cell.cell_contents = original


def _captured(fn: Callable) -> list:
    """The closure cells holding ``fn`` in the methods of every linen class alive (a class
    ``nn.scan`` or ``nn.remat`` made keeps its transform in its methods' closures)."""
    import flax.linen as nn

    cells, todo, seen = [], [nn.Module], set()
    while todo:
        for cls in todo.pop().__subclasses__():
            if cls in seen:
                continue
            seen.add(cls)
            todo.append(cls)
            for method in vars(cls).values():
                for cell in getattr(method, "__closure__", None) or ():
                    with contextlib.suppress(ValueError):  # an empty cell
                        if cell.cell_contents is fn:
                            cells.append(cell)
    return cells


def nnx_scan(wrap: Callable[[Callable], Callable]) -> contextlib.AbstractContextManager:
    """``flax.nnx.scan`` replaced by ``wrap(original)`` while the block runs: how
    ``zero_jax.blocks.scan`` runs an NNX stack's layer loop itself. Code that calls ``nnx.scan``
    as the loss runs sees the swap; a name bound before (``from flax.nnx import scan`` at
    import) does not. Trace one such loss at a time."""
    return _swapped("flax.nnx", "scan", wrap)


def set_class(obj: Any, cls: type) -> None:
    """``obj.__class__ = cls``: an NNX block's class swapped for a subclass whose ``__call__``
    makes its shards whole (``zero_jax.blocks.nnx_merge``), on the model's own copy."""
    obj.__class__ = cls
