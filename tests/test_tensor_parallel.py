"""Tensor parallelism x ZeRO on a 2-D mesh: data x model, placed by rules over parameter paths.

Each tensor-parallel rank holds its slice of a leaf (Megatron's layout, ``TENSOR_PARALLEL``),
and ZeRO cuts that slice over ``data``: the training must equal one device's optax, every state
leaf's per-device bytes must be 1/(D T) (or 1/D for the leaves whole on ``model``), and the
program's collectives must stay in their axis: ZeRO's gathers and reduce-scatters over ``data``
groups only, the partitioner's tensor-parallel all-reduces over ``model`` groups only.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import KEY, OPTIMIZERS, equations, figures_follow, max_rel, optax_steps, tree_rel
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_comm import volume

import zero_jax as zj
from zero_jax import report
from zero_jax.gpt import data
from zero_jax.gpt.model import GPT, LAYERS, TENSOR_PARALLEL, Block, GPTConfig, init_fn, lm_loss
from zero_jax.hlo import collectives, copied_bytes, gathered_ahead, reduced_behind
from zero_jax.mesh import MODEL
from zero_jax.nvme import Nvme
from zero_jax.plan import Leaf, path_str

STEPS = 5
# The GPT demo's own tensor-parallel rules (``TENSOR_PARALLEL``), on a small GPT whose
# vocabulary is cut over ``model`` too, and fc1's bias, cut over ``model`` alone, over data
# too: d_ff 96 = 4 x 2 x 12 (``test_a_leaf_cut_over_model_alone_is_cut_over_data_too``).
CFG = GPTConfig(vocab_size=256, d_model=40, n_layers=2, n_heads=4, d_ff=96, seq_len=12)
MESHES = {"4x2": {"data": 4, "model": 2}, "2x4": {"data": 2, "model": 4},
          "hierarchical 2x2x2": {"replica": 2, "data": 2, "model": 2}}


def one_device(init, loss_fn, batches, tx) -> tuple[list[float], dict]:
    """(losses, final parameters) of plain optax on one device: the suite's jitted step
    (``conftest.optax_steps``). Against it the 2-D layouts' SGD parameters part by up to
    2.4e-6 (this file's bound: 1e-5), AdamW's by 3.1e-5 (1e-4). With d_ff 100: 6.7e-6 and
    3.6e-5; against optax run op by op, 5.0e-6 and 3.4e-5. (With fused multiply-adds the jitted
    step moved SGD's by 1.2e-5: the suite compiles without them, ``tests/flags.py``.)"""
    ref = optax_steps(loss_fn, tx, init(KEY), batches)
    return list(ref["losses"]), ref["params"]


def gpt_problem(cfg: GPTConfig, batch: int, steps: int, corpus: int = 1 << 18,
                model: nn.Module | None = None):
    """(init, loss, batches) of the demo's GPT on ``cfg`` (or ``model``): ``steps`` batches of
    ``batch`` sequences from the first ``corpus`` bytes of the embedded text."""
    model = model or GPT(cfg)
    tokens = data.stdlib_corpus(corpus).astype(np.int32) % cfg.vocab_size
    batches = [np.asarray(data.batch(tokens, i, batch, cfg.seq_len, seed=0))
               for i in range(steps)]
    return init_fn(model), lm_loss(model), batches


@pytest.fixture(scope="module")
def gpt():
    init, loss_fn, batches = gpt_problem(CFG, 16, STEPS)
    refs = {name: one_device(init, loss_fn, batches, make()) for name, make in OPTIMIZERS.items()}
    return init, loss_fn, batches, refs


def train_traced(plan, init, loss_fn, batches, tx, accum_steps=1):
    """(losses, final state, the step's trace, its lowering, the compiled step): traced and
    compiled once, for a test that reads the jaxpr or the report of the program it ran."""
    state = zj.init_state(plan, init, tx, KEY)
    put = lambda b: jax.device_put(b, NamedSharding(plan.mesh, P(plan.data_axes)))
    traced = zj.make_train_step(plan, loss_fn, tx, accum_steps=accum_steps).fn.trace(
        state, put(batches[0]))
    lowered = traced.lower()
    compiled = lowered.compile()
    losses = []
    for b in batches:
        state, metrics = compiled(state, put(b))
        losses.append(float(metrics["loss"]))
    return losses, state, traced, lowered, compiled


def train(plan, init, loss_fn, batches, tx, accum_steps=1):
    """(losses, final state, compiled program text)."""
    losses, state, _, _, compiled = train_traced(plan, init, loss_fn, batches, tx, accum_steps)
    return losses, state, compiled.as_text()


def groups_of(mesh, axes: tuple[str, ...]) -> set[tuple[int, ...]]:
    """The device groups that vary along ``axes`` only (as sorted tuples of device ids)."""
    names = list(mesh.axis_names)
    within = [names.index(a) for a in axes]
    across = [i for i in range(len(names)) if i not in within]
    ids = np.vectorize(lambda d: d.id)(mesh.devices).transpose(across + within)
    return {tuple(sorted(int(i) for i in g))
            for g in ids.reshape(-1, math.prod(mesh.shape[a] for a in axes))}


def assert_collectives_stay_in_their_axis(plan, text, gathers_on_model: bool = False):
    """Every collective runs within data groups (ZeRO's, and the loss statistics) or within
    model groups (the partitioner's tensor parallelism), never across both; no weight is
    gathered over ``model`` (Megatron's layout needs only all-reduces there) unless
    ``gathers_on_model`` (a bias whole on ``model`` next to a cut matrix: its gradient), not
    even a leaf cut over data x model along one dimension. Only scalar sums may span every
    device: the gradient norm's (and clipping's) over those leaves, one f32 per such leaf at
    most."""
    data = set().union(*(groups_of(plan.mesh, axes) for axes in (
        plan.data_axes, plan.data_axes[:1], plan.data_axes[-1:])))
    model = groups_of(plan.mesh, ("model",))
    found = collectives(text, plan.mesh.size)
    both = sum(leaf.axis == leaf.model_dim is not None and plan.rule.shard_opt_state
               for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: isinstance(x, Leaf)))
    across = [c for c in found if len(c.group) == plan.mesh.size]
    assert all(c.kind == "all-reduce" and c.dtype == "f32" and c.bytes <= 4 * both
               for c in across), (across, both)
    found, on_model = [c for c in found if c not in across], []
    for c in found:
        groups = {tuple(sorted(g)) for g in c.groups}
        assert groups <= data or groups <= model, c
        if groups <= model:
            on_model.append(c)
    assert any(c.kind == "all-reduce" for c in on_model)  # tensor parallelism really ran
    assert gathers_on_model or not any(c.kind == "all-gather" for c in on_model), \
        on_model
    assert not any(c.kind == "reduce-scatter" for c in on_model)


def assert_bytes_per_device(plan, state, tx):
    """Every leaf of the parameters, the fp32 master (if any) and the optimizer state (Adam's
    moments), on every device, read off its addressable shards: the whole bytes / T for a leaf
    cut on ``model``, / D more where the stage cuts that copy over data (the optimizer state
    and master at stage >= 1 over all data axes, the parameters at stage 3 within a group)."""
    t = plan.mesh.shape["model"]
    group, d = plan.mesh.shape[plan.axis], plan.dp_size
    rule = plan.rule

    def check(x, leaf, cut, n, what):
        parts = (t if leaf.model_dim is not None else 1) * (n if cut and leaf.axis is not None
                                                            else 1)
        sizes = {s.data.nbytes for s in x.addressable_shards}
        assert sizes == {x.nbytes // parts} and x.nbytes % parts == 0, (what, leaf.path, sizes)

    leaves = jax.tree.leaves(plan.leaves, is_leaf=lambda x: isinstance(x, Leaf))
    for leaf, p in zip(leaves, jax.tree.leaves(state.params), strict=True):
        check(p, leaf, rule.shard_params and not leaf.persistent, group, "params")
    masters = [] if state.master is None else jax.tree.leaves(state.master)
    for leaf, m in zip(leaves[:len(masters)], masters, strict=True):
        check(m, leaf, rule.shard_opt_state, d, "master")
    # Each optimizer-state leaf beside the parameter it belongs to ("whole": Adam's count).
    owners = plan.map_opt_state(tx, lambda x, _, leaf: leaf if x.shape == leaf.shape
                                else "whole", plan.leaves, "whole")
    moments = 0
    for leaf, x in zip(jax.tree.leaves(owners, is_leaf=lambda x: isinstance(x, Leaf)),
                       jax.tree.leaves(state.opt_state), strict=True):
        if isinstance(leaf, Leaf):
            check(x, leaf, rule.shard_opt_state, d, "opt_state")
            moments += 1
    return moments


@pytest.fixture(scope="module")
def tp_run(gpt):
    """The training on a 2-D layout, per (layout, stage, optimizer, gather), trained once for
    every test that reads it: (plan, losses, final state, compiled program text)."""
    init, loss_fn, batches, _ = gpt
    runs = {}

    def run(layout, stage, opt, gather="block"):
        if (layout, stage, opt, gather) not in runs:
            plan = zj.make_plan(jax.eval_shape(init, KEY), zj.make_mesh(8, axes=MESHES[layout]),
                                stage, layers=zj.Layers(LAYERS, gather=gather),
                                rules=TENSOR_PARALLEL)
            runs[layout, stage, opt, gather] = plan, *train(plan, init, loss_fn, batches,
                                                            OPTIMIZERS[opt]())
        return runs[layout, stage, opt, gather]
    return run


# Every stage with SGD (a gradient of the wrong scale shows) and clipped AdamW on 4 x 2; on
# 2 x 4 SGD at every stage and AdamW where everything is cut (stage 3); hierarchical at stage 3.
@pytest.mark.slow
@pytest.mark.parametrize("layout, stage, opt, gather", [
    *((layout, stage, opt, "block") for layout in ("4x2", "2x4") for stage in range(4)
      for opt in ("sgd", "adamw") if layout == "4x2" or opt == "sgd" or stage == 3),
    ("hierarchical 2x2x2", 3, "sgd", "block"), ("hierarchical 2x2x2", 3, "adamw", "block"),
    ("hierarchical 2x2x2", 3, "sgd", "module"),
])
def test_equals_one_device_with_collectives_in_their_axis(gpt, tp_run, layout, stage, opt,
                                                          gather):
    """Losses over 5 steps equal one-device optax within 1e-5. The final parameters too for
    SGD; AdamW's to 1e-4: its update g / (sqrt(v) + eps) normalizes each coordinate, so a
    rounding difference in a small gradient (the partitioner sums the model axis's partial
    products in another order) becomes a full-size step difference. Stage 3 gathering by
    module (``Layers.gather``) too."""
    refs = gpt[3]
    plan, losses, state, text = tp_run(layout, stage, opt, gather)
    assert plan.param_specs["blocks"]["qkv"]["kernel"] == (
        P(None, "data", None, "model", None) if stage == 3 else P(None, None, None, "model",
                                                                   None))
    tx = OPTIMIZERS[opt]()
    params = jax.device_get(state.params)
    tolerance = 1e-5 if opt == "sgd" else 1e-4
    np.testing.assert_allclose(losses, refs[opt][0], rtol=1e-5)
    assert max_rel(params, refs[opt][1]) < tolerance
    assert_collectives_stay_in_their_axis(plan, text)
    moments = assert_bytes_per_device(plan, state, tx)
    assert moments == (2 * len(jax.tree.leaves(params)) if opt == "adamw" else 0)


@pytest.mark.slow
def test_a_leaf_cut_over_model_alone_is_cut_over_data_too(gpt, tp_run):
    """fc1's bias, cut over ``model`` by Megatron's layout and with no other dimension, on
    4 x 2: its dimension is cut into D x T pieces, model-major, so each device holds 1/(D T)
    of each copy the stage cuts, as of every leaf (at stage 3 parameters and Adam's moments,
    read off the shards; the gradient from stage 2, the optimizer state from stage 1); and
    with hierarchical ZeRO (2 x 2 x 2), its parameter within the group, the rest across
    groups too. Losses over 5 steps equal one device's within 1e-5 (SGD at stages 2-3 and
    hierarchical, clipped AdamW at stages 1-3; the parameters 1e-5 and 1e-4). ZeRO's
    collectives stay on data groups, tensor parallelism's on model groups (no gather on
    ``model``); only the gradient norm's scalars span both. The runs are the ones
    ``test_equals_one_device_with_collectives_in_their_axis`` trains (``tp_run``)."""
    refs = gpt[3]
    # SGD wherever the bias's gradient is cut (stages 2-3): Adam would hide it N times too large
    for stage, opt, layout in ((3, "sgd", "4x2"), (3, "adamw", "4x2"), (2, "sgd", "4x2"),
                               (2, "adamw", "4x2"), (1, "adamw", "4x2"),
                               (3, "sgd", "hierarchical 2x2x2")):
        plan, losses, state, text = tp_run(layout, stage, opt)
        cut = P(None, ("model", *reversed(plan.data_axes)))  # within groups, then across
        assert plan.opt_specs["blocks"]["fc1"]["bias"] == cut
        assert (plan.grad_specs["blocks"]["fc1"]["bias"] == cut) == (stage > 1)
        np.testing.assert_allclose(losses, refs[opt][0], rtol=1e-5)
        assert max_rel(jax.device_get(state.params), refs[opt][1]) < (1e-5 if opt == "sgd"
                                                                     else 1e-4)
        assert_bytes_per_device(plan, state, OPTIMIZERS[opt]())
        assert_collectives_stay_in_their_axis(plan, text)
        assert any(len(c.group) == 8 for c in collectives(text, 8))  # the norm's sum


COMPOSED_TOLERANCE = 2e-3  # nats: twice the gap measured with d_ff 100 (9.9e-4)


@pytest.mark.slow
def test_composes_with_bf16_accumulation_buckets_and_int8(gpt):
    """Stage 3 at 4 x 2 with bf16 compute (fp32 master), 2 microbatches, 8 KiB buckets and
    int8 weights and gradients trains like the same run on data = 8 (T = 1): the losses of 5
    clipped-AdamW steps within COMPOSED_TOLERANCE nats. Not 1e-5: bf16 rounds the forward
    where the model axis's partial sums meet, and int8 rounds what crosses ``data`` in blocks
    of other sizes (each rank quantizes its slice); measured 7.8e-4. The tensor-parallel
    collectives stay on model groups, ZeRO's (int8 all-to-alls included) on data groups, and
    every state leaf, master included, is cut by the formula with T."""
    init, loss_fn, batches, _ = gpt
    options = {"layers": LAYERS, "precision": zj.Precision(param_dtype="bf16"),
               "comm": zj.Comm(8 << 10, quantize_weights=True, quantize_grads=True)}
    tx = OPTIMIZERS["adamw"]()
    runs = {}
    for name, axes in (("2-D", MESHES["4x2"]), ("1-D", {"data": 8})):
        rules = TENSOR_PARALLEL if "model" in axes else ()
        plan = zj.make_plan(jax.eval_shape(init, KEY), zj.make_mesh(8, axes=axes), 3,
                            rules=rules, **options)
        runs[name] = plan, *train(plan, init, loss_fn, batches, tx, accum_steps=2)
    plan, losses, state, text = runs["2-D"]
    gap = np.abs(np.array(losses) - runs["1-D"][1]).max()
    assert gap < COMPOSED_TOLERANCE, gap
    assert np.all(np.isfinite(losses)) and losses[0] - losses[-1] > 0.1
    assert_collectives_stay_in_their_axis(plan, text)
    assert any(c.kind == "all-to-all" and c.dtype == "s8" for c in collectives(text, 8))
    assert assert_bytes_per_device(plan, state, tx) == 2 * len(jax.tree.leaves(state.params))
    assert state.master is not None


def test_report_counts_zero_per_tensor_parallel_rank(gpt):
    """The model-state formula holds per rank: Psi/T of the leaves on ``model``. In mixed
    precision (bf16 compute, fp32 master, Adam) stage 3 holds (2 + 2 + K) Psi / (D T) per
    device with K = 12 (master 4, moments 8) when every leaf is cut on ``model``; the leaves
    whole on ``model`` (norms, biases) count whole in each rank's Psi."""
    init = gpt[0]
    shapes = jax.eval_shape(init, KEY)
    mesh = zj.make_mesh(8, axes=MESHES["4x2"])
    plan = zj.make_plan(shapes, mesh, 3, layers=LAYERS, rules=TENSOR_PARALLEL)
    tx = OPTIMIZERS["sgd"]()
    actual, formula, _, _ = report.model_states(plan, zj.abstract_state(plan, tx))
    on_model = sum(math.prod(x.shape) for x in jax.tree.leaves(plan.leaves, is_leaf=lambda x:
                   isinstance(x, Leaf)) if x.model_dim is not None)
    whole = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert report.per_rank(plan) == whole - on_model / 2
    assert formula["params"] == pytest.approx(4 * report.per_rank(plan) / 4)
    # Leaves that do not divide stay whole over data: the actual bytes are a little above.
    assert formula["params"] <= actual["params"] < 1.1 * formula["params"]

    bf16 = zj.make_plan(shapes, mesh, 3, layers=LAYERS, rules=TENSOR_PARALLEL,
                        precision=zj.Precision(param_dtype="bf16"))
    actual, formula, _, _ = report.model_states(bf16, zj.abstract_state(bf16,
                                                                         OPTIMIZERS["adamw"]()))
    d, t = 4, 2
    # K = 12 (master 4, moments 8), plus Adam's step count (4 bytes in all): rel 1e-4.
    assert sum(formula.values()) == pytest.approx((2 + 2 + 12) * report.per_rank(bf16) / d,
                                                  rel=1e-4)
    assert formula["master"] == pytest.approx(4 * report.per_rank(bf16) / d)
    # Psi per rank: Psi / T of the leaves cut on model, all of the others; Psi / T if all are.
    assert report.per_rank(bf16) == pytest.approx(whole - on_model + on_model / t)
    assert sum(formula.values()) <= sum(actual.values()) < 1.1 * sum(formula.values())


@pytest.mark.slow
def test_prefetch_gathers_a_layer_ahead_within_each_tensor_parallel_rank():
    """Stage 3 with prefetch at 4 x 2 (4 layers, clipped AdamW, buckets): bit for bit the plain
    stage 3's training; in the program every layer-loop gather (over ``data``) feeds only the
    next iteration and every gradient reduction reduces the previous iteration's, the bytes of
    each kind are the plain step's, and the tensor-parallel collectives stay on ``model``. The
    price is one gathered layer and one whole gradient of each rank's slice (7,550 f32 of the
    layer's 14,860), in the report; XLA's temp grows by at most three of them. What the loops
    carry is written in place: an iteration copies the biases cut over ``model`` only (d_ff
    100 does not divide into D x T pieces) and the carried activation gradient, no gathered
    layer."""
    init, loss_fn, batches = gpt_problem(dataclasses.replace(CFG, n_layers=4, d_ff=100), 16, 3)
    mesh = zj.make_mesh(8, axes=MESHES["4x2"])
    tx = OPTIMIZERS["adamw"]()

    def run(prefetch):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                            layers=zj.Layers(LAYERS, prefetch=prefetch), rules=TENSOR_PARALLEL)
        state = zj.init_state(plan, init, tx, KEY)
        put = lambda b: jax.device_put(b, NamedSharding(mesh, P(plan.data_axes)))
        lowered = zj.make_train_step(plan, loss_fn, tx).lower(state, put(batches[0]))
        compiled = lowered.compile()
        losses = []
        for b in batches:
            state, m = compiled(state, put(b))
            losses.append(float(m["loss"]))
        return (plan, losses, jax.device_get(state.params), compiled.as_text(),
                report.build(plan, state, lowered, compiled))

    plain, ahead = run(False), run(True)
    assert ahead[1] == plain[1]
    for a, b in zip(jax.tree.leaves(ahead[2]), jax.tree.leaves(plain[2]), strict=True):
        np.testing.assert_array_equal(a, b)
    text = ahead[3]
    loops = gathered_ahead(text)
    assert len(loops) == 2 and all(all(x) for x in loops.values()), loops
    assert not any(any(x) for x in gathered_ahead(plain[3]).values())
    behind = reduced_behind(text)
    assert len(behind) == 1 and all(all(x) for x in behind.values()), behind
    assert volume(collectives(text, 8)) == volume(collectives(plain[3], 8))
    assert_collectives_stay_in_their_axis(ahead[0], text)
    layer = 7_550 * 4  # (4,800 + 120 + 1,600 + 4,000 + 100 + 4,000) / 2 cut, 240 whole
    assert ahead[4]["prefetch_bytes"] == 2 * layer
    assert ahead[4]["compiled"]["temp_bytes"] - plain[4]["compiled"]["temp_bytes"] <= 3 * layer
    assert copied_bytes(text, loops) < layer // 2
    groups = figures_follow(ahead[4])  # --plot of a tensor-parallel report
    assert {"data", "model"} <= set(groups), set(groups)


SMALL_MODELS = [(3, "sgd"), (2, "adamw")]  # stage, optimizer: each a few seconds


def trains_like_one_device(plan, init, loss_fn, batch, opt: str = "sgd",
                           gathers_on_model: bool = False):
    """5 steps on ``batch`` (SGD 0.1, or the clipped AdamW) equal one device's: losses to 1e-5,
    parameters to 1e-5 (AdamW's 1e-4, as above); the collectives stay in their axis and every
    state leaf's bytes per device follow the formula with T."""
    tx, batches = optax.sgd(0.1) if opt == "sgd" else OPTIMIZERS[opt](), [batch] * STEPS
    losses, state, text = train(plan, init, loss_fn, batches, tx)
    ref_losses, ref_params = one_device(init, loss_fn, batches, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_rel(state.params, ref_params) < (1e-5 if opt == "sgd" else 1e-4)
    assert_collectives_stay_in_their_axis(plan, text, gathers_on_model)
    assert_bytes_per_device(plan, state, tx)
    return state


class Unrolled(nn.Module):
    """Blocks in a Python loop (HF style), no annotation: the rule table places them (2: with
    prefetch the first is handed the second's weights; a third would be another copy)."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            h = nn.gelu(nn.Dense(64, name=f"h_{i}_up")(x))
            x = x + nn.Dense(16, name=f"h_{i}_down")(h)
        return nn.Dense(4, name="head")(x)


@pytest.mark.parametrize("stage, opt", SMALL_MODELS)
def test_unrolled_model_placed_by_the_rule_table(stage, opt):
    model = Unrolled()
    x = jax.random.normal(jax.random.key(1), (32, 16))
    y = jax.random.randint(jax.random.key(2), (32,), 0, 4)
    init = lambda key: model.init(key, x[:1])["params"]

    def loss_fn(params, batch):
        xb, yb = batch
        logits = model.apply({"params": params}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    rules = [zj.Rule(r"_up/(kernel|bias)$", model_dim=-1), zj.Rule(r"_down/kernel$", model_dim=-2)]
    mesh = zj.make_mesh(8, axes=MESHES["4x2"])
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, stage, rules=rules,
                        layers=zj.Layers(r"^h_\d+_(up|down)$", prefetch=stage == 3))
    state = trains_like_one_device(plan, init, loss_fn, (x, y), opt)
    assert state.params["h_0_up"]["kernel"].sharding.spec == P("data" if stage == 3 else None,
                                                                "model")


class Annotated(nn.Module):
    """MaxText style: kernels annotated with logical axes, no table written for it."""

    @nn.compact
    def __call__(self, x):
        dense = lambda n, names, name: nn.Dense(n, name=name, kernel_init=(
            nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)))
        for i in range(2):
            h = nn.gelu(dense(64, ("embed", "mlp"), f"h_{i}_up")(x))
            x = x + dense(16, ("mlp", "embed"), f"h_{i}_down")(h)
        return nn.Dense(4, name="head")(x)


@pytest.mark.parametrize("stage, opt", SMALL_MODELS)
def test_annotated_linen_model_needs_no_table(stage, opt):
    model = Annotated()
    x = jax.random.normal(jax.random.key(1), (32, 16))
    y = jax.random.randint(jax.random.key(2), (32,), 0, 4)
    boxed = jax.eval_shape(lambda: model.init(KEY, x[:1])["params"])
    rules = zj.tensor_parallel_rules(boxed, [("mlp", "model"), ("embed", None)])
    assert {r.pattern: r.model_dim for r in rules} == {
        r"^h_0_up/kernel$": -1, r"^h_0_down/kernel$": -2,
        r"^h_1_up/kernel$": -1, r"^h_1_down/kernel$": -2}
    init = lambda key: nn.unbox(model.init(key, x[:1])["params"])

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    mesh = zj.make_mesh(8, axes=MESHES["2x4"])
    plan = zj.make_plan(nn.unbox(boxed), mesh, stage, rules=rules,
                        layers=zj.Layers(r"^h_\d+_(up|down)$", prefetch=stage == 3))
    state = trains_like_one_device(plan, init, loss_fn, (x, y), opt, gathers_on_model=True)
    assert state.params["h_1_down"]["kernel"].sharding.spec == (
        P("model", "data") if stage == 3 else P("model", None))


# Pa's tests: a step at sequence 256 runs as long as a compile here; the second step already
# trains from parameters the first one updated. 4 sequences: 2 per data rank (of 2) show the
# batch dimension of what is saved as well as more would, in half the steps' time of 8.
PA_STEPS, PA_BATCH = 2, 4
PA_LOCAL = PA_BATCH // 2  # per data rank: the meshes here are 2 x 4


@pytest.mark.slow
def test_partitioned_activations_keep_a_tp_slice_of_the_saved_inputs():
    """ZeRO-R's Pa: the forward loop's stacked block inputs (what remat full saves) are
    (layers, batch, sequence / T, d) per device instead of (layers, batch, sequence, d), read
    from the compiled program; the training is the same. With the ``offload`` policy the same
    slices leave the forward loop in host memory (in the traced program; on the CPU backend
    the move itself is a no-op). With prefetch, whose loop saves the inputs itself (layers
    1-3: the last runs after it), as well."""
    cfg = dataclasses.replace(CFG, vocab_size=64, d_model=32, n_layers=4, d_ff=64, seq_len=256,
                              remat="none")  # stage 3 remats the blocks itself
    init, loss_fn, batches = gpt_problem(cfg, PA_BATCH, PA_STEPS, corpus=1 << 16)
    mesh = zj.make_mesh(8, axes=MESHES["2x4"])
    tx = OPTIMIZERS["sgd"]()
    runs, plans = {}, {}
    for layers in (zj.Layers(LAYERS), zj.Layers(LAYERS, partition=True),
                   zj.Layers(LAYERS, "offload", partition=True),
                   zj.Layers(LAYERS, partition=True, prefetch=True)):
        plans[layers] = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=layers,
                                     rules=TENSOR_PARALLEL)
        runs[layers] = train_traced(plans[layers], init, loss_fn, batches, tx)
    plain, cut, offloaded, prefetched = ((losses, text.as_text()) for losses, _, _, _, text
                                         in runs.values())
    host = [sum(v.aval.memory_space == jax.memory.Space.Host for v in eqn.outvars)
            for eqn, _ in equations(runs[zj.Layers(LAYERS, "offload", partition=True)][2]
                                    .jaxpr.jaxpr)
            if eqn.primitive.name == "scan"]
    stacked = lambda seq, n=cfg.n_layers: f"f32[{n},{PA_LOCAL},{seq},{cfg.d_model}]"
    assert stacked(256) in plain[1] and stacked(64) not in plain[1]
    # The report's saved block inputs (layers x local batch x sequence x d, /T with Pa) are
    # the compiled program's stacked ones; Megatron's all-reduces on model against its theory.
    block_input = jax.ShapeDtypeStruct((PA_BATCH, cfg.seq_len, cfg.d_model), np.float32)
    for layers, seq in ((zj.Layers(LAYERS), 256), (zj.Layers(LAYERS, partition=True), 64)):
        _, state, _, lowered, compiled = runs[layers]
        plan = plans[layers]
        r = report.build(plan, state, lowered, compiled, None, block_input)
        saved = r["saved_activation_bytes"]
        assert saved["with_pa" if layers.partition else "without_pa"] == (
            cfg.n_layers * PA_LOCAL * seq * cfg.d_model * 4)
        assert saved["with_pa"] * 4 == saved["without_pa"]
        if not layers.partition:  # 5 all-reduces per layer and 2 more, within 1% (softmax's)
            theory, measured = (r[k]["model"] for k in (
                "comm_bytes_theory_by_axes", "comm_bytes_by_axes"))
            assert theory == 2 * (5 * cfg.n_layers + 2) * PA_LOCAL * 256 * cfg.d_model * 4
            assert theory <= measured < 1.01 * theory
    for run in (cut, offloaded):
        assert stacked(64) in run[1] and stacked(256) not in run[1]
        np.testing.assert_allclose(run[0], plain[0], rtol=1e-6)
    n = cfg.n_layers - 1
    assert stacked(64, n) in prefetched[1] and stacked(256, n) not in prefetched[1]
    np.testing.assert_allclose(prefetched[0], plain[0], rtol=1e-6)
    assert host[0] == 1  # the forward loop's checkpoints, cut, in host memory
    with pytest.raises(ValueError, match="needs tensor parallelism"):
        zj.make_plan(jax.eval_shape(init, KEY), zj.make_mesh(8), 3,
                     layers=zj.Layers(LAYERS, partition=True))


@pytest.mark.slow
def test_partitioned_activations_at_stages_without_gathers():
    """Pa at stages 0-2 (DeepSpeed's partition_activations holds at any stage): zero_jax then
    rematerializes each block itself, saving its input cut over ``model``; the training equals
    the model's own remat (full) at stage 0 without Pa, whose saved inputs are whole. Stage 0:
    replicas in per-block buckets; stage 2: each block reads its whole copy."""
    base = dataclasses.replace(CFG, vocab_size=64, d_model=32, n_layers=4, d_ff=64,
                               seq_len=256, remat="full")
    mesh = zj.make_mesh(8, axes=MESHES["2x4"])
    stacked = lambda seq: f"f32[{base.n_layers},{PA_LOCAL},{seq},{base.d_model}]"

    def run(cfg, stage, pa):
        init, loss_fn, batches = gpt_problem(cfg, PA_BATCH, PA_STEPS, corpus=1 << 16)
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, stage, rules=TENSOR_PARALLEL,
                            layers=zj.Layers(LAYERS, partition=pa))
        return train(plan, init, loss_fn, batches, OPTIMIZERS["sgd"]())

    plain, _, plain_text = run(base, 0, False)
    assert stacked(256) in plain_text and stacked(64) not in plain_text
    for stage in (0, 2):
        cut, _, cut_text = run(dataclasses.replace(base, remat="none"), stage, True)
        assert stacked(64) in cut_text and stacked(256) not in cut_text
        np.testing.assert_allclose(cut, plain, rtol=1e-6)


class UnrolledGPT(nn.Module):
    """The demo's blocks in a Python loop (``h_0``, ``h_1``, ...: HF style), so that prefetch
    hands each block the next one's weights (``zero_jax.blocks.chain``), not a scan's loop."""
    cfg: GPTConfig

    def __call__(self, tokens):
        x, head = self.features(tokens)
        return x @ head

    @nn.compact
    def features(self, tokens):  # what lm_loss takes: the last hidden states and the head
        wte = self.param("wte", nn.initializers.normal(0.02), (self.cfg.vocab_size,
                                                                self.cfg.d_model))
        x = wte[tokens]
        for i in range(self.cfg.n_layers):
            x, _ = Block(self.cfg, name=f"h_{i}")(x, None)
        return x, wte.T


@pytest.mark.slow
def test_partitioned_activations_with_prefetch_on_unrolled_blocks():
    """Pa where prefetch hands each unrolled block the next one's weights: each block's saved
    input is (batch, sequence / T, d) per device, read from the compiled program, and the
    training is the same as without Pa."""
    # 2 blocks: the first is handed the second's weights ahead, the second runs last; a block
    # between them would add a copy of the same program (unrolled: compiled once per block).
    cfg = dataclasses.replace(CFG, vocab_size=64, d_model=32, n_layers=2, d_ff=64, seq_len=256,
                              remat="none")
    init, loss_fn, batches = gpt_problem(cfg, PA_BATCH, PA_STEPS, corpus=1 << 16,
                                         model=UnrolledGPT(cfg))
    rules = [zj.Rule(r.pattern.replace("blocks", r"h_\d+"), model_dim=r.model_dim)
             for r in TENSOR_PARALLEL]
    mesh = zj.make_mesh(8, axes=MESHES["2x4"])
    runs = [train(zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, rules=rules,
                               layers=zj.Layers(r"^h_\d+$", partition=pa, prefetch=True)),
                  init, loss_fn, batches, OPTIMIZERS["sgd"]())
             for pa in (False, True)]
    saved = lambda seq: f"f32[{PA_LOCAL},{seq},{cfg.d_model}]"
    (plain, _, plain_text), (cut, _, cut_text) = runs
    assert saved(64) in cut_text and saved(64) not in plain_text
    np.testing.assert_allclose(cut, plain, rtol=1e-6)


def test_the_demo_gives_the_report_its_block_input():
    """train.py's report needs the shape of a block's input (global batch, sequence, d_model),
    which only the model knows: the demo's Experiment says it (nothing compiled here)."""
    from zero_jax.gpt import config
    from zero_jax.gpt.experiment import Experiment

    exp = Experiment.build(config.load("tiny", ["mesh.tensor_parallel=2"]),
                           zj.make_mesh(8, axes=MESHES["4x2"]))
    assert exp.block_input.shape == (32, 64, 128) and exp.block_input.dtype == np.float32
    saved = report.saved_activations(exp.plan, exp.block_input)["saved_activation_bytes"]
    assert saved["without_pa"] == 4 * (32 // 4) * 64 * 128 * 4 == 2 * saved["with_pa"]


@pytest.mark.slow
def test_checkpoint_moves_between_meshes(tmp_path, gpt):
    """Written at data 2 x model 4, read back exactly at 8 x 1 (no model axis) and 4 x 2; the
    issue's chain T = 4 x D = 2 -> T = 1 x D = 8 (written again there) -> T = 2 x D = 4
    bit-exact; read into stage 1 at 4 x 2; and ``export`` writes whole parameters equal to the
    gathered ones. Adam's moments are filled with distinct values so that they are checked."""
    import orbax.checkpoint as ocp

    from zero_jax.export import export

    init = gpt[0]
    tx = OPTIMIZERS["adamw"]()
    shapes = jax.eval_shape(init, KEY)

    def plan_on(axes, stage=3):
        rules = TENSOR_PARALLEL if "model" in axes else ()
        return zj.make_plan(shapes, zj.make_mesh(8, axes=axes), stage, layers=LAYERS,
                            rules=rules)

    state = zj.init_state(plan_on(MESHES["2x4"]), init, tx, KEY)
    fill = lambda x: jax.device_put(x + np.arange(x.size, dtype=x.dtype).reshape(x.shape) / 7,
                                    x.sharding) if x.dtype == np.float32 else x
    state = state._replace(opt_state=jax.tree.map(fill, state.opt_state))
    want = [np.asarray(x) for x in jax.tree.leaves(state)]

    def read(ckpts, plan):
        back, _ = ckpts.restore(zj.abstract_state(plan, tx))
        for a, b in zip(jax.tree.leaves(back), want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        kernel = back.params["blocks"]["fc1"]["kernel"]
        assert kernel.sharding.spec == plan.param_specs["blocks"]["fc1"]["kernel"]
        return back

    first, second = zj.Checkpoints(tmp_path / "2x4"), zj.Checkpoints(tmp_path / "8x1")
    first.save(state, {"step": 0})
    for axes in ({"data": 8}, MESHES["4x2"]):
        read(first, plan_on(axes))
    read(first, plan_on(MESHES["4x2"], stage=1))
    second.save(read(first, plan_on({"data": 8})), {"step": 0})
    read(second, plan_on(MESHES["4x2"]))
    first.close()
    second.close()
    export(str(tmp_path / "2x4"), str(tmp_path / "export"))
    whole = ocp.StandardCheckpointer().restore(tmp_path / "export" / "params")
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused():
    odd = dataclasses.replace(CFG, n_heads=2)  # 2 heads over 4
    with pytest.raises(ValueError, match="does not divide"):
        zj.make_plan(jax.eval_shape(init_fn(GPT(odd)), KEY), zj.make_mesh(8, axes=MESHES["2x4"]),
                     3, layers=LAYERS, rules=TENSOR_PARALLEL)


def host_paths(tree) -> set[str]:
    """The paths of ``tree``'s leaves that live in host memory."""
    return {path_str(p) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if x.sharding.memory_kind == "pinned_host"}


@pytest.mark.slow
def test_offload_and_the_nvme_tier_compose(gpt, tmp_path):
    """ZeRO-Offload on the 4 x 2 mesh, each host-memory leaf cut by the formula with T: at
    stage 3 the optimizer and the parameter shards in host memory and updated there, 5 SGD
    steps equal to one device's (losses and parameters 1e-5: SGD shows a gradient of the wrong
    scale, which Adam would hide); at stage 2 ZeRO-Infinity's NVMe tier (AdamW unclipped: the
    tier updates elementwise) bit for bit the same update in host memory, and that one
    device's too."""
    init, loss_fn, batches, refs = gpt
    shapes, mesh = jax.eval_shape(init, KEY), zj.make_mesh(8, axes=MESHES["4x2"])

    def run(stage, offload, tx):
        plan = zj.make_plan(shapes, mesh, stage, layers=LAYERS, rules=TENSOR_PARALLEL,
                            offload=offload)
        state = zj.init_state(plan, init, tx, KEY)
        put = lambda b: jax.device_put(b, NamedSharding(mesh, P(plan.data_axes)))
        step = zj.make_train_step(plan, loss_fn, tx).lower(state, put(batches[0])).compile()
        losses = []
        for b in batches:
            state, metrics = step(state, put(b))
            losses.append(float(metrics["loss"]))
        if offload.nvme is None:  # else the master and the moments are in files
            assert_bytes_per_device(plan, state, tx)
            offloaded = {x.path for x in jax.tree.leaves(plan.leaves, is_leaf=lambda x:
                                                         isinstance(x, Leaf)) if x.offload}
            assert host_paths(state.master) == offloaded and offloaded
        return plan, losses, state

    ref_losses, ref_params = refs["sgd"]
    plan, losses, state = run(3, zj.Offload(1.0, params=True), OPTIMIZERS["sgd"]())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_rel(state.params, ref_params) < 1e-5
    cut = {x.path for x in jax.tree.leaves(plan.leaves, is_leaf=lambda x: isinstance(x, Leaf))
           if x.axis is not None and not x.persistent}
    assert host_paths(state.params) == cut
    tx = optax.adamw(1e-3)
    _, host_losses, host = run(2, zj.Offload(1.0), tx)
    _, nvme_losses, nvme = run(2, zj.Offload(1.0, nvme=Nvme(str(tmp_path))), tx)
    assert nvme_losses == host_losses
    for a, b in zip(jax.tree.leaves(nvme.params), jax.tree.leaves(host.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    one_losses, one_params = one_device(init, loss_fn, batches, tx)
    np.testing.assert_allclose(host_losses, one_losses, rtol=1e-5)
    # Per leaf 1.6e-4 (the zero-initialised biases: Adam's g / sqrt(v), unclipped), as a whole:
    assert tree_rel(host.params, one_params) < 1e-5


class AnnotatedBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        dense = lambda i, o, names: nnx.Linear(i, o, rngs=rngs, kernel_init=(
            nnx.with_partitioning(nnx.initializers.lecun_normal(), names)))
        self.up, self.down = dense(16, 64, ("embed", "mlp")), dense(64, 16, ("mlp", "embed"))

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(x)))


class AnnotatedNNX(nnx.Module):
    """NNX, MaxText style: kernels annotated with logical axes, blocks in a list."""

    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([AnnotatedBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def annotated_nnx_problem():
    """(x, y, rules read from the annotations, init, loss) of ``AnnotatedNNX``."""
    x = jax.random.normal(jax.random.key(1), (32, 16))
    y = jax.random.randint(jax.random.key(2), (32,), 0, 4)
    with nnx.use_eager_sharding(False):  # zero_jax places the parameters
        graphdef, state = nnx.split(AnnotatedNNX(nnx.Rngs(0)), nnx.Param)
        rules = zj.tensor_parallel_rules(state, [("mlp", "model"), ("embed", None)])

    def init(key):
        with nnx.use_eager_sharding(False):
            return nnx.state(AnnotatedNNX(nnx.Rngs(key)), nnx.Param)

    def loss_fn(params, batch):
        logits = zj.nnx_merge(graphdef, params)(batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()
    return x, y, rules, init, loss_fn


@pytest.mark.parametrize("stage, opt", SMALL_MODELS)
def test_annotated_nnx_model_needs_no_table(stage, opt):
    x, y, rules, init, loss_fn = annotated_nnx_problem()
    assert {r.pattern: r.model_dim for r in rules} == {
        r"^blocks/0/up/kernel$": -1, r"^blocks/0/down/kernel$": -2,
        r"^blocks/1/up/kernel$": -1, r"^blocks/1/down/kernel$": -2}
    mesh = zj.make_mesh(8, axes=MESHES["2x4"])
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, stage, rules=rules,
                        layers=zj.Layers(r"^blocks/\d+$", prefetch=stage == 3))
    state = trains_like_one_device(plan, init, loss_fn, (x, y), opt, gathers_on_model=True)
    assert state.params["blocks"][1]["down"]["kernel"].sharding.spec == (
        P("model", "data") if stage == 3 else P("model", None))


def test_partitioned_activations_on_nnx_blocks():
    """Pa on NNX blocks (stage 3, and stage 2 where zero_jax rematerializes them for it): each
    block's recompute receives its input cut over ``model`` (the residual its checkpoint
    saves, read from the step's jaxpr); without Pa it receives it whole. Same losses."""
    x, y, rules, init, loss_fn = annotated_nnx_problem()

    def saves_cut_inputs(traced) -> list[bool]:
        """Per block recompute in the traced step: whether one of its inputs of the block
        input's shape (16 of the batch per data rank, 16 wide) is that input laid out cut over
        ``model``."""
        eqns = [e for e, _ in equations(traced.jaxpr.jaxpr)]
        made = {id(v): e for e in eqns for v in e.outvars}
        cut = lambda e: e is not None and e.primitive.name == "sharding_constraint" and \
            MODEL in e.params["sharding"].spec
        return [any(v.aval.shape == (16, 16) and cut(made.get(id(v))) for v in e.invars)
                for e in eqns if e.primitive.name == "remat2"]

    mesh, tx = zj.make_mesh(8, axes=MESHES["2x4"]), optax.sgd(0.1)
    losses = {}
    for stage, pa in ((3, False), (3, True), (2, True)):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, stage, rules=rules,
                            layers=zj.Layers(r"^blocks/\d+$", partition=pa))
        # The step that trains, traced once: its jaxpr read, then compiled and run.
        losses[stage, pa], _, traced, _, _ = train_traced(plan, init, loss_fn, [(x, y)] * 3, tx)
        assert saves_cut_inputs(traced) == [pa, pa]
    for run in losses.values():
        np.testing.assert_allclose(run, losses[3, False], rtol=1e-6)
