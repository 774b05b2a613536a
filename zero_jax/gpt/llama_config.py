"""The Llama family's config.json, both ways: read into the demo's model section, refusing
what ``zero_jax.gpt.llama`` does not compute (another activation, biases, rope type, a Qwen's
sliding window, ...), and written for a model, then read back to prove transformers would
compute the same model (``hf_config``). Twenty-six ``model_type``s: Llama, Mistral, Phi-3,
Qwen2, Qwen3, Gemma 1-3, OLMo 2 and 3, SmolLM3, Granite, Seed-OSS (written back as the Qwen2
it computes as), StableLM, Cohere 1 and 2, Ernie 4.5, Helium (written back as the Ernie 4.5
it computes as), GLM, GLM-4 and the experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
GraniteMoE and GPT-OSS."""

from __future__ import annotations

import json
import os
import pathlib

from zero_jax.gpt import moe
from zero_jax.gpt.model import GPTConfig
from zero_jax.tensorfiles import WeightsError

HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "d_model",
           "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "num_key_value_heads": "n_kv_heads", "intermediate_size": "d_ff",
           "max_position_embeddings": "seq_len", "rms_norm_eps": "norm_eps"}
# The families whose decoder this is, by config.json's model_type, and what each must say for
# this model to compute it (anything else is refused): the Qwens without their sliding
# windows; Qwen2 with biases on q, k and v (``qkv_bias``), Qwen3 with q and k normed
# (``qk_norm``); Mistral and Phi-3 with a window or none (``sliding_window``), Phi-3 with
# its q, k, v and its gate and up projections fused in two tensors, rotating whole heads or a
# share of each (``partial_rotary_factor``, Phi-4-mini's); the OLMos without biases, OLMoE
# without clipping q, k and v; SmolLM3 without biases or a sliding window; Granite without
# biases; Seed-OSS with biases on q, k and v or none (``attention_bias``), none elsewhere;
# StableLM with LayerNorms (``layer_norm``), q, k, v biases or none (``use_qkv_bias``), a
# share of each head rotated, StableLM 2 12B's q and k norms and parallel residual or none;
# Cohere (Command R, Aya; Command R+ with q and k normed, ``use_qk_norm``) and Cohere 2
# (Command R7B) without biases; Helium and Ernie 4.5 (dense) without biases, their rotary pairs
# side by side; GLM (GLM-4-9B) with q, k, v biases
# or none (``attention_bias``), half of each head rotated in pairs side by side, its gate and
# up projections fused; GLM-4 (0414) with norms of the outputs too (``output_norms``); GPT-OSS
# with biases on every projection of the attention and its experts (``gpt_oss``).
# Dropout rates are training settings, not the model: read past (``hf.dropout``).
_PLAIN = {"hidden_act": "silu", "attention_bias": False}
FAMILIES = {"llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
            "mistral": {"hidden_act": "silu"},
            "phi3": {"hidden_act": "silu"},
            "qwen2": {"hidden_act": "silu", "use_sliding_window": False},
            "qwen3": {"hidden_act": "silu", "attention_bias": False,
                      "use_sliding_window": False},
            "gemma": {"hidden_act": "gelu_pytorch_tanh", "attention_bias": False,
                      "use_bidirectional_attention": None},
            "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                       "use_bidirectional_attention": None},
            "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                            "use_bidirectional_attention": None},
            "olmo2": _PLAIN, "olmo3": _PLAIN,
            "mixtral": {"hidden_act": "silu", "router_jitter_noise": 0.0},
            "qwen2_moe": {"hidden_act": "silu", "qkv_bias": True, "use_sliding_window": False,
                          "decoder_sparse_step": 1, "mlp_only_layers": []},
            "qwen3_moe": {"hidden_act": "silu", "attention_bias": False,
                          "use_sliding_window": False, "decoder_sparse_step": 1,
                          "mlp_only_layers": []},
            "granite": {**_PLAIN, "mlp_bias": False},
            "smollm3": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                        "use_sliding_window": False},
            "olmoe": {**_PLAIN, "clip_qkv": None},
            "seed_oss": {"hidden_act": "silu", "attention_out_bias": False, "mlp_bias": False},
            "stablelm": {"hidden_act": "silu"},
            "cohere": _PLAIN, "cohere2": _PLAIN,
            "helium": {**_PLAIN, "mlp_bias": False},
            "ernie4_5": {"hidden_act": "silu", "use_bias": False},
            "glm": {"hidden_act": "silu"}, "glm4": {"hidden_act": "silu"},
            "granitemoe": _PLAIN,
            "gpt_oss": {"attention_bias": True, "swiglu_alpha": 1.702}}
# Their LayerNorms' epsilon under its own key (read as the RMSNorms')
LAYER_NORM_EPS = ("stablelm", "cohere", "cohere2")
# Their rotary pairs side by side (``rope_interleaved``)
INTERLEAVED = ("cohere", "cohere2", "helium", "ernie4_5", "glm", "glm4")
# Gemma 3's text keys at transformers' defaults: the text_config of its image-text models on
# the Hub (4B and up) holds only those that differ
GEMMA3_TEXT = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
               "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
               "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "tie_word_embeddings": True}
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# yarn as the Qwens use it: these of its keys at transformers' defaults (DeepSeek's mscale not)
YARN_FIXED = {"beta_fast": 32, "beta_slow": 1, "mscale": None, "mscale_all_dim": None}
# The training window a directory's model starts with, where its declared context is longer
# (Hugging Face's run_clm picks its block size so): Llama 3.2 declares 131,072 tokens.
WINDOW = 1024
# config.json's rope scaling keys -> the demo's model section
ROPE_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
             "high_freq_factor": "rope_high_freq_factor",
             "original_max_position_embeddings": "rope_original_max_positions"}


def read_config(directory: str | os.PathLike) -> dict:
    """The model section of the demo's config from the config.json of a directory of one of
    ``FAMILIES``; what this model does not compute (other biases, another
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
        raise WeightsError(f"{path} is missing or not the config.json of a model_type this "
                           f"demo reads ({', '.join(FAMILIES)}): pass a Hugging Face directory "
                           "of one") from None
    quantized = hf.get("quantization_config")
    how = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
    if quantized and (hf["model_type"], how) != ("gpt_oss", "mxfp4"):
        raise WeightsError(f"{path} has quantization_config {how!r}; this demo reads "
                           "floating-point weights, and GPT-OSS's MXFP4 experts: pass a model "
                           "with floating-point weights")
    return _model_section(path, hf)


def _model_section(path: pathlib.Path, hf: dict) -> dict:
    """``read_config``'s model section of the config.json ``hf`` read from ``path``."""
    if hf["model_type"] in LAYER_NORM_EPS:
        hf = {**hf, "rms_norm_eps": hf.get("layer_norm_eps", 1e-5)}
    if hf["model_type"] == "gemma" and hf.get("hidden_act") == "gelu":
        hf["hidden_act"] = "gelu_pytorch_tanh"  # Gemma's first files: meant so (transformers)
    if hf.get("mlp_only_layers", []) is None:  # transformers' default: none
        hf["mlp_only_layers"] = []
    if hf.get("use_bidirectional_attention") is False:
        hf["use_bidirectional_attention"] = None
    if hf["model_type"] in ("gemma3_text", "olmo3"):
        hf = _layer_rope(path, hf)
    model = section_keys(path, hf, FAMILIES[hf["model_type"]], HF_KEYS, "Llama")
    head_dim = hf.get("head_dim") or model["d_model"] // model["n_heads"]
    partial = _partial_rotary(path, hf, head_dim)
    for key, default in (("tie_word_embeddings", False), ("attention_bias", False),
                         ("use_qkv_bias", False), ("use_qk_norm", False),
                         ("qk_layernorm", False), ("use_parallel_residual", False)):
        if not isinstance(hf.get(key, default), bool):
            raise WeightsError(f"{path} has {key} {hf[key]!r}, not true or false: pass a "
                               "model whose config.json has one of them")
    tied = hf.get("tie_word_embeddings", False)
    window = hf.get("sliding_window") if hf["model_type"] in (
        "mistral", "mixtral", "phi3", "gemma2", "gemma3_text", "olmo3", "cohere2",
        "gpt_oss") else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise WeightsError(f"{path} has sliding_window {window!r}, not a number of tokens: pass "
                           "a model whose config.json has one, or null")
    gemma = _gemma(path, hf, model["n_layers"], window) \
        if hf["model_type"].startswith("gemma") else {}
    experts = _moe(path, hf) if hf["model_type"] in moe.NAMES else {}
    kind, n = hf["model_type"], model["n_layers"]
    own = OWN_KEYS[kind](path, hf, n, window) if kind in OWN_KEYS else {}
    return {**model, "seq_len": min(model["seq_len"], WINDOW), **gemma, **experts, **own,
            "max_positions": model["seq_len"], "sliding_window": window or 0,
            "arch": "llama", "tie_head": tied,
            "qkv_bias": _qkv_bias(kind, hf),
            **({"rope_interleaved": True} if kind in INTERLEAVED else {}),
            "qk_norm": hf["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2",
                                            "olmo3", "olmoe")
            or (kind == "cohere" and hf.get("use_qk_norm", False))
            or (kind == "stablelm" and hf.get("qk_layernorm", False)),
            **({"olmo": 1 if hf["model_type"] == "olmoe" else 2}
               if hf["model_type"].startswith("olmo") else {}),
            "head_dim": 0 if head_dim * model["n_heads"] == model["d_model"] else head_dim,
            "partial_rotary_factor": partial, **_rope(path, hf, int(head_dim * partial))}


def _gemma(path: pathlib.Path, hf: dict, n_layers: int, window: int | None) -> dict:
    """Gemma's keys: its version; Gemma 2's and 3's soft caps, scores' scalar, and the layers
    whose window slides, all but every N-th (``layer_types``, else 2 and Gemma 3's
    ``sliding_window_pattern``); Gemma 3's q and k norms and its sliding layers' rope base."""
    if hf["model_type"] == "gemma":
        return {"gemma": 1}
    three = hf["model_type"] == "gemma3_text"
    pattern = _pattern(path, hf, n_layers, hf.get("sliding_window_pattern", 6) if three else 2)
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


def _pattern(path: pathlib.Path, hf: dict, n_layers: int, default: int) -> int:
    """Every how many layers one is full, the others sliding: from ``layer_types`` (none full:
    past the last), else ``default``; layers otherwise are refused."""
    pattern, types = default, hf.get("layer_types")
    if isinstance(types, list):
        pattern = types.index("full_attention") + 1 if "full_attention" in types \
            else n_layers + 1
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1 or (
            types is not None and types != _layer_types(pattern, n_layers)):
        raise WeightsError(f"{path} has layer_types {str(types)[:60]}; this demo slides the "
                           "window of every layer but each N-th: pass a model whose layers "
                           "are so")
    return pattern


def _qkv_bias(kind: str, hf: dict) -> bool:
    """Whether q, k and v have biases: always Qwen2's; Seed-OSS's and GLM's as
    ``attention_bias`` says (true by default), StableLM's as ``use_qkv_bias`` (false); the
    others' never (their fixed keys refuse them)."""
    if kind in ("seed_oss", "glm", "glm4", "gpt_oss"):
        return hf.get("attention_bias", True)
    return kind in ("qwen2", "qwen2_moe") or hf.get("use_qkv_bias", False)


def _olmo3(path: pathlib.Path, hf: dict, n_layers: int, window: int | None) -> dict:
    """OLMo 3's sliding layers: every layer's but each 4th by default, rotating at the base
    ``_layer_rope`` found for them, unscaled."""
    if not window:
        raise WeightsError(f"{path} has sliding_window None; this demo's OLMo 3 slides a "
                           "window: pass a model whose config.json has one")
    return {"window_pattern": _pattern(path, hf, n_layers, 4),
            "rope_local_theta": hf["rope_local_base_freq"]}


def _cohere(path: pathlib.Path, hf: dict, n_layers: int, window: int | None) -> dict:
    """Cohere's: one LayerNorm without biases before the attention and the MLP side by side,
    the logits times ``logit_scale`` (the hidden states divided by
    its inverse, ``logits_scaling``); Cohere 2's window on every layer but each N-th (4th by
    default), the full layers without rotary positions."""
    scale = hf.get("logit_scale", 0.0625)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not \
            0 < scale < float("inf"):
        raise WeightsError(f"{path} has logit_scale {scale!r}, not a positive number: pass a "
                           "model whose config.json has one")
    out = {"layer_norm": 2, "parallel_residual": 2, "logits_scaling": 1 / scale}
    if hf["model_type"] == "cohere2":
        if not window:
            raise WeightsError(f"{path} has sliding_window None; this demo's Cohere 2 slides a "
                               "window: pass a model whose config.json has one")
        pattern = _pattern(path, hf, n_layers, hf.get("sliding_window_pattern", 4))
        out.update(window_pattern=pattern, nope_every=pattern)
    return out


def _granite(path: pathlib.Path, hf: dict, *_) -> dict:
    """Granite's multipliers, 1 where its file has none; its attention's as the scores' scalar
    (``query_pre_attn_scalar``, whose -1/2 power scales the scores)."""
    got = {k: hf.get(k, 1.0) for k in ("embedding_multiplier", "residual_multiplier",
                                       "logits_scaling", "attention_multiplier")}
    for key, value in got.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not \
                0 < value < float("inf"):
            raise WeightsError(f"{path} has {key} {value!r}, not a positive number: pass a "
                               "model whose config.json has one")
    scalar = 1.0 / got.pop("attention_multiplier") ** 2
    return {**{k: float(v) for k, v in got.items()}, "query_pre_attn_scalar": scalar}


def _nope(path: pathlib.Path, hf: dict, n_layers: int, _) -> dict:
    """SmolLM3's layers without rotary positions: every N-th (``no_rope_layers``, 0 where a layer
    has none, else every ``no_rope_layer_interval``-th, 4 by default); layers otherwise are
    refused."""
    layers, every = hf.get("no_rope_layers"), hf.get("no_rope_layer_interval", 4)
    if isinstance(layers, list):
        every = layers.index(0) + 1 if 0 in layers else 0
    if isinstance(every, bool) or not isinstance(every, int) or every < 0 or (
            layers is not None and layers != _no_rope_layers(every, n_layers)):
        raise WeightsError(f"{path} has no_rope_layers {str(layers)[:60]}; this demo takes "
                           "rotary positions off every N-th layer: pass a model whose layers "
                           "are so")
    return {"nope_every": every}


def _gpt_oss(path: pathlib.Path, hf: dict, n_layers: int, window: int | None) -> dict:
    """GPT-OSS's: its conventions (``gpt_oss``), its experts' clamp, every other layer
    sliding (``layer_types``) where it has a window."""
    limit = hf.get("swiglu_limit", 7.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not \
            0 < limit < float("inf"):
        raise WeightsError(f"{path} has swiglu_limit {limit!r}, not a positive number: pass a "
                           "model whose config.json has one")
    return {"gpt_oss": True, "swiglu_limit": float(limit),
            "window_pattern": _pattern(path, hf, n_layers, 2) if window else 0}


# One family's own keys, by model_type: ``(path, hf, n_layers, window) -> keys`` (OLMo 3's
# windows, SmolLM3's layers without positions, Granite's multipliers, Cohere's norms and scale,
# StableLM's LayerNorms, GLM-4's outputs' norms, GPT-OSS's)
OWN_KEYS = {"olmo3": _olmo3, "smollm3": _nope, "granite": _granite, "granitemoe": _granite,
            "gpt_oss": _gpt_oss,
            "cohere": _cohere, "cohere2": _cohere,
            "stablelm": lambda _, hf, *__: {"layer_norm": 1, "parallel_residual": 2 * hf.get(
                "use_parallel_residual", False)},
            "glm4": lambda *_: {"output_norms": True}}


def _moe(path: pathlib.Path, hf: dict) -> dict:
    """A Mixtral's, Qwen-MoE's or OLMoE's experts: how many, how many a token takes, their
    width (the Qwens' ``moe_intermediate_size``), whether the chosen ones' weights renormalize, the
    weight of their load-balancing loss where transformers adds it (``output_router_logits``;
    0.001 by default)."""
    # their experts intermediate_size wide, their chosen weights renormalized
    mixtral = hf["model_type"] in ("mixtral", "granitemoe", "gpt_oss")
    got = {"num_local_experts": hf.get("num_local_experts", hf.get("num_experts")),
           "num_experts_per_tok": hf.get("num_experts_per_tok"),
           "moe_intermediate_size": hf["intermediate_size"] if mixtral or hf["model_type"] ==
           "olmoe" else hf.get("moe_intermediate_size")}
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
    if not isinstance(router := hf.get("output_router_logits", False), bool):
        raise WeightsError(f"{path} has output_router_logits {router!r}, not true or false: "
                           "pass a model whose config.json has one of them")
    coef = hf.get("router_aux_loss_coef", 0.001) if router else 0.0
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
        raise WeightsError(f"{path} has router_aux_loss_coef {coef!r}, not a number of at "
                           "least 0: pass a model whose config.json has one")
    return {"n_experts": n, "experts_per_token": k, "moe_norm_topk": norm,
            "expert_d_ff": 0 if f == hf["intermediate_size"] else f,
            "shared_expert_d_ff": shared, "router_aux_loss_coef": float(coef)}


def _no_rope_layers(every: int, n_layers: int) -> list[int]:
    """transformers' ``no_rope_layers`` of SmolLM3: 0 for every ``every``-th layer (none: 0)."""
    return [int(not every or (i + 1) % every != 0) for i in range(n_layers)]


def _layer_types(pattern: int, n_layers: int) -> list[str]:
    """transformers' ``layer_types`` of Gemma 2 and 3: every ``pattern``-th layer full."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(n_layers)]


def section_keys(path: pathlib.Path, hf: dict, fixed: dict, keys: dict, what: str) -> dict:
    """``hf``'s values of ``keys`` (config.json's name -> the model section's), once each key of
    ``fixed`` (in the file, or its ``rope_parameters``, or absent) is the value this demo's
    ``what`` computes; else one line naming the key."""
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    for key, want in fixed.items():
        if (got := hf.get(key, rope.get(key, want))) != want:
            raise WeightsError(f"{path} has {key} {got!r}; this demo's {what} computes "
                               f"{want!r} only: pass a model with {key} {want!r}")
    try:
        return {ours: hf[theirs] for theirs, ours in keys.items()}
    except KeyError as e:
        raise WeightsError(f"{path} has no {e.args[0]}: pass a complete {what} "
                           "config.json") from None


def _layer_rope(path: pathlib.Path, hf: dict) -> dict:
    """``hf`` with Gemma 3's or OLMo 3's rope keys as the other families have theirs: the full
    layers' (``rope_parameters.full_attention`` in transformers 5's files, else ``rope_theta``
    and ``rope_scaling``; a base of 1,000,000 by default, OLMo 3's 500,000) as the model's, the
    sliding layers' plain base beside them (``rope_local_base_freq``: Gemma 3's 10,000 by
    default; OLMo 3's the full layers' where the file gives one base)."""
    gemma = hf["model_type"] == "gemma3_text"
    params, base = hf.get("rope_parameters"), hf.get("rope_theta", 1e6 if gemma else 5e5)
    local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0) if gemma else base}
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or local
        hf = {**hf, "rope_parameters": params["full_attention"]}
    elif not isinstance(params, dict):
        hf = {**hf, "rope_theta": base}
    theta = local.get("rope_theta", 10000.0 if gemma else 5e5) if isinstance(local, dict) \
        else local
    if not isinstance(local, dict) or local.get("rope_type", "default") != "default" or \
            isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise WeightsError(f"{path} has sliding layers' rope {str(local)[:60]}; this demo "
                           "rotates them at a plain base: pass a model whose config.json has one")
    return {**hf, "rope_local_base_freq": float(theta)}


def _partial_rotary(path: pathlib.Path, hf: dict, dh: int) -> float:
    """The share of each head a Phi-3 (Phi-4-mini: 0.75), a StableLM or a GLM (0.25 and 0.5
    where the file says none, as transformers reads it) rotates, beside the rope keys or among
    them; 1 for the other families, whose transformers classes rotate whole heads."""
    if hf["model_type"] not in ("phi3", "stablelm", "glm", "glm4"):
        return 1.0
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    default = {"stablelm": 0.25, "glm": 0.5, "glm4": 0.5}.get(hf["model_type"], 1.0)
    factor = hf.get("partial_rotary_factor", params.get("partial_rotary_factor", default))
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
    if kind == "yarn":
        if not isinstance(truncate := rope.get("truncate", True), bool):
            raise WeightsError(f"{path} has {where}.truncate {truncate!r}, not true or false: "
                               "pass a model whose config.json has one of them")
        out["rope_truncate"] = truncate
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
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "olmo3": "Olmo3ForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM",
                 "stablelm": "StableLmForCausalLM", "cohere": "CohereForCausalLM",
                 "cohere2": "Cohere2ForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM",
                 "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM",
                 "granitemoe": "GraniteMoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def family_of(c: GPTConfig) -> str:
    """The Hugging Face family that computes ``c``: with experts Qwen3-MoE's (q and k
    normed) or Mixtral's; Gemma's three; Phi-3's where heads rotate in part (only its class
    computes that; its tensors then ``phi3_mapping``'s); Qwen2's with ``qkv_bias``, Qwen3's with
    ``qk_norm``, Mistral's with ``sliding_window``, else Llama's (a Mistral without its window
    computes as one); the OLMos' with their norms (``olmo``), q and k normed: OLMoE's
    (``olmo`` 1) with experts, OLMo 3's (2) with a window, else OLMo 2's; SmolLM3's with
    layers without rotary positions (``nope_every``); Granite's with its multipliers;
    StableLM's with LayerNorms, Cohere's (2 with a window) without their biases; Ernie 4.5's
    with rotary pairs side by side (GLM's where they rotate in part); GPT-OSS's with its
    conventions (``gpt_oss``)."""
    if c.gpt_oss:
        return "gpt_oss"
    if c.layer_norm == 2:
        return "cohere2" if c.sliding_window else "cohere"
    if c.layer_norm:
        return "stablelm"
    if c.rope_interleaved:  # Helium's too, whose output projection is hidden_size wide only
        return ("glm4" if c.output_norms else "glm") if c.rotary_dim < c.dh else "ernie4_5"
    if c.olmo:
        if not c.qk_norm or bool(c.n_experts) != (c.olmo == 1):
            raise WeightsError("model.olmo without qk_norm, 1 without experts or 2 with them "
                               "is no Hugging Face family's (OLMoE, OLMo 2 and 3 norm q and "
                               "k, OLMoE its inputs, with experts): not written")
        return "olmoe" if c.n_experts else "olmo3" if c.sliding_window else "olmo2"
    if c.n_experts:
        if not (c.qk_norm or c.qkv_bias or c.moe_norm_topk):
            raise WeightsError("model.moe_norm_topk false without qk_norm or qkv_bias is no "
                               "Hugging Face family's (Mixtral renormalizes its experts' "
                               "weights): not written")
        if bool(c.shared_expert_d_ff) != c.qkv_bias:
            raise WeightsError("model.shared_expert_d_ff goes with qkv_bias (Qwen2-MoE's) in "
                               "Hugging Face's families: not written")
        granite = c.query_pre_attn_scalar or (c.embedding_multiplier, c.residual_multiplier,
                                              c.logits_scaling) != (1, 1, 1)
        return "qwen2_moe" if c.qkv_bias else "qwen3_moe" if c.qk_norm else "granitemoe" \
            if granite else "mixtral"
    if c.gemma:
        return "gemma" if c.gemma == 1 else "gemma3_text" if c.qk_norm else "gemma2"
    if c.nope_every:
        return "smollm3"
    if c.query_pre_attn_scalar or (c.embedding_multiplier, c.residual_multiplier,
                                   c.logits_scaling) != (1, 1, 1):
        return "granite"
    return ("phi3" if c.rotary_dim < c.dh else "qwen2" if c.qkv_bias else "qwen3"
            if c.qk_norm else "mistral" if c.sliding_window else "llama")


def write_config(directory: pathlib.Path, model: dict, dtype: str = "float32") -> None:
    """``hf_config``'s config.json in ``directory``."""
    (directory / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2))


def hf_config(model: dict, dtype: str = "float32") -> dict:
    """A config.json for the demo's ``model`` section, as transformers reads it, of
    ``family_of`` its model; the rope scaling in the ``rope_scaling`` form Llama 3's files use,
    which transformers 4 and 5 both read (OLMo 3's by layer type, transformers 5's form). Read
    back (``read_config``), it must give the model it was written for: a model no family
    computes (Gemma 2's norms with experts, Gemma's with q/k/v biases) is refused before
    anything is written, naming the first key it loses."""
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
                                 if c.rope_attention_factor else {}),
                              **({} if c.rope_truncate else {"truncate": False})}
    elif c.rope_type != "default":
        keys = ("factor",) if c.rope_type == "linear" else tuple(ROPE_KEYS)
        hf["rope_scaling"] = {"rope_type": c.rope_type,
                              **{k: getattr(c, ROPE_KEYS[k]) for k in keys}}
    if family == "olmo3":  # by layer type, as transformers 5 writes it: from the legacy form
        # it gives the sliding layers its default base (500,000), not rope_theta
        full = {"rope_type": "default", **hf.pop("rope_scaling", {}),
                "rope_theta": hf.pop("rope_theta")}
        hf["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": c.rope_local_theta or c.rope_theta}}
    if family in LAYER_NORM_EPS:
        hf["layer_norm_eps"] = hf.pop("rms_norm_eps")
    _check_read_back(c, family, hf)
    return hf


TENSORS_ALONE = "export its tensors alone (python -m zero_jax.export --format safetensors)"


def _computes(c: GPTConfig) -> dict:
    """What ``c`` computes, in keys of the config: two configs alike here compute alike (a
    window on no layer is none; every N-th layer full, N past the depth, is a window on all)."""
    moe = dict(n_experts=c.n_experts, experts_per_token=c.experts_per_token,
               expert_d_ff=c.expert_d_ff or c.d_ff, moe_norm_topk=c.moe_norm_topk,
               shared_expert_d_ff=c.shared_expert_d_ff,
               router_aux_loss_coef=c.router_aux_loss_coef) if c.n_experts else {}
    rope = {k: getattr(c, k) for k in GPTConfig.__dataclass_fields__
            if k.startswith("rope_") and k not in ("rope_theta", "rope_local_theta")}
    sliding = c.sliding_window and c.window_pattern != 1
    pattern = c.window_pattern if sliding and c.window_pattern <= c.n_layers else 0
    return {"vocab_size": c.vocab_size, "d_model": c.d_model, "n_layers": c.n_layers,
            "n_heads": c.n_heads, "d_ff": c.d_ff, "norm_eps": c.norm_eps,
            "n_kv_heads": c.kv_heads, "rope_theta": c.rope_theta, "head_dim": c.dh,
            "partial_rotary_factor": c.rotary_dim / c.dh, "tie_head": c.tie_head,
            "qkv_bias": c.qkv_bias, "qk_norm": c.qk_norm, "gemma": c.gemma, "olmo": c.olmo,
            "layer_norm": c.layer_norm, "parallel_residual": c.parallel_residual,
            "output_norms": c.output_norms,
            "rope_interleaved": c.rope_interleaved,
            "nope_every": c.nope_every if c.nope_every <= c.n_layers else 0,
            "embedding_multiplier": c.embedding_multiplier,
            "residual_multiplier": c.residual_multiplier, "logits_scaling": c.logits_scaling,
            "attn_softcap": c.attn_softcap, "logit_softcap": c.logit_softcap,
            "sliding_window": c.sliding_window if sliding else 0,
            "window_pattern": pattern,
            "rope_local_theta": (c.rope_local_theta or c.rope_theta) if pattern else 0.0,
            "query_pre_attn_scalar": c.query_pre_attn_scalar or c.dh,
            "gpt_oss": c.gpt_oss, "swiglu_limit": c.swiglu_limit if c.gpt_oss else 0.0,
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
    if family in ("gemma2", "gemma3_text", "olmo3", "cohere2", "gpt_oss"):  # none: not default
        out.update(sliding_window=c.sliding_window or None,
                   layer_types=_layer_types(c.window_pattern or c.n_layers + 1, c.n_layers))
    if family in ("gemma2", "gemma3_text"):
        out.update(attn_logit_softcapping=c.attn_softcap or None,
                   final_logit_softcapping=c.logit_softcap or None,
                   query_pre_attn_scalar=_number(c.query_pre_attn_scalar or c.dh))
        if c.rope_local_theta:
            out["rope_local_base_freq"] = c.rope_local_theta
    if c.n_experts:
        local = family in ("mixtral", "granitemoe", "gpt_oss")  # keys' names, experts' widths
        out.update({"num_local_experts" if local else "num_experts": c.n_experts,
                    "num_experts_per_tok": c.experts_per_token,
                    "output_router_logits": bool(c.router_aux_loss_coef)})
        if c.router_aux_loss_coef:  # else transformers' default, for a run that turns it on
            out["router_aux_loss_coef"] = c.router_aux_loss_coef
        if not local:
            out.update(norm_topk_prob=c.moe_norm_topk)
        if not local and family != "olmoe":  # theirs intermediate_size wide
            out.update(moe_intermediate_size=c.expert_d_ff or c.d_ff)
        if family == "qwen2_moe":
            out.update(shared_expert_intermediate_size=c.shared_expert_d_ff)
    if family.startswith("granite"):
        out.update(embedding_multiplier=c.embedding_multiplier,
                   residual_multiplier=c.residual_multiplier, logits_scaling=c.logits_scaling,
                   attention_multiplier=(c.query_pre_attn_scalar or c.dh) ** -0.5)
    if family == "smollm3":
        out.update(no_rope_layer_interval=c.nope_every, pad_token_id=None,
                   no_rope_layers=_no_rope_layers(c.nope_every, c.n_layers))
    if family == "phi3":  # its original context beside the rope keys, where Phi3Config reads it
        out.update(partial_rotary_factor=c.partial_rotary_factor, pad_token_id=None,
                   original_max_position_embeddings=c.rope_original_max_positions
                   or c.max_positions or c.seq_len)
    if family == "stablelm":  # StableLM 2 12B's q and k norms and parallel residual
        out.update(use_qkv_bias=c.qkv_bias, partial_rotary_factor=c.partial_rotary_factor,
                   qk_layernorm=c.qk_norm, use_parallel_residual=bool(c.parallel_residual))
    if family.startswith("cohere"):
        out.update(logit_scale=1 / c.logits_scaling)
    if family == "cohere":  # Command R+'s q and k norms
        out.update(use_qk_norm=c.qk_norm)
    if family in ("glm", "glm4"):
        out.update(attention_bias=c.qkv_bias, partial_rotary_factor=c.partial_rotary_factor,
                   pad_token_id=None)  # its default is past a smaller vocabulary
    if family == "gpt_oss":
        out.update(swiglu_limit=c.swiglu_limit)
    return out


def _number(x: float) -> int | float:
    """A whole number as an int: the form transformers' strict configs type it in."""
    return int(x) if float(x).is_integer() else x
