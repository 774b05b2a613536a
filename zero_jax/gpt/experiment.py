"""Everything a config describes, built once: model, optimizer, ZeRO plan and train step.

``train.py`` and ``bench/`` both start here, so a benchmark measures exactly what a run trains.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zero_jax.blocks import Layers
from zero_jax.buckets import Comm
from zero_jax.checkpoint import CheckpointError
from zero_jax.gpt import attention
from zero_jax.gpt.config import DEFAULTS
from zero_jax.gpt.model import (
    LAYER_STACKS,
    GPTConfig,
    init_fn,
    lm_loss,
    tensor_parallel,
)
from zero_jax.gpt.model import build as build_model
from zero_jax.gpt.optim import make_optimizer
from zero_jax.mesh import make_mesh
from zero_jax.offload import Nvme, Offload
from zero_jax.plan import Plan, Rule, make_plan, modules_pattern, path_str, prefetchable
from zero_jax.precision import LossScaleConfig, Precision, default_param_dtype
from zero_jax.step import make_eval_step, make_train_step

# Model keys added after checkpoints were written without them, with the value those were
# trained with: flax's layer-norm epsilon before the demo took GPT-2's; a vocabulary unpadded.
BEFORE_KEYS = {"norm_eps": 1e-6, "vocab_multiple": 1}
# Model keys that change what is computed, not what is stored: any value resumes a checkpoint.
STATELESS_KEYS = ("remat", "attention", "max_positions", "sliding_window", "window_pattern",
                  "nope_every", "rope_local_theta", "scan_unroll", "router_aux_loss_coef",
                  "router_aux_loss_global", "router_z_loss_coef", "expert_capacity_factor",
                  "eval_capacity_factor")


@dataclasses.dataclass
class Experiment:
    cfg: dict
    mesh: Mesh
    model: GPTConfig
    init: Callable[[jax.Array], Any]
    tx: optax.GradientTransformation
    plan: Plan
    step: Callable

    @classmethod
    def build(cls, cfg: dict, mesh: Mesh) -> Experiment:
        t = cfg["train"]
        n = mesh.size // cfg["mesh"]["tensor_parallel"]  # the data-parallel devices
        if t["batch_size"] % n:
            raise ValueError(f"global batch {t['batch_size']} is not divisible by {n} "
                             f"data-parallel devices: use --set train.batch_size=<multiple of "
                             f"{n}> or --devices <divisor of {t['batch_size']}>")
        if t["batch_size"] // n % t["accum_steps"]:
            raise ValueError(f"each device's batch of {t['batch_size'] // n} does not split into "
                             f"{t['accum_steps']} microbatches: make train.batch_size a "
                             f"multiple of {n * t['accum_steps']}")
        precision = precision_from(cfg["precision"], mesh.devices.flat[0].platform)
        z = cfg["zero"]
        # At stage 3 (and with Pa at any stage) the step rematerializes each named block itself,
        # under the plan's policy (to gather it again in the backward, or to save its input
        # cut); the model's own remat would add nothing (the block is recomputed once either
        # way: equal compiled FLOPs, tests/test_blocks.py).
        cfg = {**cfg, "model": resolved_model(cfg["model"], mesh.devices.flat[0].platform,
                                              precision.compute)}
        own_remat = "none" if z["transformer_layers"] and (
            z["stage"] == 3 or z["partition_activations"]) else cfg["model"]["remat"]
        model_cfg = GPTConfig(**{**cfg["model"], "remat": own_remat})
        model = build_model(model_cfg)
        init = init_fn(model)
        tx, schedule = make_optimizer(cfg["optimizer"], t["steps"])
        shapes = jax.eval_shape(init, jax.random.key(0))
        _check_modules(cfg, shapes)
        layers = modules_pattern(z["transformer_layers"])
        plan = make_plan(shapes, mesh, z["stage"],
                         layers=layers and Layers(layers, cfg["model"]["remat"],
                                                  z["partition_activations"],
                                                  z["tile_mb"] or None, z["gather"],
                                                  prefetch_from(z)),
                         rules=[*rules_from(cfg), *tensor_parallel(model_cfg)],
                         precision=precision, offload=offload_from(z),
                         comm=comm_from(z))
        loss = lm_loss(model, t["completion_only"])
        step = make_train_step(plan, loss, tx, lr_schedule=schedule,
                               accum_steps=t["accum_steps"],
                               has_aux=model_cfg.router_losses)
        return cls(cfg, mesh, model_cfg, init, tx, plan, step)

    def eval_step(self) -> Callable:
        """``make_eval_step`` for this run's model and plan (``train.eval_every``), its experts
        at the evaluation's capacity."""
        model = dataclasses.replace(self.model,
                                    expert_capacity_factor=self.model.eval_capacity_factor)
        return make_eval_step(self.plan, lm_loss(build_model(model),
                                                 self.cfg["train"]["completion_only"]),
                              has_aux=self.model.router_losses)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.plan.data_axes))

    @property
    def batch_shape(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.cfg["train"]["batch_size"], self.model.seq_len + 1),
                                    jnp.int32, sharding=self.batch_sharding)

    @property
    def block_input(self) -> jax.ShapeDtypeStruct:
        """What each block takes (global batch, sequence, d_model): the report's saved
        activations and tensor-parallel theory need it (``report.build(block_input=)``)."""
        return jax.ShapeDtypeStruct((self.cfg["train"]["batch_size"], self.model.seq_len,
                                     self.model.d_model), self.plan.precision.compute)

    @property
    def accum_steps(self) -> int:
        """Microbatches per step (``train.accum_steps``), as the step was made with."""
        return self.cfg["train"]["accum_steps"]

    @property
    def tokens_per_step(self) -> int:
        return self.cfg["train"]["batch_size"] * self.model.seq_len


def resolved_model(model: dict, platform: str, compute) -> dict:
    """The model section for these devices: ``attention`` "auto" is cuDNN's flash attention
    where it runs (a CUDA GPU, bf16/fp16, no soft caps or sinks), else XLA's; ``remat`` "auto"
    then saves the matmuls' outputs (``dots``: with the attention fused, every remaining matmul
    is a projection without batch dimensions) and recomputes the rest, else saves nothing
    (``full``, the CPU mesh's default: with the attention's einsums, ``dots`` saves them; GPT-OSS
    20B on 8 H100s at 4,096 tokens, compiled: 137 GiB of temp, not 17.7). cuDNN asked for where
    it cannot run is refused here."""
    dh = model.get("head_dim") or model["d_model"] // model["n_heads"]
    einsums = bool(model.get("attn_softcap") or model.get("gpt_oss"))
    impl = attention.resolve(model["attention"], platform, compute, dh, einsums)
    if impl == "cudnn" and (why := attention.cudnn_fits(platform, compute, dh) or (
            einsums and "its flash attention has no soft caps or sinks")):
        raise ValueError(f"model.attention=cudnn cannot run here: {why}; use auto or xla")
    remat = model["remat"]
    if remat == "auto":
        remat = "dots" if impl == "cudnn" else "full"
    return {**model, "attention": impl, "remat": remat}


def _check_modules(cfg: dict, params_shape: Any) -> None:
    """Module names in the config must exist (a typo would silently shard or train them), and
    something must be left to train: a run that updates nothing would still "succeed"."""
    modules = set()  # every module path: "blocks", "blocks/qkv", "wte" (a bare parameter)
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params_shape)[0]]
    for path in paths:
        parts = path.split("/")
        modules.update("/".join(parts[:i]) for i in range(1, len(parts) + (len(parts) == 1)))
    for key, names in [("zero.ignored_modules", cfg["zero"]["ignored_modules"]),
                       ("optimizer.frozen_modules", cfg["optimizer"]["frozen_modules"])]:
        for name in names:
            if name.strip("/") not in modules:
                raise ValueError(f"{key}: the model has no module {name!r}; its modules are "
                                 f"{', '.join(sorted(modules))}")
    frozen = modules_pattern(cfg["optimizer"]["frozen_modules"])
    if frozen and all(re.search(frozen, path) for path in paths):
        raise ValueError(f"optimizer.frozen_modules={cfg['optimizer']['frozen_modules']} "
                         "freezes every parameter: nothing to train; leave at least one "
                         "module out of it")
    for name in cfg["zero"]["transformer_layers"]:
        if name not in LAYER_STACKS:
            raise ValueError(f"zero.transformer_layers: {name!r} is not a layer stack of this "
                             f"model (a block under nn.scan); its stacks are "
                             f"{', '.join(LAYER_STACKS)}")


def mesh_for(cfg: dict, devices: int | None) -> Mesh:
    """One data axis; with ``zero.zero3_size`` K, two: ``replica`` (across groups) x ``data``
    (the K devices of a group); with ``mesh.tensor_parallel`` T, a last axis ``model`` of T
    adjacent devices."""
    k, t = cfg["zero"]["zero3_size"], cfg["mesh"]["tensor_parallel"]
    if not k and t == 1:
        return make_mesh(devices)
    total = make_mesh(devices).size
    if total % t:
        raise ValueError(f"mesh.tensor_parallel {t} does not divide the {total} devices: pick a "
                         "divisor (at most the devices of one host, typically)")
    n = total // t
    axes = {"data": n}
    if k:
        if n % k:
            raise ValueError(f"zero.zero3_size {k} does not divide the {n} data-parallel "
                             "devices: pick a divisor (the devices of one node, typically)")
        if cfg["zero"]["stage"] != 3:
            raise ValueError(f"hierarchical ZeRO (zero3_size {k}) is built on stage 3; drop "
                             f"--stage {cfg['zero']['stage']} or zero3_size")
        axes = {"replica": n // k, "data": k}
    return make_mesh(devices, axes={**axes, **({"model": t} if t > 1 else {})})


def comm_from(z: dict) -> Comm:
    """The ``zero`` section's buckets and int8 collectives."""
    return Comm(int(z["bucket_mb"] * 2 ** 20), z["quantize_weights"] == "int8",
                z["quantize_grads"] == "int8", z["quantize_block"])


def prefetch_from(z: dict) -> bool:
    """``zero.prefetch`` where it applies, as the blocks' ``Layers.prefetch`` (as DeepSpeed
    reads its prefetch settings at stage 3 only; not with tiling)."""
    return z["prefetch"] and prefetchable(z["stage"], bool(z["transformer_layers"])) \
        and not z["tile_mb"]


def rules_from(cfg: dict) -> list[Rule]:
    """``zero.ignored_modules``, ``optimizer.frozen_modules`` and ``zero.min_shard_elems`` as
    the plan's rule table."""
    rules = [Rule(modules_pattern(names), **{field: value})
             for names, field, value in ((cfg["zero"]["ignored_modules"], "shard", False),
                                         (cfg["optimizer"]["frozen_modules"], "frozen", True))
             if names]
    if cfg["zero"]["min_shard_elems"]:
        rules.append(Rule("", min_shard_elems=cfg["zero"]["min_shard_elems"]))
    return rules


def offload_from(z: dict) -> Offload:
    """The ``zero`` section's offload keys as the plan's policy."""
    off = z["offload_optimizer"]
    nvme = Nvme(off["nvme_path"], off["buffer_mb"], off["buffer_count"]) \
        if off["device"] == "nvme" else None
    return Offload(offload_ratio(off), z["offload_params"] == "cpu", z["offload_grads"], nvme)


def offload_ratio(cfg: dict) -> float:
    """The fraction of the optimizer state in host memory: DeepSpeed's ``offload_optimizer``
    with Megatron's offload fraction as ``ratio``."""
    return cfg["ratio"] if cfg["device"] in ("cpu", "nvme") else 0.0


def precision_from(cfg: dict, platform: str) -> Precision:
    """The ``precision`` config section as a policy for ``platform`` ("cpu", "gpu", "tpu")."""
    param = default_param_dtype(platform) if cfg["param_dtype"] == "auto" else cfg["param_dtype"]
    scaler = None
    if param == "fp16":
        scaler = LossScaleConfig(cfg["initial_scale_power"], cfg["loss_scale_window"],
                                 cfg["hysteresis"], cfg["min_loss_scale"])
    return Precision(param_dtype=param,
                     reduce_dtype=None if cfg["reduce_dtype"] == "auto" else cfg["reduce_dtype"],
                     accum_dtype=cfg["accum_dtype"], autocast_input=cfg["autocast_input"],
                     autocast_output=cfg["autocast_output"],
                     skip_nonfinite=cfg["skip_nonfinite"], loss_scale=scaler)


def _padded(vocab_size: int, multiple: int) -> int:
    return GPTConfig(vocab_size=vocab_size, vocab_multiple=multiple).padded_vocab


def check_compatible(meta: dict, config: dict, platform: str | None = None) -> None:
    """A checkpoint resumes a run only with the same model, the same kind of optimizer and
    the same state layout: clipping (a stage of the optimizer chain) and fp16's loss scale
    decide which arrays the state holds (a master copy comes and goes: ``Checkpoints``)."""
    saved = meta["config"]
    for key, value in config["model"].items():
        # A key added since: what the model was before it (a default now may differ).
        was = saved["model"].get(key, BEFORE_KEYS.get(key, DEFAULTS["model"][key]))
        if key == "vocab_multiple":  # the state holds the padded vocabulary: compare that
            differs = _padded(saved["model"]["vocab_size"], was) != \
                _padded(config["model"]["vocab_size"], value)
        else:
            differs = key not in STATELESS_KEYS and was != value
        if differs:
            raise CheckpointError(
                f"the checkpoint was written for model.{key}={was} but the "
                f"config says {value}: use the checkpoint's config or another --checkpoint-dir")
    if saved["optimizer"]["name"] != config["optimizer"]["name"]:
        raise CheckpointError(
            f"the checkpoint holds {saved['optimizer']['name']} optimizer state but the config "
            f"asks for {config['optimizer']['name']}: set --set optimizer.name="
            f"{saved['optimizer']['name']} or start a new --checkpoint-dir")
    frozen = saved["optimizer"].get("frozen_modules", [])
    if frozen != config["optimizer"]["frozen_modules"]:
        raise CheckpointError(
            f"the checkpoint was trained with optimizer.frozen_modules={frozen} but the config "
            f"says {config['optimizer']['frozen_modules']}: frozen modules carry no optimizer "
            "state, so the two do not fit; use the checkpoint's setting")
    written_on = meta.get("writer", {}).get("platform", platform)
    was, now = saved["precision"]["param_dtype"], config["precision"]["param_dtype"]
    if platform and written_on:
        was = default_param_dtype(written_on) if was == "auto" else was
        now = default_param_dtype(platform) if now == "auto" else now
    if now == "fp16" and was != "fp16":  # any other change of policy restores (checkpoint.py)
        raise CheckpointError(
            f"the checkpoint was written with precision.param_dtype={was}, without fp16's loss "
            f"scale, which an fp16 run keeps in its state: resume it with --set "
            "precision.param_dtype=bf16 or fp32")
    clip, clip_now = saved["optimizer"]["clip_norm"], config["optimizer"]["clip_norm"]
    if (clip > 0) != (clip_now > 0):
        raise CheckpointError(
            f"the checkpoint was trained with optimizer.clip_norm={clip} but the config says "
            f"{clip_now}: clipping on and off keep different optimizer state; pass --set "
            f"optimizer.clip_norm={clip} (any value > 0 resumes a clipped run)")
