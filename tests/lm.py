"""The suite's own small language model, so that the library's tests do not lean on the GPT
demo (``zero_jax.gpt``), which is a user of the library and may change as an application does.

A pre-norm transformer whose layers are stacked with ``nn.scan`` under the name ``blocks``.
Its default shapes exercise ZeRO's rules: a vocabulary of 250 and 12 positions do not divide
by 8 (the embeddings are cut along the model dimension instead), the MLP's bias of 100 does not
divide at all (it stays whole), and the layer norms are small enough to be persistent.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import sysconfig

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name

from zero_jax.blocks import BLOCK_INPUT, remat_policy
from zero_jax.plan import modules_pattern

LAYERS = modules_pattern(["blocks"])  # the plan's ``layers``: the scanned stack, layer by layer


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 250
    d_model: int = 40
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 100
    seq_len: int = 12
    remat: str = "full"  # what each layer keeps for its backward ("none": the plan decides)
    unroll: int = 1  # layers per iteration of nn.scan's loop


SMALL = LMConfig()


class Layer(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, _):
        c = self.cfg
        x_BxTxD = checkpoint_name(x_BxTxD, BLOCK_INPUT)  # what remat "offload" moves to host
        # GPT-2's initialization: small weights, the residual branches' outputs smaller still.
        dense = lambda name, *shape, std=0.02: nn.DenseGeneral(
            shape, kernel_init=nn.initializers.normal(std), name=name)
        out_std = 0.02 / (2 * c.n_layers) ** 0.5
        qkv = dense("qkv", 3, c.n_heads, c.d_model // c.n_heads)(nn.LayerNorm(name="ln1")(x_BxTxD))
        causal = nn.make_causal_mask(jnp.ones(x_BxTxD.shape[:2]))
        att_BxTxHxK = nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                               mask=causal)
        x_BxTxD += dense("proj", c.d_model, std=out_std)(att_BxTxHxK.reshape(x_BxTxD.shape))
        h_BxTxF = nn.gelu(dense("fc1", c.d_ff)(nn.LayerNorm(name="ln2")(x_BxTxD)))
        return x_BxTxD + dense("fc2", c.d_model, std=out_std)(h_BxTxF), None


class LM(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        c = self.cfg
        embed = nn.initializers.normal(0.02)
        wte = self.param("wte", embed, (c.vocab_size, c.d_model))
        wpe = self.param("wpe", embed, (c.seq_len, c.d_model))
        layer = Layer if c.remat == "none" else nn.remat(
            Layer, prevent_cse=False, policy=remat_policy(c.remat))
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=c.n_layers, unroll=c.unroll)
        x_BxTxD, _ = stack(c, name="blocks")(wte[tokens_BxT] + wpe[: tokens_BxT.shape[1]], None)
        return nn.LayerNorm(name="ln_f")(x_BxTxD) @ wte.T  # the head tied to the embedding


def init_fn(model: LM):
    return lambda key: model.init(key, jnp.zeros((1, model.cfg.seq_len), jnp.int32))["params"]


def lm_loss(model: LM):
    """Mean next-token cross-entropy of a ``(batch, seq_len + 1)`` block of token ids."""
    def loss_fn(params, tokens_BxT1: jax.Array) -> jax.Array:
        logits_BxTxV = model.apply({"params": params}, tokens_BxT1[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits_BxTxV.astype(jnp.float32), tokens_BxT1[:, 1:]).mean()
    return loss_fn


def corpus(vocab_size: int, limit: int = 1 << 18) -> np.ndarray:
    """Token ids with structure to learn: the first ``limit`` bytes of the Python standard
    library's top-level modules (sorted by name), within the vocabulary."""
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = b"".join(itertools.islice((f.read_bytes() for f in files), 64))[:limit]
    return np.frombuffer(text, np.uint8) % vocab_size


def batches(cfg: LMConfig, count: int, batch_size: int = 16, seed: int = 0) -> list[np.ndarray]:
    """``count`` batches of ``(batch_size, seq_len + 1)`` windows; batch ``i`` at positions
    drawn from ``(seed, i)``."""
    tokens = corpus(cfg.vocab_size)
    out = []
    for i in range(count):
        starts = np.random.default_rng([seed, i]).integers(0, len(tokens) - cfg.seq_len - 1,
                                                           size=batch_size)
        out.append(np.stack([tokens[s: s + cfg.seq_len + 1] for s in starts]).astype(np.int32))
    return out
