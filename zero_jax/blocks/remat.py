"""What a block keeps for its backward, in one place: the remat policies, ZeRO-R's partitioned
(Pa) and offloaded checkpoints, and every place a block or module is rematerialized (linen's
``nn.remat``, NNX's ``nnx.remat``, and ``Saved``, for the loops prefetch runs itself)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from zero_jax.blocks.layers import REMAT
from zero_jax.mesh import MODEL
from zero_jax.shards import GATHERED

PyTree = Any

# The name of a block's input (its per-layer checkpoint), for remat policies.
BLOCK_INPUT = "zero_jax_block_input"


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
            "none": all_but_gathered if gathers else cp.everything_saveable,
            "offload": cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=[BLOCK_INPUT],
                offload_src="device", offload_dst="pinned_host")}[name]


# Ops that only lay a value out again: recomputed from their input rather than saved, so that a
# gathered weight's reshapes and casts are not saved in its place.
_LAYOUT = frozenset({"reshape", "transpose", "convert_element_type", "broadcast_in_dim",
                     "squeeze", "expand_dims", "slice", "copy", "copy_p", "optimization_barrier"})


def all_but_gathered(prim, *_, **params) -> bool:
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
    """What a block keeps for its backward: ``remat``, the policy (``REMAT``) of what it saves
    besides its input; its input ``offload``ed to host memory (remat ``offload``);
    ``partition``, cut over ``model`` (ZeRO-R's Pa). Its methods run a block as remat would:
    ``linen`` and ``nnx`` through the framework's own remat, ``linearize`` and ``backward``
    in the loops prefetch runs itself."""

    remat: str = "full"
    partition: bool = False

    @property
    def offload(self) -> bool:
        return self.remat == "offload"

    @property
    def policy(self) -> Any:
        """The checkpoint policy of a block at stage 3 (``remat_policy(..., gathers=True)``)."""
        return remat_policy(self.remat, gathers=True)

    def _move(self, x: Any, space: Any) -> Any:
        inexact = isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)
        return jax.device_put(x, space) if self.offload and inexact else x

    def barrier(self, in_loop: bool) -> bool:
        """Whether remat keeps its barrier (``prevent_cse``): outside loops, and with Pa, whose
        saved input XLA would otherwise keep whole (T = 2: 7.9 -> 9.4 MiB a device)."""
        return not in_loop or self.partition

    def cut(self, tree: PyTree) -> PyTree:
        """Pa: laid out cut over ``model`` (as it waits between blocks, too)."""
        return jax.tree.map(lambda x: partitioned(x, True), tree) if self.partition else tree

    def whole(self, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: partitioned(x, False), tree) if self.partition else tree

    def save(self, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: self._move(x, jax.memory.Space.Host), self.cut(tree))

    def load(self, tree: PyTree) -> PyTree:
        return self.whole(jax.tree.map(lambda x: self._move(x, jax.memory.Space.Device), tree))

    def inputs(self, args: tuple, kwargs: dict) -> Callable[[], tuple[tuple, dict]]:
        """A block's inputs as its checkpoint saves them (Pa: cut over ``model``), and a
        function, to call inside the checkpoint, that gives them back named (``name_inputs``)
        and whole."""
        saved = self.cut((args, kwargs))

        def inside():
            return self.whole(name_inputs(*saved))
        return inside

    def linen(self, module: nn.Module, method: str, args: tuple, kwargs: dict, whole: Callable,
              ran: Callable[[tuple, dict], None], in_loop: bool = False) -> Any:
        """A linen block's ``method`` under ``nn.remat``, its parameters made whole by
        ``whole`` inside the checkpoint; with Pa its inputs reach the checkpoint cut (what it
        saves, or offloads) and are made whole inside it. ``ran(args, kwargs)`` is told the
        inputs inside (gathering by module with prefetch, the first module waits for them).
        ``in_loop``: a layer of an ``nn.scan`` stack, as ``linearize``'s (told at trace time,
        ``blocks.scan.looping``: ``plan.scanned`` only guesses it from shapes)."""
        inputs = self.inputs(args, kwargs)

        def named(mdl):  # inside the checkpoint, where the policy sees the names
            a, k = inputs()
            ran(a, k)
            return getattr(mdl, method)(*a, **k)
        run = nn.map_variables(named, "params", trans_in_fn=whole)
        return nn.remat(run, prevent_cse=self.barrier(in_loop), policy=self.policy)(module)

    def nnx(self, module: Any, run: Callable, args: tuple, kwargs: dict,
            in_loop: bool = False) -> Any:
        """An NNX block's ``run(module, args, kwargs)`` under ``nnx.remat``, its inputs and
        ``in_loop`` as ``linen``'s."""
        from flax import nnx

        inputs = self.inputs(args, kwargs)
        return nnx.remat(lambda m: run(m, *inputs()), prevent_cse=self.barrier(in_loop),
                         policy=self.policy)(module)

    def linearize(self, fn: Any, *args: PyTree, in_loop: bool = False) -> tuple[Any, list, Any]:
        """``fn(*args)`` run as the remat policy says: ``(out, kept, how)``, ``kept`` what the
        policy saves for the backward less ``args`` themselves (which the backward has again:
        the weights gathered again, the input as ``save``d), ``how`` (static) the backward's
        shape (``backward``). ``offload`` keeps what ``full`` does: the input, moved by
        ``save``.

        ``in_loop``: ``fn`` is a layer of a loop (prefetch's, ``prefetch.run_stack``), whose body
        keeps XLA from merging the recompute with the forward. Remat's barrier (``prevent_cse``) is
        left out there but with Pa (``barrier``), as ``nn.remat`` under ``nn.scan`` leaves it:
        with it, each saved value the backward slices out of the loop's stacks is copied out
        before it is read (on an H100, 1.8 GB per layer of gpt2-124m's saved matmul outputs, 6%
        of the step)."""
        policy = remat_policy("full" if self.offload else self.remat, gathers=True)
        out, pull = jax.vjp(jax.checkpoint(fn, policy=policy, prevent_cse=self.barrier(in_loop)),
                            *args)
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

    def backward(self, fn: Any, kept: list, *args: PyTree, in_loop: bool = False) -> Any:
        """``fn``'s backward at ``args`` from what ``linearize`` kept (``in_loop`` as there).
        Its shape comes from linearizing ``fn`` again here: work nothing reads, which XLA
        drops."""
        _, fresh, (treedef, where) = self.linearize(fn, *args, in_loop=in_loop)
        if len(fresh) != len(kept):
            raise AssertionError("a block linearized twice kept different values")
        known = [*(jax.tree.leaves(a) for a in args), kept]
        return treedef.unflatten([known[a][j] for a, j in where])
