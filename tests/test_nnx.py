"""Per-block ZeRO on NNX models: blocks in a list and under ``nnx.scan``, merged with
``zero_jax.nnx_merge`` in the loss, compared with one-device optax."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import N, max_rel, optax_steps, rel, tree_rel
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax.hlo import collectives

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

D, H = 16, 64
KEY = jax.random.key(0)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
        self.up = nnx.Linear(D, H, rngs=rngs)
        self.down = nnx.Linear(H, D, rngs=rngs)
        self.gate = nnx.Param(jnp.full((3,), 0.1))  # 3 does not cut over 8: whole
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        return x + self.gate.mean() * self.down(self.drop(nnx.gelu(self.up(x))))


class Listed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, n: int = 8, dropout: float = 0.0):
        self.blocks = nnx.List([Block(rngs, dropout) for _ in range(n)])
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Scanned(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, n: int = 4, dropout: float = 0.0):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(rngs, dropout)
        self.blocks = blocks(rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def forward(block, x):
            return block(x)
        return self.head(forward(self.blocks, x))


def problem(cls):
    """The documented recipe: parameters trained, the rest (RNG streams) passed along."""
    graphdef, _, rest = nnx.split(cls(nnx.Rngs(0)), nnx.Param, ...)
    init = lambda key: nnx.state(cls(nnx.Rngs(key)), nnx.Param)

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((zj.nnx_merge(graphdef, params, rest)(x) - y) ** 2)

    return init, loss_fn


def data(seed):
    x = jax.random.normal(jax.random.key(seed), (32, D))
    return x, jnp.sin(x.sum(axis=1, keepdims=True))


def put(mesh, batch):
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


# SGD at every stage (it shows a gradient of the wrong scale, which Adam would hide); AdamW once:
# the blocks' routing does not depend on the optimizer, and test_equivalence runs AdamW with
# clipping at every stage.
# Stage 3 gathering each module as it runs (Layers.gather) likewise, with SGD. 4 blocks: every
# block is routed alike, so 8 prove no more (the file: 81 -> 57 s of CPU).
LISTED = 4


TXS = {"sgd": lambda: optax.sgd(0.01), "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1)}


@pytest.fixture(scope="module")
def one_device():
    """Per optimizer, ``optax_steps`` of the listed blocks over 5 batches (computed once for
    the stages: one jitted step, where each stage's reference ran optax's update op by op)."""
    init, loss_fn = problem(lambda rngs: Listed(rngs, n=LISTED))
    return {name: optax_steps(loss_fn, make(), init(KEY), [data(i) for i in range(5)])
            for name, make in TXS.items()}


@pytest.mark.parametrize(("stage", "opt", "gather"), [
    (0, "sgd", "block"), (1, "sgd", "block"), (2, "sgd", "block"), (3, "sgd", "block"),
    (3, "adamw", "block"), (3, "sgd", "module")])
def test_listed_blocks_train_like_one_device(stage, opt, gather, mesh, one_device):
    init, loss_fn = problem(lambda rngs: Listed(rngs, n=LISTED))
    tx = TXS[opt]()
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, stage,
                        layers=zj.Layers(r"^blocks/\d+$", gather=gather))
    assert plan.blocks == [f"blocks/{i}" for i in range(LISTED)]
    state = zj.init_state(plan, init, tx, KEY)
    step = zj.make_train_step(plan, loss_fn, tx).lower(state, put(mesh, data(0))).compile()
    ref = one_device[opt]
    if opt == "sgd":  # gradients directly, at the initial parameters (once per stage)
        _, grads = jax.jit(zj.make_grad_fn(plan, loss_fn))(state.params, put(mesh, data(0)))
        # Summed over 8 devices in another order: 1e-5 of the whole, 1e-4 of the smallest leaf.
        assert tree_rel(grads, ref["grads"][0]) < 1e-5 and max_rel(grads, ref["grads"][0]) < 1e-4
    for i in range(5):
        state, m = step(state, put(mesh, data(i)))
        assert rel(m["loss"], ref["losses"][i]) < 1e-5
    params = ref["params"]
    # Zero-initialised biases stay tiny here, so per leaf the summation order shows more.
    assert tree_rel(state.params, params) < 1e-5
    assert max_rel(state.params, params) < (1e-4 if opt == "sgd" else 1e-3)
    found = collectives(step.as_text(), N)
    if stage == 3 and gather == "block":  # each block's buffer (its two matrices and cut
        # biases) gathered in the forward and again in the backward
        blocks = [c for c in found if c.bytes >= 2 * 4 * D * H]
        assert sum(c.count for c in blocks if c.kind == "all-gather") == 2 * LISTED
    if gather == "module":  # each matrix alone (it outweighs its input): gathered in the
        # forward, in the block's recompute and in its own backward (but the first block's
        # first, whose input, the data, needs no gradient); reduced once
        matrices = [c for c in found if c.bytes == 4 * D * H]
        assert sum(c.count for c in matrices if c.kind == "all-gather") == 3 * 2 * LISTED - 1
        assert sum(c.count for c in matrices if c.kind == "reduce-scatter") == 2 * LISTED


def test_scanned_blocks_train_like_one_device(mesh):
    init, loss_fn = problem(Scanned)
    tx = optax.sgd(0.05)
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers="^blocks$")
    kernel = plan.leaves["blocks"]["up"]["kernel"]
    assert kernel.stacked and kernel.axis == 1  # the layer index is never cut
    state = zj.init_state(plan, init, tx, KEY)
    step = zj.make_train_step(plan, loss_fn, tx)
    params, grad = init(KEY), jax.jit(jax.value_and_grad(loss_fn))  # one device's
    for i in range(5):
        state, m = step(state, put(mesh, data(i)))
        loss, g = grad(params, data(i))
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, g)
        assert rel(m["loss"], loss) < 1e-5
    assert max_rel(state.params, params) < 1e-5


def test_trained_state_goes_out_to_safetensors_and_back(mesh, tmp_path):
    """An NNX model's trained parameters at stage 3 (a scanned stack cut over the devices)
    saved as safetensors, one tensor per parameter named by its path, and read back into the
    plan's shards: the same bits, and a fresh module updated with them computes the same."""
    import safetensors.numpy

    init, loss_fn = problem(Scanned)
    tx = optax.sgd(0.05)
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers="^blocks$")
    state = zj.init_state(plan, init, tx, KEY)
    state, _ = zj.make_train_step(plan, loss_fn, tx)(state, put(mesh, data(0)))
    zj.save_safetensors(state.params, tmp_path / "out")
    files = safetensors.numpy.load_file(tmp_path / "out" / "model.safetensors")
    assert files["blocks.up.kernel"].shape == (4, D, H) and "head.bias" in files
    loaded = zj.load_params(plan, tmp_path / "out")
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state.params), strict=True):
        assert a.sharding == b.sharding and (np.asarray(a) == np.asarray(b)).all()
    graphdef, _, rest = nnx.split(Scanned(nnx.Rngs(0)), nnx.Param, ...)
    trained = nnx.merge(graphdef, jax.device_get(state.params), rest)
    model = Scanned(nnx.Rngs(1))  # other weights, replaced by the file's
    nnx.update(model, jax.device_get(loaded))
    x = data(1)[0]
    assert rel(model(x), trained(x)) == 0 and rel(Scanned(nnx.Rngs(1))(x), trained(x)) > 1e-3


@pytest.mark.parametrize("prefetch", [False, True])
def test_dropout_streams_reseeded_per_step_and_device(prefetch, mesh):
    """NNX keeps RNG streams as state; the recipe reseeds them from the step's key. With
    prefetch each block runs as a pure function of its parameters and its streams' state,
    and its backward draws the forward's keys again."""
    graphdef, _, rest = nnx.split(Listed(nnx.Rngs(0), n=3, dropout=0.5), nnx.Param, ...)
    init = lambda key: nnx.state(Listed(nnx.Rngs(key), n=3, dropout=0.5), nnx.Param)

    def loss_fn(params, batch, key):
        model = zj.nnx_merge(graphdef, params, rest)
        nnx.reseed(model, dropout=key)
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    tx = optax.sgd(0.1)
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                        layers=zj.Layers(r"^blocks/\d+$", prefetch=prefetch))
    state = zj.init_state(plan, init, tx, KEY)
    step = zj.make_train_step(plan, loss_fn, tx)
    params, key = init(KEY), jax.random.key(5)

    @jax.jit  # run op by op, its small programs cost more than one compile
    @jax.value_and_grad
    def reference(params, batch, step_key):
        parts = [jnp.split(b, N) for b in batch]
        return sum(loss_fn(params, (x, y), zj.device_key(step_key, d))
                   for d, (x, y) in enumerate(zip(*parts, strict=True))) / N

    for i in range(2):
        state, m = step(state, put(mesh, data(i)), key=key)
        loss, g = reference(params, data(i), jax.random.fold_in(key, i))
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, g)
        assert rel(m["loss"], loss) < 1e-5
    assert max_rel(state.params, params) < 1e-5


class NormBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, H, rngs=rngs)
        self.norm = nnx.BatchNorm(H, momentum=0.5, rngs=rngs)
        self.down = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.relu(self.norm(self.up(x))))


class Normed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([NormBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("prefetch", [False, True])
def test_batch_statistics_carried_through_the_batch(prefetch, mesh):
    """The recipe for non-parameter state that training updates (BatchNorm's statistics): it
    rides in the batch whole (spec ``P()``), and comes back as an auxiliary output, averaged
    over devices; each device normalizes with its own batch, as one device per slice would.
    With prefetch the statistics ride through each block's call and are set back after it."""
    graphdef, _, stats, rest = nnx.split(Normed(nnx.Rngs(0)), nnx.Param, nnx.BatchStat, ...)
    init = lambda key: nnx.state(Normed(nnx.Rngs(key)), nnx.Param)

    def loss_fn(params, batch):
        model = zj.nnx_merge(graphdef, params, batch["stats"], rest)
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, {"stats": nnx.state(model, nnx.BatchStat)}

    tx = optax.sgd(0.05)
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                        layers=zj.Layers(r"^blocks/\d+$", prefetch=prefetch))
    state = zj.init_state(plan, init, tx, KEY)
    spec = {"x": P("data"), "y": P("data"), "stats": P()}
    step = zj.make_train_step(plan, loss_fn, tx, batch_spec=spec, has_aux=True)

    @jax.jit  # run op by op, its small programs cost more than one compile
    @functools.partial(jax.value_and_grad, has_aux=True)
    def reference(params, batch):
        parts = [dict(x=x, y=y, stats=batch["stats"]) for x, y in
                 zip(jnp.split(batch["x"], N), jnp.split(batch["y"], N), strict=True)]
        outs = [loss_fn(params, p) for p in parts]
        mean = lambda trees: jax.tree.map(lambda *xs: sum(xs) / N, *trees)
        return sum(o[0] for o in outs) / N, mean([o[1] for o in outs])

    params, ref_stats = init(KEY), stats
    for i in range(3):
        x, y = data(i)
        state, m = step(state, {"x": x, "y": y, "stats": stats})
        (loss, aux), g = reference(params, {"x": x, "y": y, "stats": ref_stats})
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, g)
        stats, ref_stats = m["stats"], aux["stats"]
        assert rel(m["loss"], loss) < 1e-5
        assert tree_rel(stats, ref_stats) < 1e-5
    # As a whole only: the bias before a BatchNorm has a zero gradient in theory, so per leaf
    # it is rounding noise.
    assert tree_rel(state.params, params) < 1e-5
    assert tree_rel(stats, nnx.state(Normed(nnx.Rngs(0)), nnx.BatchStat)) > 0.1  # it moved
