"""Figures of a report, a planner report and a metrics file, as PNG and SVG.

Drawn from the JSON files alone (``train.py --report``, ``--metrics``), so a run on a cluster can
be plotted on a laptop: ``python -m zero_jax.plot REPORT.json [METRICS.jsonl] --out DIR``. Each
figure also writes ``NAME.json``: exactly the numbers it drew, for a reader or a test that
should not parse pixels. Needs matplotlib (``pip install 'zero_jax[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any

from zero_jax.fit import HEADROOM, variants

SIZE, DPI = (8.0, 4.5), 100  # 800 x 450 pixels: legible at README width
PARTS = ("params", "grads", "master", "opt_state", "temp")
PART_LABELS = {"params": "parameters", "grads": "gradients", "master": "fp32 master",
               "opt_state": "optimizer state",
               "host": "host memory (offloaded state)"}
CURVES = (("loss", "loss (nats per token)", False),
          ("grad_norm", "gradient norm (global L2)", False),
          ("lr", "learning rate (per step)", False),
          ("tokens_per_s", "throughput (tokens/s)", False),
          ("loss_scale", "fp16 loss scale (log2 axis)", True))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, the same pixels everywhere
    import matplotlib.pyplot as plt

    return plt


def unit(largest: float) -> tuple[str, float]:
    """MiB below a GiB, else GiB: the figures stay in the 0.1-1000 range."""
    return ("GiB", 2.0**30) if largest >= 2**30 else ("MiB", 2.0**20)


def save(fig: Any, data: dict, out: str | pathlib.Path, name: str) -> list[pathlib.Path]:
    """``NAME.png``, ``NAME.svg`` and the sidecar ``NAME.json`` in ``out``."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.{ext}" for ext in ("png", "svg", "json")]
    fig.savefig(paths[0], dpi=DPI)
    fig.savefig(paths[1])
    paths[2].write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    _pyplot().close(fig)
    return paths


def memory_bars(report: dict) -> list[dict]:
    """One bar pair per stage row: device bytes by part, host bytes. Without the dry run's
    per-stage table, the report's own stage. Compiled temp is known only for the compiled
    stage (and offload setting): other stages' bars carry none."""
    offloaded = bool(report["offload"]["optimizer_leaves"])
    temp = report["compiled"]["temp_bytes"]
    rows = report.get("stages") or [{
        "stage": report["stage"], "offload": offloaded, **report["per_device_bytes"],
        "host": sum(report["per_device_host_bytes"].values())}]
    bars = []
    for r in rows:
        compiled = r["stage"] == report["stage"] and bool(r["offload"]) == offloaded
        bars.append({"label": f"{r['stage']}" + (" off" if r["offload"] else ""),
                     "stage": r["stage"], "offload": bool(r["offload"]),
                     **{k: int(r[k]) for k in PARTS[:-1]},
                     "temp": int(temp) if compiled else 0, "temp_compiled": compiled,
                     "host": int(r["host"])})
    return bars


def memory_by_stage(report: dict, capacity: int | None = None) -> tuple[Any, dict]:
    """Stacked bars of what each device holds at each stage (ZeRO's Figure 1, measured): the
    model states from the shardings, the compiled step's temp, the host memory beside it."""
    plt = _pyplot()
    bars = memory_bars(report)
    tallest = max([sum(b[k] for k in PARTS) for b in bars] + [b["host"] for b in bars]
                  + [capacity or 0])
    name, div = unit(tallest)
    fig, ax = plt.subplots(figsize=SIZE, layout="constrained")
    xs = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for part in PARTS:
        heights = [b[part] / div for b in bars]
        if part == "master" and not any(heights):
            continue
        label = PART_LABELS[part] if part != "temp" else \
            f"compiled temp of stage {report['stage']}'s step (activations, gathered layers)"
        ax.bar([x - 0.2 for x in xs], heights, 0.38, bottom=bottom, label=label)
        bottom = [a + h for a, h in zip(bottom, heights, strict=True)]
    ax.bar([x + 0.2 for x in xs], [b["host"] / div for b in bars], 0.38, color="0.75",
           hatch="//", edgecolor="0.4", label=PART_LABELS["host"])
    if capacity:
        ax.axhline(capacity / div, color="crimson", ls="--", label="device capacity")
    ax.set_xticks(xs, [b["label"] for b in bars])
    mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items())
    ax.set_xlabel("ZeRO stage (off: master and optimizer state offloaded); left bar device, "
                  "right bar host")
    ax.set_ylabel(f"{name} per device")
    ax.set_title(f"Memory per device by stage: {report['n_params']:,} parameters, {mesh}, "
                 f"{report['precision']['param_dtype']}", fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the tallest bar
    ax.legend(fontsize=8, loc="upper center", ncols=3)
    data = {"figure": "memory_by_stage", "unit": name, "unit_bytes": div,
            "capacity_bytes": capacity, "bars": bars}
    return fig, data


def communication(report: dict) -> tuple[Any, dict]:
    """Bytes per device and step by collective kind and mesh axes (ZeRO's units: an all-reduce
    counts twice), beside ZeRO's theory for each axis."""
    plt = _pyplot()
    axes = sorted(set(report["comm_bytes_by_axes"]) | set(report["comm_bytes_theory_by_axes"]))
    kinds = sorted({g["kind"] for g in report["collectives"]})
    measured = {k: {a: sum(g["volume"] for g in report["collectives"]
                           if g["kind"] == k and g["axes"] == a) for a in axes} for k in kinds}
    theory = {a: report["comm_bytes_theory_by_axes"].get(a, 0) for a in axes}
    name, div = unit(max([sum(report["comm_bytes_by_axes"].values())] + list(theory.values())
                         + [1]))
    fig, ax = plt.subplots(figsize=SIZE, layout="constrained")
    xs = list(range(len(axes)))
    bottom = [0.0] * len(axes)
    for k in kinds:
        heights = [measured[k][a] / div for a in axes]
        ax.bar([x - 0.2 for x in xs], heights, 0.38, bottom=bottom, label=f"measured: {k}")
        bottom = [a + h for a, h in zip(bottom, heights, strict=True)]
    ax.bar([x + 0.2 for x in xs], [theory[a] / div for a in axes], 0.38, color="0.75",
           edgecolor="0.3", label=f"ZeRO theory ({report['comm_theory_formula']})")
    ax.set_xticks(xs, [f"mesh axes: {a}" for a in axes])
    ax.set_xlim(-0.8, len(axes) - 0.2)
    ax.set_ylabel(f"{name} per device per step")
    ax.set_title(f"Communication per step, stage {report['stage']}: compiled collectives "
                 "beside ZeRO's theory (all-reduce counted twice)", fontsize=10)
    ax.legend(fontsize=8)
    data = {"figure": "communication", "unit": name, "unit_bytes": div, "axes": axes,
            "measured_bytes": measured, "theory_bytes": theory}
    return fig, data


def layout_name(c: dict) -> str:
    tp = f", tp {c['tp']}" if c.get("tp", 1) > 1 else ""
    return (f"stage {c['stage']}, offload {c['offload']}, remat {c['remat']}{tp}"
            + "".join(f", {v}" for v in variants(c)))


OFFLOAD_COLORS = {"none": "tab:blue", "optimizer": "tab:orange", "params": "tab:red",
                  "nvme": "tab:brown", "nvme+params": "tab:pink", "as set": "tab:purple"}


def planner(plan: dict) -> tuple[Any, dict]:
    """Each compiled layout at (device bytes per device, host bytes per host): marker the
    stage, colour the offload, text the remat policies that land there; the region that fits
    (within the planner's headroom of both memories) shaded, the chosen layout starred."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    cands, best = plan["candidates"], plan["best"]
    dev, host = plan["device_memory"], plan["host_memory"]
    name, div = unit(max([c["device_bytes"] for c in cands] + [HEADROOM * dev]))
    hname, hdiv = unit(max([c["host_bytes_per_host"] for c in cands] + [HEADROOM * host]))
    xy = lambda c: (c["device_bytes"] / div, c["host_bytes_per_host"] / hdiv)
    fig, ax = plt.subplots(figsize=SIZE, layout="constrained")
    ax.fill_between([0, HEADROOM * dev / div], 0, HEADROOM * host / hdiv, color="palegreen",
                    alpha=0.6, label=f"fits (within {HEADROOM:.0%} of both memories)")
    for stage in sorted({c["stage"] for c in cands}):
        mine = [c for c in cands if c["stage"] == stage]
        ax.scatter([xy(c)[0] for c in mine], [xy(c)[1] for c in mine], s=30,
                   marker="osD^"[stage], c=[OFFLOAD_COLORS[c["offload"]] for c in mine],
                   label=f"_stage {stage}")
    spots: dict = {}
    for c in cands:  # remat policies that land on the same spot share one label
        tp = f" tp{c['tp']}" if c.get("tp", 1) > 1 else ""
        spots.setdefault(xy(c), []).append(" ".join([c["remat"] + tp, *variants(c)]))
    for (x, y), names in spots.items():
        ax.annotate("/".join(dict.fromkeys(names)), (x, y), fontsize=5.5, rotation=35,
                    xytext=(3, 3), textcoords="offset points", color="0.35")
    # The layout's own keys; only the planner's variants carry tile_mb, prefetch and gather.
    same = lambda c: all(c.get(k) == best.get(k) for k in (*best, "tile_mb", "prefetch",
                                                             "gather"))
    chosen = next((c for c in cands if best and same(c)), None)
    if chosen:
        ax.scatter(*[[v] for v in xy(chosen)], s=300, marker="*", facecolor="none",
                   edgecolor="crimson", linewidth=1.5, label=f"chosen: {layout_name(chosen)}")
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], ls="", marker="osD^"[s], color="0.2", label=f"stage {s}")
                for s in sorted({c["stage"] for c in cands})]
    handles += [Line2D([], [], ls="", marker="s", color=color, label=f"offload {k}")
                for k, color in OFFLOAD_COLORS.items() if any(c["offload"] == k for c in cands)]
    ax.legend(handles=handles, fontsize=7, loc="center right")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)
    ax.set_xlabel(f"device memory, {name} per device (model state + compiled temp)")
    ax.set_ylabel(f"host memory, {hname} per host")
    ax.set_title(f"Planner: {len(cands)} layouts on {plan['devices']} devices of "
                 f"{dev / div:.1f} {name}, hosts of {host / hdiv:.1f} {hname} "
                 f"({plan['devices_per_host']} devices each)", fontsize=10)
    data = {"figure": "planner", "device_unit": name, "device_unit_bytes": div,
            "host_unit": hname, "host_unit_bytes": hdiv, "headroom": HEADROOM,
            "device_memory": dev, "host_memory": host, "best": best,
            "points": [{"layout": layout_name(c), "stage": c["stage"],
                        "device_bytes": c["device_bytes"],
                        "host_bytes_per_host": c["host_bytes_per_host"], "fits": c["fits"]}
                       for c in sorted(cands, key=lambda c: c["stage"])]}
    return fig, data


def curves(records: list[dict]) -> tuple[Any, dict]:
    """Loss, gradient norm, learning rate and tokens/s per step (and fp16's loss scale when
    the records hold one); a non-finite value (null in the file) is a gap."""
    plt = _pyplot()
    shown = [c for c in CURVES if any(c[0] in r for r in records)]
    cols = math.ceil(len(shown) / 2)
    fig, axs = plt.subplots(2, cols, figsize=SIZE, layout="constrained", squeeze=False)
    steps = [r["step"] for r in records]
    data: dict = {"figure": "training", "step": steps}
    for i, (key, label, log) in enumerate(shown):
        ax = axs[i % 2][i // 2]
        values = [r.get(key) for r in records]
        ax.plot(steps, [math.nan if v is None else v for v in values], lw=1.2)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=7)
        if log:
            ax.set_yscale("log", base=2)
        data[key] = values
    for i in range(len(shown), 2 * cols):
        axs[i % 2][i // 2].set_visible(False)
    return fig, data


def read_records(path: str | pathlib.Path) -> list[dict]:
    """A metrics file's records, one JSON object per line; blank lines skipped."""
    out = []
    for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {n} is not JSON ({e.msg}): pass the file "
                             "train.py --metrics wrote") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}: line {n} is not a step's record: pass the file "
                             "train.py --metrics wrote")
        out.append(record)
    return out


def draw(report: dict | None, records: list[dict] | None, out: str | pathlib.Path,
         capacity: int | None = None) -> list[pathlib.Path]:
    """Every figure the inputs allow: a step report's memory and communication, a planner
    report's layouts, a metrics file's curves. Returns the files written."""
    paths: list[pathlib.Path] = []
    if report is not None and "candidates" in report:
        paths += save(*planner(report), out, "planner")
    elif report is not None:
        paths += save(*memory_by_stage(report, capacity), out, "memory_by_stage")
        paths += save(*communication(report), out, "communication")
    if records:
        paths += save(*curves(records), out, "training")
    return paths


def kind_of(report: Any) -> str | None:
    """Which report a JSON value is, or None."""
    if isinstance(report, dict) and {"candidates", "device_memory"} <= set(report):
        return "planner"
    if isinstance(report, dict) and {"per_device_bytes", "collectives", "stage"} <= set(report):
        return "step"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zero_jax.plot", description=__doc__.split("\n")[0])
    p.add_argument("report", help="train.py --report's JSON (a run, a dry run or the planner)")
    p.add_argument("metrics", nargs="?", help="train.py --metrics's JSON Lines file")
    p.add_argument("--out", required=True, help="directory for the figures")
    p.add_argument("--device-memory", type=int, metavar="BYTES",
                   help="draw this device capacity on the memory figure")
    p.error = lambda message: sys.exit(fail(message))  # one line, exit 2
    args = p.parse_args(argv)
    try:
        report = json.loads(pathlib.Path(args.report).read_text())
        if kind_of(report) is None:
            return fail(f"{args.report} is not a report of train.py --report (a run's, a dry "
                        "run's or the planner's)")
        records = read_records(args.metrics) if args.metrics else None
    except json.JSONDecodeError as e:
        return fail(f"{args.report} is not JSON ({e.msg}, line {e.lineno}): pass the file "
                    "train.py --report wrote")
    except OSError as e:
        return fail(f"{e.filename} cannot be read ({e.strerror})")
    except ValueError as e:
        return fail(str(e))
    for path in draw(report, records, args.out, args.device_memory):
        print(path)
    return 0


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
