"""The device mesh: one data-parallel axis today, room for more (``model``, two-level data).

With no accelerator, the CPU is split into simulated devices by XLA's
``--xla_force_host_platform_device_count`` (``simulate_cpu_devices``, before jax's first
computation); each simulated device then holds its own buffers and every collective really
runs.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import warnings

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zero_jax.internals import CSE_BARRIER_PASS

# The axis parameters are cut over; hierarchical ZeRO's across-group one; tensor parallelism's.
DATA, REPLICA, MODEL = "data", "replica", "model"

def simulate_cpu_devices(n: int) -> None:
    """Split the CPU into ``n`` devices (unless XLA_FLAGS already says how many). Effective
    before jax's first computation; harmless on GPU/TPU."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith("--xla_force_host_platform_device_count") for f in flags):
        flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def keep_remat_barriers() -> None:
    """Keep remat's optimization barriers when the CPU will run the programs (``XLA_FLAGS``,
    read when jax starts its backend: ``import zero_jax`` calls this).

    The CPU compiler drops the barriers early, and CSE then merges each block's backward
    re-gather into its forward gather: stage 3 would hold every block's whole weights from
    forward to backward (measured, 8 unrolled GPT blocks: 9 all-gathers instead of 17, temp
    27.0 MiB instead of 4.5). The GPU compiler keeps them, and refuses the flag: it is set
    only when ``JAX_PLATFORMS`` names the CPU first, or no accelerator plugin is installed.
    The report warns when a compiled stage-3 step gathers its blocks once.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms.split(",")[0] not in ("", "cpu") or not platforms and _accelerator_plugin():
        return
    flags = os.environ.get("XLA_FLAGS", "").split()
    passes = [p for f in flags if f.startswith("--xla_disable_hlo_passes=")
              for p in f.split("=", 1)[1].split(",")]
    if CSE_BARRIER_PASS not in passes:
        flags = [f for f in flags if not f.startswith("--xla_disable_hlo_passes=")]
        flags.append(f"--xla_disable_hlo_passes={','.join([*passes, CSE_BARRIER_PASS])}")
        os.environ["XLA_FLAGS"] = " ".join(flags)


def _accelerator_plugin() -> bool:
    """Whether a GPU or TPU backend for jax is installed (jax may then start it)."""
    try:
        import jax_plugins  # the namespace of jax's CUDA and ROCm plugins
    except ImportError:
        pass
    else:
        if any(pkgutil.iter_modules(jax_plugins.__path__)):
            return True
    return importlib.util.find_spec("libtpu") is not None


def make_mesh(devices: int | None = None, axes: dict[str, int] | None = None) -> Mesh:
    """A mesh over the first ``devices`` devices of the default backend.

    ``axes`` maps axis names to sizes (one may be -1 for "the rest"); the default is a single
    ``data`` axis. Axes are ``Auto`` so the partitioner may place what ``shard_map`` does not.
    """
    # A host's devices next to each other, in device order: a data-axis slice is then one
    # host's, and the groups of an inner (last) axis no larger than a host stay on it.
    available = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n = len(available) if devices is None else devices
    if jax.process_count() > 1 and n != len(available):
        raise ValueError(f"a mesh of {n} devices: across {jax.process_count()} processes a mesh "
                         f"spans all {len(available)} devices; leave devices out (each "
                         "process's simulated devices are set where it starts)")
    if not 1 <= n <= len(available):
        raise ValueError(f"cannot build a mesh of {n} devices: {len(available)} "
                         f"{available[0].platform} device(s) available; pass devices between "
                         f"1 and {len(available)}")
    axes = dict(axes or {DATA: -1})
    fixed = int(np.prod([s for s in axes.values() if s != -1]))
    for name, size in axes.items():
        if size == -1:
            axes[name] = n // fixed
    if int(np.prod(list(axes.values()))) != n:
        raise ValueError(f"mesh axes {axes} do not multiply to {n} devices")
    if devices is None and n == 1 and available[0].platform == "cpu":
        warnings.warn("make_mesh: one CPU device, so nothing is cut: to simulate 8, call "
                      "zero_jax.simulate_cpu_devices(8) before JAX's first computation (or "
                      "set XLA_FLAGS=--xla_force_host_platform_device_count=8)", stacklevel=2)
    grid = np.array(available[:n]).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))
