"""A GPT-NeoX decoder (EleutherAI's Pythia, GPT-NeoX-20B and the models trained with their code):
layer norms with biases, a share of each head rotated (``partial_rotary_factor``, Pythia's
0.25), q, k and v in one projection laid out head by head, a GELU MLP with biases, and with
``parallel_residual`` the attention and the MLP both reading the layer's input, their outputs
added to it together. Hugging Face's ``GPTNeoXForCausalLM`` tensor names and config.json, both
ways; its layers under ``nn.scan`` as ``blocks``, as the other models'.
"""

from __future__ import annotations

import json
import pathlib

import flax.linen as nn
import jax

from zero_jax.embedding import take_rows
from zero_jax.gpt import attention
from zero_jax.gpt.llama import Head, rope, rope_frequencies
from zero_jax.gpt.model import GPT, GPTConfig, layer_stack
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
    Rule(r"^head/kernel$", model_dim=-1),
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
        # heads first, then q, k, v: GPT-NeoX's fused rows, so tensor parallelism cuts heads
        qkv = nn.DenseGeneral((c.n_heads, 3, c.dh), name="qkv")(norm("ln1")(x))
        inv = rope_frequencies(c, c.rotary_dim, t)
        q, k = rope(qkv[..., 0, :], inv), rope(qkv[..., 1, :], inv)
        att = attention.causal(q, k, qkv[..., 2, :], c.attention).reshape(b, t, d)
        att = nn.Dense(d, name="proj")(att)
        # the MLP reads the layer's input (parallel) or the attention's output added to it
        y = x if c.parallel_residual else x + att
        exact = c.hidden_act == "gelu"
        mlp = nn.Dense(d, name="fc2")(nn.gelu(nn.Dense(c.d_ff, name="fc1")(norm("ln2")(y)),
                                              approximate=not exact))
        return (x + att + mlp if c.parallel_residual else y + mlp), None


class NeoX(GPT):
    """The demo's model when ``cfg.arch`` is "neox" (GPT's logits of its ``features``)."""

    @nn.compact
    def features(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The last hidden states and the head's kernel (``GPT.features``)."""
        c = self.cfg
        wte = self.param("wte", nn.initializers.normal(0.02), (c.padded_vocab, c.d_model))
        x, _ = layer_stack(NeoXBlock, c, wte.dtype)(c, name="blocks")(
            take_rows(wte, tokens), None)
        x = nn.LayerNorm(epsilon=c.norm_eps, name="ln_f")(x)
        return x, wte.T if c.tie_head else Head(c.padded_vocab, name="head")(c.d_model)


def mapping(c: GPTConfig) -> Mapping:
    """Hugging Face's ``GPTNeoXForCausalLM`` tensors: PyTorch Linear weights ``(out, in)``,
    transposed into Flax kernels, the fused q, k, v rows split head by head; the buffers older
    files hold (the causal mask, rotary frequencies) and a tied head's copy ignored."""
    h = "gpt_neox.layers.{layer}."
    qkv = (c.n_heads, 3, -1)
    rows = [Tensor("gpt_neox.embed_in.weight", "wte", pad=(0, c.vocab_size)),
            Tensor("gpt_neox.final_layer_norm.weight", "ln_f/scale"),
            Tensor("gpt_neox.final_layer_norm.bias", "ln_f/bias"),
            Tensor(h + "attention.query_key_value.weight", "blocks/qkv/kernel",
                   transpose=(1, 0), split=(1, qkv)),
            Tensor(h + "attention.query_key_value.bias", "blocks/qkv/bias", split=(0, qkv))]
    if not c.tie_head:
        rows.append(Tensor("embed_out.weight", "head/kernel", transpose=(1, 0),
                           pad=(1, c.vocab_size)))
    for theirs, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
        rows += [Tensor(f"{h}{theirs}.weight", f"blocks/{ours}/scale"),
                 Tensor(f"{h}{theirs}.bias", f"blocks/{ours}/bias")]
    for theirs, ours in (("attention.dense", "proj"), ("mlp.dense_h_to_4h", "fc1"),
                         ("mlp.dense_4h_to_h", "fc2")):
        rows += [Tensor(f"{h}{theirs}.weight", f"blocks/{ours}/kernel", transpose=(1, 0)),
                 Tensor(f"{h}{theirs}.bias", f"blocks/{ours}/bias")]
    ignore = (r"\.attention\.(masked_)?bias$", r"\.rotary_emb\.inv_freq$",
              *((r"^embed_out\.weight$",) if c.tie_head else ()))
    return Mapping(tuple(rows), ignore=ignore)


# config.json's keys -> the demo's model section; what it must say for this model to compute it
KEYS = {"vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads", "intermediate_size": "d_ff",
        "max_position_embeddings": "seq_len", "layer_norm_eps": "norm_eps"}
FIXED = {"attention_bias": True, "attention_dropout": 0.0, "hidden_dropout": 0.0}
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # exact, then tanh's
WINDOW = 2048  # the training window a model declaring more starts with (Pythia's whole context)


def read_config(path: pathlib.Path, hf: dict) -> dict:
    """The model section of a GPT-NeoX config.json ``hf`` (read from ``path``), in transformers
    5's form (``rope_parameters``) or Pythia's on the Hub (``rotary_pct``, ``rotary_emb_base``);
    what this model does not compute (another activation, no biases, dropout, scaled rotary
    positions) is refused."""
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise WeightsError(f"{path} has hidden_act {act!r}; this demo's GPT-NeoX computes "
                           f"{', '.join(ACTIVATIONS)}: pass a model with one of them")
    for key, want in {**FIXED, "rope_type": "default", "rope_scaling": None}.items():
        got = hf.get(key, rope.get(key, want))
        if got != want:
            raise WeightsError(f"{path} has {key} {got!r}; this demo's GPT-NeoX computes "
                               f"{want!r} only: pass a model with {key} {want!r}")
    try:
        model = {ours: hf[theirs] for theirs, ours in KEYS.items()}
    except KeyError as e:
        raise WeightsError(f"{path} has no {e.args[0]}: pass a GPT-NeoX config.json") from None
    def number(names: tuple[str, ...], default: float) -> float:
        """The first of ``names`` the file has (``rope_parameters``' first, as transformers 5
        reads them), a positive number."""
        found = [(f"rope_parameters.{n}", rope[n]) for n in names if n in rope]
        key, value = (found + [(n, hf[n]) for n in names if n in hf] or [("", default)])[0]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise WeightsError(f"{path} has {key} {value!r}, not a positive number: pass a "
                               "model whose config.json has one")
        return float(value)

    theta = number(("rope_theta", "rotary_emb_base"), 10000.0)
    share = number(("partial_rotary_factor", "rotary_pct"), 0.25)
    tied, parallel = hf.get("tie_word_embeddings", False), hf.get("use_parallel_residual", True)
    for key, value in (("tie_word_embeddings", tied), ("use_parallel_residual", parallel)):
        if not isinstance(value, bool):
            raise WeightsError(f"{path} has {key} {value!r}, not true or false: pass a model "
                               "whose config.json has one of them")
    return {**model, "seq_len": min(model["seq_len"], WINDOW), "max_positions": model["seq_len"],
            "arch": "neox", "hidden_act": act, "tie_head": tied, "parallel_residual": parallel,
            "rope_theta": theta, "partial_rotary_factor": share}


def hf_config(model: dict, dtype: str = "float32") -> dict:
    """A ``GPTNeoXForCausalLM`` config.json for the demo's ``model`` section, its rotary keys in
    transformers 5's ``rope_parameters`` and in Pythia's form both (transformers 4 reads the
    second). The config's checks leave nothing that it would not give back (``read_config``)."""
    c = GPTConfig(**model)
    hf = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
          **{theirs: getattr(c, ours) for theirs, ours in KEYS.items()}, **FIXED,
          "max_position_embeddings": c.max_positions or c.seq_len, "hidden_act": c.hidden_act,
          "tie_word_embeddings": c.tie_head, "use_parallel_residual": c.parallel_residual,
          "rotary_pct": c.partial_rotary_factor, "rotary_emb_base": c.rope_theta,
          "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                              "partial_rotary_factor": c.partial_rotary_factor},
          "dtype": dtype}
    return hf


def write_config(directory: pathlib.Path, model: dict, dtype: str = "float32") -> None:
    """``hf_config``'s config.json in ``directory``."""
    (directory / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2))
