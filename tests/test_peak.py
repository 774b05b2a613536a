"""What fills the compiled step's peak (``zero_jax.peak``): XLA's live ranges read and sorted
by kind, on a hand-written dump and on compiled steps of a scanned 4-layer model."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import zero_jax as zj
from zero_jax import report
from zero_jax.peak import breakdown, kind, temp_split
from zero_jax.shards import after_inputs

# The shape of XLA's "Stack trace breakdown for peak usage" (jax 0.10.2's CPU dump), written
# by hand: a program root, an argument's path in parts, operations by name stack.
DUMP = """\
  Live ranges at 12 (peak):
    all_gather.1{}: 400 bytes (cumulative: 400 bytes)
  Stack trace breakdown for peak usage: 1 000 bytes
    main.1_spmd (100.0%, total: 1 000 bytes, current: 0 bytes)
      ├── s/jvp(M)/while (60.0%, total: 600 bytes, current: 0 bytes)
      │   └── body.2_spmd (60.0%, total: 600 bytes, current: 0 bytes)
      │       ├── s/jvp(M)/w/b/checkpoint/all_gather (40.0%, total: 400 bytes, current: 400 bytes)
      │       └── s/jvp(M)/w/b/gathered/slice (20.0%, total: 200 bytes, current: 200 bytes)
      ├── state (25.0%, total: 250 bytes, current: 0 bytes)
      │   └── params (25.0%, total: 250 bytes, current: 0 bytes)
      │       └── w (25.0%, total: 250 bytes, current: 250 bytes)
      ├── s/transpose(jvp(M))/jvp(b)/dot (10.0%, total: 100 bytes, current: 100 bytes)
      └── s/transpose(jvp(M))/transpose(jvp(b))/add_any (5.0%, total: 50 bytes, current: 50 bytes)
"""


def test_a_dump_is_read_and_sorted_by_kind():
    b = breakdown(DUMP)
    assert b["peak_bytes"] == 1000
    assert {k: v for k, v in b["by_kind"].items() if v} == {
        "model states": 250, "gathered weights": 600, "recomputed activations": 100,
        "gradients": 50}
    assert b["largest"][0] == ["s/jvp(M)/w/b/checkpoint/all_gather",
                               "gathered weights", 400]
    assert ["state/params/w", "model states", 250] in b["largest"]
    assert breakdown("no breakdown here")["peak_bytes"] == 0
    assert kind("jit(step)/shard_map/psum_scatter") == "reduced gradients"
    assert kind("jit(step)/shard_map/jvp(M)/ln_f/mul") == "forward activations"
    assert kind("jit(step)/cond/branch_1_fun/add") == "optimizer update"
    # The gradient half's last phases, by their named scopes (grads.local_grads).
    assert kind("jit(step)/shard_map/reduce_gradients/psum") == "reduced gradients"
    assert kind("jit(step)/shard_map/normalize_gradients/mul") == "gradients"
    # A gradient bucket packed in a block's backward (stage 2) is not a gathered one.
    assert kind("jit(step)/shard_map/transpose(jvp(M))/while/body/closed_call/checkpoint/"
                "blocks/concatenate") == "gradients"
    # Leaves cut out of a bucket (buckets.all_gather's scope), in prefetch's backward too, are
    # gathered weights; a block's own slices and casts (q, k, v split from one matmul's output;
    # a layer norm's cast) are not.
    assert kind("jit(step)/shard_map/transpose(jvp(M))/gathered/slice") == "gathered weights"
    block = "jit(step)/shard_map/transpose(jvp(M))/while/body/closed_call/checkpoint/"
    for op in ("blocks/slice", "blocks/ln1/convert_element_type"):
        assert kind(block + "rematted_computation/" + op) == "recomputed activations"
    # Prefetch's backward loop runs each layer's remat under transposes of its own.
    assert kind("jit(step)/shard_map/transpose(jvp(M))/transpose(jvp(transpose(jvp(M))))/jvp()/"
                "checkpoint/rematted_computation/blocks/mul") == "recomputed activations"
    assert kind("jit(step)/shard_map/transpose(jvp(M))/transpose(jvp(transpose(jvp(M))))/jvp()/"
                "checkpoint/blocks/add_any") == "gradients"


# The four dumps ``temp_split`` reads, written by hand in the shapes of jax 0.10.2's CPU dumps:
# a loop whose body hands a gathered layer to its next iteration (a "phi"), a buffer that
# shares bytes with it, and two buffers of the backward. The allocation is 1,000 bytes.
ASSIGNMENT = """\
allocation 0: size 100, parameter 0, shape |f32[25]| at ShapeIndex {}:
 value: <0 p @0> (size=100,offset=0): f32[25]{0}
allocation 1: size 1000, preallocated-temp:
 value: <1 param.1{1} (phi) @0> (size=400,offset=0): f32[100]{0}
 value: <2 copy.1 @0> (size=350,offset=50): f32[87]{0}
 value: <3 dot.1 @0> (size=200,offset=600): f32[50]{0}
 value: <4 add_any.1 @0> (size=300,offset=400): f32[75]{0}
"""
VALUES = """\
<1 param.1{1} (phi) @0>
 positions:
  param.1 {1}
 from instruction: %param.1 = (s32[], f32[100]{0}) parameter(0)
<2 copy.1 @0>
 positions:
  copy.1
 from instruction: %copy.1 = f32[87]{0} copy(%x)
<3 dot.1 @0>
 positions:
  dot.1
 from instruction: %dot.1 = f32[50]{0} dot(%a, %b)
<4 add_any.1 @0>
 positions:
  add_any.1
 from instruction: %add_any.1 = f32[75]{0} add(%c, %d)
"""
LIVE_RANGES = """\
  BufferLiveRange:
    p{}:0-6
    param.1{1}:0-5
    copy.1{}:2-2
    dot.1{}:2-3
    add_any.1{}:4-6
  Live ranges at 4 (peak):
    add_any.1{}: 300 bytes (cumulative: 300 bytes)
"""
HLO = """\
%body.1 (param.1: (s32[], f32[100])) -> (s32[], f32[100]) {
  %param.1 = (s32[], f32[100]{0}) parameter(0)
  %all-gather.1 = f32[100]{0} all-gather(%y), metadata={op_name="s/jvp(M)/while/body/all_gather"}
  ROOT %tuple.1 = (s32[], f32[100]{0}) tuple(%add.1, %all-gather.1)
}

ENTRY %main.2 (p: f32[25]) -> f32[] {
  %while.1 = (s32[], f32[100]{0}) while(%tuple.0), condition=%cond.1, body=%body.1
  %copy.1 = f32[87]{0} copy(%x)
  %dot.1 = f32[50]{0} dot(%a, %b), metadata={op_name="s/transpose(jvp(M))/jvp(b)/dot"}
  %add_any.1 = f32[75]{0} add(%c), metadata={op_name="s/transpose(jvp(M))/transpose(jvp(b))/add"}
}
"""


def test_the_temp_allocation_splits_into_kinds_and_the_bytes_between_them():
    """At its fullest (time 4: 400 + 300 bytes; at time 2 the copy lies within the carried
    layer's bytes, so 400 + 200), by kind: the loop's carried value named by what the body
    hands on (a gathered layer), the backward's gradient, and 300 bytes between buffers."""
    split = temp_split(ASSIGNMENT, VALUES, LIVE_RANGES, HLO)
    assert split["bytes"] == 1000 and split["at"] == 4 and split["between buffers"] == 300
    assert {k: v for k, v in split["by_kind"].items() if v} == {
        "gathered weights": 400, "gradients": 300}
    assert temp_split("no temp allocation", VALUES, LIVE_RANGES, HLO) == {}
    # jax 0.11's dumps (a GPU's too) name the allocation's page before what it holds.
    paged = ASSIGNMENT.replace("size 1000, preallocated", "size 1000, page 0, preallocated")
    assert temp_split(paged, VALUES, LIVE_RANGES, HLO) == split


@pytest.fixture(scope="module")
def scanned():
    import regather

    cfg = dataclasses.replace(regather.CFG, n_layers=4)
    from zero_jax.gpt.model import GPT, init_fn, lm_loss

    model = GPT(cfg)
    shapes = jax.eval_shape(init_fn(model), jax.random.key(0))
    layer = 4 * sum(math.prod(x.shape[1:]) for x in jax.tree.leaves(shapes["blocks"]))
    return shapes, lm_loss(model), regather.BATCH, layer


def peak_of(mesh, scanned, stage, comm=None, gather="block", prefetch=False):
    """The report's ``compiled`` figures and ``peak`` (the report compiles the step itself)."""
    shapes, loss_fn, batch, _ = scanned
    tx = optax.adamw(1e-3)
    plan = zj.make_plan(shapes, mesh, stage,
                        layers=zj.Layers("blocks", gather=gather, prefetch=prefetch),
                        comm=comm or zj.Comm())
    state = zj.abstract_state(plan, tx)
    r = report.build(plan, state, zj.make_train_step(plan, loss_fn, tx).lower(state, batch))
    if stage == 3 and gather == "block":
        table = report.format_table(r)
        assert "at the compiled step's peak" in table and "gathered weights" in table
        fills = table.split("what fills XLA's temp allocation")[1]
        assert re.search(r"\n +gathered weights +[\d.]+ MiB +ZeRO: [\d.]+ MiB\n", fills)
        assert re.search(r"\n +between buffers +[\d.]+ MiB", fills)
        assert r["peak"]["expected"]["gathered weights"] == \
            (1 + plan.prefetch) * scanned[3]
    return r["compiled"], r["peak"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_peak_splits_into_arguments_and_temp(stage, mesh, scanned):
    """At every stage the peak fits what XLA allocates (arguments, temp, outputs not written
    over the arguments), its model states are arguments (at most their bytes, at least the
    half not yet donated away), and only stage 3 holds gathered weights. From stage 2 on no
    whole gradient is held beyond one block's and its bucket (ZeRO's figure twice), beside the
    shards reduced so far and the leaves outside the blocks, reduced after the backward;
    stages 0 and 1, which all-reduce, hold more."""
    memory, peak = peak_of(mesh, scanned, stage)
    args, states = memory["argument_bytes"], peak["by_kind"]["model states"]
    assert args / 2 < states <= args < peak["peak_bytes"] <= args + \
        memory["temp_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
    assert (peak["by_kind"]["gathered weights"] > 0) == (stage == 3)
    shapes, layer = scanned[0], scanned[3]
    whole = 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    outside = whole - 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["blocks"]))
    bound = 2 * layer + whole // mesh.size + outside
    assert peak["expected"].get("gradients") == (layer if stage >= 2 else None)
    assert (peak["by_kind"]["gradients"] <= bound) == (stage >= 2), (peak["by_kind"], bound)
    # The temp allocation when fullest: its kinds and the bytes between buffers are all of it.
    temp = peak["temp"]
    assert temp["bytes"] == memory["temp_bytes"]
    assert sum(temp["by_kind"].values()) + temp["between buffers"] == temp["bytes"]
    assert 0 <= temp["between buffers"] < temp["bytes"] / 5
    assert temp["by_kind"]["model states"] == 0  # the arguments are not in it
    assert (temp["by_kind"]["gathered weights"] > 0) == (stage == 3)


@pytest.mark.slow
@pytest.mark.parametrize("prefetch, bucket_bytes",
                         [(False, 0), (True, 0), (True, zj.Comm().bucket_bytes)])
def test_stage3_holds_one_gathered_layer_more_with_prefetch(prefetch, bucket_bytes, mesh,
                                                            scanned):
    """Per leaf, stage 3 holds at most one gathered layer at its peak, and with prefetch at
    most two, in buckets too (a bucket live beside the leaves cut from it would add a third):
    read from the live ranges. (Without prefetch, buckets still hold 1.3 layers.)"""
    layer = scanned[3]
    _, peak = peak_of(mesh, scanned, 3, zj.Comm(bucket_bytes=bucket_bytes), prefetch=prefetch)
    assert 0 < peak["by_kind"]["gathered weights"] <= (1 + prefetch) * layer
    # And when the temp allocation is fullest.
    assert 0 < peak["temp"]["by_kind"]["gathered weights"] <= (1 + prefetch) * layer


def test_a_block_input_gradient_skips_the_gather_barrier():
    """``after_inputs`` holds a block's gathers back until its input exists; the input's own
    gradient must not come back through that barrier: a zero gradient of the input's size,
    materialized and added to the real one in every block's backward (0.5 MiB of temp per
    device on the wide config's stage 3)."""
    x_BxD, w_DxD = jnp.ones((4, 16)), jnp.ones((16, 16))
    loss = lambda w, x: jnp.sum(jnp.tanh(x) @ after_inputs(w, (x,), {}))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(w_DxD, x_BxD).jaxpr
    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == 2  # the forward's, and its transpose
    read = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    assert [v.aval.shape for e in barriers for v in e.outvars if id(v) in read] == \
        [w_DxD.shape] * 2


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [False, True])
def test_gathering_by_module_holds_one_module_at_a_time(prefetch, mesh, scanned):
    """``Layers(gather="module")``: at its peak stage 3 holds at most the largest module's
    gathered weights (an MLP matrix, less than half of a layer), not a layer's; with prefetch
    (the next module's gather issued one module ahead) at most two."""
    layer = scanned[3]
    _, peak = peak_of(mesh, scanned, 3, gather="module", prefetch=prefetch)
    expected = peak["expected"]["gathered weights"]
    assert expected / (1 + prefetch) < layer / 2
    assert 0 < peak["by_kind"]["gathered weights"] <= expected, (peak["by_kind"], expected)
