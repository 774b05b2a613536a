"""Prefetch: stage 3's scanned stacks, unrolled blocks and NNX blocks gather layer i+1 while
layer i computes (i-1 in the backward, while layer i+1's gradient is reduce-scattered). It
changes when bytes travel, not what is computed: the prefetched step must train bit-identically
to the plain one, move the same bytes, and its program must gather one layer ahead and reduce
one behind; the price is one more gathered layer and one more whole layer gradient, which the
report states."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import regather
from conftest import KEY, OPTIMIZERS, equations, max_rel, optax_steps
from flags import FUSION_EMITTERS
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm import LAYERS, LM, SMALL, init_fn, lm_loss
from lm import batches as lm_batches
from test_comm import volume
from test_nnx import D, Scanned
from test_nnx import data as nnx_data
from test_nnx import problem as nnx_problem
from test_remat import scan_outputs_in_host_memory

import zero_jax as zj
from zero_jax import peak, report
from zero_jax.hlo import (
    collectives,
    copied_bytes,
    gathered_ahead,
    gathered_beside,
    reduced_behind,
    scheduled_ahead,
)

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

STEPS = 5
# Four layers: the forward loop runs layers 0-2 (3 after it), the backward loop layers 2-1 (3
# before it, 0 after it); fewer would leave XLA a backward loop of one iteration, which it
# removes.
MODEL = LM(dataclasses.replace(SMALL, n_layers=4))
# (optimizer, hierarchical, accumulation, comm, offload): SGD, hierarchical, one collective per
# leaf; AdamW with accumulation, buckets and int8 weights and gradients (exact too: prefetch
# gathers the same int8 blocks, only earlier); AdamW with the optimizer and the parameter shards
# in host memory (each layer's gradient shard leaves for the host from the backward loop).
LAYOUTS = {
    "sgd, hierarchical, per leaf": ("sgd", "replica", 1, zj.Comm(bucket_bytes=0), zj.Offload()),
    "adamw, accumulation, buckets, int8": ("adamw", None, 2, zj.Comm(25 << 20, True, True),
                                           zj.Offload()),
    "adamw, buckets, offload": ("adamw", None, 1, zj.Comm(), zj.Offload(1.0, params=True)),
}


@pytest.fixture(scope="module")
def problem():
    return init_fn(MODEL), lm_loss(MODEL), lm_batches(MODEL.cfg, STEPS)


def test_the_layer_loop_reads_what_its_layers_kept_past_no_barrier(problem, mesh):
    """A scanned stack's loop keeps XLA from merging a layer's recompute with its forward.
    Remat's own barrier (``prevent_cse``) would also hold each value the forward kept, which
    XLA then copies out of the loop's stacks before reading it (on an H100, 1.8 GB a layer of
    gpt2-124m's stage 3, 6% of its step: docs/benchmarks/gpu-compile.md). So no remat of a
    layer of the stack asks for it, with prefetch's loop (each backward still waits for its
    cotangent: ``blocks.scan``'s own barrier holds the weights and the layer's input) and
    without (``nn.scan``'s or ``nnx.scan``'s, told at trace time); for unrolled blocks it
    stays."""
    init, loss_fn, batches = problem
    tx = optax.sgd(0.1)
    batch = jax.ShapeDtypeStruct(batches[0].shape, batches[0].dtype,
                                 sharding=NamedSharding(mesh, P("data")))

    def remats(init, loss_fn, layers, prefetch, batch):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                            layers=zj.Layers(layers, "dots", prefetch=prefetch))
        jaxpr = jax.make_jaxpr(zj.make_train_step(plan, loss_fn, tx).fn)(
            zj.abstract_state(plan, tx), batch)
        return [(e.params["prevent_cse"], loop) for e, loop in equations(jaxpr.jaxpr)
                if e.primitive.name == "remat2"]  # jax.checkpoint
    nnx_init, nnx_loss = nnx_problem(Scanned)
    nnx_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P("data"))), nnx_data(0))
    for prefetch in (False, True):  # (and the model's own remat)
        for looped in (remats(init, loss_fn, LAYERS, prefetch, batch),
                       remats(nnx_init, nnx_loss, "blocks", prefetch, nnx_batch)):
            assert any(loop is not None for _, loop in looped) and \
                not any(c for c, _ in looped), (prefetch, looped)
    unrolled_init, unrolled_loss, blocks = dict(regather.problems(n_blocks=2))["unrolled"]
    for prefetch in (False, True):
        unrolled = remats(unrolled_init, unrolled_loss, blocks, prefetch, regather.BATCH)
        assert unrolled and all(c for c, _ in unrolled)


def test_the_layer_loops_keep_the_stacks_unroll(mesh):
    """A stack scanned with ``nn.scan(unroll=2)``: prefetch's own loops, which take the place of
    ``nn.scan``'s, run two layers an iteration as well (they ran one), and train bit-identically
    to the stack without prefetch."""
    model = LM(dataclasses.replace(SMALL, n_layers=5, unroll=2))
    init, loss_fn, batches = init_fn(model), lm_loss(model), lm_batches(model.cfg, 2)
    tx = optax.sgd(0.1)

    def train(prefetch):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                            layers=zj.Layers(LAYERS, prefetch=prefetch))
        step, state = zj.make_train_step(plan, loss_fn, tx), zj.init_state(plan, init, tx, KEY)
        jaxpr = jax.make_jaxpr(step.fn)(state, batches[0]).jaxpr
        unrolls = [e.params["unroll"] for e, _ in equations(jaxpr) if e.primitive.name == "scan"]
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        return unrolls, losses, jax.device_get(state.params)

    plain, ahead = train(False), train(True)
    assert plain[0] == [2, 2] and ahead[0] == [2, 2], (plain[0], ahead[0])  # forward, backward
    assert plain[1] == ahead[1]
    for a, b in zip(jax.tree.leaves(plain[2]), jax.tree.leaves(ahead[2]), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prefetch_trains_bit_identically_and_gathers_a_layer_ahead(layout, problem):
    init, loss_fn, batches = problem
    opt, outer, accum, comm, offload = LAYOUTS[layout]
    mesh = zj.make_mesh(8, axes={"replica": 2, "data": 4} if outer else None)
    tx = OPTIMIZERS[opt]()

    def train(prefetch):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                            layers=zj.Layers(LAYERS, prefetch=prefetch),
                            rules=[zj.Rule("", min_shard_elems=64)], comm=comm,
                            offload=offload)
        state = zj.init_state(plan, init, tx, KEY)
        put = lambda b: jax.device_put(b, NamedSharding(mesh, P(plan.data_axes)))
        lowered = zj.make_train_step(plan, loss_fn, tx, accum_steps=accum).lower(
            state, put(batches[0]))
        # Read, then run: one compile. The copies below are bounded: per leaf with XLA's
        # default emitters (the older ones copy 4.3 layers there, against 3.2); with buckets
        # both copy the same bytes (0.21 and 0.25 of a layer) and the older compile 2.2x faster.
        compiled = lowered.compile(None if comm.bucket_bytes else FUSION_EMITTERS)
        losses = []
        for b in batches:
            state, m = compiled(state, put(b))
            losses.append(float(m["loss"]))
        return losses, jax.device_get(state.params), compiled, report.build(
            plan, state, lowered, compiled, accum_steps=accum)

    plain, ahead = train(False), train(True)
    assert plain[0] == ahead[0]
    for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(ahead[1]), strict=True):
        np.testing.assert_array_equal(a, b)

    # Read from the programs: every all-gather in the prefetched loops (forward and backward)
    # only feeds the next iteration; in the plain loops each feeds this iteration's matmuls.
    # Every gradient reduction in the prefetched backward loop reduces what the iteration
    # before computed; in the plain one, what this iteration's matmuls did.
    loops = gathered_ahead(ahead[2].as_text())
    assert len(loops) == 2 and all(all(x) for x in loops.values()), loops
    plain_loops = gathered_ahead(plain[2].as_text())
    assert len(plain_loops) == 2 and not any(any(x) for x in plain_loops.values())
    behind = reduced_behind(ahead[2].as_text())
    assert len(behind) == 1 and all(all(x) for x in behind.values()), behind
    plain_behind = reduced_behind(plain[2].as_text())
    assert len(plain_behind) == 1 and not any(any(x) for x in plain_behind.values())
    # The same bytes of each kind; one layer's gathers per direction moved out of the layer loops.
    found, before = collectives(ahead[2].as_text(), 8), collectives(plain[2].as_text(), 8)
    assert volume(found) == volume(before)
    count = lambda cs, bodies: sum(c.count for c in cs if c.kind == "all-gather"
                                   and c.computation in bodies)
    assert count(found, loops) * 8 == count(before, plain_loops) * 5  # 3 + 2 of 4 + 4 layers
    # The price, stated in the report: one more gathered layer and one more whole gradient
    # (14,860 f32 elements each here), and XLA's temp grows by at most that; with buckets, by
    # at most a layer more (the layer's flat buffer and the leaves cut out of it coexist).
    layer = 14_860 * 4
    assert ahead[3]["prefetch_bytes"] == 2 * layer and plain[3]["prefetch_bytes"] == 0
    grown = ahead[3]["compiled"]["temp_bytes"] - plain[3]["compiled"]["temp_bytes"]
    assert 0 < grown <= layer * (3 if comm.bucket_bytes else 2), grown
    # What the loops carry to the next iteration (a gathered layer; in the backward also a
    # whole gradient) is written over the last one, not copied in and out beside it: with
    # buckets no layer is copied at all (the layer is cut out of its bucket, and the next
    # gradient begins, once the old value is dead); per leaf, where the collective's own
    # result is carried, once (3 layers in all). Without that, 6 layers are copied here.
    copied = copied_bytes(ahead[2].as_text(), loops)
    assert copied < (layer // 4 if comm.bucket_bytes else 3.5 * layer), copied


def test_remat_offload_keeps_the_saved_layer_inputs_in_host_memory(mesh, problem):
    """With remat ``offload`` the prefetching forward loop saves each layer's input (what the
    backward recomputes from) in host memory, as the plain loop's policy does."""
    init, loss_fn, batches = problem
    tx = optax.sgd(0.5)
    batch = jax.device_put(batches[0], NamedSharding(mesh, P("data")))
    host = {}
    for remat in ("full", "offload"):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                            layers=zj.Layers(LAYERS, remat, prefetch=True))
        step = zj.make_train_step(plan, loss_fn, tx)
        jaxpr = jax.make_jaxpr(step)(zj.abstract_state(plan, tx), batch).jaxpr
        host[remat] = scan_outputs_in_host_memory(jaxpr)
    assert host["offload"][0] == 1 and host["full"][0] == 0


class Twice(nn.Module):
    """Block h_0 called twice, first and last (weights shared across layers, ALBERT style)."""

    @nn.compact
    def __call__(self, x):
        h, g = nn.Dense(64, name="h_0"), nn.Dense(64, name="h_1")
        return jnp.tanh(h(jnp.tanh(g(jnp.tanh(h(x)))))).sum() / x.shape[0]


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        x = x + nn.Dense(x.shape[-1])(x)
        return nn.Dropout(0.5, deterministic=False)(x), None


class Stack(nn.Module):
    """An nn.scan stack whose blocks draw random numbers (dropout, a key per layer)."""

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True,
                                                                        "dropout": True},
                        length=3)
        return stack(name="blocks")(x, None)[0].sum()


class Reversed(Scanned):
    def __call__(self, x):
        forward = nnx.scan(lambda block, x: block(x), in_axes=(0, nnx.Carry),
                           out_axes=nnx.Carry, reverse=True)
        return self.head(forward(self.blocks, x))


class CarryFirst(Scanned):
    """``nnx.scan``'s default order: the carry first, then the stack."""

    def __call__(self, x):
        forward = nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0),
                           out_axes=nnx.Carry)
        return self.head(forward(x, self.blocks))


class ModuleBeside(Scanned):
    """A module passed beside the carry and the stack."""

    def __call__(self, x):
        forward = nnx.scan(lambda x, head, block: block(x) + head(x),
                           in_axes=(nnx.Carry, None, 0), out_axes=nnx.Carry)
        return self.head(forward(x, self.head, self.blocks))


class BroadcastNNX(Scanned):
    """Broadcast arguments beside the carry and the stack: a context computed from a
    parameter outside the stack (its gradient is the sum of every layer's), an integer mask,
    and a per-layer scale scanned with the stack."""

    def __init__(self, rngs: nnx.Rngs, n: int = 4, dropout: float = 0.0):
        super().__init__(rngs, n, dropout)
        self.ctx = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        def layer(x, ctx, block, mask, scale):
            return jnp.where(mask, block(x) * ctx * scale, x)
        forward = nnx.scan(layer, in_axes=(nnx.Carry, None, 0, None, 0), out_axes=nnx.Carry)
        return self.head(forward(x, jnp.tanh(self.ctx(x)), self.blocks,
                                 jnp.arange(D) % 3 != 0, jnp.linspace(0.5, 1.0, 4)))


class CtxBlock(nn.Module):
    @nn.compact
    def __call__(self, x, ctx, scale, mask):
        return jnp.where(mask, x + nn.Dense(x.shape[-1])(x) * ctx * scale, x), None


class BroadcastLinen(nn.Module):
    """The linen counterpart: ``in_axes=(nn.broadcast, 0, nn.broadcast)``."""

    @nn.compact
    def __call__(self, x):
        ctx = jnp.tanh(nn.Dense(x.shape[-1], name="ctx")(x))
        stack = nn.scan(CtxBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast, 0, nn.broadcast), length=4)
        mask = jnp.arange(x.shape[-1]) % 3 != 0
        x = stack(name="blocks")(x, ctx, jnp.linspace(0.5, 1.0, 4), mask)[0]
        return nn.Dense(1, name="head")(x)


class CtxOnly(nn.Module):
    @nn.compact
    def __call__(self, x, ctx):
        return x + nn.Dense(x.shape[-1])(x) * ctx, None


class AllBroadcastLinen(nn.Module):
    """``in_axes=nn.broadcast``: one for all the arguments."""

    @nn.compact
    def __call__(self, x):
        ctx = jnp.tanh(nn.Dense(x.shape[-1], name="ctx")(x))
        stack = nn.scan(CtxOnly, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=nn.broadcast, length=4)
        return nn.Dense(1, name="head")(stack(name="blocks")(x, ctx)[0])


def broadcast_problem(kind: str):
    """(init, loss) of a scanned stack with broadcast arguments."""
    if kind == "nnx":
        return nnx_problem(BroadcastNNX)
    model = BroadcastLinen() if kind == "linen" else AllBroadcastLinen()
    init = lambda key: model.init(key, nnx_data(0)[0])["params"]
    return init, lambda p, b: jnp.mean((model.apply({"params": p}, b[0]) - b[1]) ** 2)


@pytest.mark.parametrize("kind", ["linen", "linen, one nn.broadcast", "nnx"])
def test_stacks_with_broadcast_arguments_prefetch(kind, mesh):
    """A stack scanned with broadcast arguments (a context computed from a parameter outside
    the stack, an integer mask) beside a scanned one, or given one ``nn.broadcast`` for all:
    prefetch runs its loop, every layer seeing the whole arguments. The gradient, the
    context's parameter's too (the sum of every layer's part), equals one device's and the
    plain stage-3 step's (SGD, 1e-5), and the compiled loops gather one layer ahead."""
    init, loss = broadcast_problem(kind)
    batch = nnx_data(0)
    ref = jax.jit(jax.grad(loss))(init(KEY), batch)  # one device's (op by op: slower)
    grads = {}
    for on in (False, True):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                            layers=zj.Layers("^blocks$", prefetch=on))
        params = zj.init_state(plan, init, optax.sgd(0.1), KEY).params
        put = jax.device_put(batch, NamedSharding(mesh, P("data")))
        fn = jax.jit(zj.make_grad_fn(plan, loss)).lower(params, put).compile()  # run, then read
        grads[on] = jax.device_get(fn(params, put)[1])
        assert max_rel(grads[on], ref) < 1e-5, (on, max_rel(grads[on], ref))
    assert max_rel(grads[True], grads[False]) < 1e-5
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads[True]["ctx"]))
    loops = gathered_ahead(fn.as_text())
    assert len(loops) == 2 and all(all(x) for x in loops.values()), loops


# Transforms made at import, before any step is traced: they hold Flax's lifted transform in
# their methods' closures.
RematDense = nn.remat(nn.Dense)
ScannedBlocks = nn.scan(CtxBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast, 0, nn.broadcast), length=4)


class Remade(nn.Module):
    late: bool = False  # the nn.remat class made while the loss runs instead

    @nn.compact
    def __call__(self, x):
        dense = nn.remat(nn.Dense) if self.late else RematDense
        for i in range(3):
            x = jnp.tanh(dense(64, name=f"h_{i}")(x))
        return jnp.mean(x)


class ImportScanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = jnp.arange(x.shape[-1]) % 3 != 0
        x = ScannedBlocks(name="blocks")(x, jnp.tanh(x), jnp.linspace(0.5, 1.0, 4), mask)[0]
        return jnp.mean(x)


class Vmapped(nn.Module):
    """Blocks under the model's own ``nn.vmap``: nothing computed inside may leave it."""

    @nn.compact
    def __call__(self, x):
        dense = nn.vmap(nn.Dense, variable_axes={"params": None},
                        split_rngs={"params": False})
        for i in range(3):
            x = jnp.tanh(dense(64, name=f"h_{i}")(x))
        return jnp.mean(x)


@pytest.mark.parametrize(("cls", "layers"), [(Remade, r"^h_\d$"), (ImportScanned, "^blocks$")],
                         ids=["nn.remat", "nn.scan"])
def test_transforms_made_at_import_prefetch(cls, layers, mesh):
    """An ``nn.remat`` class and an ``nn.scan`` stack made at import: prefetch runs them as
    those made while the loss runs (the block without the model's remat, recomputed once as
    the plan says; the stack as its own loop). The gradient equals one device's and the plain
    stage-3 step's (SGD, 1e-6); the stack's loops gather a layer ahead, and the blocks are
    gathered beside their neighbours as those of a class made while the loss runs are."""
    model, x = cls(), jax.random.normal(jax.random.key(3), (16, 64))
    init = lambda key: model.init(key, x)["params"]
    loss = lambda p, b: model.apply({"params": p}, b)
    ref = jax.jit(jax.grad(loss))(init(KEY), x)  # one device's (op by op: slower)
    batch, grads = jax.device_put(x, NamedSharding(mesh, P("data"))), {}
    for on in (False, True):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                            layers=zj.Layers(layers, prefetch=on))
        params = zj.init_state(plan, init, optax.sgd(0.1), KEY).params
        fn = jax.jit(zj.make_grad_fn(plan, loss)).lower(params, batch).compile()  # run, then read
        grads[on] = jax.device_get(fn(params, batch)[1])
        assert max_rel(grads[on], ref) < 1e-6, (on, max_rel(grads[on], ref))
    assert max_rel(grads[True], grads[False]) < 1e-6
    text = fn.as_text()
    if cls is Remade:
        late = jax.jit(zj.make_grad_fn(plan, lambda p, b: Remade(late=True).apply(
            {"params": p}, b))).lower(params, batch).compile().as_text()
        blocks = ["h_0", "h_1", "h_2"]
        beside = gathered_beside(text, blocks)
        assert beside == gathered_beside(late, blocks) and all(beside["forward"]), beside
    else:
        loops = gathered_ahead(text)
        assert len(loops) == 2 and all(all(x) for x in loops.values()), loops


def test_prefetch_refused_where_it_cannot_run(mesh):
    shapes = jax.eval_shape(init_fn(MODEL), KEY)
    on = lambda pattern: zj.Layers(pattern, prefetch=True)
    for stage in (0, 1, 2):  # nothing is gathered per layer
        with pytest.raises(ValueError, match="prefetch=True\\) overlaps stage 3's per-layer"):
            zj.make_plan(shapes, mesh, stage, layers=on(LAYERS))
    # Blocks under the model's own nn.vmap: nothing may leave that transform.
    model = Vmapped()
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    init = lambda key: model.init(key, jnp.zeros(x.shape))["params"]
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=on(r"h_\d+"))
    with pytest.raises(ValueError, match="inside a Flax transform of the model's own"):
        jax.eval_shape(zj.make_grad_fn(plan, lambda p, b: model.apply({"params": p}, b)),
                       zj.abstract_state(plan, optax.sgd(0.1)).params, x)
    # NNX stacks scanned in reverse, or beside a module: each named as it is.
    batch = (jax.ShapeDtypeStruct((32, 16), jnp.float32), jax.ShapeDtypeStruct((32, 1),
                                                                                jnp.float32))
    for cls, why in ((Reversed, "prefetch runs scans with"),
                     (ModuleBeside, "an argument besides the stack holds NNX modules")):
        init, loss = nnx_problem(cls)
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3, layers=on("^blocks$"))
        with pytest.raises(ValueError, match=f"NNX stack 'blocks': {why}"):
            jax.eval_shape(zj.make_grad_fn(plan, loss), zj.abstract_state(plan, optax.sgd(0.1))
                           .params, batch)


def test_no_block_ahead_where_one_device_holds_the_shards(mesh):
    """Cut over one device, stage 3 gathers nothing, and a block prefetched ahead only costs
    its loop's restructuring (the peeled layer's gradients concatenated into the stacks): the
    plan leaves it out there, on one device or with the data axis one device wide beside
    tensor parallelism; over more devices, and gathering by module, it stays."""
    shapes = jax.eval_shape(init_fn(MODEL), KEY)
    on = lambda gather: zj.Layers(LAYERS, prefetch=True, gather=gather)
    plan = lambda m, gather="block": zj.make_plan(shapes, m, 3, layers=on(gather))
    assert not plan(zj.make_mesh(1)).prefetch
    assert not plan(zj.make_mesh(2, axes={"data": 1, "model": 2})).prefetch
    assert plan(zj.make_mesh(1), "module").prefetch
    assert plan(mesh).prefetch and plan(zj.make_mesh(4, axes={"data": 2, "model": 2})).prefetch


class SharedBlocks(nnx.Module):
    """NNX: blocks/0 called twice, first and last. Its output is the mean of the last block's
    units: with their sum the loss rose from 12.6 to 488 in the test's three SGD steps, and
    XLA's fused multiply-adds alone moved the one-device parameters by 2.6e-5, more than the
    1e-5 the test holds the sharded run to. With the mean the loss falls (0.460 to 0.443), and
    prefetched against one device part by 1e-7, with or without them."""

    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        b0, b1 = self.blocks
        return jnp.tanh(b0(jnp.tanh(b1(jnp.tanh(b0(x)))))).mean(axis=-1, keepdims=True)


def twice_problem(kind: str):
    """(init, loss, batch, layers, block names) of a model calling its first block twice."""
    x = jax.random.normal(jax.random.key(1), (16, 64))
    if kind == "linen":
        model = Twice()
        return (lambda key: model.init(key, x)["params"],
                lambda p, b: model.apply({"params": p}, b), x, r"^h_\d$", ["h_0", "h_1"])
    init, loss = nnx_problem(SharedBlocks)
    return init, loss, (x, jnp.sin(x[:, :1])), r"^blocks/\d$", ["blocks/0", "blocks/1"]


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_a_block_called_twice_prefetches_as_it_runs_plainly(kind, mesh):
    """Blocks in the order 0, 1, 0: each call is handed the weights of the call after it,
    block 0's gathered twice and its two gradients summed (block 1's gather runs beside block
    0's first call, read from the program): 3 SGD steps equal the plain steps (to 1e-6: the two
    programs may fuse the loss's sum differently, 1 ulp apart) and one device's (the sum's
    scale: SGD shows it)."""
    init, loss, x, layers, names = twice_problem(kind)
    batch, tx, runs = jax.device_put(x, NamedSharding(mesh, P("data"))), optax.sgd(0.1), {}
    for on in (False, True):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                            layers=zj.Layers(layers, prefetch=on))
        state = zj.init_state(plan, init, tx, KEY)
        step = zj.make_train_step(plan, loss, tx).lower(state, batch).compile()
        # With prefetch block 1's gather is issued by block 0's call: it waits for none of
        # block 0's matmuls.
        assert gathered_beside(step.as_text(), names)["forward"] == [on]
        losses = []
        for _ in range(3):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        runs[on] = losses, jax.device_get(state.params)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-6)
    assert max_rel(runs[True][1], runs[False][1]) < 1e-6
    ref = optax_steps(loss, tx, init(KEY), [x] * 3)
    np.testing.assert_allclose(runs[True][0], ref["losses"], rtol=1e-5)
    assert max_rel(runs[True][1], ref["params"]) < 1e-5


PERSISTENT = [zj.Rule("", min_shard_elems=256)]  # norms and 128-wide biases: whole in a block


def token_batches(mesh, n: int = 3) -> list:
    """``n`` batches of random tokens for ``tests/regather.py``'s models, cut over ``data``."""
    return [jax.device_put(jax.random.randint(jax.random.key(i), regather.BATCH.shape, 0,
                                              regather.CFG.vocab_size),
                           NamedSharding(mesh, P("data"))) for i in range(n)]


def exact_steps(plan, init, loss, tx, batches, has_aux=False, split=False, **kwargs):
    """``plan``'s step compiled once and run from ``init`` over
    ``batches`` (``kwargs`` to each call): each step's metrics, the final parameters, the
    compiled step; with ``split``, also its temp split by kind (``peak.temp_split``)."""
    state = zj.init_state(plan, init, tx, KEY)
    lowered = zj.make_train_step(plan, loss, tx, has_aux=has_aux).lower(state, batches[0],
                                                                        **kwargs)
    compiled, found = peak.compile_with_peak(lowered) if split else (lowered.compile(), None)
    metrics = []
    for b in batches:
        state, m = compiled(state, b, **kwargs)
        metrics.append(jax.tree.map(float, m))
    out = metrics, jax.device_get(state.params), compiled
    return (*out, found["temp"]) if split else out


# Three unrolled or NNX blocks (``regather.problems(n_blocks=3)``): the middle one is both handed
# its weights by the block before and hands the block after its own, in the forward and the
# backward; a fourth adds one more pair of the same (with 4 these tests took ~25% more CPU).
DEPTH = 3
BLOCKS = {"unrolled": [f"h_{i}" for i in range(DEPTH)],
          "nnx": [f"blocks/{i}" for i in range(DEPTH)]}


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_unrolled_and_nnx_blocks_hand_the_next_block_its_weights(kind, mesh):
    """Three blocks built in a Python loop (linen) or held in a list (NNX): with prefetch each
    block's call gathers the next block's weights, the steps train bit-identically (SGD with
    buckets, AdamW per leaf; the layer norms whole, their gradients all-reduced in the
    blocks' buckets), and the compiled program gathers every block while the block before
    runs (in the backward: the block after), and holds at most one gathered block more at
    its fullest moment."""
    init, loss, layers = dict(regather.problems(n_blocks=DEPTH))[kind]
    batches = token_batches(mesh)
    shapes = jax.eval_shape(init, KEY)
    block = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        shapes["h_0"] if kind == "unrolled" else shapes["blocks"][0]))
    for opt, bucket_bytes in (("sgd", 25 << 20), ("adamw", 0)):
        tx, runs = OPTIMIZERS[opt](), {}
        for on in (False, True):
            plan = zj.make_plan(shapes, mesh, 3, layers=zj.Layers(layers, prefetch=on),
                                rules=PERSISTENT, comm=zj.Comm(bucket_bytes))
            runs[on] = exact_steps(plan, init, loss, tx, batches, split=True)
        assert runs[False][0] == runs[True][0]
        for a, b in zip(jax.tree.leaves(runs[False][1]), jax.tree.leaves(runs[True][1]),
                        strict=True):
            np.testing.assert_array_equal(a, b)
        text = runs[True][2].as_text()
        assert gathered_beside(text, BLOCKS[kind]) == {"forward": [True] * (DEPTH - 1),
                                                       "backward": [True] * (DEPTH - 1)}
        assert all(scheduled_ahead(text, BLOCKS[kind]))
        if kind == "unrolled":  # the plain program (its blocks named by linen) waits
            plain = runs[False][2].as_text()
            assert gathered_beside(plain, BLOCKS[kind]) == {"forward": [False] * (DEPTH - 1),
                                                            "backward": [False] * (DEPTH - 1)}
            assert not any(scheduled_ahead(plain, BLOCKS[kind]))
        # What the buffers live at the fullest moment hold; XLA's gaps between them come on
        # top (NNX with buckets: 0.30 MB with prefetch, none without).
        split = [runs[on][3] for on in (False, True)]
        assert split[0]["bytes"] == runs[False][2].memory_analysis().temp_size_in_bytes
        held = [s["bytes"] - s["between buffers"] for s in split]
        assert 0 < held[1] - held[0] <= block, (split, block)


@pytest.mark.parametrize("cls", [Scanned, CarryFirst], ids=["stack first", "carry first"])
def test_nnx_stack_prefetches_and_draws_as_nnx_scan(cls, mesh):
    """An NNX stack under ``nnx.scan`` (4 layers, dropout 0.5, its streams split per layer),
    passed before the carry or after it: prefetch runs its loop, each layer merged from its
    slice of the parameters and of the streams. 3 SGD steps equal the plain step's bit for bit
    (the masks are ``nnx.scan``'s own), the streams come back advanced as ``nnx.scan`` leaves
    them, and the compiled loops gather one layer ahead."""
    graphdef, _, rest = nnx.split(cls(nnx.Rngs(0), dropout=0.5), nnx.Param, ...)
    init = lambda key: nnx.state(cls(nnx.Rngs(key), dropout=0.5), nnx.Param)

    def loss_fn(params, batch, key):
        model = zj.nnx_merge(graphdef, params, rest)
        nnx.reseed(model, dropout=key)
        x, y = batch
        loss = jnp.mean((model(x) - y) ** 2)
        counts = [c.astype(jnp.float32) for c in jax.tree.leaves(nnx.state(model, nnx.RngCount))]
        return loss, {"draws": sum(c.sum() for c in counts)}

    tx, runs = optax.sgd(0.05), {}
    for on in (False, True):
        plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                            layers=zj.Layers("^blocks$", prefetch=on))
        batches = [jax.device_put(nnx_data(i), NamedSharding(mesh, P("data")))
                   for i in range(3)]
        runs[on] = exact_steps(plan, init, loss_fn, tx, batches, has_aux=True,
                               key=jax.random.key(1))
    assert runs[True][0] == runs[False][0] and runs[True][0][0]["draws"] > 0, (
        runs[True][0], runs[False][0])
    assert max_rel(runs[True][1], runs[False][1]) == 0
    loops = gathered_ahead(runs[True][2].as_text())
    assert len(loops) == 2 and all(all(x) for x in loops.values()), loops


def test_blocks_under_the_models_own_remat_prefetch_and_recompute_once(mesh):
    """Unrolled blocks each under the model's own ``nn.remat`` (made while the loss runs, as
    in ``setup``): prefetch runs them without it, recomputing each once as the plan's policy
    says. 3 SGD steps equal the plain step's bit for bit, the compiled FLOPs are the plain
    step's (which recomputes once too) to 1%, and every block's gather runs beside the block
    before (after, in the backward)."""
    init, loss, layers = dict(regather.problems("full", DEPTH))["unrolled"]
    shapes, tx, runs = jax.eval_shape(init, KEY), optax.sgd(0.1), {}
    for on in (False, True):
        plan = zj.make_plan(shapes, mesh, 3, layers=zj.Layers(layers, prefetch=on))
        runs[on] = exact_steps(plan, init, loss, tx, token_batches(mesh))
    assert runs[False][0] == runs[True][0]
    assert max_rel(runs[False][1], runs[True][1]) == 0
    flops = [runs[on][2].cost_analysis()["flops"] for on in (False, True)]
    assert abs(flops[1] / flops[0] - 1) < 0.01, flops
    assert gathered_beside(runs[True][2].as_text(), BLOCKS["unrolled"]) == {
        "forward": [True] * (DEPTH - 1), "backward": [True] * (DEPTH - 1)}


@pytest.mark.parametrize("kind, remat", [("scanned", "none"),
                                         ("unrolled", "dots"), ("nnx", "none")])
def test_prefetch_keeps_what_the_remat_policy_saves(kind, remat, mesh):
    """With remat ``dots`` or ``none`` prefetch's loops keep what the policy saves and
    recompute the rest, as the plain step's remat does, instead of recomputing each layer
    whole: 3 SGD steps equal the plain step's (bit for bit, but for the scanned stack under
    ``none``: 1e-7, XLA fusing its forward differently), at most one gathered block more temp
    (no block's weights kept whole through the step), and the compiled FLOPs: the plain step's
    for blocks (a whole recompute adds about a third); for a scanned stack, whose loops XLA's
    cost analysis counts once and prefetch runs layers outside, well below prefetch's with
    remat ``full``."""
    init, loss, layers = dict(regather.problems(n_blocks=DEPTH))[kind]
    if kind == "scanned":  # a stack without its own remat (as the demo's at stage 3)
        lm = LM(dataclasses.replace(SMALL, n_layers=8, remat="none"))
        init, loss = init_fn(lm), lm_loss(lm)
    shapes = jax.eval_shape(init, KEY)
    one = {"scanned": lambda p: p["blocks"], "unrolled": lambda p: p["h_0"],
           "nnx": lambda p: p["blocks"][0]}[kind]
    block = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one(shapes)))
    block //= 8 if kind == "scanned" else 1  # one layer of 8
    put = lambda b: jax.device_put(b, NamedSharding(mesh, P("data")))
    batches = [put(b) for b in lm_batches(lm.cfg, 3)] if kind == "scanned" else \
        token_batches(mesh)
    tx, runs = optax.sgd(0.1), {}
    plan = lambda on, remat: zj.make_plan(shapes, mesh, 3,
                                          layers=zj.Layers(layers, remat, prefetch=on))
    for on in (False, True):
        metrics, params, compiled = exact_steps(plan(on, remat), init, loss, tx, batches)
        runs[on] = ([m["loss"] for m in metrics], params, compiled.cost_analysis()["flops"],
                    compiled.memory_analysis().temp_size_in_bytes)
    (plain, plain_params, plain_flops, plain_temp), (ahead, params, flops, temp) = runs.values()
    np.testing.assert_allclose(ahead, plain, rtol=1e-6 if remat == "none" else 0)
    assert max_rel(params, plain_params) <= (1e-6 if kind == "scanned" and remat == "none"
                                             else 0)
    assert temp <= plain_temp + 2 * block, (temp, plain_temp, block)
    if kind == "scanned":
        full = zj.make_train_step(plan(True, "full"), loss, tx).lower(
            zj.abstract_state(plan(True, "full"), tx), batches[0]).compile()
        assert flops < 0.9 * full.cost_analysis()["flops"]
    else:
        assert plain_flops * 0.98 <= flops <= plain_flops * 1.02, (flops, plain_flops)


def test_prefetch_runs_a_stack_that_draws_dropout(mesh):
    """An ``nn.scan`` stack with dropout (rate 0.5 after each layer): prefetch's loops draw a
    key per layer from the stack's scope, and the backward recomputes each layer with the key
    its forward drew. The masks are not ``nn.scan``'s own (other draws, the same
    distribution), so the proof is the gradient's own: for the step's key, a random direction's
    central difference of the loss equals the gradient's projection on it (1e-3; other keys in
    the backward miss it by far more). (A named stack that prefetch does not run raises.)"""
    model = Stack()
    x = jax.random.normal(jax.random.key(3), (16, 64))
    init = lambda key: model.init({"params": key, "dropout": key}, x)["params"]
    loss = lambda p, batch, key: model.apply({"params": p}, batch, rngs={"dropout": key})
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                        layers=zj.Layers("^blocks$", prefetch=True))
    params = zj.init_state(plan, init, optax.sgd(0.1), KEY).params
    batch = jax.device_put(x, NamedSharding(mesh, P("data")))
    grad = jax.jit(lambda p, key: zj.make_grad_fn(plan, loss)(p, batch, key=key))
    key = jax.random.key(7)
    loss_at_key, g = grad(params, key)
    # The masks are drawn: another key, another loss; the same key, the same loss.
    assert float(grad(params, jax.random.key(8))[0]) != float(loss_at_key)
    assert float(grad(params, key)[0]) == float(loss_at_key)
    leaves, treedef = jax.tree.flatten(params)
    v = treedef.unflatten([jax.random.normal(jax.random.key(i), a.shape, a.dtype)
                           for i, a in enumerate(leaves)])
    at = lambda eps: float(grad(jax.tree.map(lambda a, b: a + eps * b, params, v), key)[0])
    central = (at(1e-3) - at(-1e-3)) / 2e-3
    projected = sum(float(jnp.vdot(a, b)) for a, b in zip(jax.tree.leaves(g),
                                                         jax.tree.leaves(v), strict=True))
    assert abs(central - projected) < 1e-3 * abs(projected), (central, projected)


@pytest.mark.parametrize("prefetch, accum, traces", [(False, 1, 1), (True, 1, 2), (False, 2, 2),
                                                     (True, 2, 2)])
def test_the_loss_is_traced_once_for_shapes_and_once_for_the_program(prefetch, accum, traces,
                                                                     mesh):
    """Building the step traces the user's loss once for the program, and once before it only
    where a later trace needs something of it (the microbatch loop's carry, prefetch's block
    order), once for both (before the block runtime: up to four times)."""
    # Two blocks: prefetch's block order needs a block after the first, no more.
    init, loss, layers = dict(regather.problems(n_blocks=2))["unrolled"]
    calls = []

    def counted(params, batch):
        calls.append(1)
        return loss(params, batch)
    tx = optax.sgd(0.1)
    plan = zj.make_plan(jax.eval_shape(init, KEY), mesh, 3,
                        layers=zj.Layers(layers, prefetch=prefetch))
    zj.make_train_step(plan, counted, tx, accum_steps=accum).lower(zj.abstract_state(plan, tx),
                                                                   regather.BATCH)
    assert len(calls) == traces
