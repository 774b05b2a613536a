"""zero_jax beside the peers a JAX user would otherwise pick: plain-jit DDP and MaxText-style
GSPMD FSDP, same model, optimizer, initial parameters and batches; step time, memory and the
collectives of each compiled step.

    python bench/peers.py [--config tiny] [--devices 8] [--steps 20] [--rounds 5] [--set K=V]

``--compile-only``: no run and no timing, the memory questions in seconds: per row the
compiled temp, the arguments (model states and the batch), their total, and what is live at
the step's peak by kind (``zero_jax.peak``).

On a data x model mesh (tensor parallelism, ``--set mesh.tensor_parallel=2``): zero_jax's stages
on it, beside a MaxText-style GSPMD baseline on the same mesh (parameters and AdamW moments on
``data`` and, by the demo's ``TENSOR_PARALLEL`` table, on ``model``; activations pinned
batch-sharded); the variants, DDP and the unconstrained FSDP are left out:

    python bench/peers.py --rounds 3 --steps 10 --set mesh.tensor_parallel=2

A wider model (``d_ff`` does not follow ``d_model`` by itself: keep GPT's 4x by hand):

    python bench/peers.py --rounds 3 --steps 10 --set model.d_model=512 --set model.d_ff=2048

``--model unrolled``: the same comparison on a GPT-2 whose blocks are built in a Python loop
and named ``h_0 .. h_{n-1}`` (``UnrolledGPT``, as every HF Flax model is written), at the
config's widths: zero_jax through its library API alone (``zj.make_plan`` with
``layers=zj.Layers(UNROLLED_BLOCKS, prefetch=...)``) at stage 0, stage 3 and stage 3
with prefetch (``zero_jax.blocks.chain``), beside DDP and the GSPMD FSDP baselines compiled for the
same model; every row's first loss checked against stage 0's (the zero_jax rows' too):

    python bench/peers.py --model unrolled --rounds 3 --steps 10

Rows: zero_jax stages 0-3 (built from the config as ``bench/stages.py`` builds them), the
``VARIANTS`` below, then three baselines written here with plain ``jax.jit``:

* DDP: parameters and AdamW state replicated (``P()``), the batch cut on the data axis; the
  partitioner all-reduces the gradients.
* GSPMD FSDP, MaxText style: every parameter and its AdamW moments cut along their largest
  dimension the device count divides (never a scanned stack's layer axis; whole if none
  divides), the batch cut on the data axis, and the activations pinned batch-sharded
  (``with_sharding_constraint`` to ``P('data', None, None)`` on each block's input and output
  and on the logits), so that the partitioner gathers the weights, not the activations.
* The same FSDP without the activation constraints: the partitioner is free to gather
  activations instead (the point of the constraints).

Before timing, every run takes its first step on the same batch from the same parameters: each
baseline's loss must equal zero_jax stage 0's within 1e-5, or the script stops (exit 1). The
comparison is in fp32 (``precision.param_dtype=fp32`` unless you ``--set`` otherwise, and the
baselines refuse anything else).

Columns: step ms (median over rounds, interleaved, ``bench/harness.py``); the median over rounds
of the step time over zero_jax stage 0's in the same round; the compiled step's temp memory
(``memory_analysis().temp_size_in_bytes``); model
states per device (parameters, fp32 master if any, optimizer state: the bytes of each array's
shard on one device); the collectives of the compiled step (``zero_jax.hlo``) per kind, as
executions per step / payload MiB per step (the full-size buffer; an all-reduce counted once).
On the simulated CPU mesh only the ratios mean something; there, too, XLA reduces the FSDP
baselines' gradients with all-reduce (each device then keeps its slice), where the GPU
backend's passes would turn that into a reduce-scatter.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import harness  # bench/harness.py, beside this script
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Extra zero_jax rows: a name and its --set overrides (on top of the command line's). Not
# checked against stage 0's loss: a quantized variant computes another loss by design.
VARIANTS: dict[str, list[str]] = {
    # bucket_mb=0: one collective per leaf, against the default 25 MiB buckets (stage 0: one
    # all-reduce after the backward instead of one per layer inside it); stage 3 without
    # prefetch (the default gathers layer i+1 during layer i); gathering each module as it
    # runs instead of each block (zero.gather, no prefetch); ZeRO++'s int8.
    "zero_jax stage 0, no buckets": ["zero.stage=0", "zero.bucket_mb=0"],
    "zero_jax stage 3, no buckets": ["zero.stage=3", "zero.bucket_mb=0"],
    "zero_jax stage 3, no prefetch": ["zero.stage=3", "zero.prefetch=false"],
    "zero_jax stage 3, by module": ["zero.stage=3", "zero.gather=module"],
    "zero_jax stage 3, int8 weights": ["zero.stage=3", "zero.quantize_weights=int8"],
    "zero_jax stage 3, int8 grads": ["zero.stage=3", "zero.quantize_grads=int8"],
}

LOSS_TOLERANCE = 1e-5
SEED_KEY = 0  # harness.build initializes zero_jax with jax.random.key(0): the same here
PyTree = Any


class State(NamedTuple):
    """A baseline's train state: what an optax loop carries."""

    params: PyTree
    opt_state: PyTree


UNROLLED_BLOCKS = r"^h_\d+$"  # the plan's ``layers`` for UnrolledGPT


def _dense(features: int, name: str, std: float = 0.02) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.normal(std), name=name)


class HFAttention(nn.Module):
    """Causal self-attention as FlaxGPT2Attention names its parts (``c_attn``, ``c_proj``)."""

    cfg: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        b, t, d = x.shape
        dh = d // c.n_heads
        q, k, v = jnp.split(_dense(3 * d, "c_attn")(x).reshape(b, t, 3 * c.n_heads, dh), 3, 2)
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(dh)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(x.dtype).min)
        att = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
        return _dense(d, "c_proj", 0.02 / math.sqrt(2 * c.n_layers))(att.reshape(b, t, d))


class HFMLP(nn.Module):
    """FlaxGPT2MLP's ``c_fc`` and ``c_proj``."""

    cfg: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        h = nn.gelu(_dense(c.d_ff, "c_fc")(x))
        return _dense(c.d_model, "c_proj", 0.02 / math.sqrt(2 * c.n_layers))(h)


class HFBlock(nn.Module):
    """A GPT-2 block as FlaxGPT2Block writes it: ``ln_1``, ``attn``, ``ln_2``, ``mlp``."""

    cfg: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        eps = self.cfg.norm_eps  # GPT-2's 1e-5, as the demo's scanned GPT
        x = x + HFAttention(self.cfg, name="attn")(nn.LayerNorm(eps, name="ln_1")(x))
        return x + HFMLP(self.cfg, name="mlp")(nn.LayerNorm(eps, name="ln_2")(x))


class UnrolledGPT(nn.Module):
    """The demo's GPT (a ``GPTConfig``'s widths) with its blocks unrolled: a Python loop of
    ``h_i``, each under the model's own ``nn.remat`` unless ``remat`` is none, the way published
    Flax models are written and the way zero_jax meets them (no ``nn.scan`` to gather in)."""

    cfg: Any

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x, head = self.features(tokens)
        return (x @ head)[..., :self.cfg.vocab_size]

    @nn.compact
    def features(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        from zero_jax.blocks import remat_policy
        from zero_jax.gpt.model import embed

        c = self.cfg
        x, wte = embed(self, c, tokens)
        block = HFBlock
        if c.remat != "none":
            block = nn.remat(block, policy=remat_policy(c.remat))  # CSE kept off: no scan
        for i in range(c.n_layers):
            x = block(c, name=f"h_{i}")(x)
        return nn.LayerNorm(c.norm_eps, name="ln_f")(x), wte.T


def _model(kind: str, model_cfg):
    """The demo's scanned GPT or ``UnrolledGPT`` (``kind``: ``--model``), of one ``GPTConfig``."""
    from zero_jax.gpt.model import GPT

    return {"scanned": GPT, "unrolled": UnrolledGPT}[kind](model_cfg)


def _setup(cfg: dict, mesh: Mesh, mixed: bool = False, kind: str = "scanned"):
    """The model, init, loss and optimizer of ``cfg`` exactly as the experiment builds them (at
    stage 0, where the model keeps the config's own remat). ``mixed``: a compute dtype other
    than fp32 is allowed (compiled, not run: ``fsdp_lowered``); the loss then casts the fp32
    parameters to it, as zero_jax computes from its fp32 master. ``kind``: ``_model``'s."""
    from zero_jax.gpt.experiment import Experiment
    from zero_jax.gpt.model import lm_loss

    cfg = copy.deepcopy(cfg)
    cfg["zero"]["stage"] = 0
    exp = Experiment.build(cfg, mesh)
    compute = exp.plan.precision.compute
    if compute != np.float32 and not mixed:
        raise ValueError("the baselines compute in fp32: pass --set precision.param_dtype=fp32 "
                         "(peers.py does, unless told otherwise)")
    model = _model(kind, exp.model)
    loss = lm_loss(model)
    if compute == np.float32:
        return exp, model, loss
    cast = lambda p: jax.tree.map(lambda x: x.astype(compute), p)
    return exp, model, lambda p, tokens: loss(cast(p), tokens)


def _axes(mesh: Mesh) -> str | tuple[str, ...]:
    """Every mesh axis but ``model`` is data-parallel: the batch, and FSDP's shards, span them."""
    names = tuple(a for a in mesh.axis_names if a != "model")
    return names[0] if len(names) == 1 else names


def fsdp_spec(shape: tuple[int, ...], n: int, axes, stacked: bool = False) -> P:
    """Cut along the largest dimension ``n`` divides (the first of equals; a scanned stack's
    layer axis, dimension 0 when ``stacked``, never); whole if none divides."""
    dims = [i for i, d in enumerate(shape) if d % n == 0 and not (stacked and i == 0)]
    if not dims or n == 1:
        return P()
    cut = max(dims, key=lambda i: (shape[i], -i))
    return P(*(axes if i == cut else None for i in range(len(shape))))


def fsdp_param_specs(shapes: PyTree, mesh: Mesh) -> PyTree:
    """FSDP's cut on the data axes; with a ``model`` axis, also Megatron's (the demo's
    ``TENSOR_PARALLEL`` table), the data cut then on another dimension."""
    from zero_jax.gpt.model import LAYER_STACKS, TENSOR_PARALLEL
    from zero_jax.plan import match_rules, path_str

    t = mesh.shape.get("model", 1)
    n = mesh.size // t
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    model_dims = ({p: f["model_dim"] for p, f in match_rules(TENSOR_PARALLEL, paths).items()}
                  if t > 1 else dict.fromkeys(paths))  # the table names the scanned model's

    def spec(path, x):
        name, shape = path_str(path), tuple(x.shape)
        stacked = name.split("/")[0] in LAYER_STACKS
        dim = None if t == 1 or model_dims[name] is None else model_dims[name] % len(shape)
        masked = tuple(1 if i == dim else d for i, d in enumerate(shape))  # not cut twice
        parts = list(fsdp_spec(masked, n, _axes(mesh), stacked)) or [None] * len(shape)
        if dim is not None:
            parts[dim] = "model"
        return P(*parts) if any(x is not None for x in parts) else P()
    return jax.tree_util.tree_map_with_path(spec, shapes)


def opt_state_specs(tx: optax.GradientTransformation, params: PyTree, specs: PyTree) -> PyTree:
    """Each optimizer-state leaf laid out as the parameter its path ends in (Adam's moments);
    anything else (step counts) whole."""
    from zero_jax.plan import path_str

    by_path = {path_str(p): s for p, s in
               jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]}
    shapes = {path_str(p): tuple(x.shape) for p, x in
              jax.tree_util.tree_flatten_with_path(params)[0]}

    def spec(path, x):
        name = path_str(path)
        for p, s in by_path.items():
            if (name == p or name.endswith("/" + p)) and tuple(x.shape) == shapes[p]:
                return s
        return P()
    return jax.tree_util.tree_map_with_path(spec, jax.eval_shape(tx.init, params))


def activation_constraints(mesh: Mesh) -> Callable:
    """A flax method interceptor pinning each block's input and output, and the last hidden
    states (the loss's input) or the logits, to ``P(data, None, None)``: batch-sharded, as
    MaxText constrains its activations. The scanned stack's ``Block`` and the unrolled
    ``HFBlock`` alike (the latter takes and returns x)."""
    from zero_jax.gpt.model import GPT, Block

    batch_sharded = NamedSharding(mesh, P(_axes(mesh), None, None))
    pin = lambda x: jax.lax.with_sharding_constraint(x, batch_sharded)

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name not in ("__call__", "features"):
            return next_fun(*args, **kwargs)
        if type(context.module) is Block:  # inside the scan (and remat) wrappers
            x, carry = args
            out, carry = next_fun(pin(x), carry, **kwargs)
            return pin(out), carry
        if type(context.module) is HFBlock:  # inside its remat wrapper, if any
            return pin(next_fun(pin(args[0]), *args[1:], **kwargs))
        if type(context.module) in (GPT, UnrolledGPT):
            out = next_fun(*args, **kwargs)
            if context.method_name == "features":  # (hidden states, the head)
                return pin(out[0]), out[1]
            return pin(out)
        return next_fun(*args, **kwargs)
    return interceptor


@functools.cache
def _init(model, kind: str = "scanned") -> Callable[[jax.Array], PyTree]:
    """The init of the model ``model`` (a ``GPTConfig``) configures, compiled once for all the
    baselines (threefry draws the same numbers whatever the layout: these are zero_jax's
    sharded initial parameters, bit for bit)."""
    from zero_jax.gpt.model import init_fn

    return jax.jit(init_fn(_model(kind, model)))


def _jitted(cfg: dict, mesh: Mesh, param_specs: Callable[[PyTree], PyTree], constrain: bool,
            mixed: bool = False, kind: str = "scanned"):
    """``(experiment, parameter shapes, shardings, jitted step)`` of a baseline."""
    from zero_jax.gpt.model import init_fn

    exp, model, loss_fn = _setup(cfg, mesh, mixed, kind)
    tx = exp.tx
    shapes = jax.eval_shape(init_fn(model), jax.random.key(SEED_KEY))
    p_specs = param_specs(shapes)
    specs = State(p_specs, opt_state_specs(tx, shapes, p_specs))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
    interceptor = activation_constraints(mesh) if constrain else None

    def loss(p, tokens):
        if interceptor is None:
            return loss_fn(p, tokens)
        with nn.intercept_methods(interceptor):
            return loss_fn(p, tokens)

    def step(state: State, batch: jax.Array):
        value, grads = jax.value_and_grad(loss)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return State(optax.apply_updates(state.params, updates), opt_state), {"loss": value}

    replicated = NamedSharding(mesh, P())
    return exp, shapes, shardings, jax.jit(step, out_shardings=(shardings, replicated),
                                           donate_argnums=0)


def _baseline(cfg: dict, mesh: Mesh, param_specs: Callable[[PyTree], PyTree],
              constrain: bool, params: PyTree | None, kind: str = "scanned"):
    exp, _, shardings, jitted = _jitted(cfg, mesh, param_specs, constrain, kind=kind)
    if params is None:  # the same init function and key as zero_jax's (harness.build)
        params = _init(exp.model, kind)(jax.random.key(SEED_KEY))
    # Copies, in this layout: the caller's arrays may be donated later.
    params = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), params,
                          shardings.params)
    state = State(params, jax.jit(exp.tx.init, out_shardings=shardings.opt_state)(params))
    compiled = jitted.lower(state, exp.batch_shape).compile()
    return jitted, state, compiled


def fsdp_lowered(cfg: dict, mesh: Mesh, constrain: bool = True, kind: str = "scanned"):
    """The MaxText-style GSPMD FSDP step of ``fsdp_step``, lowered from shapes alone (no
    arrays: for a deviceless compile, ``bench/gpu.py --compile-for``), in the config's compute
    dtype: fp32 parameters and AdamW moments, cast to it in the loss."""
    exp, shapes, shardings, jitted = _jitted(
        cfg, mesh, lambda s: fsdp_param_specs(s, mesh), constrain, mixed=True, kind=kind)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         State(shapes, jax.eval_shape(exp.tx.init, shapes)), shardings)
    return exp, jitted.lower(state, exp.batch_shape)


def ddp_step(cfg: dict, mesh: Mesh, params: PyTree | None = None, kind: str = "scanned"):
    """``(jitted step, state, compiled step)`` of plain-jit data parallelism: parameters and
    optimizer state replicated, batch sharded. ``params``: initial parameters to copy (default:
    the config's init at ``jax.random.key(0)``, as zero_jax's)."""
    return _baseline(cfg, mesh, lambda shapes: jax.tree.map(lambda _: P(), shapes), False,
                     params, kind)


def fsdp_step(cfg: dict, mesh: Mesh, constrain: bool = True, params: PyTree | None = None,
              kind: str = "scanned"):
    """``(jitted step, state, compiled step)`` of MaxText-style GSPMD FSDP: parameters and AdamW
    moments cut on the data axis (``fsdp_spec``), batch sharded; with ``constrain``, the
    activations pinned batch-sharded (``activation_constraints``)."""
    return _baseline(cfg, mesh, lambda shapes: fsdp_param_specs(shapes, mesh), constrain,
                     params, kind)


def unrolled_zero(cfg: dict, mesh: Mesh, stage: int, prefetch: bool = False):
    """``(plan, tx, init, jitted step)`` of zero_jax on ``UnrolledGPT``, built as a user of the
    library would (``make_plan`` with ``layers``, ``make_train_step``), not by the demo's
    ``Experiment``: the optimizer and dtypes from the config. At stage 3 the step remats each
    block itself (the config's policy), so the model's own remat is off there, as the demo's."""
    import zero_jax as zj
    from zero_jax.gpt.experiment import precision_from, resolved_model
    from zero_jax.gpt.model import GPTConfig, init_fn, lm_loss
    from zero_jax.gpt.optim import make_optimizer

    platform = mesh.devices.flat[0].platform
    precision = precision_from(cfg["precision"], platform)
    m = resolved_model(cfg["model"], platform, precision.compute)
    remat = m["remat"]
    model = UnrolledGPT(GPTConfig(**{**m, "remat": "none" if stage == 3 else remat}))
    init = init_fn(model)
    tx, schedule = make_optimizer(cfg["optimizer"], cfg["train"]["steps"])
    plan = zj.make_plan(jax.eval_shape(init, jax.random.key(SEED_KEY)), mesh, stage,
                        layers=zj.Layers(UNROLLED_BLOCKS, remat, prefetch=prefetch),
                        precision=precision)
    step = zj.make_train_step(plan, lm_loss(model), tx, lr_schedule=schedule,
                              accum_steps=cfg["train"]["accum_steps"])
    return plan, tx, init, step


def unrolled_rows() -> list[tuple[str, int, bool]]:
    """zero_jax's rows on the unrolled model: (name, stage, prefetch)."""
    return [("zero_jax stage 0", 0, False), ("zero_jax stage 3, no prefetch", 3, False),
            ("zero_jax stage 3, prefetch", 3, True)]


def model_state_bytes(tree: PyTree) -> int:
    """What one device holds of ``tree``: its addressable shard of each array."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def gathered_shapes(hlo_text: str) -> list[tuple[int, ...]]:
    """The shape of each array the all-gathers in ``hlo_text`` produce (an async start's shape
    is (operands, results): its last part)."""
    from zero_jax.hlo import computations, instruction, top_level

    out = []
    for lines in computations(hlo_text)[0].values():
        for _, shape, op, _ in filter(None, map(instruction, lines)):
            if op in ("all-gather", "all-gather-start"):
                result = top_level(shape)[-1] if op.endswith("-start") else shape
                out += [tuple(int(d) for d in dims.split(",") if d)
                        for dims in re.findall(r"\[([\d,]*)\]", result)]
    return out


def _baseline_run(name: str, built, batches: list) -> dict:
    _, state, compiled = built
    return dict(name=name, step=compiled, state=state, batches=batches, times=[],
                compiled=compiled, states_bytes=model_state_bytes(state), checked=True)


def bytes_by_axes(hlo_text: str, mesh: Mesh) -> str:
    """MiB per step of a compiled step's collectives (an all-reduce counted once) by the mesh
    axes their groups span (``report.mesh_axes``): on a 2-D mesh, ZeRO's belong on ``data``
    and tensor parallelism's on ``model``."""
    from zero_jax.hlo import collectives
    from zero_jax.report import mesh_axes

    totals: dict[str, int] = {}
    for c in collectives(hlo_text, mesh.size):
        axes = mesh_axes(c.group, mesh)
        totals[axes] = totals.get(axes, 0) + c.count * c.bytes
    return ", ".join(f"{axes} {v / 2 ** 20:.2f}" for axes, v in sorted(totals.items()))


def _add_model_flag(p) -> None:
    p.add_argument("--model", choices=("scanned", "unrolled"), default="scanned",
                   help="the demo's nn.scan stack, or UnrolledGPT's blocks h_0 .. h_{n-1}")


def _unrolled_runs(cfg: dict, mesh: Mesh, tokens, steps: int) -> list[dict]:
    """zero_jax's rows on ``UnrolledGPT`` and the baselines compiled for it, on the same
    batches; every row checked against stage 0's initial parameters and first loss."""
    from zero_jax.gpt import data
    from zero_jax.state import init_state

    runs = []
    for name, stage, prefetch in unrolled_rows():
        plan, tx, init, step = unrolled_zero(cfg, mesh, stage, prefetch)
        state = init_state(plan, init, tx, jax.random.key(SEED_KEY))
        sharding = NamedSharding(mesh, P(plan.data_axes))
        batch, seq = cfg["train"]["batch_size"], cfg["model"]["seq_len"]
        compiled = step.lower(state, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32,
                                                          sharding=sharding)).compile()
        batches = runs[0]["batches"] if runs else [
            jax.device_put(data.batch(tokens, i, batch, seq, 0), sharding) for i in range(steps)]
        runs.append(dict(name=name, step=compiled, compiled=compiled, state=state,
                         batches=batches, times=[], checked=bool(runs),
                         states_bytes=model_state_bytes((state.params, state.master,
                                                         state.opt_state))))
    init = jax.tree.map(np.asarray, runs[0]["state"].params)
    kind = dict(kind="unrolled", params=init)
    return [*runs,
            _baseline_run("GSPMD FSDP, activations constrained",
                          fsdp_step(cfg, mesh, constrain=True, **kind), runs[0]["batches"]),
            _baseline_run("DDP (jit, replicated)", ddp_step(cfg, mesh, **kind),
                          runs[0]["batches"]),
            _baseline_run("GSPMD FSDP, unconstrained",
                          fsdp_step(cfg, mesh, constrain=False, **kind), runs[0]["batches"])]


def main() -> None:
    args = harness.parse_args(__doc__.splitlines()[0], _add_model_flag)

    from zero_jax.gpt import config, data
    from zero_jax.gpt.experiment import mesh_for

    sets = ["precision.param_dtype=fp32", *args.set]
    mesh = mesh_for(config.load(args.config, sets), args.devices)
    two_d = "model" in mesh.axis_names
    unrolled = args.model == "unrolled"
    if unrolled and (two_d or "replica" in mesh.axis_names):
        raise SystemExit("--model unrolled: one data axis only (no tensor parallelism or "
                         "hierarchical ZeRO: its blocks have no TENSOR_PARALLEL table)")
    if args.compile_only:
        return memory_table(args.config, sets, mesh, args.model)
    print(f"{args.model} model; " + harness.header(args.config, mesh, args.rounds, args.steps),
          flush=True)
    tokens = data.stdlib_corpus()
    if unrolled:
        runs = _unrolled_runs(config.load(args.config, sets), mesh, tokens, args.steps)
    else:
        runs = _scanned_runs(args, sets, mesh, tokens)
    base = runs[0]
    init = jax.tree.map(np.asarray, base["state"].params)  # before any step donates it

    # The same first step everywhere: same parameters, same batch, the same loss.
    failures = []
    for r in runs:
        if r["checked"]:
            same = all(np.array_equal(a, b) for a, b in zip(
                jax.tree.leaves(init), jax.tree.leaves(r["state"].params), strict=True))
            if not same:
                failures.append(f"{r['name']}: initial parameters differ from zero_jax stage 0's")
        r["state"], metrics = r["step"](r["state"], base["batches"][0])
        r["loss1"] = float(metrics["loss"])
    print(f"step 1 loss, zero_jax stage 0: {base['loss1']:.7f}; difference of each run "
          f"(baselines{', and stage 3 on the unrolled model,' * unrolled} must be within "
          f"{LOSS_TOLERANCE:g}):")
    for r in runs[1:]:
        diff = r["loss1"] - base["loss1"]
        bad = r["checked"] and not abs(diff) <= LOSS_TOLERANCE
        print(f"  {r['name']}: {diff:+.2e}{'  FAILED' if bad else ''}")
        if bad:
            failures.append(f"{r['name']}: step-1 loss {r['loss1']:.7f} differs from zero_jax "
                            f"stage 0's {base['loss1']:.7f} by {diff:+.2e}")
    if failures:
        print("\n".join(f"error: {f}" for f in failures), file=sys.stderr)
        raise SystemExit(1)
    print(flush=True)

    harness.time_interleaved(runs, args.rounds)

    mib = 2 ** 20
    print("| run | step ms | time / stage 0 (same round) | temp MiB | model states MiB/device "
          "| total MiB/device | collectives per step (count / MiB) | MiB/step by mesh axes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        temp = r["compiled"].memory_analysis().temp_size_in_bytes
        comm = harness.collectives_summary(r["compiled"].as_text(), mesh.size)
        # The median of same-round ratios: a slow round slows every run in it alike.
        ratio = statistics.median(t / b for t, b in zip(r["times"][1:], base["times"][1:],
                                                         strict=True))
        print(f"| {r['name']} | {r['ms']:.1f} | {ratio:.2f} | {temp / mib:.2f} "
              f"| {r['states_bytes'] / mib:.2f} | {(temp + r['states_bytes']) / mib:.2f} "
              f"| {harness.format_collectives(comm)} "
              f"| {bytes_by_axes(r['compiled'].as_text(), mesh)} |")


def _scanned_runs(args, sets: list[str], mesh: Mesh, tokens) -> list[dict]:
    """zero_jax's stages and ``VARIANTS`` on the demo's GPT (``harness.build``), then the
    baselines; only the baselines checked against stage 0's initial parameters and loss."""
    from zero_jax.gpt import config

    two_d = "model" in mesh.axis_names
    runs = []
    for stage in range(4):
        runs.append(dict(name=f"zero_jax stage {stage}", checked=False, **harness.build(
            config.load(args.config, [*sets, f"zero.stage={stage}"]), mesh, tokens, args.steps)))
    for name, extra in ({} if two_d else VARIANTS).items():
        runs.append(dict(name=name, checked=False, **harness.build(
            config.load(args.config, [*sets, *extra]), mesh, tokens, args.steps)))
    for r in runs:
        r["compiled"] = r["step"]
        s = r["state"]
        r["states_bytes"] = model_state_bytes((s.params, s.master, s.opt_state))
    base = runs[0]
    cfg = base["exp"].cfg
    runs.append(_baseline_run("GSPMD FSDP" + " x tensor" * two_d + ", activations constrained",
                              fsdp_step(cfg, mesh, constrain=True), base["batches"]))
    if not two_d:
        runs += [_baseline_run("DDP (jit, replicated)", ddp_step(cfg, mesh), base["batches"]),
                 _baseline_run("GSPMD FSDP, unconstrained",
                               fsdp_step(cfg, mesh, constrain=False), base["batches"])]
    return runs


def memory_table(name: str, sets: list[str], mesh: Mesh, kind: str = "scanned") -> None:
    """``--compile-only``: each row compiled from shapes alone, its memory per device."""
    from zero_jax.gpt import config
    from zero_jax.gpt.experiment import Experiment
    from zero_jax.peak import compile_with_peak
    from zero_jax.state import abstract_state

    lowered = {}
    if kind == "unrolled":
        cfg = config.load(name, sets)
        batch = Experiment.build(cfg, mesh).batch_shape  # the demo's: same global batch
        for row, stage, prefetch in unrolled_rows():
            plan, tx, _, step = unrolled_zero(cfg, mesh, stage, prefetch)
            lowered[row] = step.lower(abstract_state(plan, tx), batch)
    else:
        rows = [(f"zero_jax stage {s}", [f"zero.stage={s}"]) for s in range(4)]
        rows += [] if "model" in mesh.axis_names else list(VARIANTS.items())
        for row, extra in rows:
            exp = Experiment.build(config.load(name, [*sets, *extra]), mesh)
            lowered[row] = exp.step.lower(abstract_state(exp.plan, exp.tx), exp.batch_shape)
    for row, constrain in (("GSPMD FSDP, activations constrained", True),
                           ("GSPMD FSDP, unconstrained", False)):
        lowered[row] = fsdp_lowered(config.load(name, sets), mesh, constrain, kind)[1]
    mib = 2 ** 20
    print(f"{name} config, {kind} model, on {mesh.size} devices, compiled only: MiB per "
          "device\n")
    print("| run | temp | arguments | total | peak | at the peak, by kind "
          "| temp when fullest, by kind | collectives MiB/step by mesh axes |")
    print("|---|---|---|---|---|---|---|---|")
    kinds = lambda by_kind: ", ".join(f"{k} {v / mib:.2f}" for k, v in by_kind.items()
                                      if v >= mib / 100)
    for row, low in lowered.items():
        compiled, peak = compile_with_peak(low)
        memory = compiled.memory_analysis()
        temp, args = memory.temp_size_in_bytes, memory.argument_size_in_bytes
        fullest = peak.get("temp") or {"by_kind": {}, "between buffers": 0}
        print(f"| {row} | {temp / mib:.2f} | {args / mib:.2f} | {(temp + args) / mib:.2f} "
              f"| {peak['peak_bytes'] / mib:.2f} | {kinds(peak['by_kind'])} "
              f"| {kinds(fullest['by_kind'])}, between buffers "
              f"{fullest['between buffers'] / mib:.2f} "
              f"| {bytes_by_axes(compiled.as_text(), mesh)} |", flush=True)


if __name__ == "__main__":
    main()
