"""Does a compiled step fit the devices? Asked before anything is allocated.

A model that does not fit does not always fail cleanly: on the CPU mesh the allocation grows
until the OOM killer ends the process, or XLA waits forever. The compiled step already knows
what one device needs (arguments + outputs not aliased to them + temporaries); the devices
say what they have (``memory_stats`` on GPU/TPU; on the CPU mesh every simulated device lives
in host RAM, so all of them together against the memory the host has available).
"""

from __future__ import annotations

from typing import Any

GiB = 2**30
HEADROOM = 0.9  # leave a tenth for the runtime, the data and everything else


def variants(layout: dict) -> list[str]:
    """What a planner layout sets beyond stage, offload, remat and T, in words: the one
    spelling its table, its verdict and its figure share."""
    return ([f"tiled within {layout['tile_mb']:.3g} MiB"] if layout.get("tile_mb") else []) \
        + (["no prefetch"] if layout.get("prefetch") is False else []) \
        + (["by module"] if layout.get("gather") == "module" else [])


def step_bytes(compiled: Any) -> int:
    """Bytes one device needs to run the compiled step."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def host_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (Linux), else None: unknown, not checked."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check(compiled: Any, devices: list[Any]) -> str | None:
    """None if the step fits, else what it needs against what there is, in one sentence
    (without the advice, which depends on the application)."""
    need = step_bytes(compiled)
    if devices[0].platform == "cpu":
        have = host_available_bytes()
        total = need * len(devices)
        if have is None or total <= HEADROOM * have:
            return None
        return (f"the step needs {need / GiB:.1f} GiB on each of {len(devices)} CPU devices, "
                f"{total / GiB:.1f} GiB of host memory, but {have / GiB:.1f} GiB are available")
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" not in stats:
            continue
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if need > HEADROOM * free:
            return (f"the step needs {need / GiB:.1f} GiB per device but {d} has "
                    f"{free / GiB:.1f} GiB free of {stats['bytes_limit'] / GiB:.1f} GiB")
    return None
