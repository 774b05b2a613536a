"""Mixed precision: which dtype each copy of the model is in, and fp16's dynamic loss scale.

ZeRO's accounting (K = 12) assumes this split: a compute copy of the parameters and the
gradients in 16 bits, and an fp32 master copy of the parameters kept with the optimizer's fp32
moments, in the optimizer's (sharded) layout. The compute copy is refreshed from the master
after every update. With ``param_dtype`` fp32 there is no separate master: the parameters are it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """DeepSpeed's dynamic loss scaler, with its defaults."""

    initial_scale_power: int = 16
    window: int = 1000  # steps without overflow before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    min_scale: float = 1.0


class LossScale(NamedTuple):
    scale: jax.Array  # f32 scalar
    hysteresis: jax.Array  # i32: overflows left before the scale is lowered
    good_steps: jax.Array  # i32: steps since the last overflow


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes of compute, of gradient collectives and of gradient accumulation (which matters
    only for a step over several microbatches: ``make_train_step(accum_steps=)``)."""

    param_dtype: str = "fp32"  # the compute copy and the forward/backward
    reduce_dtype: str | None = None  # gradient collectives; None: param_dtype
    accum_dtype: str = "fp32"  # the gradient accumulator across microbatches
    autocast_input: bool = True  # float inputs cast to param_dtype
    autocast_output: bool = True  # the loss (and the model's logits) in fp32
    skip_nonfinite: bool = True  # a step with a non-finite gradient leaves the state as it was
    loss_scale: LossScaleConfig | None = None  # dynamic loss scaling (fp16)

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "accum_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise ValueError(f"precision.{name} must be one of {', '.join(DTYPES)} "
                                 f"(got {value!r})")

    @property
    def compute(self) -> jnp.dtype:
        return jnp.dtype(DTYPES[self.param_dtype])

    @property
    def reduce(self) -> jnp.dtype:
        return jnp.dtype(DTYPES[self.reduce_dtype or self.param_dtype])

    @property
    def accum(self) -> jnp.dtype:
        return jnp.dtype(DTYPES[self.accum_dtype])

    def grad_dtype(self, accum_steps: int) -> jnp.dtype:
        """Gradients leave the backward in the compute dtype, or, summed over several
        microbatches, in the accumulator's."""
        return self.accum if accum_steps > 1 else self.compute

    @property
    def has_master(self) -> bool:
        return self.compute != jnp.float32

    def init_loss_scale(self) -> LossScale | None:
        if self.loss_scale is None:
            return None
        c = self.loss_scale
        return LossScale(jnp.asarray(2.0 ** c.initial_scale_power, jnp.float32),
                         jnp.asarray(c.hysteresis, jnp.int32), jnp.zeros((), jnp.int32))


def update_loss_scale(s: LossScale, finite: jax.Array, c: LossScaleConfig) -> LossScale:
    """DeepSpeed's rule: an overflow uses up hysteresis, then halves the scale (not below the
    minimum); ``window`` clean steps in a row double it."""
    lower = s.hysteresis <= 1
    on_overflow = LossScale(
        jnp.where(lower, jnp.maximum(s.scale / 2, c.min_scale), s.scale),
        jnp.where(lower, s.hysteresis, s.hysteresis - 1), jnp.zeros((), jnp.int32))
    good = s.good_steps + 1
    grow = good % c.window == 0
    on_success = LossScale(jnp.where(grow, s.scale * 2, s.scale),
                           jnp.where(grow, c.hysteresis, s.hysteresis), good)
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), on_success, on_overflow)


def default_param_dtype(platform: str) -> str:
    """bf16 compute on accelerators; fp32 on the CPU mesh, where bf16 is slow and emulated."""
    return "fp32" if platform == "cpu" else "bf16"
