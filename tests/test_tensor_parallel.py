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
from conftest import KEY, OPTIMIZERS, SMALL, equations, max_rel
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax.gpt import data
from zero_jax.gpt.model import GPT, LAYERS, TENSOR_PARALLEL, init_fn, lm_loss
from zero_jax.hlo import collectives
from zero_jax.rules import Leaf

STEPS = 5
CFG = dataclasses.replace(SMALL, vocab_size=256)  # the vocabulary cut over model too
MESHES = {"4x2": {"data": 4, "model": 2}, "2x4": {"data": 2, "model": 4},
          "hierarchical 2x2x2": {"replica": 2, "data": 2, "model": 2}}


def one_device(init, loss_fn, batches, tx) -> tuple[list[float], dict]:
    params, losses = init(KEY), []
    opt_state = tx.init(params)
    for b in batches:
        loss, grads = jax.value_and_grad(loss_fn)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, params


@pytest.fixture(scope="module")
def gpt():
    model = GPT(CFG)
    tokens = data.stdlib_corpus(1 << 18).astype(np.int32) % CFG.vocab_size
    batches = [np.asarray(data.batch(tokens, i, 16, CFG.seq_len, seed=0)) for i in range(STEPS)]
    init, loss_fn = init_fn(model), lm_loss(model)
    refs = {name: one_device(init, loss_fn, batches, make()) for name, make in OPTIMIZERS.items()}
    return init, loss_fn, batches, refs


def train(plan, init, loss_fn, batches, tx):
    """(losses, final state, compiled program text)."""
    state = zj.init_state(plan, init, tx, KEY)
    step = zj.make_train_step(plan, loss_fn, tx)
    put = lambda b: jax.device_put(b, NamedSharding(plan.mesh, P(plan.data_axes)))
    text = step.lower(state, put(batches[0])).compile().as_text()
    losses = []
    for b in batches:
        state, metrics = step(state, put(b))
        losses.append(float(metrics["loss"]))
    return losses, state, text


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
    ``gathers_on_model`` (a bias whole on ``model`` next to a cut matrix: its gradient)."""
    data = set().union(*(groups_of(plan.mesh, axes) for axes in (
        plan.data_axes, plan.data_axes[:1], plan.data_axes[-1:])))
    model = groups_of(plan.mesh, ("model",))
    found = collectives(text, plan.mesh.size)
    on_model = []
    for c in found:
        groups = {tuple(sorted(g)) for g in c.groups}
        assert groups <= data or groups <= model, c
        if groups <= model:
            on_model.append(c)
    assert any(c.kind == "all-reduce" for c in on_model)  # tensor parallelism really ran
    assert gathers_on_model or not any(c.kind == "all-gather" for c in on_model), on_model
    assert not any(c.kind == "reduce-scatter" for c in on_model)


def assert_bytes_per_device(plan, state):
    """Every leaf of the parameters, gradients' optimizer state (Adam's moments, the same
    layout) per device: 1/T for a leaf on ``model``, times 1/D where the stage cuts it."""
    t = plan.mesh.shape["model"]
    leaves = jax.tree.leaves(plan.leaves, is_leaf=lambda x: isinstance(x, Leaf))
    cut = {"params": plan.rule.shard_params, "opt": plan.rule.shard_opt_state}
    for leaf, p in zip(leaves, jax.tree.leaves(state.params), strict=True):
        whole = math.prod(leaf.shape) * 4
        on_model = t if leaf.model_dim is not None else 1
        zero = (plan.mesh.shape["data"] if cut["params"] and leaf.axis is not None
                and not leaf.persistent else 1)
        assert p.addressable_shards[0].data.nbytes * on_model * zero == whole, leaf.path


@pytest.mark.parametrize("layout, stage, opt", [
    ("4x2", 0, "sgd"), ("4x2", 1, "sgd"), ("4x2", 2, "sgd"), ("4x2", 3, "sgd"),
    ("2x4", 0, "sgd"), ("2x4", 2, "sgd"), ("2x4", 3, "adamw"), ("4x2", 1, "adamw"),
    ("hierarchical 2x2x2", 3, "sgd"), ("hierarchical 2x2x2", 3, "adamw"),
])
def test_equals_one_device_with_collectives_in_their_axis(gpt, layout, stage, opt):
    init, loss_fn, batches, refs = gpt
    mesh = zj.make_mesh(8, axes=MESHES[layout])
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, stage, layers=LAYERS,
                        rules=TENSOR_PARALLEL)
    assert plan.param_specs["blocks"]["qkv"]["kernel"] == (
        P(None, "data", None, "model", None) if stage == 3 else P(None, None, None, "model",
                                                                   None))
    losses, state, text = train(plan, init, loss_fn, batches, OPTIMIZERS[opt]())
    ref_losses, ref_params = refs[opt]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_rel(state.params, ref_params) < (1e-5 if opt == "sgd" else 1e-4)
    assert_collectives_stay_in_their_axis(plan, text)
    assert_bytes_per_device(plan, state)


def test_report_counts_zero_per_tensor_parallel_rank(gpt):
    """The model-state formula holds per rank: Psi/T of the leaves on ``model``."""
    from zero_jax.report import model_states, per_rank

    init = gpt[0]
    shapes = jax.eval_shape(init, KEY)
    mesh = zj.make_mesh(8, axes=MESHES["4x2"])
    plan = zj.make_plan(shapes, mesh, 3, layers=LAYERS, rules=TENSOR_PARALLEL)
    tx = OPTIMIZERS["sgd"]()
    actual, formula, _, _ = model_states(plan, zj.abstract_state(plan, tx))
    on_model = sum(math.prod(x.shape) for x in jax.tree.leaves(plan.leaves, is_leaf=lambda x:
                   isinstance(x, Leaf)) if x.model_dim is not None)
    whole = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert per_rank(plan) == whole - on_model / 2
    assert formula["params"] == pytest.approx(4 * per_rank(plan) / 4)
    # Leaves that do not divide stay whole over data: the actual bytes are a little above.
    assert formula["params"] <= actual["params"] < 1.1 * formula["params"]


def trains_like_one_device(plan, init, loss_fn, batch, gathers_on_model: bool = False):
    """5 SGD steps on ``batch`` equal one device's; the collectives stay in their axis."""
    tx, batches = optax.sgd(0.1), [batch] * STEPS
    losses, state, text = train(plan, init, loss_fn, batches, tx)
    ref_losses, ref_params = one_device(init, loss_fn, batches, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_rel(state.params, ref_params) < 1e-5
    assert_collectives_stay_in_their_axis(plan, text, gathers_on_model)
    return state


class Unrolled(nn.Module):
    """Blocks in a Python loop (HF style), no annotation: the rule table places them."""

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            h = nn.gelu(nn.Dense(64, name=f"h_{i}_up")(x))
            x = x + nn.Dense(16, name=f"h_{i}_down")(h)
        return nn.Dense(4, name="head")(x)


def test_unrolled_model_placed_by_the_rule_table():
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
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=r"^h_\d+_(up|down)$",
                        rules=rules)
    state = trains_like_one_device(plan, init, loss_fn, (x, y))
    assert state.params["h_0_up"]["kernel"].sharding.spec == P("data", "model")


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


def test_annotated_linen_model_needs_no_table():
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
    plan = zj.make_plan(nn.unbox(boxed), mesh, 3, layers=r"^h_\d+_(up|down)$", rules=rules)
    state = trains_like_one_device(plan, init, loss_fn, (x, y), gathers_on_model=True)
    assert state.params["h_1_down"]["kernel"].sharding.spec == P("model", "data")


def test_partitioned_activations_keep_a_tp_slice_of_the_saved_inputs():
    """ZeRO-R's Pa: the forward loop's stacked block inputs (what remat full saves) are
    (layers, batch, sequence / T, d) per device instead of (layers, batch, sequence, d), read
    from the compiled program; the training is the same. With the ``offload`` policy the same
    slices leave the forward loop in host memory (in the traced program; on the CPU backend
    the move itself is a no-op)."""
    cfg = dataclasses.replace(CFG, vocab_size=64, d_model=32, n_layers=4, d_ff=64, seq_len=256,
                              remat="none")  # stage 3 remats the blocks itself
    model = GPT(cfg)
    init, loss_fn = init_fn(model), lm_loss(model)
    tokens = data.stdlib_corpus(1 << 16).astype(np.int32) % cfg.vocab_size
    batches = [np.asarray(data.batch(tokens, i, 8, cfg.seq_len, seed=0)) for i in range(3)]
    mesh = zj.make_mesh(8, axes=MESHES["2x4"])
    tx = OPTIMIZERS["sgd"]()
    runs, host = {}, {}
    for layers in (zj.Layers(LAYERS), zj.Layers(LAYERS, partition=True),
                   zj.Layers(LAYERS, "offload", partition=True)):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=layers,
                            rules=TENSOR_PARALLEL)
        runs[layers] = train(plan, init, loss_fn, batches, tx)
        if layers.remat == "offload":
            state, step = zj.init_state(plan, init, tx, KEY), zj.make_train_step(plan, loss_fn, tx)
            put = jax.device_put(batches[0], NamedSharding(mesh, P(plan.data_axes)))
            host = [sum(v.aval.memory_space == jax.memory.Space.Host for v in eqn.outvars)
                    for eqn, _ in equations(jax.make_jaxpr(step)(state, put).jaxpr)
                    if eqn.primitive.name == "scan"]
    plain, cut, offloaded = runs.values()
    stacked = lambda seq: f"f32[{cfg.n_layers},4,{seq},{cfg.d_model}]"  # batch 8 over data 2
    assert stacked(256) in plain[2] and stacked(64) not in plain[2]
    for run in (cut, offloaded):
        assert stacked(64) in run[2] and stacked(256) not in run[2]
        np.testing.assert_allclose(run[0], plain[0], rtol=1e-6)
    assert host[0] == 1  # the forward loop's checkpoints, cut, in host memory
    with pytest.raises(ValueError, match="needs tensor parallelism"):
        zj.make_plan(jax.eval_shape(init, KEY), zj.make_mesh(8), 3,
                     layers=zj.Layers(LAYERS, partition=True))


def test_checkpoint_moves_between_meshes(tmp_path, gpt):
    """Written at data 2 x model 4, read back exactly at 8 x 1 (no model axis) and 4 x 2."""
    init = gpt[0]
    tx = OPTIMIZERS["adamw"]()
    shapes = jax.eval_shape(init, KEY)

    def plan_on(axes):
        return zj.make_plan(shapes, zj.make_mesh(8, axes=axes), 3, layers=LAYERS,
                            rules=TENSOR_PARALLEL)

    state = zj.init_state(plan_on(MESHES["2x4"]), init, tx, KEY)
    ckpts = zj.Checkpoints(tmp_path)
    ckpts.save(state, {"step": 0})
    for axes in ({"data": 8}, MESHES["4x2"]):
        plan = plan_on(axes)
        back, _ = ckpts.restore(zj.abstract_state(plan, tx))
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        kernel = back.params["blocks"]["fc1"]["kernel"]
        assert kernel.sharding.spec == plan.param_specs["blocks"]["fc1"]["kernel"]
    ckpts.close()


@pytest.mark.parametrize("options, message", [
    ({"offload": zj.Offload(1.0)}, "not built with offload or prefetch"),
    ({"comm": zj.Comm(prefetch=True)}, "not built with offload or prefetch"),
])
def test_refused_combinations(gpt, options, message):
    mesh = zj.make_mesh(8, axes=MESHES["4x2"])
    with pytest.raises(ValueError, match=message):
        zj.make_plan(jax.eval_shape(gpt[0], KEY), mesh, 3, layers=LAYERS, rules=TENSOR_PARALLEL,
                     **options)
    odd = dataclasses.replace(CFG, n_heads=2)  # 2 heads over 4
    with pytest.raises(ValueError, match="does not divide"):
        zj.make_plan(jax.eval_shape(init_fn(GPT(odd)), KEY), zj.make_mesh(8, axes=MESHES["2x4"]),
                     3, layers=LAYERS, rules=TENSOR_PARALLEL)


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


def test_annotated_nnx_model_needs_no_table():
    x = jax.random.normal(jax.random.key(1), (32, 16))
    y = jax.random.randint(jax.random.key(2), (32,), 0, 4)
    with nnx.use_eager_sharding(False):  # zero_jax places the parameters
        graphdef, state = nnx.split(AnnotatedNNX(nnx.Rngs(0)), nnx.Param)
        rules = zj.tensor_parallel_rules(state, [("mlp", "model"), ("embed", None)])
    assert {r.pattern: r.model_dim for r in rules} == {
        r"^blocks/0/up/kernel$": -1, r"^blocks/0/down/kernel$": -2,
        r"^blocks/1/up/kernel$": -1, r"^blocks/1/down/kernel$": -2}

    def init(key):
        with nnx.use_eager_sharding(False):
            return nnx.state(AnnotatedNNX(nnx.Rngs(key)), nnx.Param)

    def loss_fn(params, batch):
        logits = zj.nnx_merge(graphdef, params)(batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    mesh = zj.make_mesh(8, axes=MESHES["2x4"])
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=r"^blocks/\d+$",
                        rules=rules)
    state = trains_like_one_device(plan, init, loss_fn, (x, y), gathers_on_model=True)
    assert state.params["blocks"][1]["down"]["kernel"].sharding.spec == P("model", "data")
