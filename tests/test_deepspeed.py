"""DeepSpeed configs as users have them: Hugging Face Trainer's, with "auto" everywhere, read as
the run's own config; WarmupDecayLR and WarmupCosineLR against DeepSpeed's formulas; every key
that cannot be mapped refused in one message. No compile: the mapping and the schedules alone.
(The mapping of hand-written configs and a run trained from one: test_observability.py.)
"""

import copy
import json
import math
import sys

import pytest
from conftest import ROOT

from zero_jax.gpt import config as configs
from zero_jax.gpt import deepspeed
from zero_jax.gpt.optim import make_schedule

sys.path.insert(0, str(ROOT))
import train  # noqa: E402

# Hugging Face's ZeRO-3 config as its DeepSpeed guide shows it, with the WarmupDecayLR block the
# guide gives for that scheduler.
HF_STAGE3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "last_batch_iteration": -1, "total_num_steps": "auto", "warmup_min_lr": "auto",
        "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# The run's own config, none of it zero_jax's default: what each "auto" must take.
RUN = {"train.batch_size": 64, "train.accum_steps": 2, "optimizer.lr": 2e-3,
       "optimizer.b1": 0.85, "optimizer.b2": 0.99, "optimizer.eps": 1e-6,
       "optimizer.weight_decay": 0.05, "optimizer.warmup_steps": 7, "optimizer.decay_steps": 50,
       "optimizer.warmup_min_lr": 1e-5, "optimizer.clip_norm": 0.5, "zero.bucket_mb": 10,
       "zero.min_shard_elems": 123, "precision.param_dtype": "bf16"}
AUTO_LINES = {  # each auto key of HF_STAGE3 and the key it resolves to
    "train_batch_size": "train.batch_size", "gradient_accumulation_steps": "train.accum_steps",
    "optimizer.params.lr": "optimizer.lr", "optimizer.params.betas[0]": "optimizer.b1",
    "optimizer.params.betas[1]": "optimizer.b2", "optimizer.params.eps": "optimizer.eps",
    "optimizer.params.weight_decay": "optimizer.weight_decay",
    "scheduler.params.warmup_num_steps": "optimizer.warmup_steps",
    "scheduler.params.total_num_steps": "optimizer.decay_steps",
    "scheduler.params.warmup_min_lr": "optimizer.warmup_min_lr",
    "scheduler.params.warmup_max_lr": "optimizer.lr", "gradient_clipping": "optimizer.clip_norm",
    "zero_optimization.reduce_bucket_size": "zero.bucket_mb",
    "zero_optimization.stage3_param_persistence_threshold": "zero.min_shard_elems",
    "bf16/fp16.enabled": "precision.param_dtype"}


def load(ds: dict, tmp_path, run: dict | None = None, *argv) -> dict:
    """train.py's config from the DeepSpeed config ``ds`` over a --config file holding ``run``
    (dotted keys; --set would override the DeepSpeed config, not be read by it)."""
    path, yaml = tmp_path / "ds.json", tmp_path / "run.yaml"
    path.write_text(json.dumps(ds))
    sections: dict = {}
    for key, value in (run or {}).items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    yaml.write_text(json.dumps(sections))  # JSON is YAML
    return train.load_config(train.parse_args(["--config", str(yaml), "--deepspeed-config",
                                               str(path), *argv]))


def test_hugging_face_stage3_config_takes_the_runs_own_values(tmp_path, capsys):
    cfg = load(HF_STAGE3, tmp_path, RUN)
    out = capsys.readouterr().out
    # The run's config, but for what the file says outright: stage 3 with both offloads,
    # prefetch (overlap_comm), WarmupDecayLR and its default log warmup.
    want = configs.load("tiny", [f"{k}={json.dumps(v)}" for k, v in {
        **RUN, "zero.stage": 3, "zero.offload_optimizer.device": "cpu",
        "zero.offload_params": "cpu", "zero.prefetch": True, "optimizer.schedule": "linear",
        "optimizer.warmup_type": "log"}.items()])
    assert cfg == want
    for ds_key, key in AUTO_LINES.items():
        value = cfg[key.split(".")[0]][key.split(".")[1]]
        assert f"{ds_key:<42} -> auto: {key}={json.dumps(value)}" in out, (ds_key, out)
    assert "train_micro_batch_size_per_gpu" in out and "-> auto: 4 per device per microbatch " \
        "on 8 devices" in out  # 64 / 2 microbatches / 8 devices
    # fp16 resolved off: its scaler's keys change nothing.
    assert "ignored, no effect on what is computed: fp16.loss_scale, " in out


def test_the_same_config_in_fp16_maps_the_loss_scaler(tmp_path):
    cfg = load(HF_STAGE3, tmp_path, {"precision.param_dtype": "fp16"})
    p = cfg["precision"]
    assert p["param_dtype"] == "fp16" and p["loss_scale_window"] == 1000 \
        and p["initial_scale_power"] == 16 and p["min_loss_scale"] == 1.0


@pytest.mark.parametrize("batch, want", [
    # (train_batch_size, micro, accumulation) of the file; (train.batch_size, accum_steps) got,
    # the run's being 64 and 2 on 8 devices
    (("auto", "auto", "auto"), (64, 2)),
    (("auto", 3, "auto"), (48, 2)),  # Trainer: world x micro x accumulation = 8 x 3 x 2
    ((128, "auto", "auto"), (128, 2)),
    ((128, 4, "auto"), (128, 4)),  # the accumulation the other two give
    (("auto", 2, 1), (16, 1)),
    ((32, "auto", 4), (32, 4)),
], ids=str)
def test_auto_batch_sizes_as_the_trainer_fills_them(batch, want, tmp_path):
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    cfg = load(dict(zip(keys, batch, strict=True)), tmp_path,
               {"train.batch_size": 64, "train.accum_steps": 2})
    assert (cfg["train"]["batch_size"], cfg["train"]["accum_steps"]) == want


# DeepSpeed's schedulers (deepspeed/runtime/lr_schedules.py), written out: the learning rate
# after `last_batch_iteration` t. Both warm up as WarmupLR does, over max(2, warmup_num_steps).
def ds_warmup(t, n, warmup_type):
    n = max(2, n)
    return math.log(t + 1) / math.log(n) if warmup_type == "log" else t / n


def ds_warmup_lr(t, min_lr, max_lr, n, warmup_type):
    gamma = ds_warmup(t, n, warmup_type) if t < max(2, n) else 1.0
    return min_lr + (max_lr - min_lr) * gamma


def ds_warmup_decay_lr(t, total, min_lr, max_lr, n, warmup_type):
    if t < max(2, n):
        gamma = ds_warmup(t, n, warmup_type)
    else:
        gamma = max(0.0, (total - t) / max(1.0, total - max(2, n)))
    return min_lr + (max_lr - min_lr) * gamma


def ds_warmup_cosine_lr(t, lr, total, min_ratio, n, cos_min_ratio, warmup_type):
    n2 = max(2, n)
    if t < n2:
        return lr * (min_ratio + ds_warmup(t, n, warmup_type) * (1 - min_ratio))
    progress = min(1.0, (t - n2 + 1) / max(1, total - n2))
    ratio = (1 + math.cos(math.pi * progress)) / 2
    return lr * max(0.0, cos_min_ratio + (1 - cos_min_ratio) * ratio)


STEPS = [0, 1, 2, 5, 9, 10, 11, 17, 30, 44, 59, 60, 61, 90]


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr_is_deepspeeds(warmup_type, tmp_path):
    params = {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 10,
              "warmup_type": warmup_type}
    cfg = load({"scheduler": {"type": "WarmupLR", "params": params}}, tmp_path)
    lr = make_schedule(cfg["optimizer"], total_steps=400)
    want = [ds_warmup_lr(t, 1e-5, 2e-3, 10, warmup_type) for t in STEPS]
    assert [float(lr(t)) for t in STEPS] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr_is_deepspeeds(warmup_type, tmp_path):
    params = {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 10,
              "total_num_steps": 60, "warmup_type": warmup_type}
    cfg = load({"scheduler": {"type": "WarmupDecayLR", "params": params}}, tmp_path)
    lr = make_schedule(cfg["optimizer"], total_steps=400)
    want = [ds_warmup_decay_lr(t, 60, 1e-5, 2e-3, 10, warmup_type) for t in STEPS]
    assert [float(lr(t)) for t in STEPS] == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert float(lr(60)) == pytest.approx(1e-5)  # decayed to warmup_min_lr, and stays


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr_is_deepspeeds(warmup_type, tmp_path):
    params = {"total_num_steps": 60, "warmup_min_ratio": 0.1, "warmup_num_steps": 10,
              "cos_min_ratio": 0.05, "warmup_type": warmup_type}
    cfg = load({"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
                "scheduler": {"type": "WarmupCosineLR", "params": params}}, tmp_path)
    lr = make_schedule(cfg["optimizer"], total_steps=400)
    want = [ds_warmup_cosine_lr(t, 2e-3, 60, 0.1, 10, 0.05, warmup_type) for t in STEPS]
    assert [float(lr(t)) for t in STEPS] == pytest.approx(want, rel=1e-6)


def test_total_num_steps_auto_decays_over_the_run(tmp_path):
    """decay_steps 0 (the run's own): WarmupDecayLR's total_num_steps is the run's train.steps,
    as the Trainer fills it with its number of training steps."""
    ds = copy.deepcopy(HF_STAGE3)
    cfg = load(ds, tmp_path, {"optimizer.warmup_steps": 4}, "--steps", "30")
    lr = make_schedule(cfg["optimizer"], total_steps=cfg["train"]["steps"])
    want = [ds_warmup_decay_lr(t, 30, 0.0, 3e-3, 4, "log") for t in STEPS]
    assert [float(lr(t)) for t in STEPS] == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_every_key_that_cannot_be_mapped_is_refused_in_one_message():
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": "auto", "offload_param": {"device": "nvme"}},
          "fp16": {"enabled": True, "loss_scale": 128},
          "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
          "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0}},
          "sparse_attention": {"mode": "fixed"}, "amp": {"enabled": True}}
    with pytest.raises(configs.ConfigError) as e:
        deepspeed.translate(ds, 8, "ds.json", configs.merge("tiny"))
    assert str(e.value) == (
        "--deepspeed-config ds.json: 8 keys cannot be mapped: "
        "zero_optimization.stage is \"auto\", which Hugging Face's Trainer does not fill either: "
        "write the value; "
        "zero_optimization.offload_param.device is nvme: the NVMe tier (ZeRO-Infinity) holds "
        "the optimizer's state, not the parameters; use \"cpu\" (host memory) or \"none\"; "
        "fp16.loss_scale is a static loss scale, which is not built: zero_jax's fp16 scaler is "
        "DeepSpeed's dynamic one (loss_scale 0); "
        "train_batch_size 16 is not train_micro_batch_size_per_gpu 4 x "
        "gradient_accumulation_steps 1 x 8 data-parallel devices = 32: fix one of them; "
        "optimizer.type Lamb is not built: zero_jax maps Adam and AdamW (optax.adam, "
        "optax.adamw); "
        "scheduler.type OneCycle is not built: zero_jax maps WarmupLR, WarmupDecayLR, "
        "WarmupCosineLR (optax schedules); "
        "sparse_attention is not supported by zero_jax: remove it; "
        "amp is not supported by zero_jax: remove it "
        f"(the keys it maps, ignores and refuses: {deepspeed.GUIDE})")


def test_refusals_within_one_block_are_all_named():
    ds = {"fp16": {"enabled": True, "loss_scale": 64, "consecutive_hysteresis": True},
          "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1,
                                                   "amsgrad": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic",
                                                       "last_batch_iteration": 5}}}
    with pytest.raises(configs.ConfigError) as e:
        deepspeed.translate(ds, 8, "ds.json", configs.merge("tiny"))
    message = str(e.value)
    assert message.startswith("--deepspeed-config ds.json: 6 keys cannot be mapped: ")
    assert "\n" not in message
    for key in ("fp16.loss_scale is", "fp16.consecutive_hysteresis is",
                "optimizer.params.adam_w_mode false", "optimizer.params.amsgrad is",
                "scheduler.params.warmup_type must", "scheduler.params.last_batch_iteration is"):
        assert key in message, key


def test_train_refuses_them_in_one_line_before_compiling(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "cpu_offload": True},
                                "gradient_clipping": "1.0", "prescale_gradients": True}))
    assert train.main(["--deepspeed-config", str(path), "--steps", "1"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [f"error: --deepspeed-config {path}: 3 keys cannot be mapped: "
                      "gradient_clipping must be a number (got \"1.0\"); "
                      "zero_optimization.cpu_offload is not supported by zero_jax: remove it; "
                      "prescale_gradients is not supported by zero_jax: remove it (the keys it "
                      f"maps, ignores and refuses: {deepspeed.GUIDE})"]
