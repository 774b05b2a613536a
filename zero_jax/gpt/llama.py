"""A Llama-family decoder (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention,
the head untied or tied to the embedding, biases on q, k and v or an RMSNorm over each head's
q and k, or neither: Llama, Mistral and Phi-3 with their sliding windows, Qwen2, Qwen3; with
Gemma's norms, embedding scale and GELU gate, Gemma and Gemma 2 with its output norms and soft
caps) with Hugging Face's tensor names, its layers under ``nn.scan`` as ``blocks``.

Rotary positions rotate the two halves of each head (Hugging Face's ``rotate_half``), so its
q and k projections are read as they are stored, with no permutation of their rows. Their
frequencies are scaled as Hugging Face's ``linear`` and ``llama3`` rope types scale them (Llama
3.1 and 3.2 use ``llama3``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero_jax.blocks import remat_policy
from zero_jax.embedding import take_rows
from zero_jax.gpt import attention, moe
from zero_jax.gpt.model import GPTConfig, block_remat
from zero_jax.gpt.moe import MoE
from zero_jax.plan import Rule
from zero_jax.tensorfiles import WeightsError
from zero_jax.weights import Mapping, Tensor

HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "d_model",
           "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "num_key_value_heads": "n_kv_heads", "intermediate_size": "d_ff",
           "max_position_embeddings": "seq_len", "rms_norm_eps": "norm_eps"}
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
# The families whose decoder this is, by config.json's model_type, and what each must say for
# this model to compute it (anything else is refused): the Qwens without their sliding
# windows; Qwen2 with biases on q, k and v (``qkv_bias``), Qwen3 with q and k normed
# (``qk_norm``); Mistral and Phi-3 with a window or none (``sliding_window``), Phi-3 with
# its q, k, v and its gate and up projections fused in two tensors, without dropout, rotating
# whole heads or a share of each (``partial_rotary_factor``, Phi-4-mini's).
FAMILIES = {"llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
            "mistral": {"hidden_act": "silu"},
            "phi3": {"hidden_act": "silu", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                     "attention_dropout": 0.0},
            "qwen2": {"hidden_act": "silu", "use_sliding_window": False},
            "qwen3": {"hidden_act": "silu", "attention_bias": False,
                      "use_sliding_window": False},
            "gemma": {"hidden_act": "gelu_pytorch_tanh", "attention_bias": False,
                      "use_bidirectional_attention": None},
            "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                       "use_bidirectional_attention": None},
            "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                            "use_bidirectional_attention": None},
            "mixtral": {"hidden_act": "silu", "router_jitter_noise": 0.0},
            "qwen2_moe": {"hidden_act": "silu", "qkv_bias": True, "use_sliding_window": False,
                          "decoder_sparse_step": 1, "mlp_only_layers": []},
            "qwen3_moe": {"hidden_act": "silu", "attention_bias": False,
                          "use_sliding_window": False, "decoder_sparse_step": 1,
                          "mlp_only_layers": []}}
# Gemma 3's text keys at transformers' defaults: the text_config of its image-text models on
# the Hub (4B and up) holds only those that differ
GEMMA3_TEXT = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
               "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
               "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "tie_word_embeddings": True}
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# yarn as the Qwens use it: these of its keys at transformers' defaults (DeepSeek's mscale not)
YARN_FIXED = {"beta_fast": 32, "beta_slow": 1, "mscale": None, "mscale_all_dim": None,
              "truncate": True}
# The training window a directory's model starts with, where its declared context is longer
# (Hugging Face's run_clm picks its block size so): Llama 3.2 declares 131,072 tokens.
WINDOW = 1024
# config.json's rope scaling keys -> the demo's model section
ROPE_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
             "high_freq_factor": "rope_high_freq_factor",
             "original_max_position_embeddings": "rope_original_max_positions"}


def tensor_parallel(c: GPTConfig) -> tuple[Rule, ...]:
    """``TENSOR_PARALLEL`` for the leaves ``c`` has: the q, k, v biases cut by heads as their
    kernels, the experts' as the MLP's where they are its, no head's rule where the head is
    the embedding's."""
    bias = (Rule(r"^blocks/(q|k|v)/bias$", model_dim=-2),) if c.qkv_bias else ()
    mlp = moe.TENSOR_PARALLEL if c.n_experts else TENSOR_PARALLEL[2:4]
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
    and ramps between."""
    inv = 1.0 / c.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    if c.rope_type == "yarn":  # slow pairs divided by the factor, fast ones kept, a ramp between
        fast, slow = (dh * math.log(c.rope_original_max_positions / (turns * 2 * math.pi))
                      / (2 * math.log(c.rope_theta)) for turns in (32, 1))
        low, high = max(math.floor(fast), 0), min(math.ceil(slow), dh - 1)
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


def rope(x: jax.Array, inv: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotary positions on ``(batch, seq, heads, head_dim)`` at frequencies ``inv``, halves
    rotated as HF does, cosines and sines times ``scale`` (``rope_scale``); only the first
    ``2 len(inv)`` of each head where that is less than its width (partial rotary)."""
    if 2 * inv.shape[0] < x.shape[-1]:
        rotated = rope(x[..., :2 * inv.shape[0]], inv, scale)
        return jnp.concatenate([rotated, x[..., 2 * inv.shape[0]:]], -1)
    t, dh = x.shape[1], x.shape[-1]
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
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
    return (GemmaNorm if c.gemma else nn.RMSNorm)(epsilon=c.norm_eps, name=name)


class LlamaBlock(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, sliding: jax.Array | None) -> tuple[jax.Array, None]:
        """``sliding``: whether this layer's attention slides (``window_pattern``'s layers; None:
        every layer alike)."""
        c = self.cfg
        b, t, d = x.shape
        dh = c.dh
        dense = lambda features, name, bias=False, **kw: nn.DenseGeneral(
            features, use_bias=bias, name=name, **kw)
        after = lambda y, name: norm(c, name)(y) if c.gemma == 2 else y  # Gemma 2's outputs'
        h = norm(c, "ln1")(x)
        inv, scale = rope_frequencies(c, c.rotary_dim, t), rope_scale(c)
        if sliding is not None and c.rope_local_theta:  # the sliding layers' own base
            local = dataclasses.replace(c, rope_theta=c.rope_local_theta, rope_type="default")
            inv = jnp.where(sliding, rope_frequencies(local, c.rotary_dim, t), inv)
            scale = jnp.where(sliding, 1.0, scale) if scale != 1.0 else scale
        q, k = dense((c.n_heads, dh), "q", c.qkv_bias)(h), dense((c.kv_heads, dh), "k",
                                                                  c.qkv_bias)(h)
        if c.qk_norm:  # over each head's width, the one scale shared by the heads
            q, k = norm(c, "q_norm")(q), norm(c, "k_norm")(k)
        q, k = rope(q, inv, scale), rope(k, inv, scale)
        v = dense((c.kv_heads, dh), "v", c.qkv_bias)(h)
        # query head i reads kv head i // rep
        attend = lambda window: attention.causal(  # noqa: E731
            q, k, v, c.attention, window,
            c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar else None, c.attn_softcap)
        att = attend(c.sliding_window) if sliding is None else jax.lax.cond(
            sliding, lambda: attend(c.sliding_window), lambda: attend(0))
        x = x + after(dense(d, "o", axis=(-2, -1))(att), "post_attn")
        h = norm(c, "ln2")(x)
        if c.n_experts:
            return x + after(MoE(c.n_experts, c.experts_per_token, c.expert_d_ff or c.d_ff,
                                 c.moe_norm_topk, swiglu, c.shared_expert_d_ff,
                                 name="moe")(h), "post_mlp"), None
        gate, up = dense(c.d_ff, "gate")(h), dense(c.d_ff, "up")(h)
        mid = nn.gelu(gate, approximate=True) * up if c.gemma else swiglu(gate, up)
        return x + after(dense(d, "down")(mid), "post_mlp"), None


class Head(nn.Module):
    """The output head's kernel ``(d_model, padded_vocab)``, as ``nn.Dense`` names and
    initializes it; its matmul is the loss's (``zero_jax.losses.cross_entropy``)."""

    features: int

    @nn.compact
    def __call__(self, d: int) -> jax.Array:
        return self.param("kernel", nn.initializers.lecun_normal(), (d, self.features))


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
        block = LlamaBlock
        if c.remat != "none":
            policy = remat_policy(block_remat(c, wte.dtype))
            block = nn.remat(block, prevent_cse=False, policy=policy)
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=c.n_layers, unroll=c.scan_unroll)
        x = take_rows(wte, tokens)
        if c.gemma:  # in the compute dtype, as transformers rounds the factor
            x = x * jnp.asarray(math.sqrt(c.d_model), x.dtype)
        sliding = None  # the layers whose window slides, where not all
        if c.window_pattern and c.sliding_window:
            sliding = (jnp.arange(c.n_layers) + 1) % c.window_pattern != 0
        x, _ = stack(c, name="blocks")(x, sliding)
        x = norm(c, "ln_f")(x)
        return x, wte.T if c.tie_head else Head(c.padded_vocab, name="head")(c.d_model)


def mapping(c: GPTConfig) -> Mapping:
    """Hugging Face's ``LlamaForCausalLM`` tensors: PyTorch Linear weights ``(out, in)``,
    transposed into Flax kernels, the attention's output axis split into heads; a tied head
    has no tensor of its own (one written anyway is ignored)."""
    h = "model.layers.{layer}."
    head = [] if c.tie_head else [Tensor("lm_head.weight", "head/kernel", transpose=(1, 0),
                                         pad=(1, c.vocab_size))]
    # Gemma 2's post_attention_layernorm is the attention output's, its MLP's input's
    # pre_feedforward_layernorm; Llama's post_attention_layernorm is the MLP input's
    norms = {"ln2": "pre_feedforward", "post_attn": "post_attention",
             "post_mlp": "post_feedforward"} if c.gemma == 2 else {"ln2": "post_attention"}
    rows = [Tensor("model.embed_tokens.weight", "wte", pad=(0, c.vocab_size)),
            Tensor("model.norm.weight", "ln_f/scale"), *head,
            Tensor(h + "input_layernorm.weight", "blocks/ln1/scale"),
            *(Tensor(f"{h}{theirs}_layernorm.weight", f"blocks/{ours}/scale")
              for ours, theirs in norms.items()),
            Tensor(h + "self_attn.o_proj.weight", "blocks/o/kernel", transpose=(1, 0),
                   split=(0, (c.n_heads, -1)))]
    for name, heads in [("q", c.n_heads), ("k", c.kv_heads), ("v", c.kv_heads)]:
        rows.append(Tensor(f"{h}self_attn.{name}_proj.weight", f"blocks/{name}/kernel",
                           transpose=(1, 0), split=(1, (heads, -1))))
        if c.qkv_bias:
            rows.append(Tensor(f"{h}self_attn.{name}_proj.bias", f"blocks/{name}/bias",
                               split=(0, (heads, -1))))
    if c.qk_norm:
        rows += [Tensor(f"{h}self_attn.{n}_norm.weight", f"blocks/{n}_norm/scale")
                 for n in ("q", "k")]
    if c.n_experts:
        rows += moe.rows(family_of(c), c.n_experts, h, bool(c.shared_expert_d_ff))
    for name in ("gate", "up", "down") if not c.n_experts else ():
        rows.append(Tensor(f"{h}mlp.{name}_proj.weight", f"blocks/{name}/kernel",
                           transpose=(1, 0)))
    tied = (r"^lm_head\.weight$",) if c.tie_head else ()
    return Mapping(tuple(rows), ignore=(r"rotary_emb\.inv_freq$", *tied))


def text_mapping(text: Mapping) -> Mapping:
    """An image-text Gemma 3's text model (``language_model.`` before Gemma3ForCausalLM's
    names), its vision tower and projector left unread: written back as that text model."""
    return dataclasses.replace(text, prefix="language_model.", ignore=(
        *text.ignore, r"^vision_tower\.", r"^multi_modal_projector\.",
        r"^language_model\.lm_head\.weight$"))


def phi3_mapping(c: GPTConfig) -> Mapping:
    """Hugging Face's ``Phi3ForCausalLM`` tensors: Llama's, but for q, k and v in one
    ``qkv_proj`` and the gate and up projections in one ``gate_up_proj``, each parameter
    taking its rows (and an export writing it there). A trained Phi-3 is written back as the
    Llama it computes as, unless its heads rotate in part (``write_config``)."""
    h = "model.layers.{layer}."
    fused = {"q": (0, c.n_heads), "k": (c.n_heads, c.kv_heads),
             "v": (c.n_heads + c.kv_heads, c.kv_heads)}
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


def read_config(directory: str | os.PathLike) -> dict:
    """The model section of the demo's config from a Llama, Mistral, Qwen2, Qwen3 or Phi-3
    directory's config.json; what this model does not compute (other biases, another
    activation, a Qwen's sliding window, another rope type) is refused. A Mistral's or Phi-3's
    sliding window is read as ``sliding_window``, which the attention keeps whatever the
    training window (``seq_len``)."""
    path = pathlib.Path(directory) / "config.json"
    try:
        hf = json.loads(path.read_text())
        if hf.get("model_type") == "gemma3":  # an image-text Gemma 3: its text model
            hf = {**hf["text_config"], "model_type": "gemma3_text"}
        if hf.get("model_type") == "gemma3_text":
            hf = {**GEMMA3_TEXT, **hf}
        assert isinstance(hf, dict) and hf.get("model_type") in FAMILIES
    except (OSError, ValueError, AssertionError, KeyError, TypeError):
        raise WeightsError(f"{path} is missing or not a Llama, Mistral, Qwen, Phi-3 or "
                           "Gemma config.json: pass a Hugging Face directory of one") from None
    return _model_section(path, hf)


def _model_section(path: pathlib.Path, hf: dict) -> dict:
    """``read_config``'s model section of the config.json ``hf`` read from ``path``."""
    rope_parameters = hf.get("rope_parameters")
    if hf["model_type"] == "gemma" and hf.get("hidden_act") == "gelu":
        hf["hidden_act"] = "gelu_pytorch_tanh"  # Gemma's first files: meant so (transformers)
    if hf.get("mlp_only_layers", []) is None:  # transformers' default: none
        hf["mlp_only_layers"] = []
    if hf.get("use_bidirectional_attention") is False:
        hf["use_bidirectional_attention"] = None
    if hf["model_type"] == "gemma3_text":
        hf = _gemma3_rope(path, hf)
    for key, want in FAMILIES[hf["model_type"]].items():
        got = hf.get(key, rope_parameters.get(key, want) if isinstance(rope_parameters, dict)
                     else want)
        if got != want:
            raise WeightsError(f"{path} has {key} {got!r}; this demo's Llama computes "
                               f"{want!r} only: pass a model with {key} {want!r}")
    try:
        model = {ours: hf[theirs] for theirs, ours in HF_KEYS.items()}
    except KeyError as e:
        raise WeightsError(f"{path} has no {e.args[0]}: pass a Llama config.json") from None
    head_dim = hf.get("head_dim") or model["d_model"] // model["n_heads"]
    partial = _partial_rotary(path, hf, head_dim)
    if not isinstance(tied := hf.get("tie_word_embeddings", False), bool):
        raise WeightsError(f"{path} has tie_word_embeddings {tied!r}, not true or false: pass a "
                           "model whose config.json has one of them")
    window = hf.get("sliding_window") if hf["model_type"] in (
        "mistral", "mixtral", "phi3", "gemma2", "gemma3_text") else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise WeightsError(f"{path} has sliding_window {window!r}, not a number of tokens: pass "
                           "a model whose config.json has one, or null")
    gemma = _gemma(path, hf, model["n_layers"], window) \
        if hf["model_type"].startswith("gemma") else {}
    experts = _moe(path, hf) if hf["model_type"] in moe.NAMES else {}
    return {**model, "seq_len": min(model["seq_len"], WINDOW), **gemma, **experts,
            "max_positions": model["seq_len"], "sliding_window": window or 0,
            "arch": "llama", "tie_head": tied,
            "qkv_bias": hf["model_type"] in ("qwen2", "qwen2_moe"),
            "qk_norm": hf["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text"),
            "head_dim": 0 if head_dim * model["n_heads"] == model["d_model"] else head_dim,
            "partial_rotary_factor": partial, **_rope(path, hf, int(head_dim * partial))}


def _gemma(path: pathlib.Path, hf: dict, n_layers: int, window: int | None) -> dict:
    """Gemma's keys: its version; Gemma 2's and 3's soft caps, scores' scalar, and the layers
    whose window slides, all but every N-th (``layer_types``, else 2 and Gemma 3's
    ``sliding_window_pattern``); Gemma 3's q and k norms and its sliding layers' rope base."""
    if hf["model_type"] == "gemma":
        return {"gemma": 1}
    three = hf["model_type"] == "gemma3_text"
    pattern = hf.get("sliding_window_pattern", 6) if three else 2
    types = hf.get("layer_types")
    if isinstance(types, list):  # none full: every layer slides
        pattern = types.index("full_attention") + 1 if "full_attention" in types \
            else n_layers + 1
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1 or (
            types is not None and types != _layer_types(pattern, n_layers)):
        raise WeightsError(f"{path} has layer_types {str(types)[:60]}; this demo slides the "
                           "window of every layer but each N-th: pass a model whose layers "
                           "are so")
    if three and not window:  # its sliding layers would still rotate at their own base
        raise WeightsError(f"{path} has sliding_window None; this demo's Gemma 3 slides a "
                           "window: pass a model whose config.json has one")
    out = {"gemma": 2, "window_pattern": pattern if window else 0,
           **({"rope_local_theta": hf["rope_local_base_freq"]} if three else {})}
    caps = (None, None) if three else (50.0, 30.0)  # transformers' defaults
    for theirs, ours, default in (("attn_logit_softcapping", "attn_softcap", caps[0]),
                                  ("final_logit_softcapping", "logit_softcap", caps[1]),
                                  ("query_pre_attn_scalar", "query_pre_attn_scalar", 256)):
        value = hf.get(theirs, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value <= 0):
            raise WeightsError(f"{path} has {theirs} {value!r}, not a positive number: pass a "
                               "model whose config.json has one, or null")
        out[ours] = float(value or 0)
    return out


def _moe(path: pathlib.Path, hf: dict) -> dict:
    """A Mixtral's or Qwen3-MoE's experts: how many, how many a token takes, their width
    (Qwen3-MoE's ``moe_intermediate_size``), whether the chosen ones' weights renormalize."""
    mixtral = hf["model_type"] == "mixtral"
    got = {"num_local_experts": hf.get("num_local_experts", hf.get("num_experts")),
           "num_experts_per_tok": hf.get("num_experts_per_tok"),
           "moe_intermediate_size": hf["intermediate_size"] if mixtral
           else hf.get("moe_intermediate_size")}
    for key, value in got.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WeightsError(f"{path} has {key} {value!r}, not a positive whole number: pass "
                               "a model whose config.json has one")
    n, k, f = got.values()
    if k > n:
        raise WeightsError(f"{path} has num_experts_per_tok {k}, more than its {n} experts: "
                           "pass a model whose config.json has at most that many")
    norm = True if mixtral else hf.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise WeightsError(f"{path} has norm_topk_prob {norm!r}, not true or false: pass a "
                           "model whose config.json has one of them")
    shared = hf.get("shared_expert_intermediate_size", 0) \
        if hf["model_type"] == "qwen2_moe" else 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise WeightsError(f"{path} has shared_expert_intermediate_size {shared!r}, not a "
                           "whole number: pass a model whose config.json has one")
    return {"n_experts": n, "experts_per_token": k, "moe_norm_topk": norm,
            "expert_d_ff": 0 if f == hf["intermediate_size"] else f,
            "shared_expert_d_ff": shared}


def _layer_types(pattern: int, n_layers: int) -> list[str]:
    """transformers' ``layer_types`` of Gemma 2 and 3: every ``pattern``-th layer full."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(n_layers)]


def _gemma3_rope(path: pathlib.Path, hf: dict) -> dict:
    """``hf`` with Gemma 3's rope keys as the other families have theirs: the full layers'
    (``rope_parameters.full_attention`` in transformers 5's files, else ``rope_theta`` and
    ``rope_scaling``, a base of 1,000,000 by default) as the model's, the sliding layers'
    plain base (``rope_local_base_freq``, 10,000 by default) beside them."""
    params = hf.get("rope_parameters")
    local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or local
        hf = {**hf, "rope_parameters": params["full_attention"]}
    elif not isinstance(params, dict):
        hf = {**hf, "rope_theta": hf.get("rope_theta", 1_000_000.0)}
    theta = local.get("rope_theta", 10000.0) if isinstance(local, dict) else local
    if not isinstance(local, dict) or local.get("rope_type", "default") != "default" or \
            isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise WeightsError(f"{path} has sliding layers' rope {str(local)[:60]}; this demo "
                           "rotates them at a plain base: pass a model whose config.json has one")
    return {**hf, "rope_local_base_freq": float(theta)}


def _partial_rotary(path: pathlib.Path, hf: dict, dh: int) -> float:
    """The share of each head a Phi-3 rotates (Phi-4-mini: 0.75), beside the rope keys or among
    them; 1 for the other families, whose transformers classes rotate whole heads."""
    if hf["model_type"] != "phi3":
        return 1.0
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    factor = hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if (isinstance(factor, bool) or not isinstance(factor, (int, float))
            or not 0 < factor <= 1 or int(dh * factor) % 2 or int(dh * factor) < 2):
        raise WeightsError(f"{path} has partial_rotary_factor {factor!r}, not a share of its "
                           f"{dh}-wide heads that rotates pairs: pass a model whose "
                           "config.json has one")
    return float(factor)


def _rope(path: pathlib.Path, hf: dict, dh: int) -> dict:
    """The rotary positions' keys of the model section, from transformers 5's
    ``rope_parameters`` or the ``rope_theta`` and ``rope_scaling`` of earlier files (Llama 3's
    on the Hub); ``rope_scaling`` wins where a file has both, as in transformers 5."""
    params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    where = "rope_scaling" if scaling else "rope_parameters"
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise WeightsError(f"{path} has {where} {hf[where]!r}, not an object: pass a model "
                           "whose config.json has one there")
    rope = {**params, **scaling, "rope_theta": params.get("rope_theta",
                                                          hf.get("rope_theta", 10000.0))}
    kind = (scaling.get("rope_type", scaling.get("type")) if scaling
            else params.get("rope_type", "default"))
    if kind not in ROPE_TYPES:
        raise WeightsError(f"{path} has {where}.rope_type {kind!r}; this demo's Llama computes "
                           f"the rope types {', '.join(ROPE_TYPES)}: pass a model with one of "
                           "them")
    needs = {"default": (), "linear": ("factor",), "llama3": tuple(ROPE_KEYS), "longrope": (),
             "yarn": ()}[kind]
    if missing := [k for k in needs if k not in rope]:
        raise WeightsError(f"{path} has {where}.rope_type {kind!r} without {missing[0]}: pass "
                           "a complete Llama config.json")
    out = {"rope_type": kind}
    for theirs, ours in [("rope_theta", "rope_theta"), *((k, ROPE_KEYS[k]) for k in needs)]:
        value = rope[theirs]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            at = where if theirs in scaling or theirs in params else ""
            raise WeightsError(f"{path} has {at + '.' if at else ''}{theirs} {value!r}, not a "
                               "number: pass a model whose config.json has one there")
        out[ours] = int(value) if ours == "rope_original_max_positions" else float(value)
    if kind in ("longrope", "yarn"):
        out.update(_extended(path, where, rope, hf, dh))
    return out


def _extended(path: pathlib.Path, where: str, rope: dict, hf: dict, dh: int) -> dict:
    """The keys of longrope (Phi-3's) and yarn (the Qwens' long contexts): the original
    context, beside the rope keys (where Phi-3's files have it, and where transformers prefers
    it) or among them, else the declared context; the context's extension ``factor``, else the
    declared context over the original; the attention factor, 0 where the file has none
    (``rope_scale`` derives it); longrope's two lists of ``dh / 2`` factors."""
    kind = rope.get("rope_type", rope.get("type"))
    default = 4096 if hf.get("model_type") == "phi3" else hf["max_position_embeddings"]
    original = hf.get("original_max_position_embeddings",
                      rope.get("original_max_position_embeddings", default))
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise WeightsError(f"{path} has {kind}'s original_max_position_embeddings "
                           f"{original!r}, not a number of tokens: pass a model whose "
                           "config.json has it")
    out: dict = {"rope_original_max_positions": original}
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
    for theirs in ("short_factor", "long_factor") if kind == "longrope" else ():
        got = rope.get(theirs)
        if not (isinstance(got, list) and len(got) == dh // 2 and all(map(number, got))):
            raise WeightsError(f"{path} has {where}.{theirs} {str(got)[:40]}, not a list of "
                               f"{dh // 2} positive numbers (one per rotary pair of its "
                               f"{dh}-wide heads): pass a model whose config.json has them")
        out[f"rope_{theirs}"] = [float(x) for x in got]
    for key, want in YARN_FIXED.items() if kind == "yarn" else ():
        if rope.get(key) not in (None, want):
            only = f"{key} {want!r} only" if want is not None else f"no {key}"
            raise WeightsError(f"{path} has {where}.{key} {rope[key]!r}; this demo's yarn "
                               f"computes {only}: pass a model with {only}")
    factor = rope.get("factor")
    factor = hf["max_position_embeddings"] / original if factor is None else factor
    attention = rope.get("attention_factor")
    for key, value in (("factor", factor), ("attention_factor", attention or 1.0)):
        if not number(value):
            raise WeightsError(f"{path} has {where}.{key} {value!r}, not a positive number: "
                               "pass a model whose config.json has one there")
    return {**out, "rope_factor": float(factor), "rope_attention_factor": float(attention or 0)}


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


def family_of(c: GPTConfig) -> str:
    """The Hugging Face family that computes ``c``: with experts Qwen3-MoE's (q and k
    normed) or Mixtral's; Gemma's three; Phi-3's where heads rotate in part (only its class
    computes that; its tensors then ``phi3_mapping``'s); Qwen2's with ``qkv_bias``, Qwen3's with
    ``qk_norm``, Mistral's with ``sliding_window``, else Llama's (a Mistral without its window
    computes as one)."""
    if c.n_experts:
        if not (c.qk_norm or c.qkv_bias or c.moe_norm_topk):
            raise WeightsError("model.moe_norm_topk false without qk_norm or qkv_bias is no "
                               "Hugging Face family's (Mixtral renormalizes its experts' "
                               "weights): not written")
        if bool(c.shared_expert_d_ff) != c.qkv_bias:
            raise WeightsError("model.shared_expert_d_ff goes with qkv_bias (Qwen2-MoE's) in "
                               "Hugging Face's families: not written")
        return "qwen2_moe" if c.qkv_bias else "qwen3_moe" if c.qk_norm else "mixtral"
    if c.gemma:
        return "gemma" if c.gemma == 1 else "gemma3_text" if c.qk_norm else "gemma2"
    return ("phi3" if c.rotary_dim < c.dh else "qwen2" if c.qkv_bias else "qwen3"
            if c.qk_norm else "mistral" if c.sliding_window else "llama")


def write_config(directory: pathlib.Path, model: dict, dtype: str = "float32") -> None:
    """``hf_config``'s config.json in ``directory``."""
    (directory / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2))


def hf_config(model: dict, dtype: str = "float32") -> dict:
    """A config.json for the demo's ``model`` section, as transformers reads it, of
    ``family_of`` its model; the rope scaling in the ``rope_scaling`` form Llama 3's files use,
    which transformers 4 and 5 both read. Read back (``read_config``), it must give the model
    it was written for: a model no family computes (Gemma 2's norms with experts, Gemma's with
    q/k/v biases) is refused before anything is written, naming the first key it loses."""
    c = GPTConfig(**model)
    family = family_of(c)
    hf = {"architectures": [ARCHITECTURES[family]], "model_type": family,
          **{theirs: getattr(c, ours) for theirs, ours in HF_KEYS.items()}, **FAMILIES[family],
          "tie_word_embeddings": c.tie_head, "num_key_value_heads": c.kv_heads,
          "head_dim": c.dh, "rope_theta": c.rope_theta, "dtype": dtype,
          "max_position_embeddings": c.max_positions or c.seq_len,
          **({"sliding_window": c.sliding_window} if c.sliding_window else {}),
          **_family_keys(c, family)}
    if c.rope_type == "longrope":
        hf["rope_scaling"] = {"rope_type": "longrope", "short_factor": list(c.rope_short_factor),
                              "long_factor": list(c.rope_long_factor), "factor": c.rope_factor,
                              "original_max_position_embeddings": c.rope_original_max_positions,
                              **({"attention_factor": c.rope_attention_factor}
                                 if c.rope_attention_factor else {})}
    elif c.rope_type == "yarn":
        hf["rope_scaling"] = {"rope_type": "yarn", "factor": c.rope_factor,
                              "original_max_position_embeddings": c.rope_original_max_positions,
                              **({"attention_factor": c.rope_attention_factor}
                                 if c.rope_attention_factor else {})}
    elif c.rope_type != "default":
        keys = ("factor",) if c.rope_type == "linear" else tuple(ROPE_KEYS)
        hf["rope_scaling"] = {"rope_type": c.rope_type,
                              **{k: getattr(c, ROPE_KEYS[k]) for k in keys}}
    _check_read_back(c, family, hf)
    return hf


TENSORS_ALONE = "export its tensors alone (python -m zero_jax.export --format safetensors)"


def _computes(c: GPTConfig) -> dict:
    """What ``c`` computes, in keys of the config: two configs alike here compute alike (a
    window on no layer is none; every N-th layer full, N past the depth, is a window on all)."""
    moe = dict(n_experts=c.n_experts, experts_per_token=c.experts_per_token,
               expert_d_ff=c.expert_d_ff or c.d_ff, moe_norm_topk=c.moe_norm_topk,
               shared_expert_d_ff=c.shared_expert_d_ff) if c.n_experts else {}
    rope = {k: getattr(c, k) for k in GPTConfig.__dataclass_fields__
            if k.startswith("rope_") and k not in ("rope_theta", "rope_local_theta")}
    sliding = c.sliding_window and c.window_pattern != 1
    pattern = c.window_pattern if sliding and c.window_pattern <= c.n_layers else 0
    return {"vocab_size": c.vocab_size, "d_model": c.d_model, "n_layers": c.n_layers,
            "n_heads": c.n_heads, "d_ff": c.d_ff, "norm_eps": c.norm_eps,
            "n_kv_heads": c.kv_heads, "rope_theta": c.rope_theta, "head_dim": c.dh,
            "partial_rotary_factor": c.rotary_dim / c.dh, "tie_head": c.tie_head,
            "qkv_bias": c.qkv_bias, "qk_norm": c.qk_norm, "gemma": c.gemma,
            "attn_softcap": c.attn_softcap, "logit_softcap": c.logit_softcap,
            "sliding_window": c.sliding_window if sliding else 0,
            "window_pattern": pattern,
            "rope_local_theta": (c.rope_local_theta or c.rope_theta) if pattern else 0.0,
            "query_pre_attn_scalar": c.query_pre_attn_scalar or c.dh,
            **(rope if c.rope_type != "default" else {}), **moe}


def _check_read_back(c: GPTConfig, family: str, hf: dict) -> None:
    """Refuse ``hf`` unless transformers' reading of it (ours: ``read_config``) computes ``c``."""
    try:
        back = GPTConfig(**_model_section(pathlib.Path("config.json"),
                                          json.loads(json.dumps(hf))))
    except WeightsError as e:
        raise WeightsError(f"this model's Hugging Face {family} config would not read back "
                           f"({e}): {TENSORS_ALONE}") from None
    want, got = _computes(c), _computes(back)
    for key, value in want.items():
        if got.get(key) != value:
            raise WeightsError(
                f"model.{key} {value!r} does not survive as a Hugging Face {family} config "
                f"(read back: {got.get(key)!r}): no Hugging Face family computes this model; "
                f"{TENSORS_ALONE}")


def _family_keys(c: GPTConfig, family: str) -> dict:
    """The keys of config.json that only ``family`` has, as its files on the Hub name them."""
    out: dict = {}
    if family in ("gemma2", "gemma3_text"):  # none written, not the configs' default
        out.update(sliding_window=c.sliding_window or None,
                   layer_types=_layer_types(c.window_pattern or c.n_layers + 1, c.n_layers),
                   attn_logit_softcapping=c.attn_softcap or None,
                   final_logit_softcapping=c.logit_softcap or None,
                   query_pre_attn_scalar=_number(c.query_pre_attn_scalar or c.dh))
        if c.rope_local_theta:
            out["rope_local_base_freq"] = c.rope_local_theta
    if c.n_experts:
        out.update({"num_local_experts" if family == "mixtral" else "num_experts": c.n_experts,
                    "num_experts_per_tok": c.experts_per_token})
        if family != "mixtral":
            out.update(moe_intermediate_size=c.expert_d_ff or c.d_ff,
                       norm_topk_prob=c.moe_norm_topk)
        if family == "qwen2_moe":
            out.update(shared_expert_intermediate_size=c.shared_expert_d_ff)
    if family == "phi3":  # its original context beside the rope keys, where Phi3Config reads it
        out.update(partial_rotary_factor=c.partial_rotary_factor, pad_token_id=None,
                   original_max_position_embeddings=c.rope_original_max_positions
                   or c.max_positions or c.seq_len)
    return out


def _number(x: float) -> int | float:
    """A whole number as an int: the form transformers' strict configs type it in."""
    return int(x) if float(x).is_integer() else x
