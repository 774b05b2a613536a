"""Cheaper communication: buckets (one collective per layer) and int8 collectives (ZeRO++).

Buckets change how bytes travel, not which: the bucketed step must train bit-identically to the
one-collective-per-leaf step, and its program must hold one all-gather per layer and direction,
one reduce-scatter per layer (stages 0-1: one all-reduce per layer, inside the backward).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import KEY, OPTIMIZERS, tree_rel
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm import LAYERS

import zero_jax as zj
from zero_jax import buckets, report
from zero_jax.gpt import config
from zero_jax.gpt.experiment import Experiment
from zero_jax.hlo import collectives

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

STEPS = 5
BUCKET = zj.Comm(bucket_bytes=25 << 20)
LAYOUTS = {"stage0": (0, None), "stage1": (1, None), "stage2": (2, None), "stage3": (3, None),
           "hierarchical": (3, "replica")}


def per_kind(found, in_loop: bool) -> collections.Counter:
    """Executions per step of each (kind, dtype) in or outside the layer loops."""
    out = collections.Counter()
    for c in found:
        if c.in_loop == in_loop:
            out[c.kind, c.dtype] += c.count
    return out


def volume(found) -> dict:
    out = collections.Counter()
    for c in found:
        out[c.kind] += c.count * c.bytes
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_buckets_train_bit_identically_with_one_collective_per_layer(layout, small):
    _, init, loss_fn, batches = small
    stage, outer = LAYOUTS[layout]
    mesh = zj.make_mesh(8, axes={"replica": 2, "data": 4} if outer else None)
    tx = OPTIMIZERS["sgd"]()

    def train(comm):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, stage, layers=LAYERS,
                            rules=[zj.Rule("", min_shard_elems=64)], comm=comm)
        state = zj.init_state(plan, init, tx, KEY)
        step = zj.make_train_step(plan, loss_fn, tx)
        put = lambda b: jax.device_put(b, NamedSharding(mesh, P(plan.data_axes)))
        compiled = step.lower(state, put(batches[0])).compile()  # read, then run: one compile
        found = collectives(compiled.as_text(), 8)
        losses = []
        for b in batches[:STEPS]:
            state, m = compiled(state, put(b))
            losses.append(float(m["loss"]))
        return losses, jax.device_get(state.params), found

    plain, bucketed = train(zj.Comm(bucket_bytes=0)), train(BUCKET)
    # Stage 3's buckets as on a TPU (Comm.align): each device's piece padded to whole tiles.
    aligned = [train(zj.Comm(bucket_bytes=25 << 20, align=128))] if stage == 3 else []
    for other in [bucketed, *aligned]:
        assert plain[0] == other[0]
        for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(other[1]), strict=True):
            np.testing.assert_array_equal(a, b)
    for run in aligned:  # f32 pieces of whole 128s: 4 gathers of 2 layers, padded
        gathers = [c for c in run[2] if c.kind == "all-gather" and c.in_loop]
        assert sum(c.count for c in gathers) == 4
        assert all(c.bytes % (c.group_size * 128 * 4) == 0 for c in gathers)
        assert volume(gathers)["all-gather"] > volume(
            c for c in bucketed[2] if c.in_loop)["all-gather"]

    # The same bytes of each kind, in far fewer collectives: per layer (2 layers, f32) one
    # all-gather in the forward and one in the backward's remat, one reduce-scatter; the
    # persistent layer norms (whole parameters) all-reduced once per layer, in the backward.
    # Stages 0-1 all-reduce each layer's gradient inside the backward, not after it.
    found = bucketed[2]
    assert volume(found) == volume(plain[2])
    layers = 2
    looped = per_kind(found, in_loop=True)
    expect = {0: {("all-reduce", "f32"): layers}, 1: {("all-reduce", "f32"): layers},
              2: {("reduce-scatter", "f32"): layers, ("all-reduce", "f32"): layers},
              3: {("all-gather", "f32"): 2 * layers, ("reduce-scatter", "f32"): layers,
                  ("all-reduce", "f32"): layers}}[stage]
    if outer:  # whole leaves cross groups once per step, after the backward, not per layer
        del expect["all-reduce", "f32"]
    assert looped == expect
    if stage >= 2:  # one reduce-scatter per cut leaf per layer before, one per layer now
        scatter = ("reduce-scatter", "f32")
        assert per_kind(plain[2], in_loop=True)[scatter] > 2 * looped[scatter]
    if outer:  # the across-group sync in buckets too: one reduce-scatter, two all-gathers
        across = [c for c in found if not c.in_loop and "replica" in
                  report.mesh_axes(c.group, mesh) and c.kind != "all-reduce"]
        assert sorted(c.kind for c in across) == ["all-gather", "all-gather", "reduce-scatter"]


def test_int8_gradients_are_the_gradient_within_quantization_error(small):
    """The stage-3 gradient with int8 collectives against jax.grad on one device, directly
    (Adam would hide a gradient N times too large): int8 gradients are the exact gradient up
    to their rounding; int8 weights give the gradient at the rounded weights. Measured 0.55%
    and 0.56% of its norm (5.6% for weights when a block of 64 could straddle two leaves)."""
    _, init, loss_fn, batches = small
    params = init(KEY)
    ref = jax.jit(jax.grad(loss_fn))(params, batches[0])  # op by op: slower
    mesh = zj.make_mesh(8)
    for comm in (zj.Comm(quantize_grads=True), zj.Comm(quantize_weights=True)):  # 25 MiB buckets
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=LAYERS, comm=comm)
        sharded = jax.device_put(params, plan.shardings(plan.param_specs))
        _, grads = jax.jit(zj.make_grad_fn(plan, loss_fn))(sharded, batches[0])
        assert tree_rel(grads, ref) < 0.01, comm


def build(sets: list[str]):
    cfg = config.load("tiny", ["zero.stage=3", *sets])
    return Experiment.build(cfg, zj.make_mesh(8))


def in_loop(sets: list[str]) -> dict:
    """{kind: (bytes per step, operand dtypes)} of the layer loops' collectives in the program
    as lowered (dtypes as requested: the CPU backend computes bf16 collectives in f32)."""
    exp = build(sets)
    state = zj.abstract_state(exp.plan, exp.tx)
    found = collectives(exp.step.lower(state, exp.batch_shape).as_text(dialect="hlo"), 8)
    out = collections.defaultdict(lambda: (0, set()))
    for c in found:
        if c.in_loop:
            total, dtypes = out[c.kind]
            out[c.kind] = (total + c.count * c.bytes, dtypes | {c.dtype})
    return out


def test_int8_collectives_carry_int8_and_half_of_bf16s_bytes():
    # In bf16, as on an accelerator: int8 plus one f32 scale per 64 elements is 0.53x of bf16.
    bf16 = ["precision.param_dtype=bf16", "precision.reduce_dtype=bf16"]
    plain = in_loop(bf16)
    assert plain["all-gather"][1] == plain["reduce-scatter"][1] == {"bf16"}
    weights = in_loop([*bf16, "zero.quantize_weights=int8"])
    assert weights["all-gather"][1] == {"s8", "f32"}  # the int8 blocks and their scales
    assert weights["all-gather"][0] <= 0.55 * plain["all-gather"][0]
    grads = in_loop([*bf16, "zero.quantize_grads=int8"])  # ZeRO++'s qgZ: all-to-all, no sum
    assert "reduce-scatter" not in grads and grads["all-to-all"][1] == {"s8", "f32"}
    assert grads["all-to-all"][0] <= 0.55 * plain["reduce-scatter"][0]
    # That they train like unquantized: test_precision.py, on the default model.


def test_int8_blocks_never_straddle_two_leaves():
    # A bucket packs a layer norm's gains (about 1) beside weights (about 0.02): with a scale
    # shared across the two, the weights would round to a few levels of 1/127.
    gains, weights = jnp.ones(16), 0.02 * jax.random.normal(jax.random.key(0), (100,))
    q, scale = buckets.quantize([gains, weights], block=64)
    assert q.dtype == jnp.int8 and q.size == 16 + 128 and scale.size == 1 + 2
    back = buckets.dequantize(q, scale, [16, 100], block=64)
    assert back.shape == (116,)
    np.testing.assert_array_equal(back[:16], gains)
    err = jnp.abs(back[16:] - weights) / jnp.abs(weights).max()
    assert err.max() <= 0.5 / 127 + 1e-6
