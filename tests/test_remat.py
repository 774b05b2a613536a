"""Remat policies (ZeRO-R's activation memory): what each block saves for its backward.

Read from the compiled stage-3 step of the small model: ``dots`` and ``none`` recompute less
(fewer flops) and hold more (temp); ``offload`` recomputes what ``full`` does and, on the
device, holds what it holds, its per-layer checkpoints going to host memory instead. All four
train the same.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from conftest import KEY, equations
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm import LAYERS, LM, SMALL, init_fn, lm_loss

from zero_jax import Layers, init_state, make_plan, make_train_step

POLICIES = ("full", "dots", "none", "offload")


def scan_outputs_in_host_memory(jaxpr) -> list[int]:
    """Per scan in the program (forward first), how many of its outputs are in host memory."""
    return [sum(v.aval.memory_space == jax.memory.Space.Host for v in eqn.outvars)
            for eqn, _ in equations(jaxpr) if eqn.primitive.name == "scan"]


@pytest.fixture(scope="module")
def runs(mesh, small):
    """Per policy at stage 3: losses of 3 SGD steps, compiled temp bytes and flops, and the
    host-memory outputs of the program's scans."""
    batches = small[3][:3]
    out = {}
    for policy in POLICIES:
        model = LM(dataclasses.replace(SMALL, remat="none"))  # stage 3 remats the blocks itself
        init, loss_fn, tx = init_fn(model), lm_loss(model), optax.sgd(0.5)
        plan = make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=Layers(LAYERS, policy))
        state = init_state(plan, init, tx, KEY)
        step = make_train_step(plan, loss_fn, tx)
        put = lambda b: jax.device_put(b, NamedSharding(mesh, P("data")))
        compiled = step.lower(state, put(batches[0])).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        host = scan_outputs_in_host_memory(jax.make_jaxpr(step)(state, put(batches[0])).jaxpr)
        losses = []
        for b in batches:
            state, m = compiled(state, put(b))
            losses.append(float(m["loss"]))
        out[policy] = {"losses": losses, "params": state.params, "host": host, "flops":
                       cost["flops"], "temp": compiled.memory_analysis().temp_size_in_bytes}
    return out


def test_every_policy_trains_the_same(runs):
    for policy in POLICIES[1:]:
        np.testing.assert_allclose(runs[policy]["losses"], runs["full"]["losses"], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(runs[policy]["params"]),
                        jax.tree.leaves(runs["full"]["params"]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_saving_more_recomputes_less(runs):
    full, dots, none = (runs[p] for p in ("full", "dots", "none"))
    assert dots["flops"] < full["flops"] and none["flops"] < full["flops"]
    assert full["temp"] < dots["temp"] < none["temp"]


def test_offload_keeps_the_checkpoints_in_host_memory(runs):
    full, offload = runs["full"], runs["offload"]
    # The forward loop's per-layer checkpoints (each block's input) leave it in host memory;
    # nothing else changes: the same recomputation and the same temp. (On the CPU backend the
    # move is a no-op, so the temp is exactly full's; on a GPU the checkpoints leave the
    # device's temp for host memory.)
    assert offload["host"][0] == 1 and full["host"][0] == 0
    assert offload["flops"] == full["flops"]
    assert offload["temp"] <= full["temp"] * 1.05
