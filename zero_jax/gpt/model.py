"""The default model: a GPT-2 style decoder, its layers under ``nn.scan`` with remat.

Nothing in it knows of ZeRO: the plan names the scanned stack ``blocks`` (``LAYERS``), and the
step gathers its parameters inside the scan, one layer at a time, as any model's blocks.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zero_jax.blocks import BLOCK_INPUT, remat_policy
from zero_jax.embedding import take_rows
from zero_jax.gpt import attention
from zero_jax.grads import Weighted
from zero_jax.losses import mean_cross_entropy
from zero_jax.plan import Rule, modules_pattern

LN_EPS = 1e-5  # GPT-2's layer-norm epsilon (and nn.gelu's tanh approximation is its GELU)
LAYER_STACKS = ("blocks",)  # this model's modules under nn.scan
LAYERS = modules_pattern(LAYER_STACKS)  # the plan's ``layers`` pattern for this model
# Megatron's tensor-parallel layout, as rules over parameter paths (dimensions from the end,
# so they hold with or without the scan's layer index): attention's query/key/value by heads
# and the MLP's first matrix by output columns; attention's output and the MLP's second matrix
# by input rows (their outputs are then summed over ``model``); the embedding by vocabulary.
TENSOR_PARALLEL = (
    Rule(r"^blocks/qkv/(kernel|bias)$", model_dim=-2),
    Rule(r"^blocks/fc1/(kernel|bias)$", model_dim=-1),
    Rule(r"^blocks/(proj|fc2)/kernel$", model_dim=-2),
    Rule(r"^wte$", model_dim=0),
)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    seq_len: int = 64
    remat: str = "full"  # policy of each block's remat (zero_jax.blocks.remat_policy)
    arch: str = "gpt2"  # or "llama" (zero_jax.gpt.llama) or "neox" (zero_jax.gpt.neox)
    norm_eps: float = LN_EPS
    n_kv_heads: int = 0  # llama: key/value heads (grouped-query attention); 0: n_heads
    rope_theta: float = 10000.0  # llama, neox: the rotary positions' base
    # llama: their scaling, as Hugging Face's rope types "linear" and "llama3" (Llama 3.1, 3.2)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 0
    rope_short_factor: tuple[float, ...] = ()  # longrope (Phi-3): a factor per rotary pair
    rope_long_factor: tuple[float, ...] = ()  # the same, for sequences past the original
    rope_attention_factor: float = 0.0  # longrope: cos and sin scaled; 0: from rope_factor
    rope_truncate: bool = True  # yarn: its ramp's ends rounded to whole pairs (GPT-OSS's not)
    # llama, neox: the share of each head rotated (Phi-4-mini's 0.75, Pythia's 0.25)
    partial_rotary_factor: float = 1.0
    tie_head: bool = False  # llama, neox: the head is the embedding's transpose (GPT-2's is)
    qkv_bias: bool = False  # llama: biases on the q, k and v projections (Qwen2)
    # llama: an RMSNorm over each head's q and k before rotary (Qwen3); with layer_norm 2, a
    # LayerNorm with a scale per head (Command R+)
    qk_norm: bool = False
    head_dim: int = 0  # llama: each head's width; 0: d_model / n_heads
    # llama, neox: the context config.json declares (max_position_embeddings), written back on
    # export whatever window seq_len trains at; 0: seq_len
    max_positions: int = 0
    # llama: Mistral's and Phi-3's sliding window: each token attends to itself and the
    # sliding_window - 1 before it (attention.causal); written back on export; 0: none
    sliding_window: int = 0
    # llama: Gemma's conventions (1: RMSNorm scales of 1 + weight, the embedding times
    # sqrt(d_model), a tanh-GELU gate; 2: Gemma 2's and 3's norms of the attention's and the
    # MLP's outputs too); 0: none
    gemma: int = 0
    # llama: LayerNorms for the RMSNorms (1: with biases, StableLM's; 2: without, Cohere's)
    layer_norm: int = 0
    rope_interleaved: bool = False  # llama: rotary pairs side by side, (0, 1), (2, 3)... (Cohere's)
    # llama: RMSNorms of the attention's and the MLP's outputs too, beside their inputs' (GLM-4's
    # sandwich; Gemma 2's are gemma 2's)
    output_norms: bool = False
    # llama: OLMo's conventions (1: with qk_norm, q and k normed over all heads at once, as
    # OLMoE; 2: also RMSNorms of the attention's and the MLP's outputs in place of their
    # inputs', as OLMo 2 and 3); 0: none
    olmo: int = 0
    # llama: sliding_window on every layer but each window_pattern-th (Gemma 2: 2, Gemma 3:
    # 6), those rotating at base rope_local_theta where it is set; 0: every layer alike
    window_pattern: int = 0
    rope_local_theta: float = 0.0
    # llama: every nope_every-th layer attends without rotary positions (SmolLM3: 4); 0: none
    nope_every: int = 0
    # llama: Granite's multipliers: of the embedding's rows, of each sublayer's output before
    # it is added to the residual, and the final hidden states divided by logits_scaling
    # (its attention_multiplier is query_pre_attn_scalar's -1/2 power); 1: none
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # llama: a mixture of n_experts SwiGLU experts (zero_jax.gpt.moe) for the MLP, each token
    # through its top experts_per_token, expert_d_ff wide (0: d_ff), their weights renormalized
    # over those with moe_norm_topk (Mixtral's; Qwen3-MoE's norm_topk_prob); 0: a dense MLP
    n_experts: int = 0
    experts_per_token: int = 2
    expert_d_ff: int = 0
    moe_norm_topk: bool = True
    shared_expert_d_ff: int = 0  # llama: Qwen2-MoE's shared expert's width; 0: none
    # llama: the weight of the experts' load-balancing loss in the training loss
    # (transformers' router_aux_loss_coef, where output_router_logits); 0: none
    router_aux_loss_coef: float = 0.0
    # llama: that loss over the whole batch (each microbatch of it), not each device's share
    router_aux_loss_global: bool = False
    # llama: the weight of ST-MoE's router z-loss (the router logits' log-sum-exp squared,
    # its mean over tokens and layers) in the training loss; 0: none
    router_z_loss_coef: float = 0.0
    # llama: each expert takes at most this times its even share of a device's (token, choice)
    # pairs, the rest dropped (GShard's capacity factor; static shapes); 0: none dropped
    expert_capacity_factor: float = 0.0
    # llama: the same for evaluation (DeepSpeed-MoE's eval_capacity_factor); 0: none dropped,
    # as the exported model computes
    eval_capacity_factor: float = 0.0
    # neox, llama: the attention and the MLP both read the layer's input, their outputs added to
    # it together (1: each through its own norm, GPT-NeoX's use_parallel_residual; 2: through
    # one, Phi's and Cohere's); 0: the MLP after the attention
    parallel_residual: int = 0
    head_bias: bool = False  # neox: the output head has a bias (Phi's)
    # llama: GPT-OSS's conventions: a learned sink logit per head in each attention's softmax,
    # a bias on the attention's output too, experts with biases (gate and up in one tensor,
    # their columns interleaved) and a router with one, their GLU clamped at swiglu_limit
    gpt_oss: bool = False
    swiglu_limit: float = 7.0
    hidden_act: str = "gelu"  # neox: the MLP's GELU, exact ("gelu") or tanh's (gelu_new, ...)
    attn_softcap: float = 0.0  # llama: scores capped by softcap * tanh(s / softcap); 0: none
    logit_softcap: float = 0.0  # llama: the same of the final logits (Gemma 2's)
    query_pre_attn_scalar: float = 0.0  # llama: scores times its -1/2 power; 0: head_dim's
    attention: str = "auto"  # zero_jax.gpt.attention.IMPLEMENTATIONS
    vocab_multiple: int = 1  # the embedding (and head) padded to a multiple of this
    scan_unroll: int = 1  # layers per iteration of the layer loop (nn.scan's unroll)

    def __post_init__(self):
        # a config's lists (YAML, config.json) as tuples: the config is hashed as a module's
        for key in ("rope_short_factor", "rope_long_factor"):
            object.__setattr__(self, key, tuple(getattr(self, key)))

    @property
    def router_losses(self) -> bool:
        """Whether the loss has the experts' load-balancing loss or router z-loss: then the
        layer loop returns their routing statistics and ``lm_loss`` each one's metric
        (``has_aux``)."""
        return bool(self.n_experts and (self.router_aux_loss_coef or self.router_z_loss_coef))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dh(self) -> int:
        """Each attention head's width."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """The width of each head's first part that rotary positions rotate (the rest passes
        through), as Hugging Face rounds it."""
        return int(self.dh * self.partial_rotary_factor)

    @property
    def padded_vocab(self) -> int:
        """The embedding's rows: ``vocab_size`` rounded up to ``vocab_multiple`` (GEMMs whose
        vocabulary dimension is a multiple of 128 run at full speed; the padding is never
        predicted, ``lm_loss``)."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def n_params(self) -> int:
        d, f, L, V = self.d_model, self.d_ff, self.n_layers, self.padded_vocab
        if self.arch == "llama":  # no position table
            q, kv = self.n_heads * self.dh, self.kv_heads * self.dh
            head = 0 if self.tie_head else V * d
            # OLMo's over all heads, Command R+'s and StableLM 2's a scale per head
            normed = q + kv if self.olmo or self.layer_norm else 2 * self.dh
            extra = (q + 2 * kv if self.qkv_bias else 0) + (normed if self.qk_norm else 0)
            extra += 2 * d if self.gemma == 2 or self.output_norms else 0  # the outputs' norms
            extra += 2 * d if self.layer_norm == 1 else 0  # the norms' biases (ln_f's below)
            if self.parallel_residual:  # one norm for both (with its bias, StableLM's)
                extra -= 2 * d if self.layer_norm == 1 else d
            if self.n_experts:  # the router and the experts for the dense MLP
                extra += d * self.n_experts + self.n_experts * 3 * d * (
                    self.expert_d_ff or f) - 3 * d * f
                extra += 3 * d * self.shared_expert_d_ff + d if self.shared_expert_d_ff else 0
            if self.gpt_oss:  # the output's bias, the sinks, the router's and experts' biases
                extra += d + self.n_heads + self.n_experts * (1 + 2 * (self.expert_d_ff or f) + d)
            final = 2 * d if self.layer_norm == 1 else d
            return V * d + head + final + L * (2 * d + 2 * d * q + 2 * d * kv + 3 * d * f + extra)
        per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        if self.arch == "neox":  # GPT-2's layers, no position table, the head its own
            head = 0 if self.tie_head else V * d + (V if self.head_bias else 0)
            shared = 2 * d if self.parallel_residual == 2 else 0  # one norm a layer
            return V * d + head + L * (per_layer - shared) + 2 * d
        return V * d + self.seq_len * d + L * per_layer + 2 * d

    @property
    def active_params(self) -> int:
        """The parameters a token computes with: ``n_params`` less the experts it does not
        take (what a step's FLOPs follow, 6 a parameter a token)."""
        unchosen = self.n_experts - self.experts_per_token if self.n_experts else 0
        f = self.expert_d_ff or self.d_ff
        biases = 2 * f + self.d_model if self.gpt_oss else 0
        return self.n_params - self.n_layers * unchosen * (3 * self.d_model * f + biases)


class Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
        c = self.cfg
        x = checkpoint_name(x, BLOCK_INPUT)  # the layer's checkpoint, for remat "offload"
        b, t, d = x.shape
        dh = d // c.n_heads
        init = nn.initializers.normal(0.02)
        out_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layers))

        h = nn.LayerNorm(epsilon=c.norm_eps, name="ln1")(x)
        # (3, heads, head size) outputs: tensor parallelism cuts whole heads (TENSOR_PARALLEL).
        qkv = nn.DenseGeneral((3, c.n_heads, dh), kernel_init=init, name="qkv")(h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        att = attention.causal(q, k, v, c.attention).reshape(b, t, d)
        x = x + nn.Dense(d, kernel_init=out_init, name="proj")(att)

        h = nn.LayerNorm(epsilon=c.norm_eps, name="ln2")(x)
        h = gelu(nn.Dense(c.d_ff, kernel_init=init, name="fc1")(h))
        x = x + nn.Dense(d, kernel_init=out_init, name="fc2")(h)
        return x, None


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """GPT-2's GELU (``nn.gelu``'s tanh approximation), computed in fp32 and rounded to ``x``'s
    dtype, as PyTorch computes a bf16 GELU. Its gradient is written out, from ``x`` alone: the
    one the autodiff of ``nn.gelu`` gives, which XLA computed in bf16 from a tanh it wrote to
    HBM and read back (gpt2-124m, one H100: the backward's GELU took 28 passes of the 768-wide
    activations a layer, one fusion of 16 now)."""
    return nn.gelu(x.astype(jnp.float32)).astype(x.dtype)


def _gelu_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gelu(x), x


def _gelu_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    """d/dx of x s, s = (1 + tanh(u)) / 2 = sigmoid(2 u), u = sqrt(2 / pi) (x + 0.044715 x^3):
    s + x s (1 - s) 2 du/dx. Through the sigmoid, not the forward's tanh: XLA computes a tanh
    shared by two fusions once and writes it to HBM (fp32, a 4-byte pass more than it saves)."""
    x32 = x.astype(jnp.float32)
    c = 2 * math.sqrt(2 / math.pi)
    s = jax.nn.sigmoid(c * (x32 + 0.044715 * x32 ** 3))
    dx = s + x32 * s * (1 - s) * c * (1 + 3 * 0.044715 * x32 * x32)
    return ((g.astype(jnp.float32) * dx).astype(g.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


def embed(module: nn.Module, c: GPTConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """GPT-2's token and position embeddings of ``tokens`` (``module``'s parameters ``wte``
    and ``wpe``), and the token table, which the output head shares."""
    init = nn.initializers.normal(0.02)
    wte = module.param("wte", init, (c.padded_vocab, c.d_model))
    wpe = module.param("wpe", init, (c.seq_len, c.d_model))
    return take_rows(wte, tokens) + wpe[: tokens.shape[1]], wte


class GPT(nn.Module):
    cfg: GPTConfig

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """The logits over the vocabulary (its padding left out)."""
        x, head = self.features(tokens)
        return (x @ head)[..., :self.cfg.vocab_size]

    @nn.compact
    def features(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The last hidden states and the output head ``(d_model, padded_vocab)``: the loss
        takes the head's matmul inside (``zero_jax.losses.cross_entropy``)."""
        c = self.cfg
        x, wte = embed(self, c, tokens)
        x, _ = layer_stack(Block, c, x.dtype)(c, name="blocks")(x, None)
        x = nn.LayerNorm(epsilon=c.norm_eps, name="ln_f")(x)
        return x, wte.T  # output head tied to the embedding, as GPT-2


def layer_stack(block: type[nn.Module], c: GPTConfig, dtype) -> type[nn.Module]:
    """``block`` under the config's remat (``block_remat``), scanned over its layers."""
    if c.remat != "none":
        block = nn.remat(block, prevent_cse=False, policy=remat_policy(block_remat(c, dtype)))
    return nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=c.n_layers, unroll=c.scan_unroll)


def block_remat(c: GPTConfig, dtype) -> str:
    """``c.remat``, with "auto" resolved as the experiment resolves it, for a config used
    outside one (read back from an export): ``dots`` where attention is cuDNN's, else
    ``full``."""
    if c.remat != "auto":
        return c.remat
    fused = attention.resolve(c.attention, jax.default_backend(), dtype, c.dh,
                              bool(c.attn_softcap or c.gpt_oss)) == "cudnn"
    return "dots" if fused else "full"


def build(cfg: GPTConfig) -> nn.Module:
    """The model ``cfg.arch`` names."""
    if cfg.arch == "llama":
        from zero_jax.gpt.llama import Llama

        return Llama(cfg)
    if cfg.arch == "neox":
        from zero_jax.gpt.neox import NeoX

        return NeoX(cfg)
    return GPT(cfg)


def tensor_parallel(cfg: GPTConfig) -> tuple[Rule, ...]:
    if cfg.arch in ("llama", "neox"):
        from zero_jax.gpt import llama, neox

        return (llama if cfg.arch == "llama" else neox).tensor_parallel(cfg)
    return TENSOR_PARALLEL


def lm_loss(model: GPT, completion_only: bool = False):
    """Mean next-token cross-entropy of a ``(batch, seq_len + 1)`` block of token ids, the
    logits never whole (``zero_jax.losses.mean_cross_entropy``: chunks, fp32 log-sum-exp, the
    gradients computed in the forward pass), the vocabulary's padding out of the softmax.

    ``completion_only``: ids stored as ``-1 - id`` (a prompt's, ``data.text_tokens``) are read
    but not predicted, and the loss is the mean over the batch's other tokens, whichever device
    holds them (``zero_jax.Weighted``).

    With ``router_aux_loss_coef``, plus that times the experts' load-balancing loss
    (``moe.balance_loss``) of the tokens the loss is given: under ``make_grad_fn``, each
    device's microbatch, as transformers computes it on each rank under DDP or FSDP; with
    ``router_aux_loss_global``, every device's (``zero_jax.batch_sum``). With
    ``router_z_loss_coef``, plus that times ST-MoE's router z-loss of those tokens. The loss is
    then returned with each as a metric, ``(loss, {"balance_loss": ..., "router_z_loss":
    ...})``, for a step made with ``has_aux=model.cfg.router_losses``."""
    cfg = model.cfg
    softcap, routed = cfg.logit_softcap, cfg.router_losses
    coefs = {"balance_loss": cfg.router_aux_loss_coef, "router_z_loss": cfg.router_z_loss_coef}

    def features(params, ids: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
        if not routed:
            return *model.apply({"params": params}, ids, method="features"), {}
        (x, head), sown = model.apply({"params": params}, ids, method="features",
                                      mutable=["losses"])
        return x, head, {k: v[0] for k, v in sown["losses"].items()}

    def router_loss(aux: dict) -> jax.Array | float:
        return sum((coefs[k] * v for k, v in aux.items()), 0.0)

    def loss_fn(params, tokens: jax.Array):
        x, head, aux = features(params, tokens[:, :-1])
        loss = mean_cross_entropy(x, head, tokens[:, 1:], valid=cfg.vocab_size,
                                  softcap=softcap) + router_loss(aux)
        return (loss, aux) if routed else loss

    def completions(params, tokens: jax.Array):
        ids = jnp.where(tokens < 0, -1 - tokens, tokens)
        x, head, aux = features(params, ids[:, :-1])
        weights = (tokens[:, 1:] >= 0).astype(jnp.float32)
        mean = mean_cross_entropy(x, head, ids[:, 1:], valid=cfg.vocab_size,
                                  weights=weights, softcap=softcap)
        count = jnp.sum(weights)
        loss = Weighted((mean + router_loss(aux)) * count, count)
        return (loss, aux) if routed else loss
    return completions if completion_only else loss_fn


def init_fn(model: GPT):
    def init(key: jax.Array):
        tokens = jnp.zeros((1, model.cfg.seq_len), jnp.int32)
        return model.init(key, tokens)["params"]
    return init
