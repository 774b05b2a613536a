"""Remat policies (ZeRO-R's activation memory): what each block saves for its backward.

Read from the compiled stage-3 step of the small model: ``dots`` and ``none`` recompute less
(fewer flops) and hold more (temp); ``offload`` recomputes what ``full`` does and, on the
device, holds what it holds, its per-layer checkpoints going to host memory instead. All four
train the same. The planner, measuring the same compiled steps, picks the least recompute
that fits.
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

from zero_jax import Layers, init_state, make_plan, make_train_step, planner

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
        layout = {"stage": 3, "offload": "none", "remat": policy, "tp": 1}
        candidate = planner.measure(layout, plan, state, compiled)
        host = scan_outputs_in_host_memory(jax.make_jaxpr(step)(state, put(batches[0])).jaxpr)
        losses = []
        for b in batches:
            state, m = compiled(state, put(b))
            losses.append(float(m["loss"]))
        out[policy] = {"losses": losses, "params": state.params, "host": host, "flops":
                       cost["flops"], "temp": compiled.memory_analysis().temp_size_in_bytes,
                       "candidate": candidate}
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



def candidate(remat: str, flops: int, temp: int, comm: int = 2**20) -> planner.Candidate:
    return planner.Candidate({"stage": 3, "offload": "none", "remat": remat, "tp": 1},
                             device_state=2**20, temp=temp, host_state=0, comm=comm,
                             host_traffic=0, model_states=2**20, flops=flops)


def test_choose_computes_least_among_what_communicates_least():
    """Equal communication: fewer FLOPs win where both fit, more memory notwithstanding; the
    FLOPs' ties go to less device memory; communication and host traffic come first."""
    full, dots = candidate("full", 10**9, 2**20), candidate("dots", 8 * 10**8, 3 * 2**20)
    assert planner.choose([full, dots], 8 * 2**20, 2**30, 8) is dots
    assert planner.choose([full, dots], 3 * 2**20, 2**30, 8) is full  # dots needs 4 MiB
    assert not dots.fits and full.fits
    offload = candidate("offload", 10**9, 2**19)
    assert planner.choose([full, offload], 8 * 2**20, 2**30, 8) is offload
    cheaper = candidate("none", 10**8, 2**20, comm=2**20 + 1)
    assert planner.choose([full, dots, cheaper], 8 * 2**20, 2**30, 8) is dots
    slow = dataclasses.replace(candidate("none", 10**8, 2**20), host_traffic=1)
    assert planner.choose([full, dots, slow], 8 * 2**20, 2**30, 8) is dots


def test_step_flops_reads_each_form_of_cost_analysis():
    """A dict (jax 0.10), a list of one dict (older jax), None (a backend without it: 0)."""
    class Compiled:
        def __init__(self, cost):
            self.cost_analysis = lambda: cost

    assert [planner.step_flops(Compiled(c)) for c in ({"flops": 12.0}, [{"flops": 7.0}], None,
                                                      [])] == [12, 7, 0, 0]


def test_planner_prefers_the_least_recompute_that_fits(runs):
    """The planner's candidates, measured from these compiled steps (the same collectives for
    every policy): the one that computes least wins where it fits, ``full`` where only it does
    (or ``offload``, which recomputes as much and, on the CPU, holds as much)."""
    rows = [runs[p]["candidate"] for p in POLICIES]
    full, dots, none, offload = rows
    for c, p in zip(rows, POLICIES, strict=True):  # the planner's FLOPs: XLA's, per device
        assert c.flops == int(runs[p]["flops"]) > 0
    assert len({c.comm for c in rows}) == 1 and len({c.host_traffic for c in rows}) == 1
    assert none.flops < dots.flops < full.flops == offload.flops
    assert full.device < dots.device < none.device
    budget = lambda lo, hi: (lo.device + hi.device) / 2 / planner.HEADROOM
    assert planner.choose(rows, 2 * none.device, 2**30, 8) is none
    assert planner.choose(rows, budget(dots, none), 2**30, 8) is dots
    chosen = planner.choose(rows, budget(full, dots), 2**30, 8)
    assert chosen in (full, offload) and chosen.device == min(full.device, offload.device)
    assert not dots.fits and not none.fits
