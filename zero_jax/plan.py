"""Where each piece of model state lives, per ZeRO stage.

The whole of ZeRO as placement is the table ``STAGES`` plus one rule that picks, for each
parameter, the dimension its shards are cut along. Everything else (the train step, the report)
reads the resulting ``Plan``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zero_jax.blocks import Layers
from zero_jax.buckets import Comm
from zero_jax.mesh import DATA, MODEL, REPLICA
from zero_jax.offload import Offload
from zero_jax.precision import Precision

PyTree = Any


class Stage(NamedTuple):
    """Which of the three model states are partitioned, and how data moves."""

    shard_opt_state: bool
    shard_grads: bool
    shard_params: bool
    moves: str


STAGES: dict[int, Stage] = {
    0: Stage(False, False, False,
             "gradients all-reduced, each layer's as its backward ends (in buckets; else once, "
             "after the backward); every device runs the full update"),
    1: Stage(True, False, False,
             "gradients all-reduced, each layer's as its backward ends (in buckets; else once, "
             "after the backward); each device updates its optimizer shard; updated parameters "
             "all-gathered"),
    2: Stage(True, True, False,
             "each layer's gradients reduce-scattered as its backward ends; "
             "updated parameter shards all-gathered"),
    3: Stage(True, True, True,
             "each layer's parameters all-gathered before its forward and again before its "
             "backward; gradients reduce-scattered per layer; no gather after the update"),
}


@dataclasses.dataclass(frozen=True)
class Leaf:
    """The rules' verdict for one parameter."""

    path: str
    shape: tuple[int, ...]
    stacked: bool  # leading dimension is the layer index of a scanned layer stack
    axis: int | None  # dimension cut over the data axis; None: whole on every device
    block: str | None = None  # module path of the block it is gathered with; None: per step
    persistent: bool = False  # small: parameter and gradient stay whole, optimizer state is cut
    reason: str = ""  # why it is not cut everywhere
    frozen: bool = False  # not trained: no gradient, no optimizer state
    offload: bool = False  # ZeRO-Offload: its master and optimizer state in host memory
    model_dim: int | None = None  # dimension cut over the ``model`` axis (tensor parallelism)
    # Memory-centric tiling: (dimension, tiles) its layer gathers it in, never whole
    tile: tuple[int, int] | None = None

    @property
    def split(self) -> bool:
        """Cut over ``model`` and data along one dimension (leaf_rule): the data axes'
        ``shard_map`` takes that dimension split in two (``Plan.split_model``)."""
        return self.axis is not None and self.axis == self.model_dim

    @property
    def layer_elements(self) -> int:
        """Elements of one layer: a scanned stack's leaf without its layer index."""
        return math.prod(self.shape[1:] if self.stacked else self.shape)


def leaf_rule(path: str, shape: tuple[int, ...], n: int, stacked: bool,
              min_shard_elems: int, cut_one: bool = False,
              model: tuple[int, int] | None = None, *, subdivide: bool = True) -> Leaf:
    """Cut the first dimension (after the layer index) that ``n`` divides.

    A leaf with no such dimension stays whole everywhere, optimizer state included. A leaf
    smaller than ``min_shard_elems`` per layer is "persistent", as DeepSpeed's
    ``stage3_param_persistence_threshold``: gathering it would cost more in latency than it
    saves, so its parameter and gradient stay whole while its optimizer state is still cut.
    On one device nothing is cut, unless ``cut_one`` (into one shard: see make_plan).

    With tensor parallelism, ``model = (model_dim, t)``: ``model_dim`` is cut over the
    ``model`` axis's ``t`` devices and
    the data cut takes another dimension: each tensor-parallel rank holds 1/n of its slice.
    A leaf with no other dimension to cut (a bias cut over ``model``) has its ``model`` one
    cut into ``n x t`` pieces where ``subdivide`` (where the stage cuts anything),
    model-major: slices of each tensor-parallel rank's piece, so that ZeRO's collectives run
    on ``data`` alone (``Plan.split_model``).
    """
    first = 1 if stacked else 0
    model_dim, t = model or (None, 1)
    if model_dim is not None:
        model_dim %= len(shape)
        if model_dim < first or shape[model_dim] % t:
            raise ValueError(f"{path}: tensor parallelism cuts dimension {model_dim} of shape "
                             f"{shape} into {t}, which does not divide it (or is the layer "
                             f"index): pick a tensor-parallel size that divides it")
    axis = next((a for a in range(first, len(shape))
                 if (n > 1 or cut_one) and shape[a] % n == 0 and a != model_dim), None)
    if axis is None and model_dim is not None and n > 1 and subdivide \
            and shape[model_dim] % (n * t) == 0:
        axis = model_dim
    if axis is None:
        reason = "one device" if n == 1 else f"no dimension divisible by {n}"
        return Leaf(path, shape, stacked, None, reason=reason, model_dim=model_dim)
    size = math.prod(shape[first:]) // (t if model_dim is not None else 1)
    if size < min_shard_elems:
        return Leaf(path, shape, stacked, axis, persistent=True, model_dim=model_dim,
                    reason=f"persistent: {size} < {min_shard_elems} elements per layer")
    return Leaf(path, shape, stacked, axis, model_dim=model_dim)


def _model_major(spec: P) -> int | None:
    """The dimension ``spec`` cuts over ``model`` and the data axes together, if any."""
    return next((k for k, part in enumerate(spec)
                 if isinstance(part, tuple) and part[0] == MODEL), None)


def tile_leaf(leaf: Leaf, bound: int, itemsize: int) -> Leaf:
    """``leaf`` with the tiles its layer gathers it in, when it is a block's cut leaf of more
    than ``bound`` bytes per layer (ZeRO-Infinity's memory-centric tiling): the fewest tiles
    within the bound, along its largest dimension that is neither the cut one nor the layer
    index. Raises when no such cut fits the bound."""
    first = 1 if leaf.stacked else 0
    size = leaf.layer_elements * itemsize
    if not bound or leaf.block is None or leaf.axis is None or leaf.persistent or size <= bound:
        return leaf
    dims = sorted(set(range(first, len(leaf.shape))) - {leaf.axis}, key=lambda d: -leaf.shape[d])
    for d in dims:
        k = next((k for k in range(2, leaf.shape[d] + 1)
                  if leaf.shape[d] % k == 0 and size <= k * bound), None)
        if k is not None:
            return dataclasses.replace(leaf, tile=(d, k))
    smallest = size // leaf.shape[dims[0]] if dims else size
    raise ValueError(f"{leaf.path} ({size / 2**20:.2f} MB per layer, shape {leaf.shape}, cut "
                     f"along {leaf.axis}): its smallest tile, {smallest / 2**20:.3g} MB, is above "
                     f"tile_mb={bound / 2**20:.3g}: raise tile_mb, or leave its module out of "
                     f"layers=")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of the placement table over parameter paths ("blocks/attn/qkv/kernel").

    A path takes each field from the first rule whose ``pattern`` it contains (``re.search``)
    and that sets the field (not None); a field no rule sets keeps its default. So
    ``Rule("wpe", frozen=True)`` and ``Rule("", min_shard_elems=2048)`` compose: the threshold
    holds for ``wpe`` too. ``shard=False`` leaves a parameter out of ZeRO (DeepSpeed's and FSDP's
    ``ignored_modules``): whole on every device, gradient all-reduced, optimizer state whole.
    ``frozen``: not trained, no gradient computed or communicated, no optimizer state.
    ``min_shard_elems``: smaller parameters (per layer) are persistent, DeepSpeed's
    ``stage3_param_persistence_threshold``: whole parameter and gradient, optimizer state cut.
    ``model_dim``: the dimension cut over the mesh's ``model`` axis (tensor parallelism, e.g.
    -1 for a Dense kernel's output columns, -2 for its input rows); None: whole on ``model``.
    """

    pattern: str
    shard: bool | None = None
    frozen: bool | None = None
    min_shard_elems: int | None = None
    model_dim: int | None = None

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"Rule({self.pattern!r}): not a regular expression: {e}") from None
        if self.min_shard_elems is not None and self.min_shard_elems < 0:
            raise ValueError(f"Rule({self.pattern!r}): min_shard_elems must be at least 0 "
                             f"(got {self.min_shard_elems})")


FIELDS = {"shard": True, "frozen": False, "min_shard_elems": 0,  # what no rule sets
          "model_dim": None}
TPU_TILE = 128  # elements of a TPU's tile along an array's last dimension (Comm.align)


def match_rules(rules: tuple[Rule, ...] | list[Rule], paths: list[str]) -> dict[str, dict]:
    """Each path's fields, first match per field. A rule that matches no path is a mistake
    (a typo would silently train or shard what it meant to leave alone): it raises."""
    for r in rules:
        if not any(re.search(r.pattern, p) for p in paths):
            raise ValueError(f"Rule({r.pattern!r}) matches no parameter path; paths look like "
                             f"{paths[0]!r}")
    out = {}
    for path in paths:
        found = dict.fromkeys(FIELDS)
        for r in rules:
            if re.search(r.pattern, path):
                for name in FIELDS:
                    if found[name] is None:
                        found[name] = getattr(r, name)
        out[path] = {k: FIELDS[k] if found[k] is None else found[k] for k in FIELDS}
    return out


def find_blocks(paths: list[str], pattern: str) -> dict[str, str]:
    """Each parameter path under a block -> the block's module path.

    A block is the shortest module path (a parameter path without its last part) that
    ``pattern`` finds (``re.search``), with or without a trailing "/": "^h/\\d+$", "h/\\d+"
    and "^h/\\d+/" all name "h/0". Raises when the pattern names no module.
    """
    regex = re.compile(pattern)
    found = {}
    for path in paths:
        parts = path.split("/")[:-1]
        for end in range(1, len(parts) + 1):
            prefix = "/".join(parts[:end])
            if regex.search(prefix) or regex.search(prefix + "/"):
                found[path] = prefix
                break
    if not found:
        hits = [p for p in paths if regex.search(p)]
        what = (f"only parameters ({hits[0]!r}), not the module of a block" if hits else
                "no parameter path")
        raise ValueError(f"layers={pattern!r} names {what}; name the blocks' module paths: "
                         f"{_blocks_hint(paths)}")
    for block in dict.fromkeys(found.values()):
        _refuse_stack(pattern, block, [p for p in found if found[p] == block])
    return found


def _blocks_hint(paths: list[str]) -> str:
    """The model's top-level modules, and the numbered modules most often repeated (blocks
    built in a loop: linen's "h_0", NNX's and Hugging Face's "layers/0") as a pattern."""
    top = sorted({p.split("/")[0] for p in paths if "/" in p})
    shown = ", ".join(top[:8]) + (f", ... ({len(top)} in all)" if len(top) > 8 else "")
    stems: dict[str, set[str]] = {}
    for path in paths:
        parts = path.split("/")[:-1]
        for end in range(1, len(parts) + 1):
            if m := re.fullmatch(r"(.*?)(\d+)", parts[end - 1]):
                stem = "/".join([*parts[:end - 1], m.group(1)])
                stems.setdefault(stem, set()).add(m.group(2))
                break
    stem = max((s for s in stems if len(stems[s]) > 1), default=None,
               key=lambda s: (len(stems[s]), -s.count("/")))
    guess = (f"e.g. layers=r'^{re.escape(stem)}\\d+$' for its {len(stems[stem])} numbered "
             f"modules; " if stem is not None else "")
    return (f"{guess}an nn.scan stack is named by its module (layers='blocks'); the model's "
            f"top-level modules are {shown}")


def _refuse_stack(pattern: str, block: str, paths: list[str]) -> None:
    """A "block" holding repeated blocks (HF's ``layers/0``, ``layers/1``, ... under the
    ``layers`` a natural guess names) would be gathered whole: stage 3 then holds the whole
    stack at once. Repeated = two or more children named stem + number, each a module of
    modules with the same parameter paths below it."""
    below: dict[str, set[str]] = {}
    for path in paths:
        child, _, rest = path[len(block) + 1:].partition("/")
        below.setdefault(child, set()).add(rest)
    stems: dict[tuple[str, frozenset], list[str]] = {}
    for child, rests in below.items():
        m = re.fullmatch(r"(.*?)(\d+)", child)
        if m and all("/" in r for r in rests):
            stems.setdefault((m.group(1), frozenset(rests)), []).append(child)
    for (stem, _), children in stems.items():
        if len(children) > 1:
            parts = f"{re.escape(block)}/{re.escape(stem)}\\d+"
            raise ValueError(f"layers={pattern!r} names {block!r}, which holds {len(children)} "
                             f"repeated blocks ({block}/{children[0]}, {block}/{children[1]}, "
                             f"...) that would be gathered all at once: pass "
                             f"layers='{parts}'")


def scanned(shapes: list[tuple[int, ...]]) -> bool:
    """Whether a block's parameters look like a scan's stack: one shared leading dimension.

    Guessing "stacked" for an unrolled block is harmless (its leading dimension is just never
    cut); the reverse would cut the layer index, so ties go to "stacked"."""
    return all(len(s) >= 1 for s in shapes) and len({s[0] for s in shapes}) == 1


def path_str(path) -> str:
    """"blocks/qkv/kernel" for a key path; NNX's trailing ``.value`` is left out."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    if parts and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The placement of params, gradients and optimizer state for one stage on one mesh."""

    stage: int
    mesh: Mesh
    axis: str  # the data-parallel mesh axis that parameter shards are cut over
    leaves: PyTree  # Leaf per parameter, same tree as the params
    shapes: PyTree  # the parameters as ShapeDtypeStructs
    precision: Precision = Precision()
    # Hierarchical ZeRO: a second data axis, across groups of ``axis``. Parameters are cut
    # within a group only; gradients and optimizer state over both axes.
    outer: str | None = None
    offload: Offload = Offload()  # what lives in host memory (zero_jax.offload)
    comm: Comm = Comm()  # buckets and int8 collectives (zero_jax.buckets)
    layers: Layers | None = None  # the blocks and how they run (zero_jax.blocks), as given

    # What the blocks' policy says, read where it is held (none named: its defaults).
    @property
    def remat(self) -> str:
        """The policy of the blocks stage 3 rematerializes (``blocks.remat_policy``)."""
        return self.layers.remat if self.layers else "full"

    @property
    def partition_activations(self) -> bool:
        """ZeRO-R's Pa: the blocks' saved inputs cut over ``model``."""
        return bool(self.layers and self.layers.partition)

    @property
    def tile_bytes(self) -> int:
        """Memory-centric tiling's bound on what a block gathers whole; 0: none."""
        return self.layers.tile_bytes if self.layers else 0

    @property
    def gather(self) -> str:
        """What stage 3 gathers together: each ``block``, or each ``module`` in it."""
        return self.layers.gather if self.layers else "block"

    @property
    def prefetch(self) -> bool:
        """Stage 3 gathers the next block (or module) while this one computes. Not a block
        ahead where the shards are cut over one device, which gathers nothing: there the
        prefetching loop only costs its restructuring (the peeled layer's gradients
        concatenated into the stacks: 1.03x stage 0's step at 1.3B on one H100 by the
        estimate, 1.004x without it; by module prefetch estimates faster, so it stays)."""
        gathers = self.mesh.shape[self.axis] > 1 or self.gather == "module"
        return bool(self.layers and self.layers.prefetch and gathers)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Every data-parallel axis: the batch is cut over all of them."""
        return (self.axis,) if self.outer is None else (self.outer, self.axis)

    @property
    def model(self) -> str | None:
        """The tensor-parallel mesh axis, if the mesh has one."""
        return MODEL if MODEL in self.mesh.axis_names else None

    @property
    def block_prefetch(self) -> bool:
        """Prefetch a whole block ahead (``zero_jax.blocks.prefetch``);
        gathering by module, prefetch runs one module ahead inside the blocks instead."""
        return self.prefetch and self.gather == "block"

    @property
    def tp_size(self) -> int:
        return self.mesh.shape[MODEL] if self.model else 1

    def manual(self, specs: PyTree) -> PyTree:
        """``specs`` without the ``model`` axis: what ``shard_map`` over the data axes takes
        (the partitioner places the model axis, from the arrays' own shardings)."""
        if not self.model:
            return specs
        return jax.tree.map(lambda spec: P(*(None if p == MODEL else p for p in spec)), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def split_model(self, specs: PyTree, like: PyTree = None) -> PyTree:
        """``specs`` with each dimension cut over ``model`` and data (model-major, leaf_rule)
        split in two, ``model``'s and the data axes': the layout of ``to_split``'s arrays, in
        which a device's data piece is a slice of its tensor-parallel rank's, so that the data
        axes' ``shard_map`` and its collectives never cross ``model`` groups. ``like``: split
        where these specs cut so (a whole-on-data copy's, gathered into that shape)."""
        def split(spec: P, like: P) -> P:
            k = _model_major(like)
            if k is None:
                return spec
            rest = spec[k][1:] if isinstance(spec[k], tuple) else ()
            return P(*spec[:k], MODEL, rest[0] if len(rest) == 1 else rest or None,
                     *spec[k + 1:])
        is_spec = lambda x: isinstance(x, P)
        return jax.tree.map(split, specs, specs if like is None else like, is_leaf=is_spec)

    def to_split(self, values: PyTree, specs: PyTree) -> PyTree:
        """``values`` laid out by ``specs``, reshaped to ``split_model(specs)``: a free
        reshape, each device keeps its bytes."""
        def one(x, spec):
            k = _model_major(spec)
            return x if k is None else x.reshape(*x.shape[:k], self.tp_size, -1, *x.shape[k + 1:])
        return jax.tree.map(one, values, specs)

    def from_split(self, values: PyTree, specs: PyTree) -> PyTree:
        """``to_split`` undone."""
        def one(x, spec):
            k = _model_major(spec)
            return x if k is None else x.reshape(*x.shape[:k], -1, *x.shape[k + 2:])
        return jax.tree.map(one, values, specs)

    @property
    def dp_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    @property
    def has_master(self) -> bool:
        """A separate fp32 master copy: with 16-bit compute, when the optimizer is offloaded
        (the master is updated on the host while the compute copy stays on the device), and when
        hierarchical ZeRO gathers the compute copy across groups in int8 (else the optimizer
        would read back the rounded copy and lose every update under half an int8 level)."""
        return (self.precision.has_master or self.offloads_optimizer
                or bool(self.outer and self.comm.quantize_weights))

    @property
    def offloads_optimizer(self) -> bool:
        return any(leaf.offload for leaf in jax.tree.leaves(self.leaves, is_leaf=_is_leaf))

    @property
    def rule(self) -> Stage:
        return STAGES[self.stage]

    def _specs(self, sharded: bool, persistent_too: bool, everywhere: bool) -> PyTree:
        # ``everywhere``: cut over every data axis (inner-major, the order in which the
        # within-group and then the across-group reduce-scatter leave the pieces).
        axes = (self.axis, self.outer) if everywhere and self.outer else self.axis

        def spec(leaf: Leaf) -> P:
            parts = [None] * len(leaf.shape)
            if leaf.model_dim is not None and self.model:
                parts[leaf.model_dim] = self.model
            if sharded and leaf.axis is not None and (persistent_too or not leaf.persistent):
                # One dimension cut over both (leaf_rule): model-major
                parts[leaf.axis] = axes if parts[leaf.axis] is None else \
                    (self.model, *(axes if isinstance(axes, tuple) else (axes,)))
            return P(*parts) if any(p is not None for p in parts) else P()
        return jax.tree.map(spec, self.leaves, is_leaf=_is_leaf)

    @property
    def param_specs(self) -> PyTree:
        return self._specs(self.rule.shard_params, persistent_too=False, everywhere=False)

    @property
    def grad_specs(self) -> PyTree:
        """The layout gradients leave the backward in."""
        return self._specs(self.rule.shard_grads, persistent_too=False, everywhere=True)

    @property
    def opt_specs(self) -> PyTree:
        """The layout of optimizer state, and of gradients and parameters during the update."""
        return self._specs(self.rule.shard_opt_state, persistent_too=True, everywhere=True)

    def shardings(self, specs: PyTree) -> PyTree:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def opt_state_specs(self, tx: optax.GradientTransformation) -> PyTree:
        """The layout of ``tx``'s state: parts shaped like their parameter as ``opt_specs``;
        the rest (scalars, counters, Adafactor's factored moments) whole."""
        return self.map_opt_state(tx, lambda x, spec, leaf: spec if x.shape == leaf.shape
                                  else P(), self.opt_specs, P())

    def opt_state_offload(self, tx: optax.GradientTransformation) -> PyTree:
        """Per leaf of ``tx``'s state, whether it lives in host memory: the parts of an
        offloaded parameter; shared scalars (Adam's count) follow the device part, or the host
        when the whole optimizer is offloaded."""
        trained = [leaf for leaf in jax.tree.leaves(self.leaves, is_leaf=_is_leaf)
                   if not leaf.frozen]
        everything = bool(trained) and all(leaf.offload for leaf in trained)
        return self.map_opt_state(tx, lambda x, off, leaf: off, jax.tree.map(
            lambda leaf: leaf.offload, self.leaves, is_leaf=_is_leaf), everything)

    def map_opt_state(self, tx: optax.GradientTransformation, fn, per_param: PyTree,
                      other: Any) -> PyTree:
        """``fn(state_leaf, per_param_value, Leaf)`` for every part of ``tx``'s state that
        belongs to a parameter, whatever its shape under the parameter (SM3 keeps a list of
        per-dimension accumulators); ``other`` for the rest."""
        tx = self.optimizer(tx)
        state_shape = jax.eval_shape(tx.init, self.shapes)
        masked = lambda x: isinstance(x, optax.MaskedNode)
        stop = lambda x: isinstance(x, (Leaf, P))

        def part(value, leaf, sub):  # one parameter's part of the state: any tree
            return jax.tree.map(lambda x: x if masked(x) else fn(x, value, leaf), sub,
                                is_leaf=masked)

        # ``is_leaf`` true at the root hands each parameter-shaped copy over whole, so that its
        # parts may be trees (optax's own mapping needs each shaped exactly like a leaf).
        # Frozen leaves hold ``MaskedNode``s (no state) in the trained part's state.
        return optax.tree_map_params(
            tx, lambda sub: jax.tree.map(part, per_param, self.leaves, sub, is_leaf=stop),
            state_shape, transform_non_params=lambda _: other, is_leaf=lambda _: True)

    @property
    def blocks(self) -> list[str]:
        """The module paths gathered block by block, in parameter order."""
        return list(dict.fromkeys(leaf.block for leaf in
                                  jax.tree.leaves(self.leaves, is_leaf=_is_leaf) if leaf.block))

    @property
    def replicated(self) -> list[Leaf]:
        """Leaves whose parameters stay whole on every device (indivisible, ignored or
        persistent)."""
        return [leaf for leaf in jax.tree.leaves(self.leaves, is_leaf=_is_leaf)
                if leaf.axis is None or leaf.persistent]

    @property
    def frozen(self) -> list[Leaf]:
        """Leaves that are not trained."""
        return [leaf for leaf in jax.tree.leaves(self.leaves, is_leaf=_is_leaf) if leaf.frozen]

    def optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """``tx`` for the trained leaves; frozen ones get a zero update and carry no state."""
        if not self.frozen:
            return tx
        labels = jax.tree.map(lambda leaf: "frozen" if leaf.frozen else "trained", self.leaves,
                              is_leaf=_is_leaf)
        return optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def make_plan(params_shape: PyTree, mesh: Mesh, stage: int, *,
              layers: str | Layers | None = None, rules: tuple[Rule, ...] | list[Rule] = (),
              precision: Precision = Precision(), offload: Offload = Offload(),
              comm: Comm = Comm()) -> Plan:
    """Apply the rules to a parameter tree (arrays or ``jax.ShapeDtypeStruct``s).

    ``mesh`` (``make_mesh``) has a ``data`` axis that parameters are cut over, and for
    hierarchical ZeRO a ``replica`` axis across groups of ``data`` (stage 3 within a group,
    gradients and optimizer state over both).

    ``layers``: the model's blocks, a regular expression over module paths (unrolled blocks
    "h/\\d+", or an ``nn.scan`` stack "blocks", leading dimension = layer), or a ``Layers``
    that also says what each keeps for its backward (remat policy, ZeRO-R's Pa). At stage 3
    each block's parameters are gathered as it runs and again in its backward
    (``zero_jax.blocks``); at stage 2 its gradient is reduce-scattered as its backward ends.
    Other cut leaves are gathered once per step. ``rules``: the placement table over parameter
    paths (``Rule``: left out of ZeRO, frozen, persistence threshold, tensor-parallel cut).
    ``precision`` (dtypes, loss scaling), ``offload`` and ``comm`` are
    policies that check themselves when built.
    """
    axis, outer = data_axes(mesh)
    t = mesh.shape[MODEL] if MODEL in mesh.axis_names else 1
    layers = Layers(layers) if isinstance(layers, str) else layers
    comm = _aligned(comm, mesh)
    _check_combination(stage, layers, offload, comm, outer, t > 1)
    n = mesh.shape[axis] * (mesh.shape[outer] if outer else 1)
    flat = {path_str(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(params_shape)[0]}
    blocks = find_blocks(list(flat), layers.pattern) if layers else {}
    stacked = {b: scanned([flat[p] for p in blocks if blocks[p] == b])
               for b in set(blocks.values())}
    fields = match_rules(rules, list(flat))
    # On one device nothing needs cutting, except to stream gradients and parameters to the
    # host layer by layer, or to run stage 3's blocks as on many (each rematerialized under
    # the plan's policy, prefetched): then every leaf is cut into one shard (its collectives
    # over one device are no-ops), so it travels as stage 2's and 3's shards do.
    cut_one = offload.any or (stage == 3 and bool(layers))

    def rule(path, x):
        name, f = path_str(path), fields[path_str(path)]
        in_stack = name in blocks and stacked[blocks[name]]
        model = (f["model_dim"], t) if MODEL in mesh.axis_names else None
        if not f["shard"]:
            leaf = leaf_rule(name, tuple(x.shape), 1, in_stack, 0, False, model)
            leaf = dataclasses.replace(leaf, reason="ignored_modules")
        else:
            leaf = leaf_rule(name, tuple(x.shape), n, in_stack, f["min_shard_elems"], cut_one,
                             model, subdivide=stage > 0)
        return dataclasses.replace(leaf, frozen=f["frozen"], block=blocks.get(name))

    leaves = jax.tree_util.tree_map_with_path(rule, params_shape)
    host = offloaded(jax.tree.leaves(leaves, is_leaf=_is_leaf), offload.optimizer)
    bound = layers.tile_bytes if layers else 0
    leaves = jax.tree.map(lambda leaf: tile_leaf(dataclasses.replace(
        leaf, offload=leaf.path in host), bound, precision.compute.itemsize), leaves,
        is_leaf=_is_leaf)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_shape)
    return _warned(Plan(stage, mesh, axis, leaves, shapes, precision, outer, offload, comm,
                        layers))


def _aligned(comm: Comm, mesh: Mesh) -> Comm:
    """``comm`` with ``align`` 0 resolved by the devices: whole tiles on TPUs."""
    if comm.align:
        return comm
    tpu = mesh.devices.flat[0].platform == "tpu"
    return dataclasses.replace(comm, align=TPU_TILE if tpu else 1)


def held_once(plan: Plan) -> list[str]:
    """What a user should know about the layout: at stage 3, parameters gathered once per step
    (outside any block) are held whole for the whole step."""
    if not plan.rule.shard_params:
        return []
    leaves = [leaf for leaf in jax.tree.leaves(plan.leaves, is_leaf=_is_leaf)
              if leaf.axis is not None and not leaf.persistent]
    per_step = sum(math.prod(leaf.shape) for leaf in leaves if leaf.block is None)
    cut = sum(math.prod(leaf.shape) for leaf in leaves)
    where = "no blocks named" if not plan.blocks else "outside the named blocks"
    if cut and per_step > cut / 2:
        return [f"stage 3 gathers {per_step / cut:.0%} of the cut parameters once per step and "
                f"holds them whole through it ({where}): name the model's blocks (make_plan "
                "layers=, zero.transformer_layers) to hold one block at a time"]
    return []


def _warned(plan: Plan) -> Plan:
    """``plan``, after warning of what ``held_once`` finds: a user's own loop has no report."""
    for text in held_once(plan):
        warnings.warn(text, stacklevel=3)
    return plan


def data_axes(mesh: Mesh) -> tuple[str, str | None]:
    """The mesh's data axis, and hierarchical ZeRO's across-group axis if it has one."""
    names = set(mesh.axis_names)
    if DATA not in names or names - {DATA, REPLICA, MODEL}:
        raise ValueError(f"make_plan needs a mesh of axes {DATA!r} (and {REPLICA!r} for "
                         f"hierarchical ZeRO, {MODEL!r} for tensor parallelism), got "
                         f"{mesh.axis_names}: build it with zero_jax.make_mesh(axes={{{DATA!r}: "
                         f"-1, {MODEL!r}: 2}})")
    return DATA, REPLICA if REPLICA in names else None


def _check_combination(stage: int, layers: Layers | None, offload: Offload, comm: Comm,
                       outer: str | None, tensor_parallel: bool) -> None:
    """The options that are valid alone but not together (each policy checks itself)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3 (got {stage})")
    if layers and layers.partition and not tensor_parallel:
        raise ValueError("Layers(partition=True) cuts the blocks' saved inputs over the 'model' "
                         "axis: it needs tensor parallelism (a mesh with a 'model' axis)")
    if layers and layers.tile_bytes and (stage != 3 or layers.prefetch or offload.any
                                         or tensor_parallel):
        what = next(w for w, on in ((f"stage {stage}", stage != 3), ("prefetch", layers.prefetch),
                                    ("offload", offload.any),
                                    ("tensor parallelism", tensor_parallel)) if on)
        raise ValueError(f"Layers(tile_mb=...) gathers stage 3's large parameters tile by tile; "
                         f"it is not built with {what}: use stage 3, without prefetch, offload "
                         f"or tensor parallelism")
    if layers and layers.gather == "module" and stage != 3:
        raise ValueError(f"Layers(gather='module') gathers each module of stage 3's blocks as "
                         f"it runs; stage {stage} gathers none: use stage 3")
    if offload.params and stage != 3:
        raise ValueError(f"Offload.params keeps stage 3's parameter shards in host memory; "
                         f"stage {stage} keeps whole parameters on every device: use stage 3")
    if offload.params and outer:
        raise ValueError("Offload.params runs the whole update on the host as each layer's "
                         "gradient arrives: it is not built for hierarchical ZeRO yet")
    if outer is not None and stage != 3:
        raise ValueError(f"hierarchical ZeRO (a {outer!r} mesh axis) is built on stage 3, not "
                         f"{stage}")
    if comm.quantize_weights and stage != 3:
        raise ValueError(f"quantize_weights makes stage 3's parameter all-gathers int8; stage "
                         f"{stage} gathers no parameters in its layers: use stage 3")
    if comm.quantize_grads and stage < 2:
        raise ValueError(f"quantize_grads makes the gradient reduce-scatters of stages 2-3 int8; "
                         f"stage {stage} all-reduces: use stage 2 or 3")
    if layers and layers.prefetch and not prefetchable(stage, True):
        raise ValueError(f"Layers(prefetch=True) overlaps stage 3's per-layer gathers with the "
                         f"layer before; stage {stage} gathers none: use stage 3")


def prefetchable(stage: int, has_layers: bool) -> bool:
    """Whether prefetch (``zero_jax.blocks.prefetch``) can run: stage 3's per-layer gathers."""
    return stage == 3 and has_layers


def offloaded(leaves: list[Leaf], ratio: float) -> set[str]:
    """The trained leaves whose optimizer state goes to the host: the largest first, until
    ``ratio`` of the optimizer's bytes (proportional to the parameters') is reached."""
    trained = sorted((leaf for leaf in leaves if not leaf.frozen),
                     key=lambda leaf: (-math.prod(leaf.shape), leaf.path))
    budget, taken, host = ratio * sum(math.prod(leaf.shape) for leaf in trained), 0, set()
    for leaf in trained:
        if taken >= budget:
            break
        host.add(leaf.path)
        taken += math.prod(leaf.shape)
    return host


def modules_pattern(names: list[str] | tuple[str, ...]) -> str | None:
    """A path pattern for the parameters of the named modules ("blocks", "encoder/proj"), for
    ``layers=`` or a ``Rule``; None for no names."""
    if not names:
        return None
    return "^(?:" + "|".join(re.escape(n.strip("/")) for n in names) + ")(?:/|$)"
