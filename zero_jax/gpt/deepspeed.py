"""A DeepSpeed JSON config read as this demo's config: ``train.py --deepspeed-config FILE``.

Each key a ZeRO user has is mapped onto a config key (``--set`` form, so the usual checks
apply), or listed as ignored when it changes nothing zero_jax computes (schedulers of memory,
logging), or refused with one line when zero_jax cannot do what it asks. Nothing is dropped
unsaid. Keys the file leaves out take DeepSpeed's defaults where those change the result
(precision, clipping, the optimizer's and scheduler's parameters), zero_jax's elsewhere.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from zero_jax.gpt.config import ConfigError

GUIDE = "docs/guides/observability.md#deepspeed-configs"
# Keys with no effect on what is computed: how DeepSpeed schedules memory and logs.
IGNORED = {
    "": {"steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
         "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "tensorboard",
         "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger"},
    "zero_optimization": {"contiguous_gradients", "reduce_scatter", "allgather_partitions",
                          "round_robin_gradients", "stage3_max_live_parameters",
                          "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
                          "sub_group_size", "stage3_gather_16bit_weights_on_model_save",
                          "gather_16bit_weights_on_model_save", "elastic_checkpoint",
                          "ignore_unused_parameters", "load_from_fp32_weights"},
    "zero_optimization.offload_optimizer": {"pin_memory", "buffer_count", "fast_init"},
    "zero_optimization.offload_param": {"pin_memory", "buffer_count", "buffer_size",
                                        "max_in_cpu"},
    "optimizer.params": {"torch_adam"},
}
DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
          "bf16": "bf16", "bfloat16": "bf16"}


def read(path: str) -> dict:
    """The JSON object in ``path``, or one line saying why not. A key given twice in one
    object is refused (json keeps the last, silently), as the YAML configs refuse it."""
    try:
        ds = json.loads(pathlib.Path(path).read_bytes().decode("utf-8-sig"),
                        object_pairs_hook=_no_duplicates)
    except OSError as e:
        raise ConfigError(f"--deepspeed-config {path} cannot be read ({e.strerror}): pass "
                          "DeepSpeed's JSON config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--deepspeed-config {path} is not UTF-8 text (byte "
                          f"0x{e.object[e.start]:02x} at offset {e.start}): save it as UTF-8 "
                          "JSON") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed-config {path} is not JSON ({e.msg}, line {e.lineno}, "
                          f"column {e.colno})") from None
    except RecursionError:
        raise ConfigError(f"--deepspeed-config {path} nests its values too deep to be a "
                          "DeepSpeed config (they nest three levels at most): pass DeepSpeed's "
                          "JSON config file") from None
    except _Duplicate as e:
        raise ConfigError(f"--deepspeed-config {path}: key {e} is given twice in one object "
                          "(JSON would keep the last): keep one") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"--deepspeed-config {path} must hold a JSON object of DeepSpeed's "
                          "keys (zero_optimization, bf16, ...)")
    return ds


class _Duplicate(Exception):
    """A JSON object holds a key twice (its text: the key, quoted)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(json.dumps(key))
        seen[key] = value
    return seen


class Mapping:
    """What one DeepSpeed config sets: ``overrides`` (``KEY=VALUE``), ``lines`` to print."""

    def __init__(self, ds: dict, source: str):
        self.ds, self.source = ds, source
        self.overrides: list[str] = []
        self.lines: list[str] = []
        self.used: set[str] = set()

    def get(self, key: str, default: Any = None, kind: type | tuple = object) -> Any:
        """The value at dotted ``key`` (marked as used), checked to be a ``kind``."""
        node: Any = self.ds
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, dict):  # {"zero_optimization": 3}: not its default
                raise ConfigError(f"--deepspeed-config {self.source}: {'.'.join(parts[:i])} "
                                  f"must be an object of its keys, e.g. {{\"{part}\": ...}} "
                                  f"(got {json.dumps(node)})")
            if part not in node:
                return default
            node = node[part]
        self.used.add(key)
        if node == "auto":
            raise ConfigError(f"--deepspeed-config {self.source}: {key} is \"auto\", which "
                              "Hugging Face's Trainer fills in: write the value")
        if kind is not object and (not isinstance(node, kind) or isinstance(node, bool)
                                   and bool not in (kind if isinstance(kind, tuple) else (kind,))):
            raise ConfigError(f"--deepspeed-config {self.source}: {key} must be "
                              f"{describe(kind)} (got {json.dumps(node)})")
        return node

    def count(self, key: str, default: Any = None, least: int = 0) -> int | None:
        """An integer, which DeepSpeed's configs often write as a float (``5e8``)."""
        value = self.get(key, default, (int, float))
        if value is None:
            return None
        if not math.isfinite(value) or value != int(value) or value < least:
            raise ConfigError(f"--deepspeed-config {self.source}: {key} must be a whole number "
                              f"of at least {least} (got {json.dumps(value)})")
        return int(value)

    def set(self, ds_key: str, key: str, value: Any, note: str = "") -> None:
        self.overrides.append(f"{key}={json.dumps(value)}")
        self.lines.append(f"  {ds_key:<42} -> {key}={json.dumps(value)}"
                          + (f"  ({note})" if note else ""))

    def refuse(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"--deepspeed-config {self.source}: {key} {why}")


def describe(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {bool: "true or false", int: "a number", float: "a number", str: "a string",
             dict: "an object", list: "a list"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


def translate(ds: dict, dp_size: int, source: str) -> tuple[list[str], list[str]]:
    """``(overrides, lines)``: the ``--set`` overrides a DeepSpeed config ``ds`` stands for on
    ``dp_size`` data-parallel devices, and the mapping to print, one key a line."""
    m = Mapping(ds, source)
    _zero(m)
    _offload(m)
    _precision(m)
    _batch(m, dp_size)
    _optimizer(m)
    _scheduler(m)
    clip = m.get("gradient_clipping", None, (int, float))
    m.set("gradient_clipping", "optimizer.clip_norm", float(clip or 0.0),
          "" if clip is not None else "DeepSpeed's default: no clipping")
    ignored = _check_all_used(m)
    m.lines.insert(0, f"--deepspeed-config {source}: DeepSpeed key -> zero_jax config (--set "
                      "given after it overrides)")
    if ignored:
        m.lines.append(f"  ignored, no effect on what is computed: {', '.join(ignored)}")
    return m.overrides, m.lines


def _zero(m: Mapping) -> None:
    z = "zero_optimization"
    stage = m.get(f"{z}.stage", 0, int)
    m.set(f"{z}.stage", "zero.stage", stage, "" if m.get(z) else "DeepSpeed's default")
    if (overlap := m.get(f"{z}.overlap_comm", None, bool)) is not None:
        m.set(f"{z}.overlap_comm", "zero.prefetch", overlap,
              "stage 3 gathers ahead and reduces behind; 0-2 always reduce as the backward runs")
    itemsize = 2 if _enabled(m, "bf16") or _enabled(m, "fp16") else 4
    sizes = {k: m.count(f"{z}.{k}") for k in ("reduce_bucket_size", "allgather_bucket_size")}
    if given := {k: v for k, v in sizes.items() if v is not None}:
        mib = max(max(1, math.ceil(v * itemsize / 2**20)) for v in given.values())
        m.set(f"{z}.{'/'.join(given)}", "zero.bucket_mb", mib,
              f"elements x {itemsize} bytes, in MiB; the larger")
    if (persist := m.count(f"{z}.stage3_param_persistence_threshold")) is not None:
        m.set(f"{z}.stage3_param_persistence_threshold", "zero.min_shard_elems", persist)
    if (hpz := m.count(f"{z}.zero_hpz_partition_size")) is not None:
        m.set(f"{z}.zero_hpz_partition_size", "zero.zero3_size", 0 if hpz <= 1 else hpz,
              "hierarchical ZeRO: stage 3 within groups of this size" if hpz > 1 else "off")
    for ds_key, key in (("zero_quantized_weights", "quantize_weights"),
                        ("zero_quantized_gradients", "quantize_grads")):
        if (on := m.get(f"{z}.{ds_key}", None, bool)) is not None:
            m.set(f"{z}.{ds_key}", f"zero.{key}", "int8" if on else "none")


def _offload(m: Mapping) -> None:
    for part, key in (("offload_optimizer", "zero.offload_optimizer.device"),
                      ("offload_param", "zero.offload_params")):
        ds_key = f"zero_optimization.{part}"
        device = m.get(f"{ds_key}.device", None, str)
        if device is None:
            continue
        if device == "nvme" and part == "offload_param":
            raise m.refuse(f"{ds_key}.device", "is nvme: the NVMe tier (ZeRO-Infinity) holds "
                           "the optimizer's state, not the parameters; use \"cpu\" (host "
                           "memory) or \"none\"")
        if device == "nvme":
            m.set(f"{ds_key}.device", key, device)
            m.set(f"{ds_key}.nvme_path", "zero.offload_optimizer.nvme_path",
                  m.get(f"{ds_key}.nvme_path", "", str))
            if (count := m.get(f"{ds_key}.buffer_count", None, int)) is not None:
                m.set(f"{ds_key}.buffer_count", "zero.offload_optimizer.buffer_count", count)
            continue
        if device not in ("cpu", "none"):
            raise m.refuse(f"{ds_key}.device", f"must be cpu or none (got {device!r})")
        m.set(f"{ds_key}.device", key, device)
    ratio = m.get("zero_optimization.offload_optimizer.ratio", None, (int, float))
    if ratio is not None:
        m.set("zero_optimization.offload_optimizer.ratio", "zero.offload_optimizer.ratio",
              float(ratio))


def _enabled(m: Mapping, section: str) -> bool:
    return bool(m.get(f"{section}.enabled", False, bool))


def _precision(m: Mapping) -> None:
    bf16, fp16 = _enabled(m, "bf16"), _enabled(m, "fp16")
    if bf16 and fp16:
        raise m.refuse("bf16.enabled and fp16.enabled", "are both true: enable one")
    dtype = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    m.set("bf16/fp16.enabled", "precision.param_dtype", dtype,
          "" if bf16 or fp16 else "neither enabled: DeepSpeed trains in fp32")
    if fp16:
        if m.get("fp16.loss_scale", 0, (int, float)) != 0:
            raise m.refuse("fp16.loss_scale", "is a static loss scale, which is not built: "
                           "zero_jax's fp16 scaler is DeepSpeed's dynamic one (loss_scale 0)")
        if m.get("fp16.consecutive_hysteresis", False, bool):
            raise m.refuse("fp16.consecutive_hysteresis", "is not built: zero_jax's hysteresis "
                           "is DeepSpeed's default (false)")
        for key, kind in (("initial_scale_power", int), ("loss_scale_window", int),
                          ("hysteresis", int), ("min_loss_scale", (int, float))):
            if (value := m.get(f"fp16.{key}", None, kind)) is not None:
                m.set(f"fp16.{key}", f"precision.{key}",
                      float(value) if key == "min_loss_scale" else value)
        if (cast := m.get("fp16.auto_cast", None, bool)) is not None:
            m.set("fp16.auto_cast", "precision.autocast_input", cast)
    if (comm := m.get("communication_data_type", None, str)) is not None:
        if comm.lower() not in DTYPES:
            raise m.refuse("communication_data_type", f"must be fp32, fp16 or bf16 (got {comm!r})")
        m.set("communication_data_type", "precision.reduce_dtype", DTYPES[comm.lower()])


def _batch(m: Mapping, n: int) -> None:
    """train_batch_size = micro x accumulation x data-parallel devices, as DeepSpeed checks."""
    total = m.count("train_batch_size", least=1)
    micro = m.count("train_micro_batch_size_per_gpu", least=1)
    accum = m.count("gradient_accumulation_steps", least=1)
    if total is not None and micro is not None and accum is not None \
            and total != micro * accum * n:
        raise m.refuse("train_batch_size", f"{total} is not train_micro_batch_size_per_gpu "
                       f"{micro} x gradient_accumulation_steps {accum} x {n} data-parallel "
                       f"devices = {micro * accum * n}: fix one of them")
    accum_from = "gradient_accumulation_steps"
    if accum is None and total is not None and micro is not None:
        if total % (micro * n):
            raise m.refuse("train_batch_size", f"{total} is not a multiple of "
                           f"train_micro_batch_size_per_gpu {micro} x {n} devices")
        accum, accum_from = total // (micro * n), "train_batch_size / (micro x devices)"
    elif accum is None and (total or micro):
        accum, accum_from = 1, "(no gradient_accumulation_steps)"
    if accum is not None:
        m.set(accum_from, "train.accum_steps", accum)
    total_from = "train_batch_size"
    if total is None and micro is not None:
        total, total_from = micro * accum * n, "micro batch x accumulation x devices"
    if total is not None:
        m.set(total_from, "train.batch_size", total,
              f"{total // accum // n} per device per microbatch on {n} devices")


def _optimizer(m: Mapping) -> None:
    kind = m.get("optimizer.type", None, str)
    if kind is None:
        if m.get("optimizer") is not None:
            raise m.refuse("optimizer", "has no type: write \"type\": \"AdamW\" or \"Adam\"")
        m.lines.append("  (no optimizer block: zero_jax's optimizer section is kept)")
        return
    if kind.lower() not in ("adam", "adamw"):
        raise m.refuse("optimizer.type", f"{kind} is not built: zero_jax maps Adam and AdamW "
                       "(optax.adam, optax.adamw)")
    p = "optimizer.params"
    decoupled = kind.lower() == "adamw" or m.get(f"{p}.adam_w_mode", True, bool)
    decay = float(m.get(f"{p}.weight_decay", 0.0, (int, float)))
    if not decoupled and decay:
        raise m.refuse(f"{p}.adam_w_mode", "false with weight_decay is Adam with L2 "
                       "regularization, which is not built: use AdamW (adam_w_mode true)")
    if m.get(f"{p}.amsgrad", False, bool):
        raise m.refuse(f"{p}.amsgrad", "is not built: zero_jax's Adam has no AMSGrad")
    m.set("optimizer.type", "optimizer.name", "adamw" if decoupled else "adam",
          "DeepSpeed's Adam is decoupled (AdamW) unless adam_w_mode is false")
    betas = m.get(f"{p}.betas", [0.9, 0.999], list)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) for b in betas):
        raise m.refuse(f"{p}.betas", f"must be two numbers (got {json.dumps(betas)})")
    for key, value in (("lr", m.get(f"{p}.lr", 1e-3, (int, float))), ("b1", betas[0]),
                       ("b2", betas[1]), ("eps", m.get(f"{p}.eps", 1e-8, (int, float))),
                       ("weight_decay", decay)):
        ds_key = {"b1": f"{p}.betas[0]", "b2": f"{p}.betas[1]"}.get(key, f"{p}.{key}")
        m.set(ds_key, f"optimizer.{key}", float(value))
    if m.get("scheduler") is None:
        m.set("(no scheduler)", "optimizer.schedule", "constant", "the optimizer's lr")
        m.set("(no scheduler)", "optimizer.warmup_steps", 0)


def _scheduler(m: Mapping) -> None:
    kind = m.get("scheduler.type", None, str)
    if kind is None:
        if m.get("scheduler") is not None:
            raise m.refuse("scheduler", "has no type: write \"type\": \"WarmupLR\"")
        return
    if kind != "WarmupLR":
        raise m.refuse("scheduler.type", f"{kind} is not built: zero_jax maps WarmupLR (for "
                       "warmup and cosine decay, leave the scheduler out and use --set "
                       "optimizer.schedule=cosine)")
    p = "scheduler.params"
    steps = m.count(f"{p}.warmup_num_steps", 1000)
    warmup = m.get(f"{p}.warmup_type", "log", str)
    if warmup not in ("log", "linear"):
        raise m.refuse(f"{p}.warmup_type", f"must be log or linear (got {warmup!r})")
    if m.get(f"{p}.last_batch_iteration", -1, int) != -1:
        raise m.refuse(f"{p}.last_batch_iteration", "is not -1: zero_jax resumes the schedule "
                       "from its checkpoints (--resume)")
    m.set("scheduler.type", "optimizer.schedule", "constant", "WarmupLR: warmup, then constant")
    m.set(f"{p}.warmup_num_steps", "optimizer.warmup_steps", max(2, steps),
          "at least 2, as DeepSpeed's WarmupLR")
    m.set(f"{p}.warmup_type", "optimizer.warmup_type", warmup)
    m.set(f"{p}.warmup_min_lr", "optimizer.warmup_min_lr",
          float(m.get(f"{p}.warmup_min_lr", 0.0, (int, float))))
    top = m.get(f"{p}.warmup_max_lr", None, (int, float))
    if top is not None:
        m.set(f"{p}.warmup_max_lr", "optimizer.lr", float(top))


def _check_all_used(m: Mapping) -> list[str]:
    """Every key of the file was mapped or is known to change nothing; the first other one is
    refused. Returns the ignored ones."""
    ignored = []

    def walk(node: dict, where: str) -> None:
        for key, value in node.items():
            dotted = f"{where}.{key}" if where else key
            inside = any(u == dotted or u.startswith(dotted + ".") for u in m.used)
            if key in IGNORED.get(where, ()):
                ignored.append(dotted)
            elif isinstance(value, dict) and inside:
                walk(value, dotted)
            elif dotted not in m.used:
                raise m.refuse(dotted, f"is not supported by zero_jax: remove it (the keys it "
                               f"maps, ignores and refuses: {GUIDE})")

    walk(m.ds, "")
    return ignored
