"""The public API on users' own models: the docs' examples (README's linen one, the NNX one of
docs/guides/your-model.md), run as written, and NNX."""

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, SUBPROCESS_ENV, example, rel
from flax import nnx

import zero_jax as zj

LINEN = ("README.md", "api-example")
NNX = ("docs/guides/your-model.md", "api-example-nnx")


def test_readme_example_trains_sharded_and_exactly(capsys):
    ns: dict = {}
    for path, name in (LINEN, NNX):
        exec(compile(example(path, name), str(ROOT / path), "exec"), ns)
    assert "loss" in capsys.readouterr().out
    plan, state, loss_fn, init, x, y = (ns[k] for k in
                                        ("plan", "state", "loss_fn", "init", "x", "y"))
    # One device's initial parameters, their loss and gradients: one program. (The references
    # jitted: op by op, each operation is a program compiled of its own.)
    @jax.jit
    def one_device(key):
        params = init(key)
        return params, *jax.value_and_grad(loss_fn)(params, (x, y))

    whole, loss0, ref = one_device(ns["key"])
    # It learned: the final loss is well below the loss of the initial parameters.
    assert float(ns["metrics"]["loss"]) < 0.5 * float(loss0)
    # Stage 3: every block weight is held as 1/8 per device, the blocks found by path.
    assert plan.blocks == ["h_0", "h_1", "h_2", "h_3"] and ns["nnx_plan"].blocks == [
        f"blocks/{i}" for i in range(4)]
    kernel = state.params["h_0"]["Dense_0"]["kernel"]
    assert kernel.addressable_shards[0].data.size * 8 == kernel.size
    # The NNX example learned too (dropout on, so the loss is the training loss).
    assert float(ns["nnx_metrics"]["loss"]) < 0.5 * float(jax.jit(lambda key: ns["nnx_loss"](
        ns["nnx_init"](key), (x, y), jax.random.key(2)))(ns["key"]))
    # And its gradients (at the initial parameters, before they shrink to rounding noise) are
    # the one-device gradients.
    params = jax.device_put(whole, plan.shardings(plan.param_specs))
    _, grads = jax.jit(zj.make_grad_fn(plan, loss_fn))(params, (x, y))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert rel(g, r) < 1e-5


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(16, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 3, rngs=rngs)  # bias of 3 does not cut over 8: stays whole

    def __call__(self, x):
        return self.l2(nnx.gelu(self.l1(x)))


def test_nnx_model_trains_like_one_device():
    graphdef, _ = nnx.split(Net(nnx.Rngs(0)))
    init = lambda key: nnx.state(Net(nnx.Rngs(key)), nnx.Param)

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

    x = jax.random.normal(jax.random.key(1), (64, 16))
    batch = (x, jnp.tanh(x[:, :3]))
    tx, key = optax.sgd(0.1), jax.random.key(0)
    plan = zj.make_plan(jax.eval_shape(init, key), zj.make_mesh(), stage=3)
    assert [leaf.path for leaf in plan.replicated] == ["l2/bias"]
    state = zj.init_state(plan, init, tx, key)
    step = zj.make_train_step(plan, loss_fn, tx)

    params, grad = init(key), jax.jit(jax.value_and_grad(loss_fn))  # one device's
    opt_state = tx.init(params)
    for _ in range(5):
        state, metrics = step(state, batch)
        loss, grads = grad(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        assert abs(float(metrics["loss"]) - float(loss)) <= 1e-5 * float(loss)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        assert rel(a, b) < 1e-5
    kernel = state.params["l1"]["kernel"][...]
    assert kernel.addressable_shards[0].data.size * 8 == kernel.size


def test_state_from_existing_parameters():
    """Pretrained parameters (here, host arrays) become the state without a device holding
    more than its part; the same state as from the initializer."""
    model = nn.Dense(64)
    init = lambda key: model.init(key, jnp.zeros((1, 16)))["params"]
    tx, key = optax.adam(1e-3), jax.random.key(0)
    plan = zj.make_plan(jax.eval_shape(init, key), zj.make_mesh(), stage=3)
    pretrained = jax.tree.map(np.asarray, init(key))
    state = zj.init_state(plan, pretrained, tx)
    reference = zj.init_state(plan, init, tx, key)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
        assert a.sharding == b.sharding and np.array_equal(a, b)
    assert state.params["kernel"].addressable_shards[0].data.shape == (2, 64)
    wrong = {"kernel": pretrained["kernel"][:8], "bias": pretrained["bias"]}
    with pytest.raises(ValueError, match="parameter kernel has shape"):
        zj.init_state(plan, wrong, tx)


def test_a_users_mistakes_are_said_in_one_line():
    """What ``train.py`` checks for its users, the library says to a loop of one's own: a
    batch that does not divide over the devices, stage 3 without its blocks named."""
    model = nn.Dense(16)
    init = lambda key: model.init(key, jnp.zeros((1, 16)))["params"]
    loss_fn = lambda params, batch: jnp.mean(model.apply({"params": params}, batch) ** 2)
    tx, key = optax.sgd(0.1), jax.random.key(0)
    with pytest.warns(UserWarning, match=r"stage 3 gathers 100% of the cut parameters once per "
                                         r"step .* name the model's blocks \(make_plan layers="):
        zj.make_plan(jax.eval_shape(init, key), zj.make_mesh(), stage=3)
    plan = zj.make_plan(jax.eval_shape(init, key), zj.make_mesh(), stage=2)
    step = zj.make_train_step(plan, loss_fn, tx, accum_steps=2)
    state = zj.init_state(plan, init, tx, key)
    with pytest.raises(ValueError, match=r"^batch has 24 rows, which do not divide over the 8 "
                                         r"devices of the mesh's data axis times accum_steps 2: "
                                         r"pass a batch of a multiple of 16 rows"):
        step(state, jnp.ones((24, 16)))
    state, _ = step(state, jnp.ones((32, 16)))  # and a batch that divides trains
    assert int(state.step) == 1


def test_one_cpu_device_says_how_to_simulate_more():
    """The README's example on a machine without accelerators would run on one device, with
    nothing cut; ``make_mesh`` says so, and how to get eight."""
    code = ("import warnings, zero_jax as zj\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); zj.make_mesh()\n"
            "print(*[str(x.message) for x in w])\n"
            "zj.simulate_cpu_devices(8)\n")
    env = {k: v for k, v in SUBPROCESS_ENV.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "one CPU device, so nothing is cut: to simulate 8, call " \
           "zero_jax.simulate_cpu_devices(8) before JAX's first computation" in out.stdout
    assert "simulate_cpu_devices(8)" in example(*LINEN)  # the README's example shows it


def test_export_help_names_the_command_a_user_types():
    out = subprocess.run([sys.executable, "-m", "zero_jax.export", "--help"], capture_output=True,
                         text=True, env=SUBPROCESS_ENV, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m zero_jax.export ")
