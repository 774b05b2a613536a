"""ZeRO-Offload read from the program: where the state lives and where the update runs.

The CPU backend moves nothing between "device" and "pinned_host" (both are host RAM), so its
program shows the placements and the host computation but no saving; the program exported for
GPU shows the same placements and the transfers XLA's host offloader will carry out. That
training with offload equals training without it is in test_equivalence.
"""

import re
import warnings

import jax
import numpy as np
import optax
import pytest
from conftest import KEY, OPTIMIZERS, equations
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm import LAYERS

from zero_jax import Offload, make_plan, make_train_step
from zero_jax.plan import path_str
from zero_jax.state import abstract_state, init_state

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

HOST_CALL = re.compile(r'call @(\w+)\(([^)]*)\).*_xla_compute_type = "host"')


def update_call(text: str, state) -> tuple[str, list[str]]:
    """The host computation that runs the update: the one taking every gradient, the master,
    the optimizer state and the finite flag (the others scale and convert the gradients that
    streamed to the host)."""
    n = len(jax.tree.leaves(state.params)) + len(jax.tree.leaves((state.master,
                                                                  state.opt_state))) + 1
    calls = [(name, [o.strip() for o in ops.split(",")]) for name, ops in HOST_CALL.findall(text)]
    found = [c for c in calls if len(c[1]) == n]
    assert len(found) == 1, [len(c[1]) for c in calls]
    return found[0]


@pytest.fixture(scope="module")
def offloaded(mesh, small):
    """The stage-2 step with the whole optimizer offloaded, lowered on abstract arrays."""
    _, init, loss_fn, batches = small
    tx = OPTIMIZERS["adamw"]()
    plan = make_plan(jax.eval_shape(init, KEY), mesh, 2, layers=LAYERS,
                     offload=Offload(optimizer=1.0))
    state = abstract_state(plan, tx)
    batch = jax.ShapeDtypeStruct(batches[0].shape, batches[0].dtype,
                                 sharding=NamedSharding(mesh, P("data")))
    step = make_train_step(plan, loss_fn, tx)
    return plan, step, state, batch


def test_update_is_one_host_computation_over_host_state(offloaded):
    plan, step, state, batch = offloaded
    text = step.lower(state, batch).as_text()
    name, _ = update_call(text, state)  # the whole update, one host computation
    # Master and optimizer state (moments, counts) enter and leave the step in host memory,
    # donated in place, and nothing else does.
    master_and_moments = len(jax.tree.leaves((state.master, state.opt_state)))
    assert master_and_moments > 3 * len(jax.tree.leaves(state.params))
    main = text[text.index("func.func public @main("):]
    args = main[:main.index(") -> (")].split("%arg")[1:]
    host_args = [a for a in args if '"pinned_host"' in a]
    assert len(host_args) == master_and_moments
    assert all("tf.aliasing_output" in a for a in host_args)
    # The compute copy comes back in the compute dtype, to the device.
    body = text[text.index(f"func.func private @{name}("):]
    body = body[:body.index("\n  }")]
    assert "all_gather" not in body and "reduce_scatter" not in body  # no collective on host


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_leave_for_the_host_layer_by_layer(stage, offloaded, mesh, small):
    """ZeRO-Offload's gradient streaming: at stages 2 and 3 each layer's gradient shard moves to
    host memory inside the backward loop, as that layer's backward ends, not after the loop
    (stage 3 with its parameters on the device: the shard is gathered from the device, its
    gradient carried by a host copy)."""
    plan, step, state, batch = offloaded
    if stage == 3:
        _, init, loss_fn, _ = small
        tx = OPTIMIZERS["adamw"]()
        plan = make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=LAYERS,
                         offload=Offload(optimizer=1.0))
        step, state = make_train_step(plan, loss_fn, tx), abstract_state(plan, tx)
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    puts = device_puts_per_loop(jax.make_jaxpr(step)(state, batch).jaxpr)
    cut = [leaf for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "axis"))
           if leaf.axis is not None and not leaf.persistent]
    in_blocks = sum(leaf.block is not None for leaf in cut)
    assert puts["scans"] == 2 and puts[1, "Host"] == in_blocks > 0


def test_gpu_program_keeps_the_host_placements(offloaded):
    """Exported for CUDA: the update is one host computation, every operand of which is in host
    memory (the state as the step's pinned_host arguments, the gradients streamed or annotated
    to move there), and nothing inside it moves data back to the device."""
    plan, step, state, batch = offloaded
    text = export.export(step.fn, platforms=["cuda"])(state, batch).mlir_module()
    name, operands = update_call(text, state)
    main = text[text.index("func.func public @main("):]
    signature = main[:main.index(") -> (")]
    host_args = {"%arg" + a.split(":")[0] for a in signature.split("%arg")[1:]
                 if '"pinned_host"' in a}

    def in_host_memory(value: str) -> bool:
        if value in host_args:
            return True
        defined = re.search(rf"\n\s*{re.escape(value)} = (.*)", text).group(1)
        return ("annotate_device_placement" in defined and
                '_xla_buffer_placement = "pinned_host"' in defined)

    # Gradients, master, optimizer state (and the finite flag): all in host memory.
    assert all(in_host_memory(o) for o in operands), operands
    body = text[text.index(f"func.func private @{name}("):]
    assert "annotate_device_placement" not in body[:body.index("\n  }")]


def test_an_optimizer_that_couples_leaves_is_refused_below_ratio_1(mesh, small):
    """A split update is exact only when no leaf's update reads another leaf's state or
    parameter (reading every gradient, as clipping does, is fine): checked on the jaxpr."""
    _, init, loss_fn, _ = small

    def scale_by_param_norm() -> optax.GradientTransformation:  # LARS-like, but global
        def update(updates, state, params):
            norm = optax.tree.norm(params)
            return jax.tree.map(lambda u: u * norm, updates), state
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    shapes = jax.eval_shape(init, KEY)
    coupled = optax.chain(scale_by_param_norm(), optax.sgd(0.1))
    half = make_plan(shapes, mesh, 3, layers=LAYERS, offload=Offload(optimizer=0.5))
    with pytest.raises(ValueError, match="not separable"):
        make_train_step(half, loss_fn, coupled)
    make_train_step(make_plan(shapes, mesh, 3, layers=LAYERS, offload=Offload(1.0)), loss_fn,
                    coupled)  # all on the host: nothing to split
    make_train_step(half, loss_fn, OPTIMIZERS["adamw"]())  # clipping reads only gradients


def test_ratio_picks_the_largest_leaves(mesh, small):
    _, init, _, _ = small
    shapes = jax.eval_shape(init, KEY)
    sizes = {path_str(path): x.size
             for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    total = sum(sizes.values())
    for ratio in (0.0, 0.3, 0.5, 1.0):
        plan = make_plan(shapes, mesh, 1, offload=Offload(optimizer=ratio))
        leaves = jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "offload"))
        host = [leaf for leaf in leaves if leaf.offload]
        taken = sum(sizes[leaf.path] for leaf in host)
        assert taken >= ratio * total
        if host:  # the smallest one taken was needed to reach the ratio, and none is bigger
            smallest = min(sizes[leaf.path] for leaf in host)
            assert taken - smallest < ratio * total
            assert all(sizes[leaf.path] <= smallest for leaf in leaves if not leaf.offload)
    with pytest.raises(ValueError, match="0 to 1"):
        Offload(optimizer=1.5)


def device_puts_per_loop(jaxpr) -> dict:
    """``{(loop, "Device"|"Host"): count}`` of the device_puts in the program, ``loop`` being
    the index of the scan they run in (in program order: the forward loop first), or None;
    ``"scans"``: how many scans there are."""
    found = {"scans": 0}
    for eqn, loop in equations(jaxpr):
        found["scans"] += eqn.primitive.name == "scan"
        for dst in eqn.params["devices"] if eqn.primitive.name == "device_put" else ():
            key = (loop, getattr(dst, "name", str(dst)))
            found[key] = found.get(key, 0) + 1
    return found


def test_parameter_offload_moves_each_layer_inside_both_loops(mesh, small):
    """Stage 3 with ``offload_params``: the cut shards live in host memory; each layer's shard
    is copied to the device inside the forward loop and again inside the backward loop, right
    before its gathers, and each layer's gradient shard goes back to host memory inside the
    backward loop."""
    _, init, loss_fn, batches = small
    tx = OPTIMIZERS["adamw"]()
    shapes = jax.eval_shape(init, KEY)
    plan = make_plan(shapes, mesh, 3, layers=LAYERS, offload=Offload(1.0, params=True))
    state = abstract_state(plan, tx)
    cut = [leaf for leaf in jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "axis"))
           if leaf.axis is not None and not leaf.persistent]
    in_blocks = sum(leaf.block is not None for leaf in cut)
    kinds = [x.sharding.memory_kind for x in jax.tree.leaves(state.params)]
    assert kinds.count("pinned_host") == len(cut) and in_blocks > 0
    batch = jax.ShapeDtypeStruct(batches[0].shape, batches[0].dtype,
                                 sharding=NamedSharding(mesh, P("data")))
    step = make_train_step(plan, loss_fn, tx)
    puts = device_puts_per_loop(jax.make_jaxpr(step)(state, batch).jaxpr)
    assert puts["scans"] == 2  # the forward and the backward layer loops
    assert puts[0, "Device"] == in_blocks  # forward: every cut leaf of the layer
    # Backward: again before the re-gather (JAX drops those of biases the backward never
    # reads), and every cut leaf's gradient shard back to the host.
    assert in_blocks / 2 < puts[1, "Device"] <= in_blocks
    assert puts[1, "Host"] == in_blocks
    assert puts[None, "Device"] == len(cut) - in_blocks  # the rest, once per step
    # The same program for CUDA carries each of those moves as a placement annotation.
    text = export.export(step.fn, platforms=["cuda"])(state, batch).mlir_module()
    to_device = re.findall(r'_xla_buffer_placement = "device"', text)
    assert len(to_device) >= puts[0, "Device"] + puts[1, "Device"] + puts[None, "Device"]
    with pytest.raises(ValueError, match=r"Offload\(optimizer=1.0\)"):
        Offload(optimizer=0.5, params=True)


# What may take a host-memory value outside the host computation: moves, layout, and the
# structure around them (loops, remat, shard_map, barriers); no arithmetic.
MOVES = {"device_put", "sharding_constraint", "jit", "pjit", "scan", "remat2", "checkpoint",
         "shard_map", "optimization_barrier", "custom_vjp_call", "custom_vjp_call_jaxpr"}


def host_consumers(jaxpr) -> set:
    """The primitives outside ``compute_on`` that read a value in host memory."""
    return {eqn.primitive.name for eqn, _ in equations(jaxpr, skip="compute_on")
            if any(getattr(getattr(v, "aval", None), "memory_space", None) ==
                   jax.memory.Space.Host for v in eqn.invars)}


@pytest.mark.parametrize("offload", ["half at stage 2", "parameters at stage 3"])
def test_no_device_computation_reads_host_memory(offload, mesh, small):
    """Arithmetic on host memory happens only inside host computations (the update, the
    scaling of streamed gradients); the device program only moves host data."""
    _, init, loss_fn, batches = small
    stage, kw = {"half at stage 2": (2, {"offload": Offload(optimizer=0.5)}),
                 "parameters at stage 3": (3, {"offload": Offload(1.0, params=True)})}[offload]
    tx = OPTIMIZERS["adamw"]()
    plan = make_plan(jax.eval_shape(init, KEY), mesh, stage, layers=LAYERS, **kw)
    batch = jax.ShapeDtypeStruct(batches[0].shape, batches[0].dtype,
                                 sharding=NamedSharding(mesh, P("data")))
    jaxpr = jax.make_jaxpr(make_train_step(plan, loss_fn, tx))(abstract_state(plan, tx), batch)
    consumers = host_consumers(jaxpr.jaxpr)
    assert "device_put" in consumers and consumers <= MOVES, consumers - MOVES


@pytest.mark.parametrize("stage, offload", [(2, Offload(optimizer=1.0)),
                                            (3, Offload(optimizer=1.0, params=True))],
                         ids=["optimizer", "parameters"])
def test_init_state_says_nothing_of_donated_buffers(stage, offload, mesh, small):
    """init_state donates the fp32 parameters it starts from; offloaded, no output of the init
    has their layout (the master in host memory; the compute copy whole at stage 2, or in host
    memory), so XLA cannot write over them and JAX warned "Some donated buffers were not
    usable" in every offload run: nothing a user can act on. The state is the init's all the
    same (to rounding: the init compiled, sharded, against the init run op by op)."""
    _, init, _, _ = small
    plan = make_plan(jax.eval_shape(init, KEY), mesh, stage, layers=LAYERS, offload=offload)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = init_state(plan, init, OPTIMIZERS["adamw"](), KEY)
    assert not [w for w in caught if "donated" in str(w.message)], caught
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(init(KEY)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-8)
