"""Run configuration: YAML files in ``configs/`` over the defaults below, then ``--set`` overrides.

Every key that exists is in ``DEFAULTS``; anything else is a mistake and is refused, as is a
value whose type does not match the default's, and a key given twice in one file. Values are
read as YAML (``yaml.safe_load``), except that a number with an exponent is a float however
Python would write it (``3e-4``, ``1e30``, ``1.0e30``; YAML 1.1 reads these as strings), and a
float key takes any spelling Python's ``float()`` reads.
"""

from __future__ import annotations

import copy
import math
import pathlib
import re
from typing import Any

import yaml

from zero_jax.blocks import GATHER, REMAT
from zero_jax.gpt.attention import IMPLEMENTATIONS
from zero_jax.gpt.llama_config import ROPE_TYPES
from zero_jax.gpt.neox import ACTIVATIONS as NEOX_ACTIVATIONS
from zero_jax.offload import Nvme


def _shipped() -> pathlib.Path:
    """The shipped YAML configs: the repository's ``configs/`` in a clone, which a built wheel
    installs beside the demo as its package data (``zero_jax/gpt/configs``)."""
    here = pathlib.Path(__file__).resolve().parent
    packaged = here / "configs"
    return packaged if packaged.is_dir() else here.parents[1] / "configs"


CONFIG_DIR = _shipped()

DEFAULTS: dict[str, dict[str, Any]] = {
    # arch gpt2 (GPT-2's layer norms, learned positions, tied head) or llama (RMSNorm, rotary
    # positions of base rope_theta scaled as rope_type default, linear, llama3, longrope
    # (Phi-3's: a factor per rotary pair, short and long, cos and sin scaled) or yarn says, SwiGLU,
    # n_kv_heads key/value heads, 0: n_heads; the head tied to the embedding with tie_head;
    # biases on q, k and v with qkv_bias, as Qwen2; q and k normed with qk_norm, as Qwen3;
    # heads head_dim wide, 0: d_model / n_heads; max_positions the context it declares, which
    # an export writes back, 0: seq_len; sliding_window Mistral's, 0: none; gemma 1 or 2,
    # Gemma's conventions, with the soft caps, query scalar and window pattern of Gemma 2 and
    # 3; olmo 1 or 2, OLMo's norms; nope_every, SmolLM3's layers without rotary positions;
    # Granite's multipliers; gpt_oss, GPT-OSS's sinks, biases and clamped experts; or neox
    # (GPT-NeoX's and Phi's: layer norms with biases, rotary positions on a share of each head,
    # a GELU MLP, parallel_residual, Phi's head_bias):
    # GPTConfig).
    "model": {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 512,
              "seq_len": 64, "remat": "auto", "arch": "gpt2", "norm_eps": 1e-5,
              "n_kv_heads": 0, "rope_theta": 10000.0, "rope_type": "default",
              "rope_factor": 1.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
              "rope_original_max_positions": 0, "rope_short_factor": [],
              "rope_long_factor": [], "rope_attention_factor": 0.0, "rope_truncate": True,
              "partial_rotary_factor": 1.0, "tie_head": False,
              "qkv_bias": False, "qk_norm": False, "head_dim": 0, "max_positions": 0,
              "sliding_window": 0, "gemma": 0, "olmo": 0, "layer_norm": 0, "window_pattern": 0,
              "rope_interleaved": False, "output_norms": False,
              "nope_every": 0, "gpt_oss": False, "swiglu_limit": 7.0,
              "rope_local_theta": 0.0, "parallel_residual": 0, "head_bias": False,
              "hidden_act": "gelu",
              "n_experts": 0, "experts_per_token": 2, "expert_d_ff": 0, "moe_norm_topk": True,
              "shared_expert_d_ff": 0, "router_aux_loss_coef": 0.0,
              "router_aux_loss_global": False, "router_z_loss_coef": 0.0,
              "expert_capacity_factor": 0.0, "eval_capacity_factor": 0.0,
              "embedding_multiplier": 1.0,
              "residual_multiplier": 1.0, "logits_scaling": 1.0,
              "attn_softcap": 0.0, "logit_softcap": 0.0,
              "query_pre_attn_scalar": 0.0, "attention": "auto", "vocab_multiple": 128,
              "scan_unroll": 1},
    # frozen_modules: not trained (no gradient, no optimizer state), e.g. ["wpe"].
    # schedule cosine: warmup, then cosine decay to 10% at decay_steps; constant: warmup, then
    # lr (DeepSpeed's WarmupLR, whose default warmup_type is log: min + (lr - min) * log(t + 1)
    # / log(warmup_steps)); linear: WarmupLR's warmup, then a straight line down to
    # warmup_min_lr at decay_steps (DeepSpeed's WarmupDecayLR); deepspeed_cosine: WarmupLR's
    # warmup, then cosine down to cos_min_ratio x lr at decay_steps (DeepSpeed's
    # WarmupCosineLR). Warmup starts at warmup_min_lr; decay_steps 0: the run's last step.
    "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_steps": 20, "decay_steps": 0,
                  "schedule": "cosine", "warmup_type": "linear", "warmup_min_lr": 0.0,
                  "cos_min_ratio": 1e-4, "b1": 0.9, "b2": 0.95,
                  "eps": 1e-8, "weight_decay": 0.1, "momentum": 0.0, "clip_norm": 1.0,
                  "frozen_modules": []},
    # ckpt_load_path: a checkpoint directory to resume from (its latest complete step).
    # max_bad_steps: train.py stops (exit 3) after this many steps in a row whose loss or
    # gradient is not finite, and saves nothing from the first of them on (0: never stops,
    # saves as usual, and exits 3 if the run ends in such steps).
    # eval_every > 0: every that many steps and at the last, the mean loss of eval_batches
    # batches of batch_size windows from the data's last tenth, which training then never
    # reads; 0: no evaluation, training reads all of it.
    "train": {"batch_size": 32, "accum_steps": 1, "steps": 400, "seed": 0,
              "ckpt_load_path": "", "max_bad_steps": 5, "eval_every": 0, "eval_batches": 4,
              "completion_only": False},
    # zero3_size > 0: hierarchical ZeRO, stage 3 within groups of that many devices.
    # transformer_layers: the layer stacks gathered one layer at a time ([]: the whole model
    # once per step); ignored_modules: left out of ZeRO, whole on every device;
    # offload_grads: the gradient accumulator waits in host memory between microbatches.
    # offload_optimizer (ZeRO-Offload): device cpu puts the fp32 master and optimizer state of
    # that fraction (ratio) of the parameters in host memory and updates them there;
    # offload_params cpu (stage 3, ZeRO-Infinity's CPU tier): the parameter shards too.
    # offload_optimizer device nvme (ZeRO-Infinity's NVMe tier): the whole master and optimizer
    # state in files under nvme_path, updated on the host buffer_count bands of about
    # buffer_mb MiB at a time.
    # bucket_mb: a layer's leaves travel in flat buffers of at most this many MiB (0: one
    # collective per leaf); quantize_weights / quantize_grads int8 (ZeRO++'s qwZ / qgZ): stage
    # 3's parameter all-gathers / stages 2-3's gradient reduce-scatters in int8, one fp32 scale
    # per quantize_block elements. prefetch: at stage 3, each scanned stack's loop gathers layer
    # i+1 while layer i computes (and i-1 in the backward, reducing layer i+1's gradient), for
    # one more gathered layer and one more whole layer gradient; on wherever it applies.
    # partition_activations (ZeRO-R's Pa, with tensor parallelism): each block's saved input
    # cut over the model axis.
    # tile_mb > 0 (stage 3, ZeRO-Infinity's memory-centric tiling): a layer's parameter above
    # this many MiB is never gathered whole; its Dense gathers it tile by tile (no prefetch).
    # gather: what stage 3 gathers at once, each whole block (FSDP2) or each module with
    # parameters of its own as it runs (DeepSpeed ZeRO-3): less memory, more gathers; prefetch
    # then gathers one module ahead.
    "zero": {"stage": 3, "min_shard_elems": 0, "zero3_size": 0, "transformer_layers": ["blocks"],
             "ignored_modules": [], "offload_grads": False,
             "offload_optimizer": {"device": "none", "ratio": 1.0, "nvme_path": "",
                                   "buffer_count": 4, "buffer_mb": 64.0},
             "offload_params": "none",
             "bucket_mb": 25, "quantize_weights": "none", "quantize_grads": "none",
             "quantize_block": 64, "prefetch": True, "partition_activations": False,
             "tile_mb": 0.0, "gather": "block"},
    # tensor_parallel T: a 2-D mesh, data x model, T adjacent devices per tensor-parallel group
    # (Megatron's layout of each block, zero_jax.gpt.model.TENSOR_PARALLEL); ZeRO over data.
    "mesh": {"tensor_parallel": 1},
    # auto: bf16 compute on accelerators, fp32 on the CPU mesh; reduce_dtype auto = param_dtype.
    # fp16 turns on DeepSpeed's dynamic loss scaler, with its defaults below.
    "precision": {"param_dtype": "auto", "reduce_dtype": "auto", "accum_dtype": "fp32",
                  "autocast_input": True, "autocast_output": True, "skip_nonfinite": True,
                  "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                  "min_loss_scale": 1.0},
}

INT32_MAX = 2**31 - 1  # token ids and the step counter are int32 (JAX without x64)
OPTIMIZERS = ("adamw", "adam", "sgd")
ARCHS = ("gpt2", "llama", "neox")
SCHEDULES = ("cosine", "constant", "linear", "deepspeed_cosine")
WARMUPS = ("linear", "log")


class ConfigError(ValueError):
    """A configuration the run cannot use; the message says what to change."""


def resolve(name: str) -> pathlib.Path:
    """A config path, or the name of a file in ``configs/`` ("tiny", "gpt2-124m")."""
    path = pathlib.Path(name)
    if path.is_dir():
        raise ConfigError(f"--config {name} is a directory: pass a YAML file or a name in "
                          f"{CONFIG_DIR}")
    if path.exists():
        return path
    shipped = CONFIG_DIR / f"{name.removesuffix('.yaml')}.yaml"
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config {name} not found: pass a YAML path or one of {names}")


class DuplicateKeyError(yaml.YAMLError):
    """A mapping holds the same key twice; YAML would silently keep the last."""


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, but exponent floats as Python writes them (``3e-4``), and a
    mapping that holds a key twice is an error naming the key and the lines."""

    def construct_document(self, node):
        self._no_duplicates(node, "", set())
        return super().construct_document(node)

    def _no_duplicates(self, node, where: str, visited: set) -> None:
        if id(node) in visited:  # an alias seen before
            return
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._no_duplicates(item, f"{where}[{i}]", visited)
        if not isinstance(node, yaml.MappingNode):
            return
        lines: dict = {}
        for key_node, value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # << merges: overriding is their point
                continue
            key = (self.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode)
                   else id(key_node))
            dotted = f"{where}.{key}" if where else str(key)
            lines.setdefault(key, (dotted, []))[1].append(key_node.start_mark.line + 1)
            self._no_duplicates(value, dotted, visited)
        for dotted, at in lines.values():
            if len(at) > 1:
                times = "twice" if len(at) == 2 else f"{len(at)} times"
                raise DuplicateKeyError(f"{dotted} is given {times}, on lines "
                                        f"{', '.join(map(str, at[:-1]))} and {at[-1]}")


_Loader.add_implicit_resolver(  # after YAML 1.1's own: only what it reads as a string
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9][0-9_]*$"),
    list("-+0123456789."))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def _problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong, and where."""
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark else what


def _merge(base: dict, update: dict, where: str = "") -> None:
    for key, value in update.items():
        dotted = f"{where}{key}"
        if key not in base:
            known = ", ".join(f"{where}{k}" for k in base)
            raise ConfigError(f"unknown config key {dotted}: known keys are {known}")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {dotted} is a section; set its keys, "
                                  f"e.g. {dotted}.{next(iter(base[key]))}")
            _merge(base[key], value, dotted + ".")
        else:
            if dotted == "model.remat" and isinstance(value, bool):  # before policies: on/off
                value = "full" if value else "none"
            base[key] = _check_type(dotted, base[key], value)


NUMBER_LISTS = ("model.rope_short_factor", "model.rope_long_factor")


def _check_type(key: str, default: Any, value: Any) -> Any:
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        if isinstance(value, str):  # any spelling float() reads: "1_000.5", "inf", " 2e-3 "
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif key in NUMBER_LISTS:
        ok = isinstance(value, list) and all(isinstance(v, (int, float))
                                             and not isinstance(v, bool) for v in value)
        value = [float(v) for v in value] if ok else value
    elif isinstance(default, list):  # lists of names
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        kind = ("list of numbers" if key in NUMBER_LISTS else "list of names"
                if isinstance(default, list) else type(default).__name__)
        raise ConfigError(f"config key {key} must be {'an' if kind == 'int' else 'a'} {kind}, "
                          f"got {value!r}")
    return value


def parse_override(text: str) -> dict:
    """``"optimizer.lr=1e-3"`` as the nested dict ``{"optimizer": {"lr": 0.001}}``."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {text}: write KEY=VALUE, e.g. --set optimizer.name=sgd")
    try:
        value = _yaml(raw) if raw else ""
    except DuplicateKeyError as e:
        raise ConfigError(f"--set {text}: {e} of the value of {key}: keep one") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text}: the value is not valid YAML: {_problem(e)}; quote "
                          f"it for a string, e.g. --set '{key}=\"{raw}\"'") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load(name: str = "tiny", overrides: list[str] = ()) -> dict:
    """The defaults, updated by the YAML file ``name`` and then by each ``KEY=VALUE``."""
    config = merge(name, overrides)
    validate(config)
    return config


def merge(name: str = "tiny", overrides: list[str] = ()) -> dict:
    """``load`` before ``validate``: each key known and of its type, the whole not checked yet
    (a DeepSpeed config read after it may be what completes it)."""
    config = copy.deepcopy(DEFAULTS)
    path = resolve(name)
    try:
        data = _yaml(path.read_text()) or {}
    except DuplicateKeyError as e:
        raise ConfigError(f"config {path}: {e}: keep one") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections (model:, train:, ...)")
    _merge(config, data)
    for text in overrides:
        _merge(config, parse_override(text))
    return config


def validate(config: dict) -> None:
    """Every value checked once, section by section, before anything is built."""
    m, o, z = config["model"], config["optimizer"], config["zero"]
    if m["remat"] not in ("auto", *REMAT):
        raise ConfigError(f"model.remat must be one of auto, {', '.join(REMAT)} (got "
                          f"{m['remat']!r}): "
                          f"what each block saves for its backward")
    if o["name"] not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name {o['name']!r} is not one of {', '.join(OPTIMIZERS)}")
    if z["stage"] not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3 (got {z['stage']})")
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
        _at_least(config, "model", key, 1)
    if m["attention"] not in IMPLEMENTATIONS:
        raise ConfigError(f"model.attention must be one of {', '.join(IMPLEMENTATIONS)} (got "
                          f"{m['attention']!r})")
    _at_least(config, "model", "vocab_multiple", 1)
    _at_least(config, "model", "scan_unroll", 1)
    if m["arch"] not in ARCHS:
        raise ConfigError(f"model.arch must be one of {', '.join(ARCHS)} (got {m['arch']!r})")
    if not m["norm_eps"] > 0 or not m["rope_theta"] > 0 or m["n_kv_heads"] < 0 or \
            m["n_heads"] % (m["n_kv_heads"] or m["n_heads"]):
        raise ConfigError(f"model.norm_eps and model.rope_theta must be above 0 and "
                          f"model.n_kv_heads divide model.n_heads {m['n_heads']} (got "
                          f"{m['norm_eps']}, {m['rope_theta']}, {m['n_kv_heads']})")
    if m["vocab_size"] > INT32_MAX:
        raise ConfigError(f"model.vocab_size must be at most {INT32_MAX} (got "
                          f"{m['vocab_size']}): token ids are int32")
    _check_llama(m)
    _check_neox(m)
    if not m["head_dim"] and m["d_model"] % m["n_heads"]:
        raise ConfigError(f"model.d_model {m['d_model']} is not divisible by model.n_heads "
                          f"{m['n_heads']}")
    for key in ("batch_size", "steps", "accum_steps"):
        _at_least(config, "train", key, 1)
    _at_least(config, "train", "seed", 0)
    _at_least(config, "train", "max_bad_steps", 0)
    _at_least(config, "train", "eval_every", 0)
    _at_least(config, "train", "eval_batches", 1)
    for key in ("train.steps", "optimizer.warmup_steps", "optimizer.decay_steps"):
        section, name = key.split(".")
        if config[section][name] > INT32_MAX:  # a warmup that long keeps the lr near its start
            raise ConfigError(f"{key} must be at most {INT32_MAX} (got {config[section][name]}): "
                              "the step counter is an int32, which never gets there")
    if config["train"]["seed"] >= 2**32:  # jax.random.key keeps the low 32 bits (no x64)
        raise ConfigError(f"train.seed must be 0 to {2**32 - 1} (got {config['train']['seed']}): "
                          "jax.random.key keeps 32 bits of it")
    _check_rope(m)
    _check_optimizer(config)
    _check_zero(config)
    _check_tensor_parallel(config)
    _check_precision(config)


def _check_llama(m: dict) -> None:
    """What only the Llama decoder computes, asked of it alone, and as one family has it."""
    for key, zero in (("head_dim", "d_model / n_heads"), ("max_positions", "seq_len"),
                      ("sliding_window", "none")):
        if m[key] < 0:
            raise ConfigError(f"model.{key} must be at least 0 (got {m[key]}): 0 is {zero}")
    for key in ("attn_softcap", "logit_softcap", "query_pre_attn_scalar", "window_pattern",
                "nope_every",
                "rope_local_theta", "n_experts", "expert_d_ff", "shared_expert_d_ff",
                "router_aux_loss_coef", "router_z_loss_coef", "expert_capacity_factor",
                "eval_capacity_factor"):
        if not 0 <= m[key] < math.inf:
            raise ConfigError(f"model.{key} must be a finite number of at least 0 (got "
                              f"{m[key]}): 0 is none")
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if not 0 < m[key] < math.inf:
            raise ConfigError(f"model.{key} must be a finite number above 0 (got {m[key]}): "
                              "1 is none")
    _check_norms(m)
    if m["arch"] != "llama" and (m["head_dim"] or m["qkv_bias"] or m["qk_norm"]
                                 or m["sliding_window"] or m["gemma"] or m["layer_norm"]
                                 or m["rope_interleaved"] or m["output_norms"]
                                 or m["olmo"] or m["attn_softcap"] or m["logit_softcap"]
                                 or m["query_pre_attn_scalar"] or m["window_pattern"]
                                 or m["rope_local_theta"] or m["n_experts"] or m["nope_every"]
                                 or m["gpt_oss"]
                                 or (m["embedding_multiplier"], m["residual_multiplier"],
                                     m["logits_scaling"]) != (1, 1, 1)):
        raise ConfigError("model.head_dim, model.qkv_bias, model.qk_norm, "
                          "model.sliding_window, Gemma's, OLMo's, StableLM's, Cohere's, "
                          "SmolLM3's, Granite's and GPT-OSS's keys and model.n_experts are the "
                          "llama arch's: set model.arch=llama, or leave them out")
    if (m["shared_expert_d_ff"] or m["router_aux_loss_coef"] or m["router_z_loss_coef"]
            or m["expert_capacity_factor"] or m["eval_capacity_factor"]) and not m["n_experts"]:
        raise ConfigError("model.shared_expert_d_ff, model.router_aux_loss_coef, "
                          "model.router_z_loss_coef, model.expert_capacity_factor and "
                          "model.eval_capacity_factor are a mixture of experts': set "
                          "model.n_experts too")
    if m["router_aux_loss_global"] and not m["router_aux_loss_coef"]:
        raise ConfigError("model.router_aux_loss_global says where the experts' balance loss "
                          "is taken: set its weight, model.router_aux_loss_coef, too")
    if m["n_experts"] and not 1 <= m["experts_per_token"] <= m["n_experts"]:
        raise ConfigError(f"model.experts_per_token must be 1 to model.n_experts "
                          f"({m['n_experts']}) (got {m['experts_per_token']})")
    if (m["window_pattern"] or m["rope_local_theta"]) and not m["sliding_window"]:
        raise ConfigError("model.window_pattern and model.rope_local_theta are the sliding "
                          "layers' (Gemma 2's and 3's): set model.sliding_window too")
    if m["gpt_oss"] and (not m["n_experts"] or m["qk_norm"] or m["shared_expert_d_ff"]):
        raise ConfigError("model.gpt_oss is GPT-OSS's mixture of experts, without q and k norms "
                          "or a shared expert: set model.n_experts, leave the others out")
    if not 0 < m["swiglu_limit"] < math.inf:
        raise ConfigError(f"model.swiglu_limit must be a finite number above 0 (got "
                          f"{m['swiglu_limit']}): GPT-OSS's is 7")
    if m["qkv_bias"] + m["qk_norm"] + bool(m["sliding_window"]) > 1 + bool(
            m["gemma"] or m["olmo"] or m["gpt_oss"] or m["layer_norm"]):
        raise ConfigError("model.qkv_bias, model.qk_norm and model.sliding_window together are "
                          "no Hugging Face family's decoder (Qwen2 has the first, Qwen3 the "
                          "second, Mistral the third): set one")


def _check_neox(m: dict) -> None:
    """What only the GPT-NeoX decoder computes, asked of it alone; what it lacks refused."""
    if m["hidden_act"] not in NEOX_ACTIVATIONS:
        raise ConfigError(f"model.hidden_act must be one of {', '.join(NEOX_ACTIVATIONS)} (got "
                          f"{m['hidden_act']!r}): GELU, exact or tanh's")
    if m["parallel_residual"] not in (0, 1, 2):
        raise ConfigError(f"model.parallel_residual must be 0, 1 or 2 (got "
                          f"{m['parallel_residual']!r}): the MLP after the attention, beside it "
                          "with a norm each, or beside it with one norm")
    if m["arch"] != "neox" and (m["head_bias"] or m["hidden_act"] != "gelu" or
                                m["parallel_residual"] not in ((0, 2) if m["arch"] == "llama"
                                                               else (0,))):
        raise ConfigError("model.parallel_residual, model.head_bias and model.hidden_act are "
                          "the neox arch's (parallel_residual 2, one norm for both, the llama "
                          "arch's too): set model.arch=neox, or leave them out")
    if m["head_bias"] and m["tie_head"]:
        raise ConfigError("model.head_bias is an untied head's (Phi's): set model.tie_head "
                          "false, or leave model.head_bias out")
    if m["arch"] == "neox" and (m["n_kv_heads"] not in (0, m["n_heads"])
                                or m["rope_type"] != "default"):
        raise ConfigError("model.n_kv_heads and model.rope_type are not the neox arch's (every "
                          "head its own keys, rotary positions unscaled): leave them out")
    if m["arch"] == "gpt2" and m["max_positions"]:
        raise ConfigError("model.max_positions is the context a Hugging Face export declares "
                          "for rotary positions (the llama and neox archs); GPT-2's is seq_len: "
                          "leave it out")


def _check_norms(m: dict) -> None:
    """The Llama decoder's norm conventions: Gemma's, OLMo's, LayerNorms; one at a time."""
    if m["gemma"] not in (0, 1, 2):
        raise ConfigError(f"model.gemma must be 0, 1 or 2 (got {m['gemma']})")
    if m["olmo"] not in (0, 1, 2):
        raise ConfigError(f"model.olmo must be 0, 1 or 2 (got {m['olmo']})")
    if m["layer_norm"] not in (0, 1, 2):
        raise ConfigError(f"model.layer_norm must be 0, 1 or 2 (got {m['layer_norm']}): "
                          "RMSNorms, LayerNorms with biases, without")
    if bool(m["olmo"]) + bool(m["gemma"]) + bool(m["layer_norm"]) > 1:
        raise ConfigError("model.olmo, model.gemma and model.layer_norm make or place the norms "
                          "each its own way: set one")
    if m["olmo"] == 1 and not m["qk_norm"]:
        raise ConfigError("model.olmo 1 norms q and k over all heads at once: set "
                          "model.qk_norm too")
    if m["output_norms"] and (m["gemma"] or m["olmo"]):
        raise ConfigError("model.output_norms adds norms of the outputs to Llama's, which "
                          "model.gemma 2 and model.olmo 2 place their own way: set one")


def _check_rope(m: dict) -> None:
    """The rotary positions' scaling, as Hugging Face's rope types check theirs."""
    kind = m["rope_type"]
    if kind not in ROPE_TYPES:
        raise ConfigError(f"model.rope_type must be one of {', '.join(ROPE_TYPES)} (got "
                          f"{kind!r})")
    if kind != "default" and not m["rope_factor"] > 0:
        raise ConfigError(f"model.rope_factor must be above 0 (got {m['rope_factor']})")
    if kind == "llama3" and not (0 < m["rope_low_freq_factor"] < m["rope_high_freq_factor"]
                                 and m["rope_original_max_positions"] >= 1):
        raise ConfigError(f"rope_type llama3 needs 0 < model.rope_low_freq_factor < "
                          f"model.rope_high_freq_factor and model.rope_original_max_positions "
                          f">= 1 (got {m['rope_low_freq_factor']}, "
                          f"{m['rope_high_freq_factor']}, {m['rope_original_max_positions']})")
    dh = m["head_dim"] or m["d_model"] // m["n_heads"]
    rotary = int(dh * m["partial_rotary_factor"])
    if not (0 < m["partial_rotary_factor"] <= 1 and rotary >= 2 and rotary % 2 == 0):
        raise ConfigError(f"model.partial_rotary_factor {m['partial_rotary_factor']} must rotate "
                          f"an even part of each {dh}-wide head: a share in (0, 1] of it")
    if m["partial_rotary_factor"] < 1 and (m["arch"] == "gpt2" or (
            (m["qkv_bias"] or m["qk_norm"]) and not (m["layer_norm"] or m["rope_interleaved"]))):
        raise ConfigError("model.partial_rotary_factor below 1 is Phi-3's (the llama arch, "
                          "without qkv_bias or qk_norm), StableLM's (layer_norm), GLM's "
                          "(rope_interleaved) and GPT-NeoX's: set it to 1")
    pairs = rotary // 2
    if kind == "longrope" and not (m["rope_original_max_positions"] >= 1
                                   and m["rope_attention_factor"] >= 0 and all(
                                       len(f) == pairs and min(f) > 0 for f in
                                       (m["rope_short_factor"], m["rope_long_factor"]))):
        raise ConfigError(f"rope_type longrope needs model.rope_short_factor and "
                          f"model.rope_long_factor, {pairs} positive numbers each (one per "
                          f"rotary pair), model.rope_original_max_positions >= 1 and "
                          f"model.rope_attention_factor >= 0")
    if kind == "yarn" and not (m["rope_original_max_positions"] >= 1
                               and m["rope_attention_factor"] >= 0):
        raise ConfigError("rope_type yarn needs model.rope_original_max_positions >= 1 and "
                          "model.rope_attention_factor >= 0")


def _check_optimizer(config: dict) -> None:
    o = config["optimizer"]
    for key in ("lr", "warmup_steps", "decay_steps", "eps", "weight_decay", "momentum",
                "clip_norm", "warmup_min_lr", "cos_min_ratio"):
        _at_least(config, "optimizer", key, 0)
    if o["lr"] == 0:  # a run that trains nothing would still end "done"
        raise ConfigError("optimizer.lr is 0: no step would change the parameters; pass the "
                          "schedule's peak learning rate, e.g. --set optimizer.lr=3e-3")
    for key, allowed in (("schedule", SCHEDULES), ("warmup_type", WARMUPS)):
        if o[key] not in allowed:
            raise ConfigError(f"optimizer.{key} must be one of {', '.join(allowed)} (got "
                              f"{o[key]!r})")
    if o["warmup_type"] == "log" and (o["schedule"] == "cosine" or o["warmup_steps"] < 2):
        raise ConfigError("optimizer.warmup_type log is DeepSpeed WarmupLR's warmup: it needs "
                          "optimizer.schedule constant, linear or deepspeed_cosine and "
                          "optimizer.warmup_steps of at least 2")
    if o["cos_min_ratio"] > 1:
        raise ConfigError(f"optimizer.cos_min_ratio must be at most 1 (got {o['cos_min_ratio']:g})"
                          ": deepspeed_cosine ends at that fraction of optimizer.lr")
    for key in ("b1", "b2", "momentum"):
        if not 0 <= o[key] < 1:
            raise ConfigError(f"optimizer.{key} must be in [0, 1) (got {o[key]})")
    if o["weight_decay"] > 1:  # adamw's is decoupled: each step scales by 1 - lr * weight_decay
        raise ConfigError(f"optimizer.weight_decay must be at most 1 (got {o['weight_decay']:g}):"
                          " it is decoupled, each step shrinks the parameters by lr x "
                          "weight_decay of themselves; typical values are 0 to 0.1")
    if 0 < o["decay_steps"] < o["warmup_steps"]:
        raise ConfigError(f"optimizer.decay_steps {o['decay_steps']} ends the schedule before "
                          f"its warmup of {o['warmup_steps']} steps does: pass decay_steps of at "
                          "least warmup_steps, or 0 to decay over the whole run")


def _check_zero(config: dict) -> None:
    z = config["zero"]
    for key in ("min_shard_elems", "zero3_size", "bucket_mb", "tile_mb"):
        _at_least(config, "zero", key, 0)
    _at_least(config, "zero", "quantize_block", 1)
    for key, least in (("quantize_weights", 3), ("quantize_grads", 2)):
        if z[key] not in ("none", "int8"):
            raise ConfigError(f"zero.{key} must be none or int8 (got {z[key]!r})")
        if z[key] == "int8" and z["stage"] < least:
            raise ConfigError(f"zero.{key} int8 quantizes what stage {least}"
                              f"{'' if least == 3 else '-3'} communicates; stage {z['stage']} "
                              f"does not: use --stage {least} or --set zero.{key}=none")
    if z["gather"] not in GATHER:
        raise ConfigError(f"zero.gather must be one of {', '.join(GATHER)} (got {z['gather']!r})")
    if z["gather"] == "module" and z["stage"] != 3:
        raise ConfigError(f"zero.gather module gathers stage 3's modules one at a time; stage "
                          f"{z['stage']} gathers none: use --stage 3 or --set zero.gather=block")
    off = z["offload_optimizer"]
    for key, device, allowed in [("offload_optimizer.device", off["device"], ("none", "cpu",
                                                                            "nvme")),
                                 ("offload_params", z["offload_params"], ("none", "cpu"))]:
        if device not in allowed:
            raise ConfigError(f"zero.{key} must be {', '.join(allowed[:-1])} or {allowed[-1]} "
                              f"(got {device!r})")
    if off["device"] == "nvme" and (not off["nvme_path"] or off["ratio"] != 1):
        raise ConfigError("zero.offload_optimizer.device nvme keeps the whole optimizer in "
                          "files: set zero.offload_optimizer.nvme_path=DIR and ratio 1")
    if off["device"] == "nvme" and config["optimizer"]["clip_norm"] > 0:
        raise ConfigError("zero.offload_optimizer.device nvme updates the optimizer state band "
                          "by band, where a global-norm clip cannot be computed: set "
                          "optimizer.clip_norm=0")
    if off["buffer_count"] < 3 or not Nvme.MIN_CHUNK_MB <= off["buffer_mb"] < math.inf:
        raise ConfigError(f"zero.offload_optimizer.buffer_count must be at least 3 and "
                          f"buffer_mb a finite number of at least {Nvme.MIN_CHUNK_MB:g} (4 KiB, "
                          f"a disk page: smaller bands are many more reads of a page each) (got "
                          f"{off['buffer_count']}, {off['buffer_mb']:g})")
    if z["offload_params"] == "cpu" and (z["stage"] != 3 or off["device"] == "none"
                                         or off["ratio"] != 1):
        raise ConfigError("zero.offload_params cpu needs stage 3 and the whole optimizer "
                          "offloaded: --set zero.offload_optimizer.device=cpu (ratio 1), or "
                          "nvme")
    if not 0 <= off["ratio"] <= 1:
        raise ConfigError(f"zero.offload_optimizer.ratio is the fraction of the optimizer state "
                          f"offloaded, 0 to 1 (got {off['ratio']})")


def _check_precision(config: dict) -> None:
    p = config["precision"]
    for key in ("param_dtype", "reduce_dtype", "accum_dtype"):
        allowed = ("fp32", "bf16", "fp16") + (("auto",) if key != "accum_dtype" else ())
        if p[key] not in allowed:
            raise ConfigError(f"precision.{key} must be one of {', '.join(allowed)} "
                              f"(got {p[key]!r})")
    for key in ("loss_scale_window", "hysteresis"):
        _at_least(config, "precision", key, 1)
    _at_least(config, "precision", "initial_scale_power", 0)
    _at_least(config, "precision", "min_loss_scale", 0)
    if p["initial_scale_power"] >= 128:  # 2**128 overflows float32, where the scale is kept
        raise ConfigError(f"precision.initial_scale_power must be at most 127 (got "
                          f"{p['initial_scale_power']}): the loss scale 2**power is a float32; "
                          "DeepSpeed's default is 16")
    if p["min_loss_scale"] > 2.0**127:
        raise ConfigError(f"precision.min_loss_scale must be at most 2**127 (got "
                          f"{p['min_loss_scale']:g}): the loss scale is a float32")


def _check_tensor_parallel(config: dict) -> None:
    """T must cut whole heads, the MLP's hidden units and the vocabulary."""
    _at_least(config, "mesh", "tensor_parallel", 1)
    t, m, z = config["mesh"]["tensor_parallel"], config["model"], config["zero"]
    if z["partition_activations"] and (t == 1 or not z["transformer_layers"]):
        raise ConfigError("zero.partition_activations cuts each block's saved input over the "
                          "tensor-parallel ranks: it needs --tensor-parallel 2 or more and "
                          "the blocks named in zero.transformer_layers")
    for key in ("n_heads", "d_ff") + (("n_kv_heads",) if m["n_kv_heads"] else ()):
        if m[key] % t:
            raise ConfigError(f"mesh.tensor_parallel {t} does not divide model.{key} {m[key]}: "
                              f"tensor parallelism cuts it into {t} pieces; pick a divisor")
    padded = -(-m["vocab_size"] // m["vocab_multiple"]) * m["vocab_multiple"]
    if padded % t:
        raise ConfigError(f"mesh.tensor_parallel {t} does not divide model.vocab_size "
                          f"{m['vocab_size']} padded to a multiple of model.vocab_multiple "
                          f"{m['vocab_multiple']} ({padded}): tensor parallelism cuts it into "
                          f"{t} pieces; pick a divisor or a vocab_multiple it divides")


def _at_least(config: dict, section: str, key: str, low: int) -> None:
    """Counts, sizes and rates below ``low``, or not finite, make no sense anywhere."""
    value = config[section][key]
    if not math.isfinite(value) or value < low:
        raise ConfigError(f"{section}.{key} must be a finite number of at least {low} "
                          f"(got {value}): fix it in the config or with --set {section}.{key}=")
