"""A GPT-NeoX decoder (EleutherAI's Pythia, GPT-NeoX-20B and the models trained with their code)
and Phi's (Microsoft's Phi-1, 1.5 and 2): layer norms with biases, a share of each head rotated
(``partial_rotary_factor``: Pythia's 0.25, Phi-2's 0.4), q, k and v with biases, a GELU MLP
with biases, and with ``parallel_residual`` the attention and the MLP both reading the layer's
input (1: each through its own norm, GPT-NeoX's; 2: through one, Phi's), their outputs added
to it together; Phi's head has a bias (``head_bias``). Hugging Face's ``GPTNeoXForCausalLM`` and
``PhiForCausalLM`` tensor names and config.json, both ways; its layers under ``nn.scan`` as
``blocks``, as the other models'.
"""

from __future__ import annotations

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero_jax.embedding import take_rows
from zero_jax.gpt import attention
from zero_jax.gpt.llama import Head, rope, rope_frequencies
from zero_jax.gpt.llama_config import TENSORS_ALONE, section_keys
from zero_jax.gpt.model import GPT, GPTConfig, gelu, layer_stack
from zero_jax.plan import Rule
from zero_jax.tensorfiles import WeightsError
from zero_jax.weights import Mapping, Tensor

# Megatron's layout, as GPT-2's: q, k and v by heads (their kernel ``(d, heads, 3, head_dim)``),
# the MLP's first projection by columns, the outputs' by rows, the embedding by vocabulary, the
# head by its outputs
TENSOR_PARALLEL = (
    Rule(r"^blocks/qkv/(kernel|bias)$", model_dim=-3),
    Rule(r"^blocks/fc1/(kernel|bias)$", model_dim=-1),
    Rule(r"^blocks/(proj|fc2)/kernel$", model_dim=-2),
    Rule(r"^wte$", model_dim=0),
    Rule(r"^head/(kernel|bias)$", model_dim=-1),
)


def tensor_parallel(c: GPTConfig) -> tuple[Rule, ...]:
    """``TENSOR_PARALLEL``, without the head's rule where the head is the embedding's."""
    return TENSOR_PARALLEL[:-1] if c.tie_head else TENSOR_PARALLEL


class NeoXBlock(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
        c = self.cfg
        b, t, d = x.shape
        norm = lambda name: nn.LayerNorm(epsilon=c.norm_eps, name=name)  # noqa: E731
        h = norm("ln1")(x)
        # heads first, then q, k, v: GPT-NeoX's fused rows, so tensor parallelism cuts heads
        qkv = nn.DenseGeneral((c.n_heads, 3, c.dh), name="qkv")(h)
        inv = rope_frequencies(c, c.rotary_dim, t)
        q, k = rope(qkv[..., 0, :], inv), rope(qkv[..., 1, :], inv)
        att = attention.causal(q, k, qkv[..., 2, :], c.attention).reshape(b, t, d)
        att = nn.Dense(d, name="proj")(att)
        # the MLP reads the layer's input (parallel) or the attention's output added to it
        y = x if c.parallel_residual else x + att
        h = h if c.parallel_residual == 2 else norm("ln2")(y)
        mlp = nn.Dense(d, name="fc2")(_gelu(c, nn.Dense(c.d_ff, name="fc1")(h)))
        return (x + att + mlp if c.parallel_residual else y + mlp), None


def _gelu(c: GPTConfig, x: jax.Array) -> jax.Array:
    """The MLP's GELU in fp32, rounded to ``x``'s dtype as PyTorch computes a bf16 one: tanh's
    is GPT-2's (its gradient written out, ``model.gelu``), the exact one ``erf``'s."""
    if c.hidden_act != "gelu":
        return gelu(x)
    return nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


class NeoX(GPT):
    """The demo's model when ``cfg.arch`` is "neox" (GPT's logits of its ``features``)."""

    @nn.compact
    def features(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The last hidden states and the head's kernel (``GPT.features``); with a head bias,
        the states end with a feature of ones that the head's last row, its bias, meets."""
        c = self.cfg
        wte = self.param("wte", nn.initializers.normal(0.02), (c.padded_vocab, c.d_model))
        x, _ = layer_stack(NeoXBlock, c, wte.dtype)(c, name="blocks")(
            take_rows(wte, tokens), None)
        x = nn.LayerNorm(epsilon=c.norm_eps, name="ln_f")(x)
        if c.tie_head:
            return x, wte.T
        if c.head_bias:
            x = jnp.concatenate([x, jnp.ones((*x.shape[:-1], 1), x.dtype)], -1)
        return x, Head(c.padded_vocab, c.head_bias, name="head")(c.d_model)


def _common_rows(c: GPTConfig, h: str, names: dict[str, str]) -> list[Tensor]:
    """The rows both layouts share but for their names (``names``: ours to theirs): the
    embedding, the final norm, each layer's projections with their biases."""
    rows = [Tensor(names["wte"], "wte", pad=(0, c.vocab_size)),
            Tensor(names["ln_f"] + ".weight", "ln_f/scale"),
            Tensor(names["ln_f"] + ".bias", "ln_f/bias")]
    for ours in ("proj", "fc1", "fc2"):
        rows += [Tensor(f"{h}{names[ours]}.weight", f"blocks/{ours}/kernel", transpose=(1, 0)),
                 Tensor(f"{h}{names[ours]}.bias", f"blocks/{ours}/bias")]
    return rows


def mapping(c: GPTConfig) -> Mapping:
    """Hugging Face's ``GPTNeoXForCausalLM`` tensors (``PhiForCausalLM``'s with a head bias):
    PyTorch Linear weights ``(out, in)``, transposed into Flax kernels, the fused q, k, v rows
    split head by head; the buffers older files hold (the causal mask, rotary frequencies) and
    a tied head's copy ignored."""
    if c.head_bias:
        return _phi_mapping(c)
    h = "gpt_neox.layers.{layer}."
    qkv = (c.n_heads, 3, -1)
    rows = _common_rows(c, h, {"wte": "gpt_neox.embed_in.weight",
                               "ln_f": "gpt_neox.final_layer_norm", "proj": "attention.dense",
                               "fc1": "mlp.dense_h_to_4h", "fc2": "mlp.dense_4h_to_h"})
    rows += [Tensor(h + "attention.query_key_value.weight", "blocks/qkv/kernel",
                    transpose=(1, 0), split=(1, qkv)),
             Tensor(h + "attention.query_key_value.bias", "blocks/qkv/bias", split=(0, qkv))]
    if not c.tie_head:
        rows.append(Tensor("embed_out.weight", "head/kernel", transpose=(1, 0),
                           pad=(1, c.vocab_size)))
    for theirs, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
        rows += [Tensor(f"{h}{theirs}.weight", f"blocks/{ours}/scale"),
                 Tensor(f"{h}{theirs}.bias", f"blocks/{ours}/bias")]
    ignore = (r"\.attention\.(masked_)?bias$", r"\.rotary_emb\.inv_freq$",
              *((r"^embed_out\.weight$",) if c.tie_head else ()))
    return Mapping(tuple(rows), ignore=ignore)


def _phi_mapping(c: GPTConfig) -> Mapping:
    """``PhiForCausalLM``'s tensors: q, k and v in three projections, fused into the kernel's
    (and bias's) q, k, v axis; one norm a layer; the head's weight and bias."""
    h = "model.layers.{layer}."
    rows = _common_rows(c, h, {"wte": "model.embed_tokens.weight", "ln_f": "model.final_layernorm",
                               "proj": "self_attn.dense", "fc1": "mlp.fc1", "fc2": "mlp.fc2"})
    qkv = lambda kind: tuple(f"{h}self_attn.{n}_proj.{kind}" for n in "qkv")  # noqa: E731
    rows += [Tensor(qkv("weight"), "blocks/qkv/kernel", transpose=(1, 0),
                    split=(1, (c.n_heads, -1)), fuse_axis=2),
             Tensor(qkv("bias"), "blocks/qkv/bias", split=(0, (c.n_heads, -1)), fuse_axis=1),
             Tensor(h + "input_layernorm.weight", "blocks/ln1/scale"),
             Tensor(h + "input_layernorm.bias", "blocks/ln1/bias"),
             Tensor("lm_head.weight", "head/kernel", transpose=(1, 0), pad=(1, c.vocab_size)),
             Tensor("lm_head.bias", "head/bias", pad=(0, c.vocab_size))]
    return Mapping(tuple(rows), ignore=(r"\.rotary_emb\.inv_freq$",))


# config.json's keys -> the demo's model section
KEYS = {"vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads", "intermediate_size": "d_ff",
        "max_position_embeddings": "seq_len", "layer_norm_eps": "norm_eps"}
# By model_type: what its config.json must say for this model to compute it (anything else is
# refused), its rotary share and activation where it says none (transformers' defaults)
FAMILIES = {"gpt_neox": ({"attention_bias": True}, 0.25, "gelu"),
            "phi": ({"qk_layernorm": False, "tie_word_embeddings": False}, 0.5, "gelu_new")}
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # exact, then tanh's
WINDOW = 2048  # the training window a model declaring more starts with (Pythia's whole context)


def read_config(path: pathlib.Path, hf: dict) -> dict:
    """The model section of a GPT-NeoX or Phi config.json ``hf`` (read from ``path``), in
    transformers 5's form (``rope_parameters``) or the Hub's (Pythia's ``rotary_pct`` and
    ``rotary_emb_base``); what this model does not compute (another activation, no biases,
    grouped-query attention, scaled rotary positions) is refused."""
    fixed, share, act = FAMILIES[hf["model_type"]]
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    if (act := hf.get("hidden_act", act)) not in ACTIVATIONS:
        raise WeightsError(f"{path} has hidden_act {act!r}; this demo's GPT-NeoX computes "
                           f"{', '.join(ACTIVATIONS)}: pass a model with one of them")
    model = section_keys(path, hf, {**fixed, "rope_type": "default", "rope_scaling": None}, KEYS,
                         "GPT-NeoX")
    if hf.get("num_key_value_heads") not in (None, model["n_heads"]):
        raise WeightsError(f"{path} has num_key_value_heads {hf['num_key_value_heads']!r}; this "
                           f"demo's GPT-NeoX gives each head its own keys: pass a model with "
                           f"{model['n_heads']} or none")

    def number(names: tuple[str, ...], default: float) -> float:
        """The first of ``names`` the file has (``rope_parameters``' first, as transformers 5
        reads them), a positive number."""
        found = [(f"rope_parameters.{n}", rope[n]) for n in names if n in rope]
        key, value = (found + [(n, hf[n]) for n in names if n in hf] or [("", default)])[0]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise WeightsError(f"{path} has {key} {value!r}, not a positive number: pass a "
                               "model whose config.json has one")
        return float(value)

    tied, parallel = hf.get("tie_word_embeddings", False), hf.get("use_parallel_residual", True)
    for key, value in (("tie_word_embeddings", tied), ("use_parallel_residual", parallel)):
        if not isinstance(value, bool):
            raise WeightsError(f"{path} has {key} {value!r}, not true or false: pass a model "
                               "whose config.json has one of them")
    phi = hf["model_type"] == "phi"
    return {**model, "seq_len": min(model["seq_len"], WINDOW), "max_positions": model["seq_len"],
            "arch": "neox", "hidden_act": act, "tie_head": tied, "head_bias": phi,
            "parallel_residual": 2 if phi else int(parallel),
            "rope_theta": number(("rope_theta", "rotary_emb_base"), 10000.0),
            "partial_rotary_factor": number(("partial_rotary_factor", "rotary_pct"), share)}


def hf_config(model: dict, dtype: str = "float32") -> dict:
    """A config.json for the demo's ``model`` section: ``PhiForCausalLM``'s with its head
    bias and one norm a layer, else ``GPTNeoXForCausalLM``'s (its rotary keys in transformers
    5's ``rope_parameters`` and in Pythia's form both: transformers 4 reads the second). A
    model no family computes (a head bias with two norms a layer, or one norm without it) is
    refused; the config's checks leave nothing else that would not read back."""
    c = GPTConfig(**model)
    phi = c.parallel_residual == 2
    if c.head_bias != phi:
        raise WeightsError("model.head_bias goes with parallel_residual 2 (Phi's) in Hugging "
                           f"Face's families: no family computes this model; {TENSORS_ALONE}")
    rope = {"rope_type": "default", "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.partial_rotary_factor}
    hf = {"architectures": ["PhiForCausalLM" if phi else "GPTNeoXForCausalLM"],
          "model_type": "phi" if phi else "gpt_neox",
          **{theirs: getattr(c, ours) for theirs, ours in KEYS.items()},
          **FAMILIES["phi" if phi else "gpt_neox"][0],
          "max_position_embeddings": c.max_positions or c.seq_len, "hidden_act": c.hidden_act,
          "tie_word_embeddings": c.tie_head, "rope_parameters": rope, "dtype": dtype}
    if phi:
        return {**hf, "num_key_value_heads": c.n_heads, "rope_theta": c.rope_theta,
                "partial_rotary_factor": c.partial_rotary_factor}
    return {**hf, "use_parallel_residual": bool(c.parallel_residual),
            "rotary_pct": c.partial_rotary_factor, "rotary_emb_base": c.rope_theta}


def write_config(directory: pathlib.Path, model: dict, dtype: str = "float32") -> None:
    """``hf_config``'s config.json in ``directory``."""
    (directory / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2))
