"""What fits: layouts compiled on abstract arrays, measured against a device's and a host's memory.

DeepSpeed's estimator is formulas; this reads the compiled programs. A candidate needs, per
device, the model state it keeps in device memory (from the shardings) plus the step's
temporaries (XLA's ``memory_analysis``: activations, gradients, gathered layers); per host, the
state its devices keep in host memory. It communicates what its collectives carry (from the
compiled HLO) and, with offload, what crosses between host and device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from zero_jax.fit import HEADROOM
from zero_jax.hlo import collectives
from zero_jax.report import model_states, shard_bytes
from zero_jax.state import grads_in_host_memory


@dataclasses.dataclass
class Candidate:
    layout: dict  # what to set: stage, offload, remat, ...
    device_state: int  # model state in device memory, per device
    temp: int  # the step's temporaries, per device
    host_state: int  # model state in host memory, per device
    comm: int  # bytes the collectives move per step, per device (ZeRO's units)
    host_traffic: int  # bytes crossing between host and device per step, per device
    model_states: int  # ZeRO's accounting in device memory (parameters, gradients, master,
    # optimizer state), per device: the dry run's per-stage table; the gradient is in temp too
    fits: bool = False

    @property
    def device(self) -> int:
        return self.device_state + self.temp


def measure(layout: dict, plan: Any, state: Any, compiled: Any) -> Candidate:
    """A compiled candidate: ``state`` is its abstract train state (shardings with memory
    kinds), ``compiled`` its step."""
    comm = sum(c.volume for c in collectives(compiled.as_text(), plan.mesh.size))
    return Candidate(layout, shard_bytes(state, "device"),
                     compiled.memory_analysis().temp_size_in_bytes,
                     shard_bytes(state, "pinned_host"), comm, offload_traffic(plan, state),
                     sum(model_states(plan, state)[0].values()))


def offload_traffic(plan: Any, state: Any) -> int:
    """Bytes one device moves between its memory and the host's per step: the offloaded leaves'
    gradients out (streamed per layer in the compute dtype, else converted to fp32 first) and
    their new compute copy back; with offloaded parameters, each layer's shard in for the
    forward and again for the backward, its gradient shard out."""
    total = 0
    streamed = jax.tree.leaves(grads_in_host_memory(plan))
    for leaf, p, stream in zip(jax.tree.leaves(plan.leaves,
                                               is_leaf=lambda x: hasattr(x, "offload")),
                               jax.tree.leaves(state.params), streamed, strict=True):
        if not leaf.offload:
            continue
        c = p.dtype.itemsize
        if p.sharding.memory_kind == "pinned_host":  # shard in twice, gradient shard out
            total += 3 * c * math.prod(p.sharding.shard_shape(p.shape))
        else:  # the optimizer's share of the gradient out, of the compute copy back
            share = math.prod(p.shape) / (plan.dp_size if plan.rule.shard_opt_state else 1)
            total += ((c if stream else 4) + c) * share
    return int(total)


def choose(candidates: list[Candidate], device_memory: int, host_memory: int,
           devices_per_host: int) -> Candidate | None:
    """Mark which fit (device and host figures within ``HEADROOM`` of the sizes) and return the
    one that communicates least (then: crosses least between host and device, then holds least
    on the device); None when none fits."""
    for c in candidates:
        c.fits = (c.device <= HEADROOM * device_memory and
                  c.host_state * devices_per_host <= HEADROOM * host_memory)
    fitting = [c for c in candidates if c.fits]
    return min(fitting, key=lambda c: (c.comm, c.host_traffic, c.device), default=None)
