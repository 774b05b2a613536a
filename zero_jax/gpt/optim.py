"""The optimizer a config asks for: any of these is an ordinary optax transformation."""

from __future__ import annotations

from collections.abc import Callable

import optax


def make_optimizer(cfg: dict, total_steps: int
                   ) -> tuple[optax.GradientTransformation, Callable]:
    """``(tx, lr_schedule)`` from the ``optimizer`` section: warmup, then cosine down to 10% at
    ``decay_steps`` (0: at the run's last step)."""
    total = cfg["decay_steps"] or total_steps
    warmup = min(cfg["warmup_steps"], max(total - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg["lr"], warmup, max(total, warmup + 1), end_value=cfg["lr"] * 0.1)
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
