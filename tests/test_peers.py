"""The baselines of ``bench/peers.py`` compute what zero_jax computes, and its FSDP gathers
weights, not activations; ``bench/gpu.py`` reads async collective pairs, on a real GPU compile
too."""

import collections
import dataclasses
import math
import pathlib
import sys

import jax
import numpy as np
import pytest
from conftest import N, tree_rel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import peers  # noqa: E402  (bench/ is not a package)

from zero_jax import report  # noqa: E402
from zero_jax.gpt import config, data  # noqa: E402
from zero_jax.gpt.experiment import Experiment  # noqa: E402
from zero_jax.hlo import collectives  # noqa: E402
from zero_jax.state import abstract_state, init_state  # noqa: E402

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

# Two layers, a small batch; no warmup, so the first step moves the parameters. Global batch
# 16 and seq_len 64 are no parameter's dimensions: an all-gathered (16, 64, ...) is activations.
SETS = ["model.n_layers=2", "train.batch_size=16", "optimizer.warmup_steps=0", "zero.stage=0",
        "precision.param_dtype=fp32"]
B, T = 16, 64


@pytest.fixture(scope="module")
def runs(mesh):
    """Stage 0 and each baseline, before and after one step on the same batch."""
    cfg = config.load("tiny", SETS)
    exp = Experiment.build(cfg, mesh)  # what bench/harness.py builds, less its report
    state = init_state(exp.plan, exp.init, exp.tx, jax.random.key(0))
    tokens = data.stdlib_corpus(1 << 18)
    assert (exp.cfg["train"]["batch_size"], exp.model.seq_len) == (B, T)
    batch = jax.device_put(data.batch(tokens, 0, B, T, 0), exp.batch_sharding)
    init = jax.tree.map(np.asarray, state.params)
    out = {"init": init}
    state, metrics = exp.step(state, batch)
    out["zero_jax"] = (float(metrics["loss"]), state.params, exp.step)
    for name, (_, state, compiled) in [("ddp", peers.ddp_step(cfg, mesh)),
                                       ("fsdp", peers.fsdp_step(cfg, mesh, constrain=True))]:
        out[name + " init"] = jax.tree.map(np.asarray, state.params)
        state, metrics = compiled(state, batch)
        out[name] = (float(metrics["loss"]), state.params, compiled)
    out["shapes"] = jax.tree.map(lambda x: x.shape, init)
    return out


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_baseline_steps_as_zero_jax_stage_0(runs, name):
    """Same initial parameters bit for bit, the same step-1 loss, the same update."""
    assert jax.tree.structure(runs[name + " init"]) == jax.tree.structure(runs["init"])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(runs[name + " init"]),
                                                    jax.tree.leaves(runs["init"]), strict=True))
    loss, params, _ = runs[name]
    zero_loss, zero_params, _ = runs["zero_jax"]
    assert abs(loss - zero_loss) < 1e-5
    # Over the whole tree: Adam's first step is lr * g / (|g| + eps), so a leaf whose gradient
    # is all rounding noise (the key bias: softmax ignores it) differs relatively on its own.
    assert tree_rel(params, zero_params) < 1e-5
    assert tree_rel(params, runs["init"]) > 1e-3  # the step really moved them


def test_fsdp_gathers_weights_not_activations(runs, mesh):
    """Pinned batch-sharded activations: every all-gather is a weight's (whole, one layer's, or
    transposed), and together they move at least the parameters; unpinned, the partitioner
    gathers whole-batch activations."""
    _, _, compiled = runs["fsdp"]
    text = compiled.as_text()
    weights = set()
    for path, shape in jax.tree_util.tree_flatten_with_path(
            runs["shapes"], is_leaf=lambda x: isinstance(x, tuple))[0]:
        weights.add(tuple(sorted(shape)))
        if path[0].key == "blocks":
            weights.add(tuple(sorted(shape[1:])))
    gathered = peers.gathered_shapes(text)
    assert gathered and all(tuple(sorted(s)) in weights for s in gathered), gathered
    param_bytes = sum(math.prod(s) * 4 for s in jax.tree.leaves(
        runs["shapes"], is_leaf=lambda x: isinstance(x, tuple)))
    gather_bytes = sum(c.count * c.bytes for c in collectives(text, N) if c.kind == "all-gather")
    assert gather_bytes >= param_bytes

    _, _, free = peers.fsdp_step(config.load("tiny", SETS), mesh, constrain=False)
    assert any(s[:2] == (B, T) for s in peers.gathered_shapes(free.as_text()))


# The forms the GPU backend prints: an all-gather pair with a fusion between (in a 12-trip
# loop), a reduce-scatter wrapped in async-start/done with nothing between, the sugared
# reduce-scatter-start ((operands), result) with a fusion between, a synchronous all-reduce,
# and an all-gather pair with a GEMM fusion (a dot inside) between.
ASYNC_HLO = """\
HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%wrapped_rs (p: f32[64,64]) -> f32[8,64] {
  %p = f32[64,64]{1,0} parameter(0)
  ROOT %rs = f32[8,64]{1,0} reduce-scatter(%p), replica_groups=[1,8]<=[8], to_apply=%add
}

%gemm (x: bf16[64,64]) -> bf16[64,64] {
  %x = bf16[64,64]{1,0} parameter(0)
  ROOT %d = bf16[64,64]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], bf16[8,64])) -> (s32[], bf16[8,64]) {
  %w = bf16[8,64]{1,0} get-tuple-element(%p), index=1
  %ags = (bf16[8,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(%w), replica_groups=[1,8]<=[8]
  %f = bf16[64,64]{1,0} fusion(bf16[8,64]{1,0} %w), kind=kLoop, calls=%add
  %agd = bf16[64,64]{1,0} all-gather-done((bf16[8,64]{1,0}, bf16[64,64]{1,0}) %ags)
  %g = f32[64,64]{1,0} custom-call(%agd), custom_call_target="__cublas$gemm"
  %rss = ((f32[64,64]{1,0}), f32[8,64]{1,0}) async-start(%g), calls=%wrapped_rs
  %rsd = f32[8,64]{1,0} async-done(((f32[64,64]{1,0}), f32[8,64]{1,0}) %rss)
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %w = (s32[], bf16[8,64]) while(%t), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %ars = f32[1024]{0} all-reduce-start(%a), replica_groups=[1,8]<=[8], to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(f32[1024]{0} %ars)
  %rs2 = ((f32[4096]{0}), f32[512]{0}) reduce-scatter-start(%b), replica_groups=[1,8]<=[8]
  %c = f32[4096]{0} fusion(%b), kind=kLoop, calls=%add
  %rs2d = f32[512]{0} reduce-scatter-done(((f32[4096]{0}), f32[512]{0}) %rs2)
  %ag2 = (bf16[8,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(%v), replica_groups=[1,8]<=[8]
  %mm = bf16[64,64]{1,0} fusion(%y), kind=kCustom, calls=%gemm
  ROOT %ag2d = bf16[64,64]{1,0} all-gather-done((bf16[8,64]{1,0}, bf16[64,64]{1,0}) %ag2)
}
"""  # noqa: E501


def test_gpu_forms_are_read_and_pairs_with_compute_between_found():
    """zero_jax.hlo on GPU-style text (payload: the full-size side; a reduce-scatter wrapped in
    async-start read through its computation), and bench/gpu.py's start/done pairs with
    compute, and a matmul, scheduled between them."""
    import gpu

    from zero_jax.hlo import gathered_ahead

    found = collections.defaultdict(lambda: [0, 0])
    for c in collectives(ASYNC_HLO, N):
        found[c.kind][0] += c.count
        found[c.kind][1] += c.count * c.bytes
    assert dict(found) == {
        "all-gather": [13, 13 * 64 * 64 * 2],
        "reduce-scatter": [13, 12 * 64 * 64 * 4 + 4096 * 4],
        "all-reduce": [1, 1024 * 4]}
    pairs = gpu.overlap(ASYNC_HLO)
    assert {k: (v["pairs"], v["overlapped"], v["overlapped_in_loop"]) for k, v in pairs.items()} \
        == {"all-gather": (2, 2, 1), "reduce-scatter": (2, 1, 0), "all-reduce": (1, 0, 0)}
    # The loop's gather hides a plain fusion, the entry's a GEMM: only that one hides a matmul.
    assert {k: (v["matmul"], v["matmul_in_loop"]) for k, v in pairs.items()} \
        == {"all-gather": (1, 0), "reduce-scatter": (0, 0), "all-reduce": (0, 0)}
    # The loop's gathered weights feed a cuBLAS GEMM custom call in the same iteration: a
    # matmul to zero_jax.hlo too, so that loop does not gather ahead.
    assert gathered_ahead(ASYNC_HLO) == {"body": [False]}


def test_a_real_gpu_compile_is_read_and_prefetch_overlaps_there():
    """The default model's stage 3 step as XLA's GPU compiler built it for 8 H100s, with and
    without prefetch (tests/data, made with no GPU present by ``python bench/gpu.py
    --compile-for h100 --config tiny --save-hlo DIR``; jax and its CUDA plugin 0.10.2). The
    reader finds ZeRO's bytes in bf16: the blocks' parameters gathered twice, the leaves
    outside them once, every parameter's gradient reduce-scattered once. With prefetch, XLA's
    schedule puts GEMMs between start and done of both layer loops' gathers and of the
    backward loop's reduce-scatter, which reads only the carry; without, none; and the
    prefetched loops copy no more of what they carry than the plain loops."""
    import gzip

    import gpu

    from zero_jax.gpt.model import GPT, GPTConfig, init_fn
    from zero_jax.hlo import copied_bytes, gathered_ahead, reduced_behind

    shapes = jax.eval_shape(init_fn(GPT(GPTConfig())), jax.random.key(0))
    sizes = [(p[0].key == "blocks", math.prod(x.shape))
             for p, x in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    psi, blocks = sum(n for _, n in sizes), sum(n for b, n in sizes if b)
    data = pathlib.Path(__file__).resolve().parent / "data"
    copied = {}
    for name, ahead in (("tiny-stage-3-h100", True), ("tiny-stage-3-no-prefetch-h100", False)):
        text = gzip.open(data / f"{name}.hlo.gz", "rt").read()
        assert "all-gather-start" in text and "reduce-scatter-start" in text  # GPU's async forms
        moved = collections.Counter()
        for c in collectives(text, N):
            moved[c.kind, c.dtype] += c.count * c.bytes
        assert moved["all-gather", "bf16"] == 2 * (2 * blocks + (psi - blocks)), name
        assert moved["reduce-scatter", "bf16"] == 2 * psi, name
        gathers, reductions = gathered_ahead(text), reduced_behind(text)
        assert len(gathers) == 2 and len(reductions) == 1
        assert all(all(x) == ahead and any(x) == ahead
                   for x in [*gathers.values(), *reductions.values()]), name
        pairs = gpu.overlap(text)
        assert (pairs["all-gather"]["in_loop"], pairs["reduce-scatter"]["in_loop"]) == (2, 1)
        assert pairs["all-gather"]["matmul_in_loop"] == (2 if ahead else 0), name
        assert pairs["reduce-scatter"]["matmul_in_loop"] == (1 if ahead else 0), name
        copied[name] = copied_bytes(text, {*gathers, *reductions})
    # The prefetched loops' carry (a layer's weights, its packed gradient) is replaced in place:
    # they copy what the plain loops copy, the loop counter and the activations' cotangent
    # that XLA's copy insertion keeps for a reader after the residual add (64 KiB; before:
    # also a layer's gradient, 260 KiB, per backward iteration).
    plain = copied["tiny-stage-3-no-prefetch-h100"]
    assert copied["tiny-stage-3-h100"] <= plain <= 4 * 64 * 128 * 2 + 8, copied


def test_unrolled_blocks_gathered_again_in_the_gpu_compile():
    """Blocks in a Python loop (``tests/regather.py``'s unrolled model, 4 blocks, fp32), stage
    3 compiled by XLA's GPU compiler for 8 H100s with no option of zero_jax's (made with no GPU
    present by ``python tests/regather.py --h100 tests/data``; jax and its CUDA plugin 0.10.2):
    every block gathered in the forward and again in the backward, the leaves outside the
    blocks once, every gradient reduce-scattered once."""
    import gzip

    import regather

    shapes = jax.eval_shape(dict(regather.problems())["unrolled"][0], jax.random.key(0))
    sizes = [(p[0].key.startswith("h_"), math.prod(x.shape))
             for p, x in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    psi, blocks = sum(n for _, n in sizes), sum(n for b, n in sizes if b)
    text = gzip.open(pathlib.Path(__file__).resolve().parent / "data" /
                     "unrolled-stage-3-h100.hlo.gz", "rt").read()
    assert "all-gather-start" in text  # GPU's async form
    moved = collections.Counter()
    for c in collectives(text, N):
        moved[c.kind, c.dtype] += c.count * c.bytes
    assert moved["all-gather", "f32"] == 4 * (2 * blocks + (psi - blocks))
    assert moved["reduce-scatter", "f32"] == 4 * psi


def test_unrolled_prefetch_overlaps_in_the_gpu_compile():
    """The same model with prefetch (``zero_jax.blocks.chain``), compiled for 8 H100s: the same
    bytes; block i+1's gather overlaps block i's GEMMs (async start/done with a GEMM between:
    none without prefetch); and XLA's combiners do not merge every block's delayed
    reduce-scatter into one at the end (which would hold all the blocks' whole gradients):
    none carries more than two blocks'."""
    import gzip

    import gpu
    import regather

    shapes = jax.eval_shape(dict(regather.problems())["unrolled"][0], jax.random.key(0))
    block = sum(math.prod(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(shapes)[0]
                if p[0].key == "h_0")
    data = pathlib.Path(__file__).resolve().parent / "data"
    plain, fetched = (gzip.open(data / f"unrolled-stage-3{name}-h100.hlo.gz", "rt").read()
                      for name in ("", "-prefetch"))
    moved = [collections.Counter({(c.kind, c.dtype): 0 for c in collectives(t, N)})
             for t in (plain, fetched)]
    for counter, text in zip(moved, (plain, fetched), strict=True):
        for c in collectives(text, N):
            counter[c.kind, c.dtype] += c.count * c.bytes
    assert moved[0] == moved[1]
    assert gpu.overlap(plain)["all-gather"]["matmul"] == 0
    assert gpu.overlap(fetched)["all-gather"]["matmul"] >= 3  # blocks 1-3 in the forward
    largest = max(c.bytes for c in collectives(fetched, N) if c.kind == "reduce-scatter")
    assert largest <= 2 * 4 * block, (largest, block)


# For bench/estimate.py: a 4-trip loop whose all-gather has a GEMM fusion between start and done
# (then a plain dot on the gathered weight), and in the entry an all-gather with nothing between
# start and done, then a cuBLAS GEMM custom call (result and workspace).
ESTIMATE_HLO = """\
HloModule jit_step, is_scheduled=true

%gemm (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  ROOT %d = bf16[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], bf16[64,32], bf16[32,16], bf16[4,16])) -> (s32[], bf16[64,32], bf16[32,16], bf16[4,16]) {
  %p = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, bf16[4,16]{1,0}) parameter(0)
  %x = bf16[64,32]{1,0} get-tuple-element(%p), index=1
  %w = bf16[32,16]{1,0} get-tuple-element(%p), index=2
  %s = bf16[4,16]{1,0} get-tuple-element(%p), index=3
  %ags = (bf16[4,16]{1,0}, bf16[32,16]{1,0}) all-gather-start(%s), replica_groups=[1,8]<=[8], dimensions={0}
  %mm = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
  %agd = bf16[32,16]{1,0} all-gather-done(%ags)
  %mm2 = bf16[64,16]{1,0} dot(%x, %agd), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, bf16[4,16]{1,0}) tuple(%i, %x, %agd, %s)
}

ENTRY %main (a: bf16[128,256], b: bf16[256,64], v: bf16[16,64]) -> bf16[128,64] {
  %a = bf16[128,256]{1,0} parameter(0)
  %b = bf16[256,64]{1,0} parameter(1)
  %v = bf16[16,64]{1,0} parameter(2)
  %loop = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}, bf16[4,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %ag2 = (bf16[16,64]{1,0}, bf16[128,64]{1,0}) all-gather-start(%v), replica_groups=[1,8]<=[8], dimensions={0}
  %ag2d = bf16[128,64]{1,0} all-gather-done(%ag2)
  %g = (bf16[128,64]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %r = bf16[128,64]{1,0} get-tuple-element(%g), index=0
}
"""  # noqa: E501


def test_estimate_on_a_hand_written_program():
    """bench/estimate.py by its stated formula, computed by hand: an op takes max(FLOPs / peak,
    bytes / HBM); a collective payload x (n-1)/n over the link; an async collective is exposed
    by what its done still waits for after the compute between start and done; a loop's body
    counts its trip count times, or once where the program does not know it (and says so)."""
    import estimate

    hw = estimate.Hardware("test", peak_flops=1e12, hbm=1e11, nvlink=1e9, network=1e8)
    # The loop body's GEMM (fused, then plain): 64x32 @ 32x16 in bf16.
    gemm = max(2 * 64 * 16 * 32 / 1e12, (64 * 32 + 32 * 16 + 64 * 16) * 2 / 1e11)
    gather = 32 * 16 * 2 * 7 / 8 / 1e9  # its all-gather, 8 devices of one node
    assert gather > gemm  # the fused GEMM hides part of it
    cublas = max(2 * 128 * 64 * 256 / 1e12, (128 * 256 + 256 * 64 + 128 * 64) * 2 / 1e11)
    gather2 = 128 * 64 * 2 * 7 / 8 / 1e9  # nothing between its start and done
    got = estimate.estimate(ESTIMATE_HLO, hw, 8, model_flops=1e6)
    want = {"compute_s": 4 * 2 * gemm + cublas, "comm_s": 4 * gather + gather2,
            "exposed_s": 4 * (gather - gemm) + gather2,
            "hlo_flops": 4 * 2 * 2 * 64 * 16 * 32 + 2 * 128 * 64 * 256}
    want["step_s"] = want["compute_s"] + want["exposed_s"]
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert got["mfu"] == pytest.approx(1e6 / (want["step_s"] * 1e12))
    assert got["loops_counted_once"] == 0
    unknown = estimate.estimate(ESTIMATE_HLO.replace('"known_trip_count":{"n":"4"}', ""), hw, 8,
                                model_flops=1e6)
    assert unknown["loops_counted_once"] == 1
    assert unknown["compute_s"] == pytest.approx(2 * gemm + cublas, rel=1e-12)
    # Across nodes the network carries it: a group of devices 0 and 8, 8 GPUs per node.
    assert estimate.comm_time("all-reduce", 1000, (0, 8), hw) == pytest.approx(1000 / 1e8)
    assert estimate.comm_time("all-gather", 1000, tuple(range(8)), hw) == \
        pytest.approx(1000 * 7 / 8 / 1e9)


def test_estimate_on_the_saved_gpu_compile():
    """The estimate of the saved H100 programs (``tests/data``): FLOPs about the model's (remat
    ``auto`` keeps the matmuls' outputs on GPUs, so it adds none; PaLM's count takes norms,
    biases and position embeddings for matmul weights), exposed communication within the
    collectives' link time, step time = compute + exposed; prefetch's program exposes less
    than the one without, over NVLink and over a slow network alike."""
    import gzip

    import estimate
    import gpu

    from zero_jax.gpt.model import GPTConfig

    model = GPTConfig()
    tokens = 4 * model.seq_len  # per device: a batch of 32 over 8
    model_flops = gpu.flops_per_token(model) * tokens
    data = pathlib.Path(__file__).resolve().parent / "data"
    for hw in (estimate.H100, dataclasses.replace(estimate.H100, nvlink=5e9)):
        got = {}
        for name in ("tiny-stage-3-h100", "tiny-stage-3-no-prefetch-h100"):
            text = gzip.open(data / f"{name}.hlo.gz", "rt").read()
            e = got[name] = estimate.estimate(text, hw, N, model_flops)
            assert 0.95 * model_flops < e["hlo_flops"] < 1.6 * model_flops, name
            assert 0 < e["exposed_s"] <= e["comm_s"], name
            assert e["step_s"] == pytest.approx(e["compute_s"] + e["exposed_s"]), name
            assert 0 < e["mfu"] < 1
        assert got["tiny-stage-3-h100"]["exposed_s"] < \
            got["tiny-stage-3-no-prefetch-h100"]["exposed_s"]
        assert got["tiny-stage-3-h100"]["hlo_flops"] == \
            got["tiny-stage-3-no-prefetch-h100"]["hlo_flops"]


def test_bytes_by_axes_names_the_axes_each_collective_spans():
    """The 2-D rows' column: a psum of 1 MiB over ``data`` and one of 2 MiB over ``model``
    (4 x 2 mesh), each counted once, under the axis its groups span."""
    from jax.sharding import PartitionSpec as P

    import zero_jax as zj

    mesh = zj.make_mesh(8, axes={"data": 4, "model": 2})

    def body(a, b):
        return jax.lax.psum(a, "data"), jax.lax.psum(b, "model")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P())))
    a, b = np.ones(1 << 18, np.float32), np.ones(1 << 19, np.float32)
    assert peers.bytes_by_axes(f.lower(a, b).compile().as_text(), mesh) == (
        "data 1.00, model 2.00")


def test_unrolled_model_steps_alike_in_zero_jax_and_the_baseline(mesh):
    """``--model unrolled``: zero_jax stage 0 on the HF-style blocks (through the library API)
    and the GSPMD FSDP baseline compiled for the same model take the same first step from the
    same parameters, and the baseline's constraints reach the unrolled blocks. (Stage 3 with
    the handoff's prefetch equals stage 0 on unrolled blocks: test_prefetch.)"""
    cfg = config.load("tiny", SETS)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (B, T + 1), np.int32),
                           sharding)
    plan, tx, init_params, step = peers.unrolled_zero(cfg, mesh, 0)
    assert plan.blocks == ["h_0", "h_1"]
    state = init_state(plan, init_params, tx, jax.random.key(peers.SEED_KEY))
    init = jax.tree.map(np.asarray, state.params)
    _, metrics = step(state, batch)
    _, state, compiled = peers.fsdp_step(cfg, mesh, constrain=True, params=init,
                                         kind="unrolled")
    # Pinned activations: the partitioner gathers weights, never a (batch, sequence, ...) one.
    assert not any(s[:2] == (B, T) for s in peers.gathered_shapes(compiled.as_text()))
    _, base = compiled(state, batch)
    assert abs(float(base["loss"]) - float(metrics["loss"])) < 1e-5


def test_stage3_needs_no_more_temp_than_the_gspmd_fsdp_peer_and_prefetchs_share(mesh):
    """The README's default model at stage 3, buckets on, beside the MaxText-style GSPMD FSDP
    peer (same model, mesh and remat; both from ``memory_analysis()``). Gathering by module
    holds at most the peer's temp, and model states, with prefetch (each module's gather
    issued while the module before computes) as without; prefetch adds at most one layer's
    gathered weights. Gathering by block (the default) holds at most the peer's temp plus one
    gathered layer (prefetch's) and one bucket, a layer (docs/benchmarks/cpu-mesh.md: 7.03 <=
    5.95 + 0.76 + 0.76 MiB); the report states what prefetch may hold at most, a gathered
    layer and a layer's whole gradient waiting to be reduced."""
    temp = {}
    for gather, prefetch in (("module", False), ("module", True), ("block", True)):
        cfg = config.load("tiny", [f"zero.gather={gather}", f"zero.prefetch={prefetch}"])
        exp = Experiment.build(cfg, mesh)
        assert exp.plan.comm.bucket_bytes
        ours = exp.step.lower(abstract_state(exp.plan, exp.tx), exp.batch_shape).compile()
        temp[gather, prefetch] = ours.memory_analysis().temp_size_in_bytes
        if gather == "module":
            layer = (max(report.block_elements(exp.plan).values())
                     * exp.plan.precision.compute.itemsize)
    peer = peers.fsdp_lowered(config.load("tiny"), mesh)[1].compile().memory_analysis()
    assert ours.memory_analysis().argument_size_in_bytes <= peer.argument_size_in_bytes + 1024
    by_module = temp["module", False], temp["module", True]
    assert 0 < by_module[0] < by_module[1] <= peer.temp_size_in_bytes, (temp, peer)
    assert by_module[1] <= by_module[0] + layer, (temp, layer)
    prefetch = report.layout(exp.plan, abstract_state(exp.plan, exp.tx), [])["prefetch_bytes"]
    assert prefetch == 2 * layer
    assert temp["block", True] <= peer.temp_size_in_bytes + 2 * layer, (temp, layer)


def test_gpu_bench_unrolls_the_layer_loop_only_where_asked():
    """``bench/gpu.py --runs``: the row with the layer loop unrolled whole is made only where
    named, with ``model.scan_unroll`` the config's layers; without ``--runs``, every default
    row and not it."""
    import gpu

    extra = gpu.on_request(config.load("gpt2-124m", []))
    assert extra == [("0, unrolled", ["zero.stage=0", "model.scan_unroll=12"])]
    assert gpu.chosen(gpu.RUNS, None, extra) == gpu.RUNS
    assert gpu.chosen(gpu.RUNS, "3;0, unrolled", extra) == [gpu.RUNS[3], extra[0]]
    with pytest.raises(SystemExit, match="names none of 0; 1; 2; 3; .*0, unrolled"):
        gpu.chosen(gpu.RUNS, "9", extra)
