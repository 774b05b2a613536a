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
    its warmup short in runs shorter than it; ``constant`` follows DeepSpeed's WarmupLR to the
    step, whatever the run's length."""
    lo, hi, n = cfg["warmup_min_lr"], cfg["lr"], cfg["warmup_steps"]
    if cfg["schedule"] == "cosine":
        total = cfg["decay_steps"] or total_steps
        warmup = min(n, max(total - 1, 0))
        return optax.warmup_cosine_decay_schedule(
            lo, hi, warmup, max(total, warmup + 1), end_value=hi * 0.1)
    if n == 0:
        return optax.constant_schedule(hi)
    log = cfg["warmup_type"] == "log"

    def schedule(count):
        t = jnp.asarray(count, jnp.float32)
        gamma = jnp.log1p(t) / math.log(n) if log else t / n
        return jnp.where(t < n, lo + (hi - lo) * gamma, hi)

    return schedule
