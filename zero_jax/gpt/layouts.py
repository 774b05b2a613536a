"""The planner's candidates for the GPT demo: every layout its command line left open.

The library's planner (``zero_jax.planner``) measures compiled candidates and chooses; this
module says which configs to compile and how to spell the chosen one as train.py's flags.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Iterator

from zero_jax.blocks import REMAT
from zero_jax.gpt.experiment import prefetch_from


def candidates(cfg: dict, sets: list[str], stage: int | None, tensor_parallel: int | None,
               per_host: int, devices: int) -> Iterator[tuple[dict, dict]]:
    """(layout, config) for each candidate: what the command line did not fix (--stage,
    --tensor-parallel, model.remat, zero.offload_*) varies. Tensor parallelism (T a divisor of
    the devices per host that cuts the heads, the MLP and the vocabulary) is tried with
    partitioned activations at stage 3, as ZeRO's paper trains its largest models, with each
    offload (the lower stages follow where it fits: ``lower_stage``), or at the stage set.
    With zero.tile_mb, only stage 3 without offload or tensor parallelism tiles."""
    z, m = cfg["zero"], cfg["model"]
    fixed = functools.partial(_fixed, sets)
    offloads = {"none": ("none", "none"), "optimizer": ("cpu", "none"),
                "params": ("cpu", "cpu")}
    if _offload_fixed(sets):
        offloads = {"as set": (z["offload_optimizer"]["device"], z["offload_params"])}
    tps = [cfg["mesh"]["tensor_parallel"]]
    if tensor_parallel is None and not fixed("mesh.tensor_parallel"):
        tps = [t for t in range(1, per_host + 1) if per_host % t == 0 and devices % t == 0
               and all(m[k] % t == 0 for k in ("n_heads", "d_ff", "vocab_size"))]
    stages = [stage] if stage is not None else range(4)
    for t, s, (offload, (opt, params)), remat in itertools.product(
            tps, stages, offloads.items(), [m["remat"]] if fixed("model.remat") else REMAT):
        if (params == "cpu" and (s != 3 or cfg["train"]["accum_steps"] > 1)) or \
                (t > 1 and s != 3 and stage is None) or \
                (z["tile_mb"] and (s != 3 or opt != "none" or t > 1)) or \
                (z["gather"] == "module" and s != 3):
            continue
        c = copy.deepcopy(cfg)
        ratio = z["offload_optimizer"]["ratio"] if offload == "as set" else 1.0
        c["zero"].update(stage=s, offload_params=params, partition_activations=t > 1,
                         offload_optimizer={"device": opt, "ratio": ratio})
        c["model"]["remat"], c["mesh"]["tensor_parallel"] = remat, t
        yield {"stage": s, "offload": offload, "remat": remat, "tp": t}, c


def tiled(cfg: dict, sets: list[str], stage: int | None, tensor_parallel: int | None,
          largest_leaf_bytes: int) -> Iterator[tuple[dict, dict]]:
    """When no layout fits: ZeRO-Infinity's tiling, at stage 3 without offload or tensor
    parallelism (what it composes with), each remat the sweep tried, with the bound at a
    quarter and at a sixteenth of the blocks' largest leaf (``largest_leaf_bytes``, in the
    compute dtype). Nothing when the command line fixed what excludes it."""
    fixed = functools.partial(_fixed, sets)
    if cfg["zero"]["tile_mb"] or stage not in (None, 3) or tensor_parallel not in (None, 1) or \
            (fixed("mesh.tensor_parallel") and cfg["mesh"]["tensor_parallel"] > 1) or \
            (_offload_fixed(sets) and (cfg["zero"]["offload_optimizer"]["device"] != "none"
                                         or cfg["zero"]["offload_params"] != "none")):
        return
    for parts, remat in itertools.product(
            (4, 16), [cfg["model"]["remat"]] if fixed("model.remat") else REMAT):
        c = copy.deepcopy(cfg)
        tile_mb = largest_leaf_bytes / parts / 2**20
        c["zero"].update(stage=3, offload_params="none", partition_activations=False,
                         offload_optimizer={"device": "none", "ratio": 1.0}, tile_mb=tile_mb)
        c["model"]["remat"], c["mesh"]["tensor_parallel"] = remat, 1
        yield {"stage": 3, "offload": "none", "remat": remat, "tp": 1, "tile_mb": tile_mb}, c


def lower_stage(layout: dict, cfg: dict, stage: int | None) -> tuple[dict, dict] | None:
    """A tensor-parallel layout one stage lower (Megatron beside ZeRO-1 or 2): it keeps more
    per device and communicates less, so the planner tries it only where ``layout`` fits, one
    stage at a time. None where the command line set the stage, at stage 0, or where the
    parameters are offloaded (stage 3 only)."""
    if stage is not None or layout["tp"] == 1 or layout["stage"] == 0 or \
            layout["offload"] == "params" or layout.get("tile_mb"):
        return None
    c = copy.deepcopy(cfg)
    c["zero"]["stage"] = layout["stage"] - 1
    return {**layout, "stage": layout["stage"] - 1}, c


def at_stage(cfg: dict, stage: int) -> dict:
    """``cfg`` at another flat stage, for the figures that compare the stages: what only stage 3
    builds (tiling, gathering by module, offloaded parameters, int8 weights) is dropped below
    it, and int8 gradients below stage 2; the rest is the run's."""
    c = copy.deepcopy(cfg)
    z = c["zero"]
    z["stage"] = stage
    if stage < 3:
        z.update(tile_mb=0.0, gather="block", offload_params="none", quantize_weights="none")
    if stage < 2:
        z["quantize_grads"] = "none"
    return c


def without_prefetch(layout: dict, cfg: dict, sets: list[str]) -> tuple[dict, dict] | None:
    """The layout again without prefetch, which holds one gathered layer more: for a layout
    whose device memory does not fit with it. None where prefetch does not run, or the command
    line set it."""
    z = cfg["zero"]
    if _fixed(sets, "zero.prefetch") or not prefetch_from(z):
        return None
    c = copy.deepcopy(cfg)
    c["zero"]["prefetch"] = False
    return {**layout, "prefetch": False}, c


def by_module(layout: dict, cfg: dict, sets: list[str]) -> tuple[dict, dict] | None:
    """The layout again gathering by module (``zero.gather``), which holds one module's weights
    rather than a block's: for a stage 3 layout whose device memory does not fit. None below
    stage 3, tiled, or where the command line set ``zero.gather``."""
    if layout["stage"] != 3 or layout.get("tile_mb") or _fixed(sets, "zero.gather") or \
            cfg["zero"]["gather"] == "module":
        return None
    c = copy.deepcopy(cfg)
    c["zero"]["gather"] = "module"
    return {**layout, "gather": "module"}, c


def untried(cfg: dict, sets: list[str], layouts: list[dict]) -> list[str]:
    """What the command line kept the search from trying, as the flags that would: for the
    planner's advice when nothing fits."""
    out = []
    if all(lo["stage"] < 3 for lo in layouts):
        out.append("--stage 3")
    if _offload_fixed(sets) and all(lo["offload"] == "as set" for lo in layouts):
        out.append("zero.offload_optimizer.device=cpu, zero.offload_params=cpu")
    elif not any(lo["offload"].startswith("nvme") for lo in layouts):
        out.append("--nvme-memory SIZE (the NVMe tier)")
    if all(lo["tp"] == 1 for lo in layouts):
        out.append("--tensor-parallel T")
    if not cfg["zero"]["tile_mb"] and not any(lo.get("tile_mb") for lo in layouts):
        out.append("zero.tile_mb (stage 3, without offload or tensor parallelism)")
    return out


def tp_asked(sets: list[str], tensor_parallel: int | None) -> bool:
    """Whether the command line chose tensor parallelism's T (--tensor-parallel, or a --set of
    mesh.tensor_parallel): else the planner tries T > 1 only when nothing fits without it."""
    return tensor_parallel is not None or _fixed(sets, "mesh.tensor_parallel")


def _offload_fixed(sets: list[str]) -> bool:
    """Whether the command line chose where the state lives (the NVMe tier's buffer sizes
    leave it open)."""
    return any(_fixed(sets, f"zero.{key}") for key in (
        "offload_optimizer.device", "offload_optimizer.ratio", "offload_params"))


def _fixed(sets: list[str], key: str) -> bool:
    """Whether a ``--set`` of the command line fixed ``key`` (or a key under it)."""
    return any(s.startswith(key) for s in sets)


def flags(layout: dict) -> str:
    """train.py's flags for ``layout``."""
    out = [f"--stage {layout['stage']}", f"--set model.remat={layout['remat']}"]
    if layout["offload"] in ("optimizer", "params"):
        out.append("--set zero.offload_optimizer.device=cpu")
    if layout["offload"].startswith("nvme"):
        out += ["--set zero.offload_optimizer.device=nvme",
                "--set zero.offload_optimizer.nvme_path=DIR", "--set optimizer.clip_norm=0"]
    if layout["offload"] in ("params", "nvme+params"):
        out.append("--set zero.offload_params=cpu")
    if layout["tp"] > 1:
        out += [f"--tensor-parallel {layout['tp']}", "--set zero.partition_activations=true"]
    if layout.get("tile_mb"):
        out.append(f"--set zero.tile_mb={layout['tile_mb']:.6g}")
    if layout.get("prefetch") is False:
        out.append("--set zero.prefetch=false")
    if layout.get("gather") == "module":
        out.append("--set zero.gather=module")
    return " ".join(out)
