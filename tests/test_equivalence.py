"""Sharded training equals plain single-device optax training, stage by stage.

Gradients are compared directly and SGD is run beside AdamW: Adam divides out a gradient's
scale, so a gradient N times too large would still give Adam's losses.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import CLIP, KEY, OPTIMIZERS, max_rel, optax_steps, rel, tree_rel
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm import LAYERS

from zero_jax import (
    Offload,
    Rule,
    init_state,
    make_grad_fn,
    make_plan,
    make_train_step,
    modules_pattern,
)
from zero_jax.hlo import collectives
from zero_jax.plan import path_str

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

STAGES = [0, 1, 2, 3]
# Each stage trains offloaded once per optimizer, every stage with the whole optimizer state on
# the host and with half of it.
OFFLOAD_RATIO = {(0, "sgd"): 1.0, (0, "adamw"): 0.5, (1, "sgd"): 0.5, (1, "adamw"): 1.0,
                 (2, "sgd"): 1.0, (2, "adamw"): 0.5, (3, "sgd"): 0.5, (3, "adamw"): 1.0}
OFFLOAD_STEPS = 5
# Leaves under 64 elements per layer (layer norms) are persistent: whole parameter and
# gradient, cut optimizer state.
MIN_SHARD = 64


def is_leaf(x) -> bool:
    return hasattr(x, "offload")


def plan_leaves(plan) -> int:
    return len(jax.tree.leaves(plan.leaves, is_leaf=is_leaf))


def shard(mesh, batch):
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


@pytest.mark.parametrize("stage", STAGES)
def test_gradients_equal_single_device(stage, mesh, small, reference):
    _, init, loss_fn, batches = small
    plan = make_plan(jax.eval_shape(init, KEY), mesh, stage, layers=LAYERS,
                     rules=[Rule("", min_shard_elems=MIN_SHARD)])
    params = jax.device_put(init(KEY), plan.shardings(plan.param_specs))
    grad_fn = jax.jit(make_grad_fn(plan, loss_fn))
    ref = reference["sgd"]  # its first step's gradient is at the initial parameters
    loss, grads = grad_fn(params, shard(mesh, batches[0]))
    assert rel(loss, ref["losses"][0]) < 1e-5
    assert max_rel(grads, ref["grads"][0]) < 1e-5

    # The gradients come out in the stage's layout: 1/N per device where the plan shards them.
    for leaf, g, spec in zip(jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "axis")),
                             jax.tree.leaves(grads), jax.tree.leaves(
                                 plan.grad_specs, is_leaf=lambda x: isinstance(x, P)),
                             strict=True):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim)
        local = g.addressable_shards[0].data.size
        sharded = stage >= 2 and leaf.axis is not None and not leaf.persistent
        assert local == g.size // (8 if sharded else 1)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_training_equals_single_device_and_offloaded(stage, opt, mesh, small, reference):
    """10 steps against one-device optax, then 5 offloaded against the same steps in memory
    (compiled as the whole suite is, tests/flags.py): offloaded or not, within 1e-6 (measured:
    the same bits at every stage, jax 0.10.2)."""
    _, init, loss_fn, batches = small
    tx = OPTIMIZERS[opt]()
    plan = make_plan(jax.eval_shape(init, KEY), mesh, stage, layers=LAYERS,
                     rules=[Rule("", min_shard_elems=MIN_SHARD)])
    state = init_state(plan, init, tx, KEY)
    step = make_train_step(plan, loss_fn, tx)
    losses, norms = [], []
    for i, b in enumerate(batches):
        state, m = step(state, shard(mesh, b))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        if i + 1 == OFFLOAD_STEPS:
            at_offload_steps = jax.device_get(state.params)
    ref = reference[opt]
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    assert tree_rel(state.params, ref["params"]) < 1e-5
    # Per leaf, SGD holds 1e-5 too. Adam's update of a near-zero gradient is m/sqrt(v), close to
    # its sign, so the float rounding of summing 8 partial gradients instead of one grows to
    # ~3e-5 on the zero-initialised biases, at stage 0 (plain data parallel) as much as at 3.
    assert max_rel(state.params, ref["params"]) < (1e-5 if opt == "sgd" else 1e-4)
    # The global norm (and so clipping) is the unsharded one, and clipping was really active.
    ref_norms = [float(optax.tree.norm(g)) for g in ref["grads"]]
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    if opt == "adamw":
        assert max(ref_norms) > CLIP
    assert int(state.step) == len(batches)

    # ZeRO-Offload computes exactly the same: the offloaded leaves' master and optimizer state
    # live in host memory and are updated there (a fraction of them, or all), the rest on the
    # device; clipping still sees the global norm. At stage 3 with everything offloaded, the
    # parameter shards too (the cut ones: whole and persistent leaves stay on the device).
    ratio = OFFLOAD_RATIO[stage, opt]
    params_too = stage == 3 and ratio == 1  # ZeRO-Infinity's CPU tier: parameters offloaded
    plan = make_plan(jax.eval_shape(init, KEY), mesh, stage, layers=LAYERS,
                     rules=[Rule("", min_shard_elems=MIN_SHARD)],
                     offload=Offload(optimizer=ratio, params=params_too))
    offloaded = {leaf.path for leaf in jax.tree.leaves(plan.leaves, is_leaf=is_leaf)
                 if leaf.offload}
    assert 0 < len(offloaded) <= plan_leaves(plan) and (len(offloaded) == plan_leaves(plan)) \
        == (ratio == 1)
    state = init_state(plan, init, tx, KEY)
    step = make_train_step(plan, loss_fn, tx)
    offload_losses = []
    for b in batches[:OFFLOAD_STEPS]:
        state, m = step(state, shard(mesh, b))
        offload_losses.append(float(m["loss"]))
    np.testing.assert_allclose(offload_losses, losses[:OFFLOAD_STEPS], rtol=1e-6)
    assert max_rel(state.params, at_offload_steps) < 1e-6
    # In host memory exactly where the plan says: the master (kept even in fp32, for the
    # device's compute copy) and the optimizer state of the offloaded leaves.
    kinds = lambda tree: {path_str(p): x.sharding.memory_kind
                          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    assert {p for p, k in kinds(state.master).items() if k == "pinned_host"} == offloaded
    cut = {leaf.path for leaf in jax.tree.leaves(plan.leaves, is_leaf=is_leaf)
           if leaf.axis is not None and not leaf.persistent}
    assert {p for p, k in kinds(state.params).items() if k == "pinned_host"} == \
        (cut if params_too else set())
    for path, kind in kinds(state.opt_state).items():
        param = next((p for p in sorted(offloaded, key=len)[::-1] if path.endswith(p)), None)
        shared = not any(path.endswith(leaf) for leaf in kinds(state.master))
        assert (kind == "pinned_host") == (param is not None or (shared and ratio == 1)), path


@pytest.mark.parametrize("stage", STAGES)
def test_ignored_and_frozen_modules_at_every_stage(stage, mesh, small, reference):
    """wpe ignored (whole everywhere, still differentiated), fc2 frozen (zero gradient, nothing
    communicated): every other gradient as on one device."""
    _, init, loss_fn, batches = small
    batch = shard(mesh, batches[0])

    def grad_fn(frozen):
        """The gradient step, compiled once (run, and its program read), and the parameters."""
        plan = make_plan(jax.eval_shape(init, KEY), mesh, stage, layers=LAYERS,
                         rules=[Rule(modules_pattern(["wpe"]), shard=False),
                                *([Rule(frozen, frozen=True)] if frozen else [])])
        params = jax.device_put(init(KEY), plan.shardings(plan.param_specs))
        return jax.jit(make_grad_fn(plan, loss_fn)).lower(params, batch).compile(), params

    fn, params = grad_fn(modules_pattern(["blocks/fc2"]))
    _, grads = fn(params, batch)
    ref = reference["sgd"]["grads"][0]
    assert grads["wpe"].sharding.is_fully_replicated and rel(grads["wpe"], ref["wpe"]) < 1e-5
    assert not any(np.any(np.asarray(g)) for g in jax.tree.leaves(grads["blocks"]["fc2"]))
    trained = {k: v for k, v in grads["blocks"].items() if k != "fc2"}
    assert max_rel(trained, {k: ref["blocks"][k] for k in trained}) < 1e-5

    # Freezing fc2 removes exactly its gradient reductions, and nothing else: the reduced bytes
    # per step in the compiled program drop by fc2's gradient (the program as written may keep
    # dead ones in a rematerialized block; XLA removes them).
    def reduced_bytes(compiled) -> int:
        found = collectives(compiled.as_text(), 8)
        return sum(c.count * c.bytes for c in found if c.kind != "all-gather")

    fc2 = sum(x.size * 4 for x in jax.tree.leaves(params["blocks"]["fc2"]))
    assert reduced_bytes(fn) == reduced_bytes(grad_fn(None)[0]) - fc2


# The demo's Llama-family decoder with all that Gemma 2 and 3 add to Llama: GQA, a tied head,
# q and k norms, Gemma's norms and their outputs' norms, a window of 5 on every other layer
# (a flag through the scanned layers, a lax.cond per layer) rotating at its own base, soft caps
# on the scores and (inside the chunked loss) on the logits, a scores scalar of its own; and
# for its MLP Qwen3-MoE's mixture of experts (2 of 4 a token, each device routing its own),
# with their load-balancing loss: each device's, over its tokens (as transformers' under DDP),
# or the whole batch's; and ST-MoE's router z-loss.
GEMMA_LIKE = {"arch": "llama", "vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4,
              "n_kv_heads": 2, "d_ff": 64, "seq_len": 16, "head_dim": 8, "tie_head": True,
              "qk_norm": True, "gemma": 2, "window_pattern": 2, "sliding_window": 5,
              "rope_theta": 1e6, "rope_local_theta": 1e4, "attn_softcap": 2.0,
              "logit_softcap": 3.0, "query_pre_attn_scalar": 12.0, "remat": "none",
              "n_experts": 4, "experts_per_token": 2, "expert_d_ff": 24,
              "moe_norm_topk": False, "router_aux_loss_coef": 0.1, "router_z_loss_coef": 0.01,
              "vocab_multiple": 128}


@pytest.mark.parametrize("opt, tp, whole, accum, cap", [("sgd", 1, False, 1, 0.0),
                                                        ("adamw", 2, False, 1, 0.5),
                                                        ("sgd", 2, True, 2, 0.0)])
def test_the_llama_family_trains_at_stage_3_with_prefetch_as_on_one_device(opt, tp, whole, accum,
                                                                          cap, mesh):
    """``GEMMA_LIKE`` at stage 3 with prefetch on 8 devices (x tensor parallel 2: the experts
    cut over their width): its first gradient, and 4 steps' losses and parameters, as
    one-device optax's (the layers' flags and conds go through prefetch's loop forward and
    backward) on the mean of the loss of each data rank's rows: the experts' load-balancing
    loss is each rank's own (which the whole batch's is not: asserted), reported as the mean
    of the ranks'. With ``router_aux_loss_global`` (``whole``) it is the whole batch's, and
    the step one-device optax's on the whole batch (which the ranks' mean is not); with
    ``accum`` microbatches, each microbatch's over every rank (the mean of the microbatches'
    losses, which the whole batch's is not), the accumulated gradient compared directly. With
    a capacity factor (``cap``: 0.5, so that pairs are dropped) each rank's experts take at
    most their share of its own pairs, as one device does for those rows."""
    from zero_jax import Layers, make_mesh
    from zero_jax.gpt.llama import Llama, tensor_parallel
    from zero_jax.gpt.model import GPTConfig, init_fn, lm_loss

    cfg = GPTConfig(**GEMMA_LIKE, router_aux_loss_global=whole, expert_capacity_factor=cap)
    model = Llama(cfg)
    if tp > 1:
        mesh = make_mesh(axes={"data": 8 // tp, "model": tp})
    init, loss_fn, tx = init_fn(model), lm_loss(model), OPTIMIZERS[opt]()
    batches = [jax.random.randint(jax.random.key(i), (8, 17), 0, 64) for i in range(4)]
    ranks = 8 // tp
    # each rank's rows in a loop: the model compiled once; (loss, metrics) the ranks' means
    each = lambda p, b: jax.lax.map(lambda r: loss_fn(p, r), b.reshape(ranks, -1, b.shape[-1]))
    by_rank = lambda p, b: jax.tree.map(jnp.mean, each(p, b))
    # microbatch m: each rank's m-th run of rows (the step cuts each rank's rows in ``accum``)
    micro = lambda p, b: jax.tree.map(jnp.mean, jax.lax.map(lambda m: loss_fn(p, m), b.reshape(
        ranks, accum, -1, b.shape[-1]).swapaxes(0, 1).reshape(accum, -1, b.shape[-1])))
    reference, other = ((micro, loss_fn) if accum > 1 else (loss_fn, by_rank)) if whole \
        else (by_rank, loss_fn)
    # The initial parameters jitted, as init_state draws them (op by op: 3 s more a test).
    first = jax.jit(init)(KEY)
    ref = optax_steps(lambda p, b: reference(p, b)[0], tx, first, batches)
    assert abs(jax.jit(other)(first, batches[0])[0] - ref["losses"][0]) > 1e-4
    balance = float(jax.jit(reference)(first, batches[0])[1]["balance_loss"])
    plan = make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=Layers("^blocks$", prefetch=True),
                     rules=list(tensor_parallel(cfg)) if tp > 1 else [])
    state = init_state(plan, init, tx, KEY)
    _, grads = jax.jit(make_grad_fn(plan, loss_fn, has_aux=True, accum_steps=accum))(
        state.params, shard(mesh, batches[0]))
    assert max_rel(grads, ref["grads"][0]) < 1e-5
    step = make_train_step(plan, loss_fn, tx, has_aux=True, accum_steps=accum)
    losses, balances = [], []
    for b in batches:
        state, m = step(state, shard(mesh, b))
        losses.append(float(m["loss"]))
        balances.append(float(m["balance_loss"]))
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    assert abs(balances[0] - balance) < 1e-5 * balance  # as the loss's
    assert tree_rel(state.params, ref["params"]) < 1e-5


# The demo's GPT-NeoX as Pythia is made: layer norms with biases, a quarter of each head rotated,
# q, k and v fused head by head, the attention and the MLP side by side, the head untied.
PYTHIA_LIKE = {"arch": "neox", "vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4,
               "d_ff": 64, "seq_len": 16, "parallel_residual": 1,
               "partial_rotary_factor": 0.25, "remat": "none", "vocab_multiple": 128}
# and as Phi-2 is: one norm for both, tanh's GELU, the head's bias (cut with its columns)
PHI_LIKE = {**PYTHIA_LIKE, "parallel_residual": 2, "head_bias": True, "hidden_act": "gelu_new",
            "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("opt, tp, which", [("sgd", 2, "pythia"), ("adamw", 1, "pythia"),
                                            ("sgd", 2, "phi"), ("adamw", 2, "phi")])
def test_gpt_neox_trains_at_stage_3_with_prefetch_as_on_one_device(opt, tp, which, mesh):
    """``PYTHIA_LIKE`` and ``PHI_LIKE`` at stage 3 with prefetch on 8 devices (x tensor
    parallel 2: the fused q, k, v cut by heads, their biases with them; the head's bias with
    its columns): the first gradient and 4 steps' losses and parameters as one-device optax's
    on the same batches. k's bias past the rotated columns
    adds the same to every score of a query: its gradient is zero but for rounding (asserted),
    which Adam scales up to whole steps on either side; the parameters are compared without
    it."""
    from zero_jax import Layers, make_mesh
    from zero_jax.gpt.model import GPTConfig, init_fn, lm_loss
    from zero_jax.gpt.neox import NeoX, tensor_parallel

    cfg = GPTConfig(**(PYTHIA_LIKE if which == "pythia" else PHI_LIKE))
    model = NeoX(cfg)
    if tp > 1:
        mesh = make_mesh(axes={"data": 8 // tp, "model": tp})
    init, loss_fn, tx = init_fn(model), lm_loss(model), OPTIMIZERS[opt]()
    batches = [jax.random.randint(jax.random.key(i), (8, 17), 0, 64) for i in range(4)]
    first = jax.jit(init)(KEY)
    ref = optax_steps(loss_fn, tx, first, batches)
    plan = make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=Layers("^blocks$", prefetch=True),
                     rules=list(tensor_parallel(cfg)) if tp > 1 else [])
    state = init_state(plan, init, tx, KEY)
    _, grads = jax.jit(make_grad_fn(plan, loss_fn))(state.params, shard(mesh, batches[0]))
    assert max_rel(grads, ref["grads"][0]) < 1e-5
    step = make_train_step(plan, loss_fn, tx)
    losses = []
    for b in batches:
        state, m = step(state, shard(mesh, b))
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    unrotated = (slice(None), slice(None), 1, slice(cfg.rotary_dim, None))
    bias_grad = np.asarray(ref["grads"][0]["blocks"]["qkv"]["bias"])
    assert np.abs(bias_grad[unrotated]).max() < 1e-6 * np.abs(bias_grad).max()
    without = lambda tree: {**tree, "blocks": {**tree["blocks"], "qkv": {
        **tree["blocks"]["qkv"], "bias": np.asarray(tree["blocks"]["qkv"]["bias"]).copy()}}}
    ours, theirs = without(jax.device_get(state.params)), without(ref["params"])
    for tree in (ours, theirs):
        tree["blocks"]["qkv"]["bias"][unrotated] = 0
    assert tree_rel(ours, theirs) < 1e-5
