"""ZeRO's claims, read from the compiled step of the default model on 8 devices.

Memory from the arrays' own shards and ``memory_analysis()``; communication from the
collectives in the compiled HLO. One compile per stage, shared by every test here.
"""

import collections
import dataclasses
import math

import jax
import optax
import pytest
from conftest import local_bytes

from zero_jax import Rule, abstract_state, init_state, make_plan, make_train_step, report
from zero_jax.gpt.model import GPT, LAYERS, GPTConfig, init_fn, lm_loss
from zero_jax.hlo import collectives

N = 8
TINY = GPTConfig()  # the default config's model: d=128, 4 layers, every matrix divisible by 8
BATCH = jax.ShapeDtypeStruct((32, TINY.seq_len + 1), "int32")


def compile_step(mesh, cfg: GPTConfig, stage: int, state=None):
    model = GPT(cfg)
    init, tx = init_fn(model), optax.adamw(1e-3)
    plan = make_plan(jax.eval_shape(init, jax.random.key(0)), mesh, stage, layers=LAYERS)
    if state == "real":
        state = init_state(plan, init, tx, jax.random.key(0))
    else:
        state = abstract_state(plan, tx)
    step = make_train_step(plan, lm_loss(model), tx)
    lowered = step.lower(state, BATCH)
    return plan, state, lowered, lowered.compile()


@pytest.fixture(scope="module")
def stages(mesh):
    out = {}
    for stage in range(4):
        plan, state, lowered, compiled = compile_step(mesh, TINY, stage, state="real")
        out[stage] = dict(plan=plan, state=state, compiled=compiled,
                          report=report.build(plan, state, lowered, compiled),
                          collectives=collectives(compiled.as_text(), N))
    return out


PSI = TINY.n_params


@pytest.mark.parametrize("stage", range(4))
def test_model_state_bytes_follow_zero_formulas(stage, stages):
    """fp32 Adam, Psi parameters on N devices (the paper's table with 4-byte params and K=8):
    stage 0: 4Psi params + 8Psi moments; 1: 4Psi + 8Psi/N; 2: 4Psi + 8Psi/N; 3: (4Psi + 8Psi)/N."""
    s = stages[stage]
    params_formula = 4 * PSI / (N if stage == 3 else 1)
    opt_formula = 8 * PSI / (N if stage >= 1 else 1)
    grads_formula = 4 * PSI / (N if stage >= 2 else 1)
    params, opt = local_bytes(s["state"].params), local_bytes(s["state"].opt_state)
    assert params == pytest.approx(params_formula, rel=0.02)
    assert opt == pytest.approx(opt_formula, rel=0.02)
    # The report reads the same numbers from the shardings, and the gradient layout too.
    r = s["report"]["per_device_bytes"]
    assert (r["params"], r["opt_state"]) == (params, opt)
    assert r["grads"] == pytest.approx(grads_formula, rel=0.02)


def test_sharded_gradients_show_in_temp_memory(stages):
    """Stage 2 drops the full-size gradient buffer of stage 1: temp memory falls by about the
    (N-1)/N share of the gradient bytes."""
    temp = {k: v["report"]["compiled"]["temp_bytes"] for k, v in stages.items()}
    saved = temp[1] - temp[2]
    expected = (N - 1) / N * 4 * PSI
    assert 0.8 * expected < saved < 1.3 * expected, (temp, expected)


def kinds(found, kind, in_loop=None):
    return [c for c in found if c.kind == kind and (in_loop is None or c.in_loop == in_loop)]


def payload(found) -> int:
    return sum(c.count * c.bytes for c in found)


def replicated_bytes(plan) -> int:
    return sum(4 * math.prod(leaf.shape) for leaf in plan.replicated)


def cut_layers(plan):
    """The layer-stack leaves whose parameters and gradients are cut."""
    return [leaf for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "axis"))
            if leaf.stacked and leaf.axis is not None and not leaf.persistent]


def test_stage0_and_1_all_reduce_gradients(stages):
    for stage in (0, 1):
        found = stages[stage]["collectives"]
        assert not kinds(found, "reduce-scatter")
        # The whole gradient is all-reduced: each layer's inside the backward loop as the layer
        # finishes (DDP's buckets), the rest once, after the backward.
        layers = sum(4 * math.prod(leaf.shape) for leaf in jax.tree.leaves(
            stages[stage]["plan"].leaves, is_leaf=lambda x: hasattr(x, "axis")) if leaf.block)
        assert payload(kinds(found, "all-reduce", in_loop=True)) == layers
        assert payload(kinds(found, "all-reduce")) >= 4 * PSI
    assert not kinds(stages[0]["collectives"], "all-gather")
    # Stage 1: each device updated its shard; the shards are all-gathered into parameters.
    gathered = payload(kinds(stages[1]["collectives"], "all-gather", in_loop=False))
    sharded = 4 * PSI - replicated_bytes(stages[1]["plan"])
    assert gathered == pytest.approx(sharded, rel=0.01)


def test_stage2_and_3_reduce_scatter_per_layer_without_gradient_all_reduce(stages):
    for stage in (2, 3):
        plan, found = stages[stage]["plan"], stages[stage]["collectives"]
        sharded = 4 * PSI - replicated_bytes(plan)
        stacked = sum(4 * math.prod(leaf.shape) for leaf in cut_layers(plan))
        assert payload(kinds(found, "reduce-scatter")) == pytest.approx(sharded, rel=0.01)
        # Per layer: the layer stacks' gradients are reduce-scattered inside the backward loop.
        assert payload(kinds(found, "reduce-scatter", in_loop=True)) == pytest.approx(stacked,
                                                                                   rel=0.01)
        # No gradient-sized all-reduce: only replicated leaves and scalars (loss, norm partials).
        assert payload(kinds(found, "all-reduce")) <= replicated_bytes(plan) + 1024


def test_stage2_gathers_updated_parameters_once(stages):
    found = stages[2]["collectives"]
    assert not kinds(found, "all-gather", in_loop=True)
    sharded = 4 * PSI - replicated_bytes(stages[2]["plan"])
    assert payload(kinds(found, "all-gather")) == pytest.approx(sharded, rel=0.01)


def test_stage3_gathers_each_layer_in_forward_and_backward(stages):
    plan, found = stages[3]["plan"], stages[3]["collectives"]
    in_loop = kinds(found, "all-gather", in_loop=True)
    stacked = cut_layers(plan)
    per_loop = collections.defaultdict(list)
    for c in in_loop:
        per_loop[c.computation].append(c)
    # The forward loop gathers every cut leaf of every layer, in one buffer per layer; the
    # backward loop (remat) gathers that buffer again.
    assert sorted(sum(c.count for c in cs) for cs in per_loop.values()) == [TINY.n_layers] * 2
    for cs in per_loop.values():
        assert payload(cs) == sum(4 * math.prod(leaf.shape) for leaf in stacked)
    # Nothing gathers whole parameters after the update: all-gathers outside the loop are the
    # cut leaves outside the layer stack (embeddings, final norm), once each.
    root = [leaf for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "axis"))
            if not leaf.stacked and leaf.axis is not None and not leaf.persistent]
    outside = payload(kinds(found, "all-gather", in_loop=False))
    assert outside == sum(4 * math.prod(leaf.shape) for leaf in root)


@pytest.mark.parametrize("stage", range(4))
def test_report_communication_matches_zero_theory(stage, stages):
    """2 Psi per step for stages 0 and 2, 3 Psi for stage 3 (small replicated leaves skip the
    gathers). Stage 1 as specified all-reduces (2 Psi) and then all-gathers (1 Psi)."""
    r = stages[stage]["report"]
    measured = r["comm_bytes_per_step"] / (4 * PSI)
    assert r["comm_bytes_theory"] == (3 if stage == 3 else 2) * 4 * PSI
    assert measured == pytest.approx({0: 2, 1: 3, 2: 2, 3: 3}[stage], rel=0.03)


def test_stage3_temp_memory_grows_by_a_shard_per_layer(mesh, stages):
    """4 -> 16 layers: per added layer, stage 3 temp grows by one layer's shard, stage 0 by a
    whole layer (its gradient). Both also keep remat's checkpoint of each layer's input."""
    deep = dataclasses.replace(TINY, n_layers=16)
    layer_bytes = 4 * (TINY.n_params - GPTConfig(n_layers=0).n_params) / TINY.n_layers
    checkpoint = 4 * BATCH.shape[0] // N * TINY.seq_len * TINY.d_model
    growth = {}
    for stage in (0, 3):
        _, _, _, compiled = compile_step(mesh, deep, stage)
        base = stages[stage]["report"]["compiled"]["temp_bytes"]
        growth[stage] = (compiled.memory_analysis().temp_size_in_bytes - base) / 12 - checkpoint
    assert growth[3] <= 1.2 * layer_bytes / N, (growth, layer_bytes)
    assert growth[0] >= 0.9 * layer_bytes, (growth, layer_bytes)


def test_the_report_says_first_when_most_leaves_stay_whole(mesh, stages):
    """A persistence threshold above most leaves' size per layer keeps them whole at stage 3
    (parameters and gradients; their optimizer state is cut): the report's first lines say
    how many, and that for them stage 3 is stage 1. The default layout cuts most leaves and
    says nothing of it; below stage 3 nothing is gathered and no line says blocks are."""
    model = GPT(TINY)
    init, tx = init_fn(model), optax.adamw(1e-3)
    plan = make_plan(jax.eval_shape(init, jax.random.key(0)), mesh, 3, layers=LAYERS,
                     rules=[Rule("", min_shard_elems=TINY.d_model * TINY.d_model)])
    state = abstract_state(plan, tx)
    lowered = make_train_step(plan, lm_loss(model), tx).lower(state, BATCH)
    text = report.format_table(report.build(plan, state, lowered, lowered.compile()))
    leaves = jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "persistent"))
    whole = [leaf for leaf in leaves if leaf.persistent or leaf.axis is None]
    assert len(leaves) > len(whole) > len(leaves) / 2 and all(x.persistent for x in whole)
    share = sum(math.prod(x.shape) for x in whole) / TINY.n_params
    assert text.splitlines()[1] == (
        f"  {len(whole)} of {len(leaves)} leaves stay whole ({share:.0%} of the parameters), "
        f"so stage 3 cuts only the rest: {len(whole)} persistent (parameters and gradients "
        "whole, optimizer state cut: stage 1 for them)")
    for stage, s in stages.items():
        default = report.format_table(s["report"])
        assert "leaves stay whole" not in default
        assert ("gathered block by block (1 block): blocks" in default) == (stage == 3)
