"""Stage 2 and 3 of three kinds of blocks, compiled in a process where nobody set an XLA flag
that names an HLO pass (only the device count and the suite's compile-speed flags,
tests/flags.py: the same gathers, bytes within 200 of the default's): prints, per kind, JSON
of each stage's arguments + temp bytes and weight all-gathers per step, and the report's
warnings (``test_blocks``).

``python tests/regather.py --h100 DIR`` (with jax's CUDA plugin, no GPU needed) writes the
unrolled model's stage 3 step compiled for 8 H100s instead, without and with prefetch, as
``tests/data`` holds them.
"""

import dataclasses
import json
import os
import sys

if __name__ == "__main__":  # before zero_jax and jax start
    from flags import FAST_COMPILE  # 23 -> 14 s; not for the H100 program (the level is LLVM's)
    fast = "" if sys.argv[1:2] == ["--h100"] else FAST_COMPILE
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {fast}".strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import (
    remat_policy,  # noqa: E402
    report,  # noqa: E402
)
from zero_jax.gpt.model import GPT, Block, GPTConfig, init_fn, lm_loss  # noqa: E402
from zero_jax.hlo import collectives  # noqa: E402

CFG = GPTConfig(n_layers=4, d_model=128, d_ff=512, n_heads=4, seq_len=32)
BATCH = jax.ShapeDtypeStruct((16, CFG.seq_len + 1), jnp.int32)
# The unrolled and NNX models' blocks measured in the process (3: one block between two; 4 took
# 37 s of CPU against 29, stage 3 at 0.44x stage 2 against 0.51).
MEASURED = 3


class Unrolled(nn.Module):
    """The default model's blocks in a Python loop, as published Flax models are written;
    ``remat``: each block under the model's own ``nn.remat`` with that policy."""

    remat: str | None = None
    n_blocks: int = CFG.n_layers

    @nn.compact
    def __call__(self, tokens):
        wte = self.param("wte", nn.initializers.normal(0.02), (CFG.vocab_size, CFG.d_model))
        x = wte[tokens]
        block = Block if self.remat is None else nn.remat(Block, policy=remat_policy(self.remat))
        for i in range(self.n_blocks):
            x, _ = block(CFG, name=f"h_{i}")(x, None)
        return nn.LayerNorm(name="ln_f")(x) @ wte.T


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(CFG.d_model, rngs=rngs)
        self.up = nnx.Linear(CFG.d_model, CFG.d_ff, rngs=rngs)
        self.down = nnx.Linear(CFG.d_ff, CFG.d_model, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.ln(x))))


class NNXListed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, n_blocks: int = CFG.n_layers):
        self.embed = nnx.Embed(CFG.vocab_size, CFG.d_model, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(n_blocks)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(x)


def ce(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def problems(remat: str | None = None, n_blocks: int = CFG.n_layers):
    """(init, loss, layers) per kind of block; ``remat``: the unrolled model's; ``n_blocks``:
    the unrolled and the NNX model's."""
    unrolled = Unrolled(remat, n_blocks)
    gpt = GPT(dataclasses.replace(CFG, n_layers=8))  # a scan compiles once whatever its length
    graphdef, _ = nnx.split(NNXListed(nnx.Rngs(0), n_blocks))
    yield "unrolled", (lambda k: unrolled.init(k, jnp.zeros((1, CFG.seq_len), jnp.int32))[
        "params"], lambda p, t: ce(unrolled.apply({"params": p}, t[:, :-1]), t), r"h_\d+")
    yield "nnx", (lambda k: nnx.state(NNXListed(nnx.Rngs(k), n_blocks)),
                  lambda p, t: ce(zj.nnx_merge(graphdef, p)(t[:, :-1]), t), r"blocks/\d+")
    yield "scanned", (init_fn(gpt), lm_loss(gpt), "blocks")


def measure(init, loss, layers, stage, options=None):
    tx = optax.adamw(1e-3)
    plan = zj.make_plan(jax.eval_shape(init, jax.random.key(0)), zj.make_mesh(), stage,
                        layers=layers)
    state = zj.abstract_state(plan, tx)
    lowered = zj.make_train_step(plan, loss, tx).lower(state, BATCH)
    compiled = lowered.compile(options)
    memory = compiled.memory_analysis()
    r = report.build(plan, state, lowered, compiled)
    # A block's weights: its two largest leaves' bytes and more (the embedding is gathered once).
    gathers = sum(c.count for c in collectives(compiled.as_text(), 8)
                  if c.kind == "all-gather" and c.bytes >= 4 * CFG.d_model * CFG.d_ff)
    return {"bytes": memory.argument_size_in_bytes + memory.temp_size_in_bytes,
            "weight_gathers": gathers, "warnings": r["warnings"]}


def save_h100(directory: str) -> None:
    import gzip

    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import gpu

    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x8",
                                            target_config=gpu.TARGETS["h100"])
    mesh = Mesh(np.array(topology.devices), ("data",), axis_types=(AxisType.Auto,))
    init, loss, layers = dict(problems())["unrolled"]
    tx = optax.adamw(1e-3)
    for name, prefetch in [("", False), ("-prefetch", True)]:
        plan = zj.make_plan(jax.eval_shape(init, jax.random.key(0)), mesh, 3,
                            layers=zj.Layers(layers, prefetch=prefetch))
        step = zj.make_train_step(plan, loss, tx)
        text = step.lower(zj.abstract_state(plan, tx), BATCH).compile().as_text()
        with gzip.open(os.path.join(directory, f"unrolled-stage-3{name}-h100.hlo.gz"),
                       "wt") as f:
            f.write(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--h100"]:
        os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
        jax.config.update("jax_platforms", "cpu")
        save_h100(sys.argv[2])
        sys.exit()
    out = {}
    for kind, (init, loss, layers) in problems(n_blocks=MEASURED):
        out[kind] = {stage: measure(init, loss, layers, stage) for stage in (2, 3)}
    # The unrolled model's step with the CPU compiler's barrier pass back on: what the step
    # would do without zero_jax's own option, and what the report then says.
    out["merged"] = measure(*dict(problems(n_blocks=MEASURED))["unrolled"], 3,
                            {"xla_disable_hlo_passes": ""})
    json.dump(out, sys.stdout)
