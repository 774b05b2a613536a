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
import textwrap
from typing import Any

from zero_jax.fit import HEADROOM, variants
from zero_jax.report import stage_summary

SIZE, DPI = (8.0, 4.5), 100  # 800 x 450 pixels: legible at README width
ZERO_PARTS = ("params", "grads", "master", "opt_state")  # the model states, ZeRO's counting
COMPILED_PARTS = ("params", "master", "opt_state", "temp")  # the compiled steps' (grads in temp)
PART_LABELS = {"params": "parameters", "grads": "gradients", "master": "fp32 master",
               "opt_state": "optimizer state",
               "temp": "compiled temp: gradients,\nactivations, gathered layers",
               "host": "host memory\n(offloaded state)"}
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


def memory_bars(report: dict) -> tuple[list[dict], tuple[str, ...]]:
    """The memory figure's bars and the parts stacked in them, on equal terms for every stage.
    With each stage compiled (``compiled_stages``): the state each keeps in device memory and
    its compiled temp, which holds its gradients (what the device needs to run the step).
    Without: the model states of each stage, and each with its optimizer offloaded, as ZeRO
    counts them, temp for none (only the report's stage was compiled). Without either (a
    hierarchical run), the report's own stage compiled."""
    rows = report.get("compiled_stages")
    if rows or not report.get("stages"):
        rows = rows or [stage_summary(report)]
        mine = lambda r: " (this run)" if r["stage"] == report["stage"] and len(rows) > 1 else ""
        return [{"label": f"{r['stage']}{mine(r)}", "stage": r["stage"],
                 **{k: int(r[k]) for k in ("params", "master", "opt_state", "temp", "host")}}
                for r in rows], COMPILED_PARTS
    return [{"label": f"{r['stage']}" + (" off" if r["offload"] else ""), "stage": r["stage"],
             "offload": bool(r["offload"]), **{k: int(r[k]) for k in (*ZERO_PARTS, "host")}}
            for r in report["stages"]], ZERO_PARTS


def memory_by_stage(report: dict, capacity: int | None = None) -> tuple[Any, dict]:
    """Stacked bars of what each device holds at each stage (ZeRO's Figure 1, measured), the
    host memory beside them where any is used, the device's capacity as a line: which stage
    needs least per device. Every bar counts the same parts (``memory_bars``)."""
    plt = _pyplot()
    bars, parts = memory_bars(report)
    host = any(b["host"] for b in bars)
    totals = [sum(b[k] for k in parts) for b in bars]
    tallest = max(totals + [b["host"] for b in bars])
    shown = capacity if capacity and capacity <= 4 * tallest else None  # else off the scale
    name, div = unit(max(tallest, shown or 0))
    fig, ax = plt.subplots(figsize=SIZE, layout="constrained")
    xs, width = list(range(len(bars))), 0.38 if host else 0.6
    left = [x - 0.2 for x in xs] if host else xs
    bottom = [0.0] * len(bars)
    for part in parts:
        heights = [b[part] / div for b in bars]
        if part == "master" and not any(heights):
            continue
        ax.bar(left, heights, width, bottom=bottom, label=PART_LABELS[part])
        bottom = [a + h for a, h in zip(bottom, heights, strict=True)]
    for x, total in zip(left, totals, strict=True):
        ax.annotate(f"{total / div:.1f}", (x, total / div), xytext=(0, 2), fontsize=8,
                    textcoords="offset points", ha="center", va="bottom")
    if host:
        ax.bar([x + 0.2 for x in xs], [b["host"] / div for b in bars], width, color="0.75",
               hatch="//", edgecolor="0.4", label=PART_LABELS["host"])
    if shown:
        ax.axhline(shown / div, color="crimson", ls="--",
                   label=f"device capacity ({shown / div:.1f} {name})")
    ax.set_xticks(xs, [b["label"] for b in bars])
    ax.set_xlabel("ZeRO stage" + (" (off: master and optimizer state offloaded)"
                                  if parts == ZERO_PARTS else "")
                  + ("; left bar device, right bar host" if host else ""))
    ax.set_ylabel(f"{name} per device")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)  # room for the totals
    mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items())
    ax.set_title(f"Memory per device by stage: {report['n_params']:,} parameters, {mesh}, "
                 f"{report['precision']['param_dtype']}\n{counted(report, parts, capacity, shown)}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    data = {"figure": "memory_by_stage", "counts": "compiled" if parts == COMPILED_PARTS
            else "model states", "parts": list(parts), "unit": name, "unit_bytes": div,
            "capacity_bytes": capacity, "capacity_drawn": shown is not None,
            "compiled_stage": report["stage"], "bars": bars}
    return fig, data


def counted(report: dict, parts: tuple[str, ...], capacity: int | None,
            shown: int | None) -> str:
    """The memory figure's second title line: what its bars count (and a capacity too large
    to draw beside them)."""
    if parts == COMPILED_PARTS:
        what = "each stage's step compiled: its state (from the shardings) + XLA's temp"
    else:
        what = (f"model states as ZeRO counts them; no temp: only stage {report['stage']} was "
                f"compiled ({report['compiled']['temp_bytes'] / 2**20:.2f} MiB)")
    if capacity and not shown:
        name, div = unit(capacity)
        what += f"\ndevice capacity {capacity / div:.1f} {name}: off the scale"
    return what


def communication(report: dict) -> tuple[Any, dict]:
    """Bytes per device and step of each stage side by side (ZeRO's units: an all-reduce counts
    twice): the compiled collectives stacked by kind, beside ZeRO's theory (2 Psi, 3 Psi, ...),
    per mesh axes. Each stage compiled when the report holds ``compiled_stages``, else the
    report's own."""
    plt = _pyplot()
    groups = comm_groups(report.get("compiled_stages") or [stage_summary(report)],
                         report["stage"])
    kinds = sorted({k for g in groups for k, v in g["measured_bytes"].items() if v})
    name, div = unit(max([sum(g["measured_bytes"].values()) for g in groups]
                         + [g["theory_bytes"] for g in groups] + [1]))
    fig, ax = plt.subplots(figsize=SIZE, layout="constrained")
    xs = list(range(len(groups)))
    bottom = [0.0] * len(groups)
    tallest = max([g["measured_total"] for g in groups] + [g["theory_bytes"] for g in groups])
    unseen = {}  # under 1% of the tallest bar everywhere (scalars: the loss, the norm)
    for k in kinds:
        heights = [g["measured_bytes"].get(k, 0) / div for g in groups]
        if max(heights) * div < tallest / 100:
            unseen[k] = max(g["measured_bytes"].get(k, 0) for g in groups)
        ax.bar([x - 0.2 for x in xs], heights, 0.38, bottom=bottom,
               label=f"{'_' * (k in unseen)}compiled: {k}")
        bottom = [a + h for a, h in zip(bottom, heights, strict=True)]
    if unseen:
        ax.set_xlabel("too small to see: " + ", ".join(
            f"{k} ({b:,} bytes per step at most)" for k, b in unseen.items()), fontsize=8)
    theory = ax.bar([x + 0.2 for x in xs], [g["theory_bytes"] / div for g in groups], 0.38,
                    color="0.75", edgecolor="0.3", label="ZeRO's theory (formula above)")
    ax.bar_label(theory, [textwrap.fill(g["theory_formula"], 16) for g in groups], fontsize=7,
                 padding=2)
    ax.set_xticks(xs, [g["label"] for g in groups])
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room for the formulas
    ax.set_ylabel(f"{name} per device per step")
    ax.set_title(f"Communication per step by stage, {report['n_params']:,} parameters: the "
                 "compiled step's collectives\nbeside ZeRO's theory (an all-reduce counted "
                 "twice, as a reduce-scatter and an all-gather)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    data = {"figure": "communication", "unit": name, "unit_bytes": div, "kinds": kinds,
            "too_small_to_see": unseen, "compiled_stage": report["stage"], "groups": groups}
    return fig, data


def comm_groups(rows: list[dict], mine: int) -> list[dict]:
    """One bar pair per stage and mesh axes (one axes on a flat mesh: one pair per stage);
    ``mine``: the report's own stage."""
    groups = []
    for r in rows:
        axes = sorted(set(r["comm_bytes"]) | set(r["comm_bytes_theory"]))
        for a in axes:
            measured = r["comm_bytes"].get(a, {})
            label = f"stage {r['stage']}" + (" (this run)" if r["stage"] == mine and len(rows) > 1
                                             else "") + (f"\n{a}" if len(axes) > 1 else "")
            groups.append({"label": label,
                           "stage": r["stage"], "axes": a, "measured_bytes": measured,
                           "measured_total": sum(measured.values()),
                           "theory_bytes": r["comm_bytes_theory"].get(a, 0),
                           "theory_formula": r["comm_theory_formula"]})
    return groups


def layout_name(c: dict) -> str:
    tp = f", tp {c['tp']}" if c.get("tp", 1) > 1 else ""
    return (f"stage {c['stage']}, offload {c['offload']}, remat {c['remat']}{tp}"
            + "".join(f", {v}" for v in variants(c)))


MAX_NAMED = 12  # the planner figure names the layouts that fit when there are at most these
OFFLOAD_COLORS = {"none": "tab:blue", "optimizer": "tab:orange", "params": "tab:red",
                  "nvme": "tab:brown", "nvme+params": "tab:pink", "as set": "tab:purple"}


def planner(plan: dict) -> tuple[Any, dict]:
    """Each compiled layout at (device bytes per device, host bytes per host): marker the
    stage, colour the offload; the region that fits (within the planner's headroom of both
    memories) shaded, the chosen layout starred on top. Only the layouts that fit (and the
    chosen one) are named, by their remat policies: a sweep of a hundred named is unreadable."""
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
    # The layout's own keys; only the planner's variants carry tile_mb, prefetch and gather.
    same = lambda c: all(c.get(k) == best.get(k) for k in (*best, "tile_mb", "prefetch",
                                                             "gather"))
    chosen = next((c for c in cands if best and same(c)), None)
    named = [c for c in cands if c["fits"] or c is chosen]
    named = named if len(named) <= MAX_NAMED else [chosen] if chosen else []
    labels = planner_labels(named, xy)
    if chosen:
        ax.scatter(*[[v] for v in xy(chosen)], s=400, marker="*", facecolor="gold",
                   edgecolor="crimson", linewidth=1.5, zorder=10,
                   label=f"chosen: {layout_name(chosen)}")
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], ls="", marker="osD^"[s], color="0.2", label=f"stage {s}")
                for s in sorted({c["stage"] for c in cands})]
    handles += [Line2D([], [], ls="", marker="s", color=color, label=f"offload {k}")
                for k, color in OFFLOAD_COLORS.items() if any(c["offload"] == k for c in cands)]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1),
              borderaxespad=0)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)
    annotate(ax, labels)
    ax.set_xlabel(f"device memory, {name} per device (model state + compiled temp)")
    ax.set_ylabel(f"host memory, {hname} per host")
    ax.set_title(f"Planner: {len(cands)} layouts on {plan['devices']} devices of "
                 f"{dev / div:.1f} {name}, hosts of {host / hdiv:.1f} {hname} "
                 f"({plan['devices_per_host']} devices each)\n{sum(c['fits'] for c in cands)} "
                 "fit, named by remat policy" + ("" if len(labels) > 1 or not chosen
                                                  else ": too many, the chosen one only"),
                 fontsize=9)
    data = {"figure": "planner", "device_unit": name, "device_unit_bytes": div,
            "host_unit": hname, "host_unit_bytes": hdiv, "headroom": HEADROOM,
            "device_memory": dev, "host_memory": host, "best": best, "labels": labels,
            "points": [{"layout": layout_name(c), "stage": c["stage"],
                        "device_bytes": c["device_bytes"],
                        "host_bytes_per_host": c["host_bytes_per_host"], "fits": c["fits"]}
                       for c in sorted(cands, key=lambda c: c["stage"])]}
    return fig, data


def annotate(ax: Any, labels: list[dict]) -> None:
    """Labels of nearby layouts stacked above each other, not written over each other."""
    frac = lambda a, b: (abs(a["x"] - b["x"]) / ax.get_xlim()[1],
                         abs(a["y"] - b["y"]) / ax.get_ylim()[1])
    for i, label in enumerate(labels):
        level = sum(all(d < 0.06 for d in frac(label, other)) for other in labels[:i])
        ax.annotate(label["text"], (label["x"], label["y"]), fontsize=6, rotation=35,
                    xytext=(3, 3 + 8 * level), textcoords="offset points", color="0.25")


def planner_labels(cands: list[dict], xy: Any) -> list[dict]:
    """The planner figure's texts at ``xy(c)`` of each of ``cands``: remat policies (and tensor
    parallelism, variants) that land on the same spot share one label."""
    spots: dict = {}
    for c in cands:
        tp = f" tp{c['tp']}" if c.get("tp", 1) > 1 else ""
        spots.setdefault(xy(c), []).append(" ".join([c["remat"] + tp, *variants(c)]))
    return sorted(({"text": "/".join(dict.fromkeys(names)), "x": x, "y": y}
                   for (x, y), names in spots.items()), key=lambda label: (label["y"], label["x"]))


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
            raise ValueError(f"{path}: line {n} is not JSON ({e.msg}): pass a metrics file "
                             "(JSON Lines, one record per step)") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}: line {n} is not a step's record: pass a metrics file "
                             "(JSON Lines, one record per step)")
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
