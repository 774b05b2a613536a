"""A DeepSpeed JSON config read as this demo's config: ``train.py --deepspeed-config FILE``.

Each key a ZeRO user has is mapped onto a config key (``--set`` form, so the usual checks
apply), or listed as ignored when it changes nothing zero_jax computes (schedulers of memory,
logging), or refused when zero_jax cannot do what it asks: every refusal of the file in one
line. Nothing is dropped unsaid. Keys the file leaves out take DeepSpeed's defaults where those
change the result (precision, clipping, the optimizer's and scheduler's parameters), zero_jax's
elsewhere. ``"auto"`` takes the run's own config, as Hugging Face's Trainer fills it from its
arguments.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from zero_jax.gpt.config import ConfigError

GUIDE = "docs/guides/observability.md#deepspeed-configs"
UNSUPPORTED = "is not supported by zero_jax: remove it"
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
# The keys Hugging Face's Trainer fills when they say "auto" (transformers' integrations/
# deepspeed.py); here each keeps, or is derived from, what the run's own config says.
AUTO = "auto"
AUTO_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "bf16.enabled", "fp16.enabled",
             *(f"optimizer.params.{k}" for k in ("lr", "betas", "eps", "weight_decay")),
             *(f"scheduler.params.{k}" for k in ("warmup_min_lr", "warmup_max_lr",
                                                 "warmup_num_steps", "total_num_steps")),
             *(f"zero_optimization.{k}" for k in ("reduce_bucket_size", "allgather_bucket_size",
                                                  "stage3_param_persistence_threshold"))}
# DeepSpeed's schedulers and the optimizer.schedule each stands for.
SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear",
              "WarmupCosineLR": "deepspeed_cosine"}
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


class Refused(Exception):
    """A part of the file that cannot be mapped further; its refusal is already recorded."""


class Mapping:
    """What one DeepSpeed config sets over the run's config ``run``: ``overrides``
    (``KEY=VALUE``), ``lines`` to print, and ``refusals`` (key: why), all raised at the end."""

    def __init__(self, ds: dict, source: str, run: dict):
        self.ds, self.source, self.run = ds, source, run
        self.overrides: list[str] = []
        self.lines: list[str] = []
        self.used: set[str] = set()
        self.mapped: dict[str, Any] = {}
        self.refusals: dict[str, str] = {}
        self.settled: set[str] = set()  # keys whose mapping stopped at a refusal
        self.ignored: list[str] = []  # keys that change nothing here, beside IGNORED's

    def get(self, key: str, default: Any = None, kind: type | tuple = object) -> Any:
        """The value at dotted ``key`` (marked as used), checked to be a ``kind``, or ``AUTO``
        where Hugging Face's Trainer fills the key. A wrong value is refused and reads as
        ``default``, so that the rest of the file is still checked."""
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
        if node == AUTO:
            if key in AUTO_KEYS:
                return AUTO
            self.refuse(key, "is \"auto\", which Hugging Face's Trainer does not fill either: "
                        "write the value")
            return default
        if kind is not object and (not isinstance(node, kind) or isinstance(node, bool)
                                   and bool not in (kind if isinstance(kind, tuple) else (kind,))):
            self.refuse(key, f"must be {describe(kind)} (got {json.dumps(node)})")
            return default
        return node

    def count(self, key: str, default: Any = None, least: int = 0) -> int | None:
        """An integer, which DeepSpeed's configs often write as a float (``5e8``)."""
        value = self.get(key, default, (int, float))
        if value is None or value == AUTO:
            return value
        if not math.isfinite(value) or value != int(value) or value < least:
            self.refuse(key, f"must be a whole number of at least {least} (got "
                        f"{json.dumps(value)})")
            return default
        return int(value)

    def set(self, ds_key: str, key: str, value: Any, note: str = "", auto: bool = False) -> None:
        """Maps ``ds_key`` to ``key=value``; ``auto``: the file said "auto" and ``value`` is the
        run's own (``note`` says where from, by default the run's config)."""
        self.overrides.append(f"{key}={json.dumps(value)}")
        self.mapped[key] = value
        note = note or ("the run's config" if auto else "")
        self.lines.append(f"  {ds_key:<42} -> {'auto: ' if auto else ''}{key}="
                          f"{json.dumps(value)}" + (f"  ({note})" if note else ""))

    def value(self, key: str) -> Any:
        """What config ``key`` holds so far: as this file maps it, else the run's config."""
        if key in self.mapped:
            return self.mapped[key]
        section, name = key.split(".", 1)
        return self.run[section][name]

    def refuse(self, key: str, why: str) -> Refused:
        """Records that ``key`` cannot be mapped (the first reason given for it); raise what
        it returns where the mapping cannot go on."""
        self.refusals.setdefault(key, why)
        return Refused(key)


def describe(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {bool: "true or false", int: "a number", float: "a number", str: "a string",
             dict: "an object", list: "a list"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


def translate(ds: dict, dp_size: int, source: str, run: dict
              ) -> tuple[list[str], list[str]]:
    """``(overrides, lines)``: the ``--set`` overrides a DeepSpeed config ``ds`` stands for on
    ``dp_size`` data-parallel devices over the run's own config ``run`` (what ``"auto"``
    takes), and the mapping to print, one key a line. Raises one ``ConfigError`` naming every
    key that cannot be mapped."""
    m = Mapping(ds, source, run)
    batch = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for part, keys in ((_zero, ["zero_optimization"]), (_offload, ["zero_optimization"]),
                       (_precision, ["bf16", "fp16", "communication_data_type"]),
                       (lambda m: _batch(m, dp_size), batch), (_optimizer, ["optimizer"]),
                       (_scheduler, ["scheduler"]), (_clipping, ["gradient_clipping"])):
        try:
            part(m)
        except Refused:
            m.settled.update(keys)
    ignored = _check_all_used(m)
    if m.refusals:
        raise ConfigError(_refusal(m))
    m.lines.insert(0, f"--deepspeed-config {source}: DeepSpeed key -> zero_jax config (--set "
                      "given after it overrides)")
    if ignored:
        m.lines.append(f"  ignored, no effect on what is computed: {', '.join(ignored)}")
    return m.overrides, m.lines


def _refusal(m: Mapping) -> str:
    """Every refusal of the file in one line: the key and why, for each."""
    items = [f"{key} {why}" for key, why in m.refusals.items()]
    head = f"{len(items)} keys cannot be mapped: " if len(items) > 1 else ""
    tail = f" (the keys it maps, ignores and refuses: {GUIDE})" \
        if any(why == UNSUPPORTED for why in m.refusals.values()) else ""
    return f"--deepspeed-config {m.source}: {head}{'; '.join(items)}{tail}"


def _clipping(m: Mapping) -> None:
    clip = m.get("gradient_clipping", None, (int, float))
    if clip == AUTO:
        m.set("gradient_clipping", "optimizer.clip_norm", m.value("optimizer.clip_norm"),
              auto=True)
        return
    m.set("gradient_clipping", "optimizer.clip_norm", float(clip or 0.0),
          "" if clip is not None else "DeepSpeed's default: no clipping")


def _zero(m: Mapping) -> None:
    z = "zero_optimization"
    stage = m.get(f"{z}.stage", 0, int)
    m.set(f"{z}.stage", "zero.stage", stage, "" if m.get(z) else "DeepSpeed's default")
    if (overlap := m.get(f"{z}.overlap_comm", None, bool)) is not None:
        m.set(f"{z}.overlap_comm", "zero.prefetch", overlap,
              "stage 3 gathers ahead and reduces behind; 0-2 always reduce as the backward runs")
    itemsize = 2 if _dtype(m)[0] in ("bf16", "fp16") else 4
    sizes = {k: m.count(f"{z}.{k}") for k in ("reduce_bucket_size", "allgather_bucket_size")}
    if given := {k: v for k, v in sizes.items() if v not in (None, AUTO)}:
        mib = max(max(1, math.ceil(v * itemsize / 2**20)) for v in given.values())
        m.set(f"{z}.{'/'.join(given)}", "zero.bucket_mb", mib,
              f"elements x {itemsize} bytes, in MiB; the larger")
    elif autos := [k for k, v in sizes.items() if v == AUTO]:
        m.set(f"{z}.{'/'.join(autos)}", "zero.bucket_mb", m.value("zero.bucket_mb"), auto=True)
    if (persist := m.count(f"{z}.stage3_param_persistence_threshold")) is not None:
        m.set(f"{z}.stage3_param_persistence_threshold", "zero.min_shard_elems",
              m.value("zero.min_shard_elems") if persist == AUTO else persist,
              auto=persist == AUTO)
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


def _dtype(m: Mapping) -> tuple[str, bool]:
    """``(precision.param_dtype, auto)``: what bf16.enabled and fp16.enabled ask for, and
    whether an "auto" chose it: the run's own dtype, unless the file rules it out."""
    on = {dtype: m.get(f"{dtype}.enabled", False, bool) for dtype in ("bf16", "fp16")}
    if on["bf16"] is True and on["fp16"] is True:
        m.refuse("bf16.enabled and fp16.enabled", "are both true: enable one")
        return "fp32", False
    if explicit := [dtype for dtype, v in on.items() if v is True]:
        return explicit[0], False
    if autos := [dtype for dtype, v in on.items() if v == AUTO]:
        run = m.run["precision"]["param_dtype"]
        return (run if run in (*autos, "fp32", "auto") else "fp32"), True
    return "fp32", False


def _precision(m: Mapping) -> None:
    dtype, auto = _dtype(m)
    fp16 = dtype == "fp16"
    m.set("bf16/fp16.enabled", "precision.param_dtype", dtype,
          "neither enabled: DeepSpeed trains in fp32" if dtype == "fp32" and not auto else "",
          auto)
    if not fp16 and isinstance(section := m.get("fp16"), dict):  # its loss scaler is off
        off = [f"fp16.{k}" for k in section if k != "enabled"]
        m.used.update(off)
        m.ignored += off
    if fp16:
        if m.get("fp16.loss_scale", 0, (int, float)) != 0:
            m.refuse("fp16.loss_scale", "is a static loss scale, which is not built: "
                     "zero_jax's fp16 scaler is DeepSpeed's dynamic one (loss_scale 0)")
        if m.get("fp16.consecutive_hysteresis", False, bool):
            m.refuse("fp16.consecutive_hysteresis", "is not built: zero_jax's hysteresis "
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
    """train_batch_size = micro x accumulation x data-parallel devices, as DeepSpeed checks.
    "auto" as Hugging Face's Trainer fills it from its arguments: the accumulation is the run's,
    the global batch micro x accumulation x devices (the run's, if the micro batch is "auto"
    too), the micro batch what that gives each device."""
    total = m.count("train_batch_size", least=1)
    micro = m.count("train_micro_batch_size_per_gpu", least=1)
    accum = m.count("gradient_accumulation_steps", least=1)
    auto = {k for k, v in (("total", total), ("micro", micro), ("accum", accum)) if v == AUTO}
    if accum == AUTO:  # a number both others give is derived from them, as if left out
        accum = None if isinstance(total, int) and isinstance(micro, int) \
            else max(1, m.value("train.accum_steps"))
    if total == AUTO:
        total = None if isinstance(micro, int) else max(1, m.value("train.batch_size"))
    micro = None if micro == AUTO else micro
    if total is not None and micro is not None and accum is not None \
            and total != micro * accum * n:
        raise m.refuse("train_batch_size", f"{total} is not train_micro_batch_size_per_gpu "
                       f"{micro} x gradient_accumulation_steps {accum} x {n} data-parallel "
                       f"devices = {micro * accum * n}: fix one of them")
    accum_from, accum_note = "gradient_accumulation_steps", ""
    if accum is None and total is not None and micro is not None:
        if total % (micro * n):
            raise m.refuse("train_batch_size", f"{total} is not a multiple of "
                           f"train_micro_batch_size_per_gpu {micro} x {n} devices")
        accum, accum_from = total // (micro * n), "train_batch_size / (micro x devices)"
        if "accum" in auto:
            accum_note, accum_from = accum_from, "gradient_accumulation_steps"
    elif accum is None and (total or micro):
        accum, accum_from = 1, "(no gradient_accumulation_steps)"
    if accum is not None:
        m.set(accum_from, "train.accum_steps", accum, accum_note, "accum" in auto)
    total_from, total_note = "train_batch_size", ""
    if total is None and micro is not None:
        total, total_from = micro * accum * n, "micro batch x accumulation x devices"
        if "total" in auto:
            total_from, total_note = "train_batch_size", "micro x accumulation x devices; "
    elif "total" in auto:
        total_note = "the run's config; "
    if total is not None:
        per = f"{total // accum // n} per device per microbatch on {n} devices"
        m.set(total_from, "train.batch_size", total, total_note + per, "total" in auto)
        if "micro" in auto:
            m.lines.append(f"  {'train_micro_batch_size_per_gpu':<42} -> auto: {per}")


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
    wd = m.get(f"{p}.weight_decay", 0.0, (int, float))
    decay = m.value("optimizer.weight_decay") if wd == AUTO else float(wd)
    if not decoupled and decay:
        m.refuse(f"{p}.adam_w_mode", "false with weight_decay is Adam with L2 "
                 "regularization, which is not built: use AdamW (adam_w_mode true)")
    if m.get(f"{p}.amsgrad", False, bool):
        m.refuse(f"{p}.amsgrad", "is not built: zero_jax's Adam has no AMSGrad")
    m.set("optimizer.type", "optimizer.name", "adamw" if decoupled else "adam",
          "DeepSpeed's Adam is decoupled (AdamW) unless adam_w_mode is false")
    betas = m.get(f"{p}.betas", [0.9, 0.999], list)
    if betas == AUTO:
        betas = [AUTO, AUTO]
    elif len(betas) != 2 or not all(isinstance(b, (int, float)) for b in betas):
        raise m.refuse(f"{p}.betas", f"must be two numbers (got {json.dumps(betas)})")
    for key, value in (("lr", m.get(f"{p}.lr", 1e-3, (int, float))), ("b1", betas[0]),
                       ("b2", betas[1]), ("eps", m.get(f"{p}.eps", 1e-8, (int, float))),
                       ("weight_decay", wd)):
        ds_key = {"b1": f"{p}.betas[0]", "b2": f"{p}.betas[1]"}.get(key, f"{p}.{key}")
        m.set(ds_key, f"optimizer.{key}",
              m.value(f"optimizer.{key}") if value == AUTO else float(value), auto=value == AUTO)
    if m.get("scheduler") is None:
        m.set("(no scheduler)", "optimizer.schedule", "constant", "the optimizer's lr")
        m.set("(no scheduler)", "optimizer.warmup_steps", 0)


def _scheduler(m: Mapping) -> None:
    kind = m.get("scheduler.type", None, str)
    if kind is None:
        if m.get("scheduler") is not None:
            raise m.refuse("scheduler", "has no type: write \"type\": \"WarmupLR\"")
        return
    if kind not in SCHEDULERS:
        raise m.refuse("scheduler.type", f"{kind} is not built: zero_jax maps "
                       f"{', '.join(SCHEDULERS)} (optax schedules)")
    p = "scheduler.params"
    steps = m.count(f"{p}.warmup_num_steps", 1000)
    warmup = m.get(f"{p}.warmup_type", "log", str)
    if warmup not in ("log", "linear"):
        m.refuse(f"{p}.warmup_type", f"must be log or linear (got {warmup!r})")
    if m.get(f"{p}.last_batch_iteration", -1, int) != -1:
        m.refuse(f"{p}.last_batch_iteration", "is not -1: zero_jax resumes the schedule "
                 "from its checkpoints (--resume)")
    m.set("scheduler.type", "optimizer.schedule", SCHEDULERS[kind], {
        "WarmupLR": "WarmupLR: warmup, then constant",
        "WarmupDecayLR": "WarmupDecayLR: warmup, then linear down to warmup_min_lr",
        "WarmupCosineLR": "WarmupCosineLR: warmup, then cosine down to cos_min_ratio x lr"}[kind])
    auto = steps == AUTO
    steps = m.value("optimizer.warmup_steps") if auto else steps
    m.set(f"{p}.warmup_num_steps", "optimizer.warmup_steps", max(2, steps),
          ("the run's config; " if auto else "") + "at least 2, as DeepSpeed's schedulers", auto)
    m.set(f"{p}.warmup_type", "optimizer.warmup_type", warmup)
    if kind != "WarmupLR":
        _decay(m, kind)
    if kind == "WarmupCosineLR":
        lr = m.value("optimizer.lr")
        ratio = float(m.get(f"{p}.warmup_min_ratio", 0.0, (int, float)))
        m.set(f"{p}.warmup_min_ratio", "optimizer.warmup_min_lr", ratio * lr,
              f"warmup_min_ratio x optimizer.lr {lr:g}")
        return
    low = m.get(f"{p}.warmup_min_lr", 0.0, (int, float))
    m.set(f"{p}.warmup_min_lr", "optimizer.warmup_min_lr",
          m.value("optimizer.warmup_min_lr") if low == AUTO else float(low), auto=low == AUTO)
    top = m.get(f"{p}.warmup_max_lr", None, (int, float))
    if top == AUTO:
        m.set(f"{p}.warmup_max_lr", "optimizer.lr", m.value("optimizer.lr"),
              "the optimizer's lr", auto=True)
    elif top is not None:
        m.set(f"{p}.warmup_max_lr", "optimizer.lr", float(top))
    elif kind == "WarmupDecayLR":  # WarmupLR's is the optimizer's lr
        m.set(f"{p}.warmup_max_lr", "optimizer.lr", 1e-3, "WarmupDecayLR's default")


def _decay(m: Mapping, kind: str) -> None:
    """WarmupDecayLR's and WarmupCosineLR's end: total_num_steps, and the cosine's floor."""
    p = "scheduler.params"
    total = m.count(f"{p}.total_num_steps")
    if total is None or total == 0:
        raise m.refuse(f"{p}.total_num_steps", f"{'is missing' if total is None else 'is 0'}"
                       f": {kind} decays until that step; write it, or \"auto\" for the run's")
    if total == AUTO:
        decay = m.value("optimizer.decay_steps")
        m.set(f"{p}.total_num_steps", "optimizer.decay_steps", decay, "the run's config"
              + (": 0 is the run's train.steps" if decay == 0 else ""), auto=True)
    else:
        m.set(f"{p}.total_num_steps", "optimizer.decay_steps", total)
    if kind == "WarmupCosineLR":
        m.set(f"{p}.cos_min_ratio", "optimizer.cos_min_ratio",
              float(m.get(f"{p}.cos_min_ratio", 1e-4, (int, float))))


def _check_all_used(m: Mapping) -> list[str]:
    """Every key of the file was mapped or is known to change nothing; each other one is
    refused (but under a key whose mapping stopped at a refusal). Returns the ignored ones."""
    ignored = list(m.ignored)

    def walk(node: dict, where: str) -> None:
        for key, value in node.items():
            dotted = f"{where}.{key}" if where else key
            inside = any(u == dotted or u.startswith(dotted + ".") for u in m.used)
            if key in IGNORED.get(where, ()):
                ignored.append(dotted)
            elif dotted in m.settled or dotted in m.refusals:
                continue
            elif isinstance(value, dict) and inside:
                walk(value, dotted)
            elif dotted not in m.used:
                m.refuse(dotted, UNSUPPORTED)

    walk(m.ds, "")
    return ignored
