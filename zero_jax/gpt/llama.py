"""A Llama-family decoder (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention,
the head untied or tied to the embedding, biases on q, k and v or an RMSNorm over each head's
q and k, or neither: Llama, Mistral and Phi-3 with their sliding windows, Qwen2, Qwen3; with
Gemma's norms, embedding scale and GELU gate, Gemma and Gemma 2 with its output norms and soft
caps; OLMoE, q and k normed over all heads at once, and OLMo 2 and 3, their outputs normed in
place of their inputs too; with LayerNorms, StableLM and Cohere, whose attention and MLP read
one norm side by side; GPT-OSS, with sinks in its attention's softmax and biased, clamped
experts) with Hugging Face's tensor names, its layers under ``nn.scan`` as ``blocks``.

Rotary positions rotate the two halves of each head (Hugging Face's ``rotate_half``), or its
pairs of columns side by side (``rope_interleaved``: Cohere's, Helium's, Ernie 4.5's, GLM's), so its
q and k projections are read as they are stored, with no permutation of their rows. Their
frequencies are scaled as Hugging Face's ``linear`` and ``llama3`` rope types scale them (Llama
3.1 and 3.2 use ``llama3``). Its config.json, read and written: ``llama_config``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero_jax.embedding import take_rows
from zero_jax.gpt import attention, moe
from zero_jax.gpt.llama_config import family_of
from zero_jax.gpt.model import GPTConfig, layer_stack
from zero_jax.gpt.moe import MoE
from zero_jax.plan import Rule
from zero_jax.weights import Mapping, Tensor

# Megatron's layout (zero_jax.gpt.model.TENSOR_PARALLEL's): attention by heads, the MLP's
# gate and up by columns and down by rows, the embedding by vocabulary, the head by its outputs
TENSOR_PARALLEL = (
    Rule(r"^blocks/(q|k|v)/kernel$", model_dim=-2),
    Rule(r"^blocks/o/kernel$", model_dim=-3),
    Rule(r"^blocks/(gate|up)/kernel$", model_dim=-1),
    Rule(r"^blocks/down/kernel$", model_dim=-2),
    Rule(r"^wte$", model_dim=0),
    Rule(r"^head/kernel$", model_dim=-1),
)


def tensor_parallel(c: GPTConfig) -> tuple[Rule, ...]:
    """``TENSOR_PARALLEL`` for the leaves ``c`` has: the q, k, v biases cut by heads as their
    kernels, the experts' as the MLP's where they are its, no head's rule where the head is
    the embedding's."""
    bias = (Rule(r"^blocks/(q|k|v)/bias$", model_dim=-2),) if c.qkv_bias else ()
    if c.gpt_oss:  # a sink per head, cut as the heads
        bias += (Rule(r"^blocks/sinks$", model_dim=-1),)
    mlp = TENSOR_PARALLEL[2:4]
    if c.n_experts:
        mlp = moe.BIASED_TENSOR_PARALLEL if c.gpt_oss else moe.TENSOR_PARALLEL
    return (*bias, *TENSOR_PARALLEL[:2], *mlp, TENSOR_PARALLEL[4],
            *(() if c.tie_head else TENSOR_PARALLEL[-1:]))


def rope_frequencies(c: GPTConfig, dh: int, t: int) -> jax.Array:
    """Each rotary pair's angular frequency at a sequence of ``t`` tokens, for heads whose
    first ``dh`` are rotated (``GPTConfig.rotary_dim``), as Hugging Face's rope type computes
    it: ``linear`` divides every one by ``rope_factor``; ``llama3`` only those whose wavelength
    is beyond the original context over ``rope_low_freq_factor``, keeps those below it over
    ``rope_high_freq_factor``, and blends the two between; ``longrope``
    (Phi-3) divides each by its own factor, ``rope_long_factor``'s for sequences longer than
    the original context, else ``rope_short_factor``'s; ``yarn`` divides those turning less
    than once in the original context by ``rope_factor``, keeps those turning over 32 times,
    and ramps between (from the pairs where it turns so often, whole ones where
    ``rope_truncate``)."""
    inv = 1.0 / c.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    if c.rope_type == "yarn":  # slow pairs divided by the factor, fast ones kept, a ramp between
        fast, slow = (dh * math.log(c.rope_original_max_positions / (turns * 2 * math.pi))
                      / (2 * math.log(c.rope_theta)) for turns in (32, 1))
        if c.rope_truncate:  # the ramp's ends at whole pairs (all but GPT-OSS's)
            fast, slow = math.floor(fast), math.ceil(slow)
        low, high = max(fast, 0), min(slow, dh - 1)
        ramp = jnp.clip((jnp.arange(dh // 2, dtype=jnp.float32) - low)
                        / ((high - low) or 0.001), 0, 1)
        return inv / c.rope_factor * ramp + inv * (1 - ramp)
    if c.rope_type == "longrope":
        long = t > c.rope_original_max_positions
        return inv / jnp.asarray(c.rope_long_factor if long else c.rope_short_factor,
                                 jnp.float32)
    if c.rope_type == "linear":
        return inv / c.rope_factor
    if c.rope_type == "llama3":
        old, low, high = c.rope_original_max_positions, c.rope_low_freq_factor, \
            c.rope_high_freq_factor
        wavelength = 2 * math.pi / inv
        smooth = (old / wavelength - low) / (high - low)
        blended = (1 - smooth) * inv / c.rope_factor + smooth * inv
        return jnp.where(wavelength > old / low, inv / c.rope_factor,
                         jnp.where(wavelength < old / high, inv, blended))
    return inv


def rope_scale(c: GPTConfig) -> float:
    """What ``longrope`` and ``yarn`` multiply the rotation's cosines and sines by (1 for the
    other types): ``rope_attention_factor``, or where it is 0, Hugging Face's default from the
    context's extension ``rope_factor``: sqrt(1 + ln(factor) / ln(original context)) and
    0.1 ln(factor) + 1."""
    if c.rope_type not in ("longrope", "yarn"):
        return 1.0
    if c.rope_attention_factor:
        return c.rope_attention_factor
    if c.rope_factor <= 1:
        return 1.0
    if c.rope_type == "yarn":
        return 0.1 * math.log(c.rope_factor) + 1
    return math.sqrt(1 + math.log(c.rope_factor) / math.log(c.rope_original_max_positions))


def rope(x: jax.Array, inv: jax.Array, scale: float = 1.0, interleaved: bool = False
         ) -> jax.Array:
    """Rotary positions on ``(batch, seq, heads, head_dim)`` at frequencies ``inv``, halves
    rotated as HF does (``interleaved``: each even column with the odd one after it, as
    Cohere's), cosines and sines times ``scale`` (``rope_scale``); only the first
    ``2 len(inv)`` of each head where that is less than its width (partial rotary)."""
    if 2 * inv.shape[0] < x.shape[-1]:
        rotated = rope(x[..., :2 * inv.shape[0]], inv, scale, interleaved)
        return jnp.concatenate([rotated, x[..., 2 * inv.shape[0]:]], -1)
    t, dh = x.shape[1], x.shape[-1]
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
    if interleaved:
        angles = jnp.repeat(angles, 2, -1)[None, :, None]
        pairs = x.reshape(*x.shape[:-1], dh // 2, 2)
        half = jnp.stack([-pairs[..., 1], pairs[..., 0]], -1).reshape(x.shape)
    else:
        angles = jnp.concatenate([angles, angles], -1)[None, :, None]
        half = jnp.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if not isinstance(scale, float) or scale != 1.0:  # traced: a layer's (window_pattern)
        cos, sin = cos * scale, sin * scale
    return (x * cos + half * sin).astype(x.dtype)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's ``silu(gate) * up``, computed in fp32 and rounded to the inputs' dtype (as
    PyTorch computes it in bf16). Its gradient is written out: under remat ``full`` XLA
    computed the autodiff's in bf16 over three fusions that wrote and read the MLP-wide
    tensors again (gpt2-124m's shape with d_ff 2048, one H100: 27 of the backward's 768-wide
    passes a layer, 21 now; under ``dots`` it fused them into one, as it fuses this)."""
    g = gate.astype(jnp.float32)
    return (nn.silu(g) * up.astype(jnp.float32)).astype(jnp.result_type(gate, up))


def _swiglu_fwd(gate: jax.Array, up: jax.Array):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """sigmoid through tanh, not the forward's logistic: XLA computes one shared by two
    fusions once and writes it to HBM."""
    gate, up = res
    g, u, d = (a.astype(jnp.float32) for a in (gate, up, dh))
    s = 0.5 * (1 + jnp.tanh(0.5 * g))
    return (d * u * s * (1 + g * (1 - s))).astype(gate.dtype), (d * g * s).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def clamped_glu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """GPT-OSS's experts' GLU: the gate clamped above at ``limit``, the up projection within
    ``±limit``, ``(up + 1) * gate * sigmoid(1.702 gate)``; in fp32, rounded to the inputs'
    dtype, as ``swiglu``."""
    g = jnp.minimum(gate.astype(jnp.float32), limit)
    u = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return ((u + 1) * g * jax.nn.sigmoid(1.702 * g)).astype(jnp.result_type(gate, up))


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm: in fp32, scaled by ``1 + scale`` (its weights are stored so, zero at
    init), then cast back, as transformers computes it."""

    epsilon: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return (y * (1 + scale.astype(jnp.float32))).astype(x.dtype)


def norm(c: GPTConfig, name: str) -> nn.Module:
    if c.layer_norm:  # StableLM's (1), Cohere's without biases (2)
        return nn.LayerNorm(epsilon=c.norm_eps, use_bias=c.layer_norm == 1, name=name)
    return (GemmaNorm if c.gemma else nn.RMSNorm)(epsilon=c.norm_eps, name=name)


class LlamaBlock(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, sliding: jax.Array | None,
                 rotary: jax.Array | None) -> tuple[jax.Array, None]:
        """``sliding``: whether this layer's attention slides (``window_pattern``'s layers; None:
        every layer alike); ``rotary``: whether its q and k rotate (``nope_every``'s layers do
        not; None: every layer's do)."""
        c = self.cfg
        b, t, d = x.shape
        dh = c.dh
        dense = lambda features, name, bias=False, **kw: nn.DenseGeneral(
            features, use_bias=bias, name=name, **kw)
        # Gemma 2's outputs' norms beside the inputs', OLMo 2's and 3's in their place
        after = lambda y, name: norm(c, name)(y) if c.gemma == 2 or c.olmo == 2 \
            or c.output_norms else y
        before = lambda y, name: y if c.olmo == 2 else norm(c, name)(y)
        h = before(x, "ln1")
        inv, scale = rope_frequencies(c, c.rotary_dim, t), rope_scale(c)
        if sliding is not None and c.rope_local_theta:  # the sliding layers' own base
            local = dataclasses.replace(c, rope_theta=c.rope_local_theta, rope_type="default")
            inv = jnp.where(sliding, rope_frequencies(local, c.rotary_dim, t), inv)
            scale = jnp.where(sliding, 1.0, scale) if scale != 1.0 else scale
        q, k = dense((c.n_heads, dh), "q", c.qkv_bias)(h), dense((c.kv_heads, dh), "k",
                                                                  c.qkv_bias)(h)
        if c.qk_norm and c.olmo:  # over all heads at once, a scale per column (OLMo's)
            q, k = (norm(c, n)(y.reshape(b, t, -1)).reshape(y.shape)
                    for y, n in ((q, "q_norm"), (k, "k_norm")))
        elif c.qk_norm and c.layer_norm:  # each head's own scale (Command R+'s, StableLM 2's)
            q, k = (nn.LayerNorm(epsilon=c.norm_eps, use_bias=False, feature_axes=(-2, -1),
                                 name=n)(y) for y, n in ((q, "q_norm"), (k, "k_norm")))
        elif c.qk_norm:  # over each head's width, the one scale shared by the heads
            q, k = norm(c, "q_norm")(q), norm(c, "k_norm")(k)
        rotate = functools.partial(rope, inv=inv, scale=scale, interleaved=c.rope_interleaved)
        if rotary is None:
            q, k = rotate(q), rotate(k)
        else:
            q, k = (jnp.where(rotary, rotate(y), y) for y in (q, k))
        v = dense((c.kv_heads, dh), "v", c.qkv_bias)(h)
        sinks = self.param("sinks", nn.initializers.zeros, (c.n_heads,)) if c.gpt_oss else None
        # query head i reads kv head i // rep
        attend = lambda window: attention.causal(  # noqa: E731
            q, k, v, c.attention, window,
            c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar else None, c.attn_softcap,
            sinks)
        att = attend(c.sliding_window) if sliding is None else jax.lax.cond(
            sliding, lambda: attend(c.sliding_window), lambda: attend(0))
        residual = lambda y: y if c.residual_multiplier == 1 else c.residual_multiplier * y
        x = x + residual(after(dense(d, "o", c.gpt_oss, axis=(-2, -1))(att), "post_attn"))
        # the MLP reads the attention's input through its norm (Cohere's), or the sum's own
        h = h if c.parallel_residual else before(x, "ln2")
        if c.n_experts:  # the routing's statistics out as the layer loop's, where they count
            gated = functools.partial(clamped_glu, limit=c.swiglu_limit) if c.gpt_oss \
                else swiglu
            y, stats = MoE(c.n_experts, c.experts_per_token, c.expert_d_ff or c.d_ff,
                           c.moe_norm_topk, gated, c.shared_expert_d_ff,
                           c.expert_capacity_factor, c.gpt_oss, name="moe")(h)
            return x + residual(after(y, "post_mlp")), stats if c.router_losses else None
        gate, up = dense(c.d_ff, "gate")(h), dense(c.d_ff, "up")(h)
        mid = nn.gelu(gate, approximate=True) * up if c.gemma else swiglu(gate, up)
        return x + residual(after(dense(d, "down")(mid), "post_mlp")), None


class Head(nn.Module):
    """The output head's kernel ``(d_model, padded_vocab)``, as ``nn.Dense`` names and
    initializes it; its matmul is the loss's (``zero_jax.losses.cross_entropy``). With
    ``bias`` (Phi's), its bias is one more row of it, which the loss's matmul adds against a
    feature of ones the hidden states end with: no other loss needed."""

    features: int
    bias: bool = False

    @nn.compact
    def __call__(self, d: int) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (d, self.features))
        if not self.bias:
            return kernel
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        return jnp.concatenate([kernel, bias[None].astype(kernel.dtype)])


class Llama(nn.Module):
    """The demo's model when ``cfg.arch`` is "llama" (``d_ff``: the SwiGLU's hidden width)."""

    cfg: GPTConfig

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """The logits over the vocabulary (its padding left out)."""
        x, head = self.features(tokens)
        logits, cap = (x @ head)[..., :self.cfg.vocab_size], self.cfg.logit_softcap
        return cap * jnp.tanh(logits / cap) if cap else logits

    @nn.compact
    def features(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The last hidden states and the head's kernel (``GPT.features``)."""
        c = self.cfg
        wte = self.param("wte", nn.initializers.normal(0.02), (c.padded_vocab, c.d_model))
        stack = layer_stack(LlamaBlock, c, wte.dtype)
        x = take_rows(wte, tokens)
        if c.gemma:  # in the compute dtype, as transformers rounds the factor
            x = x * jnp.asarray(math.sqrt(c.d_model), x.dtype)
        if c.embedding_multiplier != 1:  # Granite's
            x = x * c.embedding_multiplier
        sliding = None  # the layers whose window slides, where not all
        if c.window_pattern and c.sliding_window:
            sliding = (jnp.arange(c.n_layers) + 1) % c.window_pattern != 0
        # the layers whose q and k rotate, where not all (SmolLM3's NoPE layers do not)
        rotary = (jnp.arange(c.n_layers) + 1) % c.nope_every != 0 if c.nope_every else None
        x, stats = stack(c, name="blocks")(x, sliding, rotary)
        if stats is not None:  # for a loss that applies with mutable=["losses"] (lm_loss)
            balance, z = stats
            if c.router_aux_loss_coef:
                self.sow("losses", "balance_loss", moe.balance_loss(
                    balance, tokens.size, c.router_aux_loss_global))
            if c.router_z_loss_coef:  # over every layer's tokens, as transformers' Switch
                self.sow("losses", "router_z_loss", z.sum() / (c.n_layers * tokens.size))
        x = norm(c, "ln_f")(x)
        if c.logits_scaling != 1:  # Granite's: the logits divided, through the head's matmul
            x = x / c.logits_scaling
        return x, wte.T if c.tie_head else Head(c.padded_vocab, name="head")(c.d_model)


def mapping(c: GPTConfig) -> Mapping:
    """Hugging Face's ``LlamaForCausalLM`` tensors: PyTorch Linear weights ``(out, in)``,
    transposed into Flax kernels, the attention's output axis split into heads; a tied head
    has no tensor of its own (one written anyway is ignored)."""
    h = "model.layers.{layer}."
    head = [] if c.tie_head else [Tensor("lm_head.weight", "head/kernel", transpose=(1, 0),
                                         pad=(1, c.vocab_size))]
    # Gemma 2's post_attention_layernorm is the attention output's, its MLP's input's
    # pre_feedforward_layernorm; Llama's post_attention_layernorm is the MLP input's; OLMo 2
    # norms the outputs alone
    outputs = {"post_attn": "post_attention", "post_mlp": "post_feedforward"}
    norms = {"ln2": "pre_feedforward", **outputs} if c.gemma == 2 else outputs if c.olmo == 2 \
        else {} if c.parallel_residual else {"ln2": "post_attention"}  # Cohere: one norm
    if c.output_norms:  # GLM-4's: the outputs' beside Llama's
        norms = {**norms, "post_attn": "post_self_attn", "post_mlp": "post_mlp"}
    inputs = [] if c.olmo == 2 else [Tensor(h + "input_layernorm.weight", "blocks/ln1/scale")]
    rows = [Tensor("model.embed_tokens.weight", "wte", pad=(0, c.vocab_size)),
            Tensor("model.norm.weight", "ln_f/scale"), *head, *inputs,
            *(Tensor(f"{h}{theirs}_layernorm.weight", f"blocks/{ours}/scale")
              for ours, theirs in norms.items()),
            Tensor(h + "self_attn.o_proj.weight", "blocks/o/kernel", transpose=(1, 0),
                   split=(0, (c.n_heads, -1)))]
    if c.gpt_oss:  # the output's bias, the sinks
        rows += [Tensor(h + "self_attn.o_proj.bias", "blocks/o/bias"),
                 Tensor(h + "self_attn.sinks", "blocks/sinks")]
    for name, heads in [("q", c.n_heads), ("k", c.kv_heads), ("v", c.kv_heads)]:
        rows.append(Tensor(f"{h}self_attn.{name}_proj.weight", f"blocks/{name}/kernel",
                           transpose=(1, 0), split=(1, (heads, -1))))
        if c.qkv_bias:
            rows.append(Tensor(f"{h}self_attn.{name}_proj.bias", f"blocks/{name}/bias",
                               split=(0, (heads, -1))))
    if c.qk_norm and c.layer_norm == 1:  # StableLM 2's: a LayerNorm module per head
        rows += [Tensor(tuple(f"{h}self_attn.{n}_layernorm.norms.{i}.weight"
                              for i in range(heads)), f"blocks/{n}_norm/scale")
                 for n, heads in (("q", c.n_heads), ("k", c.kv_heads))]
    elif c.qk_norm:
        rows += [Tensor(f"{h}self_attn.{n}_norm.weight", f"blocks/{n}_norm/scale")
                 for n in ("q", "k")]
    if c.n_experts:
        rows += moe.rows(family_of(c), c.n_experts, h, bool(c.shared_expert_d_ff),
                         c.expert_d_ff or c.d_ff)
    for name in ("gate", "up", "down") if not c.n_experts else ():
        rows.append(Tensor(f"{h}mlp.{name}_proj.weight", f"blocks/{name}/kernel",
                           transpose=(1, 0)))
    if c.layer_norm == 1:  # each norm's bias beside its weight (none on q and k's)
        rows += [Tensor(t.name.replace(".weight", ".bias"), t.path.replace("/scale", "/bias"))
                 for t in rows if t.path.endswith("/scale") and "_norm/" not in t.path]
    tied = (r"^lm_head\.weight$",) if c.tie_head else ()
    return Mapping(tuple(rows), ignore=(r"rotary_emb\.inv_freq$", *tied))


def text_mapping(text: Mapping) -> Mapping:
    """An image-text Gemma 3's text model (``language_model.`` before Gemma3ForCausalLM's
    names), its vision tower and projector left unread: written back as that text model."""
    return dataclasses.replace(text, prefix="language_model.", ignore=(
        *text.ignore, r"^vision_tower\.", r"^multi_modal_projector\.",
        r"^language_model\.lm_head\.weight$"))


def phi3_mapping(c: GPTConfig, qkv: bool = True) -> Mapping:
    """Hugging Face's ``Phi3ForCausalLM`` tensors: Llama's, but for q, k and v in one
    ``qkv_proj`` and the gate and up projections in one ``gate_up_proj``, each parameter
    taking its rows (and an export writing it there); without ``qkv``, GLM's (its q, k and v
    apart). A trained Phi-3 is written back as the Llama it computes as, unless its heads
    rotate in part (``llama_config.write_config``)."""
    h = "model.layers.{layer}."
    fused = {"q": (0, c.n_heads), "k": (c.n_heads, c.kv_heads),
             "v": (c.n_heads + c.kv_heads, c.kv_heads)} if qkv else {}
    llama = mapping(c)
    taken = {f"blocks/{n}/kernel" for n in (*fused, "gate", "up")}
    rows = [t for t in llama.tensors if t.path not in taken]
    for name, (first, heads) in fused.items():
        rows.append(Tensor(f"{h}self_attn.qkv_proj.weight", f"blocks/{name}/kernel",
                           take=(0, first * c.dh, (first + heads) * c.dh), transpose=(1, 0),
                           split=(1, (heads, -1))))
    for name, first in (("gate", 0), ("up", c.d_ff)):
        rows.append(Tensor(f"{h}mlp.gate_up_proj.weight", f"blocks/{name}/kernel",
                           take=(0, first, first + c.d_ff), transpose=(1, 0)))
    return Mapping(tuple(rows), ignore=llama.ignore)
