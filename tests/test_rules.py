"""The placement rules alone, in milliseconds: no step is compiled.

The rule table (first match per field), the leaf rule, block finding, the policies' own checks
and the combinations ``make_plan`` refuses, on ``ShapeDtypeStruct`` trees.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax.grads import GradStep, Route, normalize, reduce, routes, runtime
from zero_jax.hlo import collectives
from zero_jax.plan import find_blocks, leaf_rule, match_rules

F32 = jnp.float32
# A scanned stack of 4 layers beside unrolled-looking and odd-shaped leaves.
SHAPES = {
    "wte": {"embedding": jax.ShapeDtypeStruct((256, 64), F32)},
    "wpe": {"embedding": jax.ShapeDtypeStruct((16, 64), F32)},
    "blocks": {"qkv": {"kernel": jax.ShapeDtypeStruct((4, 64, 192), F32)},
               "ln": {"scale": jax.ShapeDtypeStruct((4, 64), F32)}},
    "head": {"bias": jax.ShapeDtypeStruct((13,), F32)},
    "h": {"0": {"kernel": jax.ShapeDtypeStruct((64, 128), F32),
                "bias": jax.ShapeDtypeStruct((128,), F32)}},  # an unrolled block
}
PATHS = ["wte/embedding", "wpe/embedding", "blocks/qkv/kernel", "blocks/ln/scale", "head/bias",
         "h/0/kernel", "h/0/bias"]


@pytest.fixture(scope="module")
def mesh():
    return zj.make_mesh(8)


def test_each_field_from_its_first_matching_rule():
    rules = [zj.Rule("^wpe/", frozen=True), zj.Rule("^w", shard=False),
             zj.Rule("", min_shard_elems=100), zj.Rule("^wpe/", frozen=False, shard=True)]
    fields = match_rules(rules, PATHS)
    f = lambda shard, frozen, least: {"shard": shard, "frozen": frozen,
                                      "min_shard_elems": least, "model_dim": None}
    assert fields["wpe/embedding"] == f(False, True, 100)
    assert fields["wte/embedding"] == f(False, False, 100)
    assert fields["blocks/qkv/kernel"] == f(True, False, 100)
    assert match_rules([], PATHS)["head/bias"] == f(True, False, 0)


def test_a_rule_that_matches_nothing_or_is_no_regex_is_refused():
    with pytest.raises(ValueError, match=r"Rule\('\^embed/'\) matches no parameter path"):
        match_rules([zj.Rule("^embed/", shard=False)], PATHS)
    with pytest.raises(ValueError, match="not a regular expression"):
        zj.Rule("blocks/(", frozen=True)
    with pytest.raises(ValueError, match="min_shard_elems must be at least 0"):
        zj.Rule("", min_shard_elems=-1)


def test_leaf_rule_cuts_the_first_divisible_dimension_after_the_layer_index():
    assert leaf_rule("k", (4, 64, 192), 8, stacked=True, min_shard_elems=0).axis == 1
    assert leaf_rule("k", (4, 64, 192), 8, stacked=False, min_shard_elems=0).axis == 1  # 4 % 8
    whole = leaf_rule("b", (13,), 8, stacked=False, min_shard_elems=0)
    assert whole.axis is None and "divisible by 8" in whole.reason
    small = leaf_rule("s", (4, 64), 8, stacked=True, min_shard_elems=100)
    assert small.axis == 1 and small.persistent
    assert leaf_rule("k", (64,), 1, stacked=False, min_shard_elems=0).axis is None
    assert leaf_rule("k", (64,), 1, stacked=False, min_shard_elems=0, cut_one=True).axis == 0


def test_a_leaf_cut_over_model_alone_subdivides_that_dimension_over_data():
    """A bias cut over ``model`` (t = 2) has no other dimension to cut over data (n = 4): its
    ``model`` one is cut into n x t pieces, model-major, where the stage cuts each copy: the
    optimizer state from stage 1, the gradient from 2, the parameter at 3; under the
    persistence threshold the optimizer state only. Hierarchical ZeRO likewise. The data
    axes' shard_map takes it split in two, a free reshape: each device keeps its bytes."""
    bias = leaf_rule("b", (2, 96), 4, True, 0, model=(-1, 2))
    assert (bias.axis, bias.model_dim, bias.persistent) == (1, 1, False)
    assert leaf_rule("b", (2, 96), 4, True, 0, model=(-1, 2), subdivide=False).axis is None
    small = leaf_rule("b", (2, 96), 4, True, 49, model=(-1, 2))  # 48 per rank
    assert (small.axis, small.persistent) == (1, True)
    assert leaf_rule("b", (2, 100), 4, True, 0, model=(-1, 2)).axis is None  # 100 % 8
    assert leaf_rule("k", (2, 64, 96), 4, True, 0, model=(-1, 2)).axis == 1  # another one
    shapes = {"fc1": {"kernel": jax.ShapeDtypeStruct((2, 64, 96), F32),
                      "bias": jax.ShapeDtypeStruct((2, 96), F32)}}
    mesh = zj.make_mesh(8, axes={"data": 4, "model": 2})
    rules = [zj.Rule("fc1", model_dim=-1)]
    plan = zj.make_plan(shapes, mesh, 3, rules=rules)
    spec = plan.param_specs["fc1"]["bias"]
    assert plan.param_specs["fc1"]["kernel"] == P(None, "data", "model")
    assert spec == plan.grad_specs["fc1"]["bias"] == P(None, ("model", "data"))
    view = plan.split_model(spec)
    assert view == P(None, "model", "data") and plan.manual(view) == P(None, None, "data")
    x = jax.device_put(np.arange(192, dtype=np.float32).reshape(2, 96), NamedSharding(mesh, spec))
    split = jax.jit(lambda x: plan.to_split(x, spec), out_shardings=NamedSharding(mesh, view))
    y = split(x)
    assert y.shape == (2, 2, 48) and not collectives(split.lower(x).compile().as_text(), 8)
    pieces = {s.device: np.asarray(s.data).ravel() for s in x.addressable_shards}
    for s in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data).ravel(), pieces[s.device])
    np.testing.assert_array_equal(plan.from_split(y, spec), x)
    for stage in (1, 2):
        plan = zj.make_plan(shapes, mesh, stage, rules=rules)
        assert plan.opt_specs["fc1"]["bias"] == P(None, ("model", "data"))
        assert plan.param_specs["fc1"]["bias"] == P(None, "model")
        assert plan.grad_specs["fc1"]["bias"] == (P(None, "model") if stage == 1 else spec)
    assert zj.make_plan(shapes, mesh, 0, rules=rules).opt_specs["fc1"]["bias"] == \
        P(None, "model")
    plan = zj.make_plan(shapes, zj.make_mesh(8, axes={"replica": 2, "data": 2, "model": 2}), 3,
                        rules=rules)  # hierarchical: within the group, or across groups too
    assert plan.param_specs["fc1"]["bias"] == P(None, ("model", "data"))
    assert plan.grad_specs["fc1"]["bias"] == plan.opt_specs["fc1"]["bias"] == \
        P(None, ("model", "data", "replica"))
    assert plan.manual(plan.split_model(plan.opt_specs))["fc1"]["bias"] == \
        P(None, None, ("data", "replica"))
    assert plan.split_model(P(None, "model"), like=P(None, ("model", "data"))) == \
        P(None, "model", None)  # a persistent parameter gathered into the split shape


def test_find_blocks_takes_the_shortest_module_path():
    paths = ["h/0/attn/kernel", "h/0/mlp/kernel", "h/1/attn/kernel", "ln_f/scale"]
    assert find_blocks(paths, r"h/\d+") == {"h/0/attn/kernel": "h/0", "h/0/mlp/kernel": "h/0",
                                            "h/1/attn/kernel": "h/1"}
    assert find_blocks(paths, r"^h/\d+/") == find_blocks(paths, r"h/\d+")
    with pytest.raises(ValueError, match="only parameters"):
        find_blocks(paths, "scale$")
    with pytest.raises(ValueError, match="no parameter path"):
        find_blocks(paths, "blocks")


def test_a_block_holding_repeated_blocks_is_refused():
    """HF's unrolled stacks are ``model/layers/0``, ``model/layers/1``...: ``layers="layers"``
    would gather the whole stack as one block. Repeated leaves of one module (``Dense_0``,
    ``Dense_1`` of a block's MLP) are not blocks."""
    paths = [f"model/layers/{i}/{m}/kernel" for i in range(4) for m in ("attn", "mlp")]
    with pytest.raises(ValueError, match=r"names 'model/layers', which holds 4 repeated blocks "
                                         r".*: pass layers='model/layers/\\d\+'$"):
        find_blocks(paths + ["model/norm/scale"], "layers")
    assert set(find_blocks(paths, r"layers/\d+").values()) == {f"model/layers/{i}"
                                                              for i in range(4)}
    mlp = [f"blocks/Dense_{i}/{p}" for i in range(2) for p in ("kernel", "bias")]
    assert set(find_blocks(mlp, "blocks").values()) == {"blocks"}


def test_make_plan_applies_the_table(mesh):
    plan = zj.make_plan(SHAPES, mesh, 3, layers="^blocks$",
                        rules=[zj.Rule("^wpe/", shard=False), zj.Rule("^wte/", frozen=True),
                               zj.Rule("", min_shard_elems=300)])
    leaves = {leaf.path: leaf for leaf in jax.tree.leaves(
        plan.leaves, is_leaf=lambda x: isinstance(x, zj.plan.Leaf))}
    assert leaves["wpe/embedding"].axis is None and leaves["wpe/embedding"].reason == \
        "ignored_modules"
    assert leaves["wte/embedding"].frozen and leaves["wte/embedding"].axis == 0
    assert leaves["blocks/qkv/kernel"].stacked and leaves["blocks/qkv/kernel"].block == "blocks"
    assert leaves["blocks/ln/scale"].persistent  # 64 < 300 elements per layer
    assert leaves["head/bias"].axis is None
    assert plan.param_specs["blocks"]["qkv"]["kernel"] == P(None, "data", None)
    assert plan.param_specs["blocks"]["ln"]["scale"] == P()  # persistent: whole parameter
    assert plan.opt_specs["blocks"]["ln"]["scale"] == P(None, "data")  # ... state still cut
    assert plan.data_axes == ("data",) and plan.outer is None


def test_hierarchical_comes_from_the_mesh():
    grid = zj.make_mesh(8, axes={"replica": 2, "data": 4})
    plan = zj.make_plan(SHAPES, grid, 3, layers="^blocks$")
    assert plan.data_axes == ("replica", "data") and plan.dp_size == 8
    assert plan.param_specs["wte"]["embedding"] == P("data", None)
    assert plan.opt_specs["wte"]["embedding"] == P(("data", "replica"), None)
    with pytest.raises(ValueError, match="built on stage 3"):
        zj.make_plan(SHAPES, grid, 2)
    with pytest.raises(ValueError, match="make_plan needs a mesh of axes 'data'"):
        zj.make_plan(SHAPES, zj.make_mesh(8, axes={"batch": 8}), 3)


def test_policies_check_themselves():
    with pytest.raises(ValueError, match="0 to 1"):
        zj.Offload(optimizer=1.5)
    with pytest.raises(ValueError, match=r"Offload\(optimizer=1.0\)"):
        zj.Offload(optimizer=0.5, params=True)
    with pytest.raises(ValueError, match="quantize_block must be at least 1"):
        zj.Comm(quantize_block=0)
    with pytest.raises(ValueError, match="precision.param_dtype"):
        zj.Precision("fp64")
    with pytest.raises(TypeError, match="unexpected keyword argument 'accum_steps'"):
        zj.Precision(accum_steps=2)  # microbatches are the step's (make_train_step)
    with pytest.raises(ValueError, match="remat must be one of"):
        zj.Layers("^blocks$", "some")
    with pytest.raises(ValueError, match="regular expression over module paths"):
        zj.Layers("")
    with pytest.raises(ValueError, match=r"^Layers: prefetch must be True or False \(got 'yes'\)$"):
        zj.Layers("^blocks$", prefetch="yes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefetch'"):
        zj.Comm(prefetch=True)  # prefetch is the blocks' (Layers), not how leaves travel
    assert zj.Offload().any is False and zj.Offload(0.3).any


@pytest.mark.parametrize("stage, options, message", [
    (4, {}, "stage must be one of"),
    (2, {"offload": zj.Offload(1.0, params=True)}, "use stage 3"),
    (2, {"comm": zj.Comm(quantize_weights=True)}, "quantize_weights makes stage 3"),
    (1, {"comm": zj.Comm(quantize_grads=True)}, "use stage 2 or 3"),
    (2, {"layers": zj.Layers(r"^h/\d+$", prefetch=True)},
     r"Layers\(prefetch=True\) overlaps .* stage 2 gathers none: use stage 3"),
])
def test_make_plan_refuses_combinations(mesh, stage, options, message):
    options = {"layers": "^blocks$", **options}
    with pytest.raises(ValueError, match=message):
        zj.make_plan(SHAPES, mesh, stage, **options)


def test_make_train_step_refuses_microbatches(mesh):
    """``accum_steps`` enters with the step, and is checked there: a positive integer, and not
    with the update on the host as each layer's gradient arrives."""
    plain = zj.make_plan(SHAPES, mesh, 3, layers="^blocks$")
    with pytest.raises(ValueError, match=r"^accum_steps must be an integer of at least 1 "
                                         r"\(got 0\)$"):
        zj.make_train_step(plain, None, optax.sgd(0.1), accum_steps=0)
    host = zj.make_plan(SHAPES, mesh, 3, layers="^blocks$", offload=zj.Offload(1.0, params=True))
    with pytest.raises(ValueError, match="not built for accumulation"):
        zj.make_train_step(host, None, optax.sgd(0.1), accum_steps=2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_routes_per_stage(mesh, stage):
    plan = zj.make_plan(SHAPES, mesh, stage, layers="^blocks$",
                        rules=[zj.Rule("^wpe/", frozen=True)])
    rs = {r.leaf.path: r for r in jax.tree.leaves(routes(plan, 1), is_leaf=lambda x:
                                                   isinstance(x, Route))}
    qkv, bias, wpe = rs["blocks/qkv/kernel"], rs["head/bias"], rs["wpe/embedding"]
    assert qkv.cut == (stage >= 2) and bias.cut is False
    # Whole in a block with buckets: all-reduced inside the backward, so not marked per-device.
    assert qkv.in_backward == (stage < 2) and qkv.local == ()
    assert bias.local == ("data",)  # whole, outside the blocks: reduced once, after
    assert wpe.local == () and not wpe.in_backward  # frozen: nothing to reduce
    assert not any(r.host or r.streamed for r in rs.values())


def test_reduce_and_normalize_under_shard_map(mesh):
    """Stage 0: each device's whole gradient all-reduced in buckets, then scaled from shares of
    n (the mean of 8 devices' means) to the global mean; the frozen one zeros, never sent."""
    plan = zj.make_plan(SHAPES, mesh, 0, rules=[zj.Rule("^wpe/", frozen=True)])
    g = GradStep(plan, routes(plan, 1), None, False, P("data"), runtime(plan), 1)
    per_device = jax.tree.map(
        lambda s: jnp.arange(8, dtype=F32).reshape(8, *[1] * len(s.shape))
        * jnp.ones((8, *s.shape), F32), plan.shapes)

    def local(stacked):
        grads = jax.tree.map(lambda x: x[0], stacked)
        grads = g.map(lambda r, x: jnp.zeros((), F32) if r.leaf.frozen else x, grads)
        weight = jnp.ones((), F32)
        stats = tuple(jax.lax.psum(x, "data") for x in (weight * 2.0, weight, {}))
        return normalize(g, stats, reduce(g, grads), plan.shapes)

    loss, grads, factor = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P("data"),), out_specs=(P(), P(), P())))(per_device)
    assert float(loss) == 2.0 and float(factor) == 1.0
    assert float(grads["wte"]["embedding"][0, 0]) == sum(range(8))
    assert grads["wpe"]["embedding"].shape == (16, 64) and not grads["wpe"]["embedding"].any()


def test_a_block_holding_most_of_the_model_is_warned_about(mesh):
    """One unrolled "block" with most of the cut parameters is gathered whole at once; the
    warning names the pattern of its parts. A compiled stage-3 step whose peak holds as many
    gathered weights as the whole parameters saves nothing over stage 2: warned too."""
    from zero_jax import report

    sds = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
    shapes = {"model": {"up": {"kernel": sds(64, 256)}, "down": {"kernel": sds(256, 64)}},
              "head": {"kernel": sds(64, 8)}}
    whole = zj.make_plan(shapes, mesh, 3, layers="^model$")
    (line,) = report.one_big_block(whole)
    assert "'model' holds 98% of the cut parameters" in line and "layers='model/[^/]+'" in line
    parts = zj.make_plan(shapes, mesh, 3, layers="model/[^/]+")
    assert parts.blocks == ["model/down", "model/up"] and report.one_big_block(parts) == []
    assert report.one_big_block(zj.make_plan(shapes, mesh, 2, layers="^model$")) == []
    assert report.one_big_block(zj.make_plan(SHAPES, mesh, 3, layers="^blocks$")) == []  # a scan
    params = 4 * (2 * 64 * 256 + 64 * 8)
    held = lambda size: report.held_whole(whole, {"by_kind": {"gathered weights": size}}, params)
    (line,) = held(params)
    assert "holds 0.13 MiB of gathered weights at its peak" in line
    assert held(params - 1) == [] and report.held_whole(whole, None, params) == []
    # A program that gathers nothing keeps every block whole from forward to backward; on a
    # one-device data axis there is nothing to gather, so nothing to warn about.
    assert "gathers the blocks' 32,768 parameters 0.00 times" in report.gathered_once(
        parts, [])[0]
    assert report.gathered_once(zj.make_plan(shapes, zj.make_mesh(1), 3,
                                             layers="model/[^/]+"), []) == []
