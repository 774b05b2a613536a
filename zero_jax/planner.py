"""What fits: layouts compiled on abstract arrays, measured against a device's and a host's memory.

DeepSpeed's estimator is formulas; this reads the compiled programs. A candidate needs, per
device, the model state it keeps in device memory (from the shardings) plus the step's
temporaries (XLA's ``memory_analysis``: activations, gradients, gathered layers); per host, the
state its devices keep in host memory. It communicates what its collectives carry (from the
compiled HLO) and, with offload, what crosses between host and device; it computes what XLA's
cost analysis counts (the remat policies trade recompute for memory).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from zero_jax.fit import HEADROOM, variants
from zero_jax.hlo import collectives
from zero_jax.report import model_states, peak_expected, peak_split, shard_bytes
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
    peak: dict | None = None  # what is live at the step's peak, by kind (``zero_jax.peak``)
    host_optimizer: int = 0  # of ``host_state``: master and optimizer state, per device
    nvme_state: int = 0  # in files on the host's disk (the NVMe tier), per device
    flops: int = 0  # the step's floating-point operations, per device (0: not reported)
    fits: bool = False

    @property
    def device(self) -> int:
        return self.device_state + self.temp


def measure(layout: dict, plan: Any, state: Any, compiled: Any,
            peak: dict | None = None, accum_steps: int = 1) -> Candidate:
    """A compiled candidate: ``state`` is its abstract train state (shardings with memory
    kinds), ``compiled`` its step (of ``accum_steps`` microbatches), ``peak`` what is live at
    the step's peak (``zero_jax.peak.compile_with_peak``)."""
    comm = sum(c.volume for c in collectives(compiled.as_text(), plan.mesh.size))
    return Candidate(layout, shard_bytes(state, "device"),
                     compiled.memory_analysis().temp_size_in_bytes,
                     shard_bytes(state, "pinned_host"), comm,
                     offload_traffic(plan, state, accum_steps),
                     sum(model_states(plan, state, accum_steps)[0].values()),
                     peak and {**peak, "expected": peak_expected(plan, accum_steps)},
                     shard_bytes((state.master, state.opt_state), "pinned_host"),
                     flops=step_flops(compiled))


def step_flops(compiled: Any) -> int:
    """XLA's count of the compiled step's floating-point operations, per device (its program is
    one device's): what remat recomputes shows here. ``cost_analysis`` is a dict, a list of one
    dict in older jax, or None where the backend has none: then 0, and the policies tie."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return int((cost or {}).get("flops", 0))


def on_nvme(c: Candidate, buffer_bytes: int, devices_per_host: int) -> Candidate:
    """A layout whose whole optimizer is offloaded (its parameters too, or not), with
    ZeRO-Infinity's NVMe tier instead: the same compiled gradient half and traffic to the host;
    master and optimizer state move from host memory to the disk, and the host keeps the tier's
    buffers (at most the state) and the offloaded parameters."""
    files = c.host_optimizer
    buffers = min(buffer_bytes, files * devices_per_host) / devices_per_host
    offload = "nvme+params" if c.layout["offload"] == "params" else "nvme"
    return dataclasses.replace(c, layout={**c.layout, "offload": offload}, nvme_state=files,
                               host_state=int(c.host_state - files + buffers), fits=False)


def offload_traffic(plan: Any, state: Any, accum_steps: int = 1) -> int:
    """Bytes one device moves between its memory and the host's per step: the offloaded leaves'
    gradients out (streamed per layer in the compute dtype, else converted to fp32 first) and
    their new compute copy back; with offloaded parameters, each layer's shard in for the
    forward and again for the backward, its gradient shard out."""
    total = 0
    streamed = jax.tree.leaves(grads_in_host_memory(plan, accum_steps))
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


def largest_block_leaf_bytes(plan: Any) -> int:
    """One layer's largest parameter of the declared blocks that tiling may cut (cut over the
    devices, not persistent; ``rules.tile_leaf``), in the compute dtype: what tiling's bound
    (``Layers.tile_mb``) is set against."""
    leaves = jax.tree.leaves(plan.leaves, is_leaf=lambda x: hasattr(x, "stacked"))
    return max((leaf.layer_elements for leaf in leaves
                if leaf.block and leaf.axis is not None and not leaf.persistent), default=0) \
        * plan.precision.compute.itemsize


def describe(layout: dict) -> str:
    """A layout in words, as the table's verdict and split name it."""
    return (f"stage {layout['stage']}, offload {layout['offload']}, remat {layout['remat']}, "
            f"tensor parallel {layout['tp']}" + "".join(f", {v}" for v in variants(layout)))


def state_exceeds(state: Any, device_memory: int, host_memory: int, devices_per_host: int,
                  host_checked: bool = True) -> str | None:
    """Why a layout cannot fit by its model state alone, read from its abstract state's
    shardings before anything is compiled (the step's temporaries only add to it), or None.
    ``host_checked`` False: the host's part may still move to the disk (the NVMe tier)."""
    device, host = shard_bytes(state, "device"), shard_bytes(state, "pinned_host")
    if device > HEADROOM * device_memory:
        return f"model state {device / 2**20:,.2f} MiB per device"
    if host_checked and host * devices_per_host > HEADROOM * host_memory:
        return f"model state {host * devices_per_host / 2**20:,.2f} MiB per host"
    return None


class Progress:
    """One line per compiled layout as the search goes, with what is left at the mean compile
    time so far: a sweep compiles for minutes, and says so while it does."""

    def __init__(self, total: int, device_memory: int, out=None):
        self.total, self.done, self.start, self.out = total, 0, time.monotonic(), out
        self.unit, self.div = ("GiB", 2**30) if device_memory >= 2**30 else ("MiB", 2**20)

    def __call__(self, c: Candidate, fits: bool, devices_per_host: int) -> None:
        self.done += 1
        self.total = max(self.total, self.done)
        left = (time.monotonic() - self.start) / self.done * (self.total - self.done)
        print(f"[{self.done}/{self.total}] {describe(c.layout)}: "
              f"{'fits' if fits else 'does not fit'} (device {c.device / self.div:,.2f} "
              f"{self.unit}, host {c.host_state * devices_per_host / self.div:,.2f} {self.unit} "
              f"per host), ~{left:.0f} s left", file=self.out or sys.stdout, flush=True)


def fits(c: Candidate, device_memory: int, host_memory: int, devices_per_host: int,
         nvme_memory: int = 0) -> bool:
    """Whether ``c``'s device, host and NVMe figures are within ``HEADROOM`` of the sizes."""
    return (c.device <= HEADROOM * device_memory and
            c.host_state * devices_per_host <= HEADROOM * host_memory and
            c.nvme_state * devices_per_host <= HEADROOM * nvme_memory)


def choose(candidates: list[Candidate], device_memory: int, host_memory: int,
           devices_per_host: int, nvme_memory: int = 0) -> Candidate | None:
    """Mark which fit and return the one that communicates least (then: crosses least between
    host and device, then keeps least on the disk, then computes least, then holds least on the
    device); None when none fits. Remat policies that communicate alike tie until the FLOPs:
    the one that recomputes least wins where it fits (``dots`` or ``none``, the matmuls' outputs
    kept), ``full`` only where they do not."""
    for c in candidates:
        c.fits = fits(c, device_memory, host_memory, devices_per_host, nvme_memory)
    fitting = [c for c in candidates if c.fits]
    return min(fitting, default=None,
               key=lambda c: (c.comm, c.host_traffic, c.nvme_state, c.flops, c.device))


def format_table(candidates: list[Candidate], best: Candidate | None, device_memory: int,
                 host_memory: int, devices_per_host: int, n_params: int, devices: int,
                 untried: Sequence[str] = ()) -> str:
    """The candidates as a table: device memory (state + temp), host memory per host, whether
    it fits, communication; and which was chosen. ``untried``: what the search left out, named
    when nothing fits."""
    unit, div = ("GiB", 2**30) if device_memory >= 2**30 else ("MiB", 2**20)
    lines = [f"layouts of {n_params:,} parameters on {devices} devices of "
             f"{device_memory / div:.1f} {unit}, {devices_per_host} per host of "
             f"{host_memory / div:.1f} {unit} (fits: within {HEADROOM:.0%} of both); {unit} "
             "per device, host per host, communication per device and step\n",
             f"  {'stage':<6}{'offload':<12}{'remat':<8}{'tp':>3}{'device':>9}{'(state':>9}"
             f"{'+ temp)':>9}{'host':>9}{'fits':>6}{'comm MiB':>10}{'host<->dev MiB':>16}"]
    for c in candidates:
        lo = c.layout
        lines.append(f"  {lo['stage']:<6}{lo['offload']:<12}{lo['remat']:<8}{lo['tp']:>3}"
                     f"{c.device / div:>9.2f}{c.device_state / div:>9.2f}{c.temp / div:>9.2f}"
                     f"{c.host_state * devices_per_host / div:>9.2f}"
                     f"{'yes' if c.fits else 'no':>6} {c.comm / 2**20:>9.2f}"
                     f"{c.host_traffic / 2**20:>16.2f}"
                     + "".join(f"   {v}" for v in variants(lo))
                     + (f"   {c.nvme_state * devices_per_host / div:.2f} {unit} on NVMe"
                        if c.nvme_state else ""))
    # What fills the peak of the chosen layout, or of the one closest to fitting: what to change.
    shown = best or min(candidates, key=lambda c: c.device, default=None)
    if shown is not None and shown.peak and shown.peak["peak_bytes"]:
        lines += [f"\nat the peak of {describe(shown.layout)} ({shown.peak['peak_bytes'] / div:.2f}"
                  f" {unit} live per device, arguments included; temp {shown.temp / div:.2f} "
                  f"{unit}):",
                  *peak_split(shown.peak, unit, div)]
    if best is None:
        lines.append("\nnothing fits: more devices, a smaller model or train.batch_size"
                     + (f"; not tried in this search: {', '.join(untried)}" if untried else ""))
    else:
        lines.append(f"\nfits and communicates least: {describe(best.layout)}")
    return "\n".join(lines)


def as_json(candidates: list[Candidate], best: Candidate | None, device_memory: int,
            host_memory: int, devices_per_host: int, devices: int) -> dict:
    """The planner's verdict as the report file holds it."""
    return {"device_memory": device_memory, "host_memory": host_memory,
            "devices_per_host": devices_per_host, "devices": devices,
            "best": None if best is None else best.layout,
            "candidates": [{**c.layout, "device_bytes": c.device,
                            "device_state_bytes": c.device_state, "temp_bytes": c.temp,
                            "model_state_bytes": c.model_states,
                            "host_bytes_per_host": c.host_state * devices_per_host,
                            "nvme_bytes_per_host": c.nvme_state * devices_per_host,
                            "fits": c.fits, "comm_bytes": c.comm,
                            "host_traffic_bytes": c.host_traffic, "flops": c.flops,
                            "peak": c.peak}
                           for c in candidates]}
