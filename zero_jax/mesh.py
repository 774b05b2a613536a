"""The device mesh: one data-parallel axis today, room for more (``model``, two-level data).

With no accelerator, the CPU is split into simulated devices by XLA's
``--xla_force_host_platform_device_count``, which must be set before jax is imported (see
``train.py`` and ``tests/conftest.py``); each simulated device then holds its own buffers and
every collective really runs.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(devices: int | None = None, axes: dict[str, int] | None = None) -> Mesh:
    """A mesh over the first ``devices`` devices of the default backend.

    ``axes`` maps axis names to sizes (one may be -1 for "the rest"); the default is a single
    ``data`` axis. Axes are ``Auto`` so the partitioner may place what ``shard_map`` does not.
    """
    available = jax.devices()
    n = len(available) if devices is None else devices
    if not 1 <= n <= len(available):
        raise ValueError(f"cannot build a mesh of {n} devices: {len(available)} "
                         f"{available[0].platform} device(s) available; pass --devices between "
                         f"1 and {len(available)}")
    axes = dict(axes or {"data": -1})
    fixed = int(np.prod([s for s in axes.values() if s != -1]))
    for name, size in axes.items():
        if size == -1:
            axes[name] = n // fixed
    if int(np.prod(list(axes.values()))) != n:
        raise ValueError(f"mesh axes {axes} do not multiply to {n} devices")
    grid = np.array(available[:n]).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))
