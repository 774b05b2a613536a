"""Everything a config describes, built once: model, optimizer, ZeRO plan and train step.

``train.py`` and ``bench/`` both start here, so a benchmark measures exactly what a run trains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zero_jax.model import GPT, LAYERS, GPTConfig, init_fn, lm_loss
from zero_jax.optim import make_optimizer
from zero_jax.rules import Plan, make_plan
from zero_jax.step import make_train_step


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
        n = mesh.shape["data"]
        if t["batch_size"] % n:
            raise ValueError(f"global batch {t['batch_size']} is not divisible by {n} "
                             f"data-parallel devices: use --set train.batch_size=<multiple of "
                             f"{n}> or --devices <divisor of {t['batch_size']}>")
        model_cfg = GPTConfig(**cfg["model"])
        model = GPT(model_cfg)
        init = init_fn(model)
        tx, schedule = make_optimizer(cfg["optimizer"], t["steps"])
        plan = make_plan(jax.eval_shape(init, jax.random.key(0)), mesh, cfg["zero"]["stage"],
                         layers=LAYERS, min_shard_elems=cfg["zero"]["min_shard_elems"])
        step = make_train_step(plan, lm_loss(model), tx, lr_schedule=schedule)
        return cls(cfg, mesh, model_cfg, init, tx, plan, step)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.plan.axis))

    @property
    def batch_shape(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.cfg["train"]["batch_size"], self.model.seq_len + 1),
                                    jnp.int32, sharding=self.batch_sharding)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg["train"]["batch_size"] * self.model.seq_len
