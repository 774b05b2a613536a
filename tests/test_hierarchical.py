"""Hierarchical ZeRO on 2 groups x 4: stage 3 within a group, optimizer state over all 8."""

import jax
import optax
import pytest
from conftest import rel, tree_rel

import zero_jax as zj
from zero_jax.hlo import collectives
from zero_jax.model import LAYERS

KEY = jax.random.key(42)


@pytest.fixture(scope="module")
def grid():
    return zj.make_mesh(8, axes={"replica": 2, "data": 4})


def make(grid, small):
    _, init, loss_fn, _ = small
    return zj.make_plan(jax.eval_shape(init, KEY), grid, 3, layers=LAYERS, outer="replica")


def test_gradients_and_training_equal_single_device(grid, small):
    _, init, loss_fn, batches = small
    plan = make(grid, small)
    whole = init(KEY)
    params = jax.device_put(whole, plan.shardings(plan.param_specs))
    _, grads = jax.jit(zj.make_grad_fn(plan, loss_fn))(params, batches[0])
    ref = jax.grad(loss_fn)(whole, batches[0])
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert rel(g, r) < 1e-5
    for tx in (optax.sgd(0.5), optax.adamw(3e-3)):
        state = zj.init_state(plan, init, tx, KEY)
        step = zj.make_train_step(plan, loss_fn, tx)
        p, o = whole, tx.init(whole)
        for b in batches[:5]:
            state, m = step(state, b)
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            u, o = tx.update(g, o, p)
            p = optax.apply_updates(p, u)
            assert abs(float(m["loss"]) - float(loss)) <= 1e-5 * float(loss)
        assert tree_rel(state.params, p) < 1e-5


def test_layouts_and_collectives(grid, small):
    _, init, loss_fn, batches = small
    plan = make(grid, small)
    tx = optax.adamw(1e-3)
    state = zj.init_state(plan, init, tx, KEY)
    kernel = state.params["blocks"]["qkv"]["kernel"]
    mu = state.opt_state[0].mu["blocks"]["qkv"]["kernel"]
    assert kernel.addressable_shards[0].data.size * 4 == kernel.size  # 1/zero3_size
    assert mu.addressable_shards[0].data.size * 8 == mu.size  # 1/N
    compiled = zj.make_train_step(plan, loss_fn, tx).lower(state, batches[0]).compile()
    found = collectives(compiled.as_text(), 8)
    in_loop = [c for c in found if c.in_loop]
    # Every per-layer gather and reduce-scatter stays inside a group of 4 ...
    assert {c.kind for c in in_loop} == {"all-gather", "reduce-scatter"}
    assert {c.group_size for c in in_loop} == {4}
    # ... and what crosses groups (groups of 2) runs once per step, outside the loops: the
    # gradient reduce-scatter into the ZeRO-1 layout and the parameter all-gather back.
    across = [c for c in found if c.group_size == 2]
    assert {c.kind for c in across} >= {"reduce-scatter", "all-gather"}
    assert all(not c.in_loop and c.count == 1 for c in across)
