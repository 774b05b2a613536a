"""Memory-centric tiling (ZeRO-Infinity): at stage 3 a block's parameter larger than
``Layers(tile_mb=...)`` is never gathered whole; its Dense computes tile by tile, forward and
backward. It must train as the untiled step does, gather nothing above the bound, hold less
than the untiled step's whole gathered block, and refuse what it does not handle, by name."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import max_rel, rel, tree_rel
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax import report
from zero_jax.hlo import collectives
from zero_jax.peak import compile_with_peak

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

# D = 36 does not divide by 8: "up" ([36, 2048]) is cut along its columns and tiled along its
# 36 contracted rows (tile products summed); "down" ([2048, 36]) is cut along its rows and
# tiled along its 36 output columns (tiles side by side). Each kernel is the largest leaf.
D, F, V, T, L = 36, 2048, 64, 8, 3
KERNEL = D * F * 4  # bytes of one whole kernel (fp32)
BOUND = KERNEL / 4  # the tile bound: a quarter of a kernel
KEY = jax.random.key(0)
STEPS = 4


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        h = nn.gelu(nn.Dense(F, name="up")(nn.LayerNorm(name="ln")(x)))
        return x + nn.Dense(D, name="down")(h), None


class Net(nn.Module):
    scan: bool = False

    @nn.compact
    def __call__(self, toks):
        embed = nn.Embed(V, D, name="embed")
        x = embed(toks)
        if self.scan:
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=L)(name="blocks")(x, None)
        else:
            for i in range(L):
                x, _ = Block(name=f"h_{i}")(x)
        return embed.attend(nn.LayerNorm(name="ln_f")(x))


def problem(scan: bool):
    model = Net(scan)
    init = lambda key: model.init(key, jnp.zeros((1, T), jnp.int32))["params"]

    def loss_fn(params, toks):
        logits = model.apply({"params": params}, toks[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()
    return init, loss_fn, "blocks" if scan else r"^h_\d+$"


def batch(i: int) -> np.ndarray:
    return np.asarray(jax.random.randint(jax.random.key(i), (16, T + 1), 0, V))


# (scanned, optimizer, mesh axes, microbatches): the tiles' gradients also cross groups
# (hierarchical ZeRO) and accumulate as the untiled ones do.
LAYOUTS = {"unrolled, sgd": (False, lambda: optax.sgd(0.3), None, 1),
           "scanned, adamw": (True, lambda: optax.adamw(3e-3, weight_decay=0.1), None, 1),
           "scanned, sgd, hierarchical, 2 microbatches": (True, lambda: optax.sgd(0.3),
                                                          {"replica": 2, "data": 4}, 2)}


PEAKED = "scanned, adamw"  # the layout whose temp at its fullest moment is read


@functools.cache
def trained(layout: str, tile: float | None):
    """(plan, lowered and compiled step, losses, final state, and for ``PEAKED`` what its temp
    holds at the fullest moment, else None) of ``STEPS`` steps at stage 3, tiled within
    ``tile`` bytes or not: one compile, read and then run."""
    scan, make_tx, axes, accum = LAYOUTS[layout]
    init, loss_fn, pattern = problem(scan)
    mesh, tx = zj.make_mesh(8, axes=axes), make_tx()
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=zj.Layers(
        pattern, tile_mb=tile and tile / 2**20))
    state = zj.init_state(plan, init, tx, KEY)
    put = lambda b: jax.device_put(b, NamedSharding(mesh, P(plan.data_axes)))
    lowered = zj.make_train_step(plan, loss_fn, tx, accum_steps=accum).lower(state, put(batch(0)))
    compiled, peak = compile_with_peak(lowered) if layout == PEAKED else (lowered.compile(), None)
    losses = []
    for i in range(STEPS):
        state, m = compiled(state, put(batch(i)))
        losses.append(float(m["loss"]))
    return plan, lowered, compiled, np.array(losses), state, peak


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tiled_training_equals_untiled(layout):
    plan, _, _, losses, state, _ = trained(layout, BOUND)
    _, _, _, plain_losses, plain, _ = trained(layout, None)
    block = plan.leaves[plan.blocks[0]]
    assert block["up"]["kernel"].tile[1] == block["down"]["kernel"].tile[1] == 4
    assert rel(losses, plain_losses) < 1e-6, (losses, plain_losses)
    # "up" sums its tiles' products, in another order than one matmul: rounding, which Adam
    # turns into about its sign where a gradient is near zero.
    assert tree_rel(state.params, plain.params) < (1e-6 if "sgd" in layout else 1e-5)
    assert jax.tree.map(lambda x: x.sharding.spec, state.params) == \
        jax.tree.map(lambda x: x.sharding.spec, plain.params)  # the same layout
    assert losses[-1] < losses[0]  # and it trains


def test_tiled_gradient_equals_one_device():
    init, loss_fn, pattern = problem(False)
    mesh = zj.make_mesh(8)
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                        layers=zj.Layers(pattern, tile_mb=BOUND / 2**20))
    state = zj.init_state(plan, init, optax.sgd(0.1), KEY)
    toks = batch(7)
    _, grads = jax.jit(zj.make_grad_fn(plan, loss_fn))(
        state.params, jax.device_put(toks, NamedSharding(mesh, P("data"))))
    assert max_rel(grads, jax.jit(jax.grad(loss_fn))(init(KEY), toks)) < 1e-5  # op by op: slower


def test_nothing_above_the_bound_is_gathered_and_temp_drops():
    plan, lowered, tiled, _, state, peak = trained(PEAKED, BOUND)
    _, _, plain, _, _, plain_peak = trained(PEAKED, None)
    gathers = lambda c: [x for x in collectives(c.as_text(), 8) if x.kind == "all-gather"]
    assert max(x.bytes for x in gathers(tiled)) <= BOUND
    assert max(x.bytes for x in gathers(plain)) >= 2 * KERNEL  # the block's kernels, whole
    # Each tile's gradient reduce-scattered once (3 layers x 2 kernels x 4 tiles). An "up" tile
    # is gathered in the forward, again in the block's recompute (its output feeds the
    # backward) and in its backward; a "down" tile is not recomputed (the block's output is
    # needed by no backward): 3 + 2 gathers per pair of tiles.
    tiles = [x for x in collectives(tiled.as_text(), 8) if x.bytes == BOUND]
    assert sum(x.count for x in tiles if x.kind == "reduce-scatter") == L * 2 * 4
    assert sum(x.count for x in tiles if x.kind == "all-gather") == L * 4 * (3 + 2)
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    # The untiled step holds a layer's two kernels whole (and, while they are cut out of their
    # bucket, the bucket too); the tiled one at most two tiles of them: the gathered weights
    # in XLA's temp allocation when it is fullest (zero_jax.peak). Its temp drops.
    gathered = lambda found: found["temp"]["by_kind"]["gathered weights"]
    assert gathered(plain_peak) >= 2 * KERNEL, gathered(plain_peak)
    assert gathered(peak) <= 2 * BOUND, gathered(peak)
    assert temp(tiled) < temp(plain), (temp(plain), temp(tiled))
    # The report states the tiles and the largest gather, and counts a tile as gathered.
    r = report.build(plan, state, lowered, tiled)
    assert r["largest_gather_bytes"] == BOUND and r["tile_bytes"] == BOUND
    assert [(x["path"], x["tiles"]) for x in r["tiled"]] == [("blocks/down/kernel", 4),
                                                            ("blocks/up/kernel", 4)]
    assert "tiled within 0.0703 MiB (2 leaves" in report.format_table(r)
    layer = sum(math.prod(x.shape[1:]) for x in jax.tree.leaves(plan.shapes["blocks"]))
    assert report.block_elements(plan) == {"blocks": layer - 2 * D * F + D * F // 4}


@pytest.mark.parametrize(("kwargs", "phrase"), [
    (dict(stage=2), "not built with stage 2"),
    (dict(prefetch=True), "not built with prefetch"),
    (dict(offload=zj.Offload(optimizer=1.0)), "not built with offload"),
    (dict(axes={"data": 4, "model": 2}), "not built with tensor parallelism"),
    (dict(tile=F * 4 / 2), r"h_0/down/kernel \(0.28 MB per layer, shape \(2048, 36\), cut "
                          r"along 0\): its smallest tile, 0.00781 MB, is above tile_mb=0.00391"),
    (dict(tile=0), "tile_mb must be a positive number"),
])
def test_refused_when_planned(kwargs, phrase):
    init, _, pattern = problem(False)
    mesh = zj.make_mesh(8, axes=kwargs.pop("axes", None))
    tile, prefetch = kwargs.pop("tile", BOUND) / 2**20, kwargs.pop("prefetch", False)
    with pytest.raises(ValueError, match=phrase):
        zj.make_plan(jax.eval_shape(init, KEY), mesh, kwargs.pop("stage", 3),
                     layers=zj.Layers(pattern, tile_mb=tile, prefetch=prefetch), **kwargs)


class Raw(nn.Module):
    """A block that reads its large weight itself, not through a Dense."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.02), (D, F))
        b = self.param("b", nn.initializers.zeros, (F,))
        return x + (x @ w + b)[..., :D]


class RawNet(nn.Module):
    @nn.compact
    def __call__(self, toks):
        embed = nn.Embed(V, D, name="embed")
        return embed.attend(Raw(name="raw")(embed(toks)))


def test_a_tiled_leaf_read_by_another_module_is_refused_by_name():
    model = RawNet()
    init = lambda key: model.init(key, jnp.zeros((1, T), jnp.int32))["params"]
    loss_fn = lambda p, toks: model.apply({"params": p}, toks[:, :-1]).mean()
    plan = zj.make_plan(jax.eval_shape(init, KEY), zj.make_mesh(8), 3,
                        layers=zj.Layers("raw", tile_mb=BOUND / 2**20))
    assert plan.leaves["raw"]["w"].tile == (0, 4)  # cut along its columns, tiled along rows
    with pytest.raises(ValueError, match=r"parameter raw/w is larger than Layers\(tile_mb=\.\.\.\) "
                                         r"\(0\.28 MB whole\) and reaches Raw\.__call__"):
        jax.eval_shape(zj.make_grad_fn(plan, loss_fn), zj.abstract_state(plan, optax.sgd(0.1))
                       .params, jax.ShapeDtypeStruct((16, T + 1), jnp.int32))
