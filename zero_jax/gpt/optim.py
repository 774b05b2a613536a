"""The optimizer a config asks for: any of these is an ordinary optax transformation."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
import optax


def make_optimizer(cfg: dict, total_steps: int
                   ) -> tuple[optax.GradientTransformation, Callable]:
    """``(tx, lr_schedule)`` from the ``optimizer`` section: warmup, then cosine down to 10% at
    ``decay_steps`` (0: at the run's last step)."""
    schedule = make_schedule(cfg, total_steps)
    if cfg["name"] == "sgd":
        tx = optax.sgd(schedule, momentum=cfg["momentum"] or None)
    elif cfg["name"] == "adam":
        tx = optax.adam(schedule, cfg["b1"], cfg["b2"], cfg["eps"])
    else:
        tx = optax.adamw(schedule, cfg["b1"], cfg["b2"], cfg["eps"],
                         weight_decay=cfg["weight_decay"])
    if cfg["clip_norm"] > 0:
        tx = optax.chain(optax.clip_by_global_norm(cfg["clip_norm"]), tx)
    return tx, schedule


def make_schedule(cfg: dict, total_steps: int) -> Callable:
    """The learning rate at each optimizer step count (0 at the first step). ``cosine`` cuts
    its warmup short in runs shorter than it; ``constant``, ``linear`` and ``deepspeed_cosine``
    follow DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR to the step (count t is their
    ``last_batch_iteration`` t), whatever the run's length."""
    lo, hi, n = cfg["warmup_min_lr"], cfg["lr"], cfg["warmup_steps"]
    total = cfg["decay_steps"] or total_steps
    if cfg["schedule"] == "cosine":
        warmup = min(n, max(total - 1, 0))
        return optax.warmup_cosine_decay_schedule(
            lo, hi, warmup, max(total, warmup + 1), end_value=hi * 0.1)
    if n == 0 and cfg["schedule"] == "constant":
        return optax.constant_schedule(hi)
    log = cfg["warmup_type"] == "log"
    decay = {"constant": lambda t: hi, "linear": _linear_decay(lo, hi, n, total),
             "deepspeed_cosine": _cosine_decay(hi * cfg["cos_min_ratio"], hi, n, total)}
    after = decay[cfg["schedule"]]

    def schedule(count):
        t = jnp.asarray(count, jnp.float32)
        gamma = jnp.log1p(t) / math.log(max(n, 2)) if log else t / max(n, 1)
        return jnp.where(t < n, lo + (hi - lo) * gamma, after(t))

    return schedule


def _linear_decay(lo: float, hi: float, n: int, total: int) -> Callable:
    """WarmupDecayLR after its warmup: from ``hi`` at step n down to ``lo`` at ``total``."""
    return lambda t: lo + (hi - lo) * jnp.maximum(0.0, (total - t) / max(1, total - n))


def _cosine_decay(end: float, hi: float, n: int, total: int) -> Callable:
    """WarmupCosineLR after its warmup: half a cosine from ``hi`` to ``end`` at ``total``; its
    first step after the warmup is already one step into the cosine, as DeepSpeed counts."""
    def lr(t):
        progress = jnp.minimum(1.0, (t - n + 1) / max(1, total - n))
        return end + (hi - end) * (1 + jnp.cos(jnp.pi * progress)) / 2

    return lr
