"""Fault injection: SIGKILL, SIGTERM, a damaged checkpoint and a full disk, each at a random
moment of a small ``train.py`` run, then ``--resume`` to the end; a table per kind. With the
NVMe tier: a second run on its directory, a band of a file flipped, every file zeroed.

    python bench/faults.py --trials 4 --seed 0 [--kinds kill,term,corrupt,diskfull,nvme-second,
                           nvme-flip,nvme-zero] [--json F] [--workdir DIR]

Not part of the test suite (minutes of wall time): the suite tests each fault once at a fixed
moment (``tests/test_checkpoint.py``, ``tests/test_hardening.py``); this repeats them where a
fixed test would not look. For each trial it reports the complete checkpoints that existed
before the fault and are gone or unreadable after it, whether the resumed run's losses equal an
uninterrupted run's bit for bit, any Python traceback, and the exit codes; for a damaged
checkpoint, whether the resume fell back from it, refused it, or did not need the damaged bytes;
for the NVMe tier, whether the run stopped naming the damaged file (or the second run was
refused), and how many checkpoints hold state other than the uninterrupted run's.
The figures and what they show: docs/guides/checkpoints.md, "Fault injection", and
docs/guides/nvme.md, "Damage".
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from zero_jax.internals import ORBAX_TREE_FILES  # orbax's names live there alone

ROOT = pathlib.Path(__file__).resolve().parent.parent
KINDS = ("kill", "term", "corrupt", "diskfull", "nvme-second", "nvme-flip", "nvme-zero")
# The NVMe tier's runs: the optimizer state in files under the run's nvme/ (global-norm clipping
# cannot run band by band).
NVME = ["--set", "zero.offload_optimizer.device=nvme", "--set", "optimizer.clip_norm=0",
        "--set", "zero.offload_optimizer.nvme_path=nvme"]
DAMAGES = ("flip", "truncate", "delete-file", "delete-opt_state", "delete-params-_METADATA")
# The faulted run trains STEPS, its resume and the reference TOTAL: so that every resume restores
# and trains, even from the faulted run's last checkpoint. The schedule is fixed (not spread over
# --steps) for that. Tiny and quick; --keep 100: no save rotates out a checkpoint the count would
# call lost.
STEPS, TOTAL = 12, 14
RUN = ["--set", "model.n_layers=1", "--set", "train.batch_size=8", "--set",
       "optimizer.warmup_steps=4", "--set", "optimizer.decay_steps=16",
       "--checkpoint-dir", "ckpt", "--save-every", "2", "--keep", "100"]
FSIZE = 64 * 1024  # above the metrics and log files, below every checkpoint's array files
TIMEOUT = 600
# A damaged newest checkpoint, on resume: named in a warning and an older one restored; the run
# stopped with an error; not named, yet the losses exact (a file that is never read); not named
# and the losses differ (the one outcome that must never happen).
OUTCOMES = ("fell back", "refused", "harmless", "missed")
# The NVMe tier damaged under a run: it stopped with an error naming the file; the damage was
# overwritten by the update before it was read (the run exact); it came after the run's last
# read of the files, and the resume rewrote them from its checkpoint (exact); a second run
# refused;
# one that started only once the first had ended (nothing to refuse); missed (none of these,
# or a checkpoint differing from the uninterrupted run's: must never happen).
NVME_OUTCOMES = ("stopped", "healed", "rewritten", "refused", "apart", "missed")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, as train.py's bad input
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=4, help="trials per kind (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the moments and damages")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " +
                   ", ".join(KINDS))
    p.add_argument("--json", metavar="FILE", help="also write the table and trials as JSON")
    p.add_argument("--workdir", metavar="DIR", help="keep the runs here (default: a temporary "
                   "directory, deleted)")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad or not args.kinds:
        p.error(f"--kinds: {', '.join(bad) or 'none given'}: pick from {', '.join(KINDS)}")
    if args.workdir and os.path.exists(args.workdir) and os.listdir(args.workdir):
        p.error(f"--workdir {args.workdir} is not empty: the trials need a fresh directory")
    if args.trials < 1:
        p.error(f"--trials must be at least 1, not {args.trials}")
    return args


def environment(work: pathlib.Path) -> dict:
    """One compilation cache for every run, so a trial costs a start-up, not a compile."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=1")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(work / "jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


def ignore_sigxfsz() -> None:
    """In the child: a write past RLIMIT_FSIZE then fails with EFBIG instead of killing it."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def start(run: pathlib.Path, name: str, steps: int, extra: list[str],
          env: dict) -> subprocess.Popen:
    """``train.py`` in ``run``, its stdout and stderr in files named after ``name``. Through
    pipes, copied here: a file the child wrote itself would be cut at its file-size limit."""
    argv = [sys.executable, str(ROOT / "train.py"), *RUN, "--steps", str(steps), "--metrics",
            "metrics.jsonl", *extra]
    proc = subprocess.Popen(argv, cwd=run, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            preexec_fn=ignore_sigxfsz)
    proc.copiers = [threading.Thread(target=copy, args=(pipe, run / f"{name}.{ext}"))
                    for pipe, ext in ((proc.stdout, "out"), (proc.stderr, "err"))]
    for copier in proc.copiers:
        copier.start()
    return proc


def copy(pipe, path: pathlib.Path) -> None:
    with pipe, open(path, "wb") as out:
        shutil.copyfileobj(pipe, out)


def finish(proc: subprocess.Popen) -> int:
    """Its exit code, once its output is all in the files; killed after TIMEOUT."""
    try:
        proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
    for copier in proc.copiers:
        copier.join()
    return proc.wait()


def wait_records(run: pathlib.Path, proc: subprocess.Popen, n: int = 1) -> None:
    """Until ``n`` records are in the metrics file: before the first the run is compiling."""
    metrics = run / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists()
                                       and metrics.read_bytes().count(b"\n") >= n):
        time.sleep(0.05)


def losses(run: pathlib.Path) -> dict[int, float]:
    """Step -> loss from the metrics file; a line cut short by a kill is left out."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[record["step"]] = record["loss"]
    return out


def reference(work: pathlib.Path, env: dict, extra: tuple[str, ...] = ()
              ) -> tuple[dict[int, float], float, float]:
    """The uninterrupted run's losses, and the windows for the faults: from the first record
    to the process's exit (a kill may land in the last save or the shutdown), and to the
    STEPS-th record (SIGTERM and the file-size limit: where they land in training). Its
    checkpoints stay in ``reference[-nvme]/ckpt``, to compare the trials' with."""
    run = work / ("reference-nvme" if extra else "reference")
    run.mkdir()
    (run / "nvme").mkdir()
    proc = start(run, "run", TOTAL, list(extra), env)
    wait_records(run, proc)
    tick = time.monotonic()
    wait_records(run, proc, STEPS)
    trains = time.monotonic() - tick
    if (rc := finish(proc)) != 0:
        sys.exit(f"error: the reference run exited {rc}: see {run / 'run.err'}")
    return losses(run), time.monotonic() - tick, trains


def complete_steps(ckpt: pathlib.Path) -> set[int]:
    """Numbered step directories: orbax renames a save to its number only once complete."""
    if not ckpt.is_dir():
        return set()
    return {int(d.name) for d in ckpt.iterdir() if d.name.isdigit() and d.is_dir()}


def inject(kind: str, proc: subprocess.Popen, run: pathlib.Path, rng: random.Random,
           window: float, env: dict) -> dict:
    """The fault, at a random moment of the training; the checkpoints complete before it."""
    if kind.startswith("nvme"):
        return inject_nvme(kind, proc, run, rng, window, env)
    finish_first = kind == "corrupt" and rng.random() < 0.5
    if kind == "diskfull":  # by step, not time: on a loaded machine a time may be past the saves
        wait_records(run, proc, rng.randrange(1, STEPS))
    elif not finish_first:
        time.sleep(rng.uniform(0, window))
    ckpt = run / "ckpt"
    before = complete_steps(ckpt)
    fault = {"landed": proc.poll() is None and not finish_first, "before": sorted(before)}
    if fault["landed"] and kind in ("kill", "corrupt"):
        proc.send_signal(signal.SIGKILL)
    elif fault["landed"] and kind == "term":
        proc.send_signal(signal.SIGTERM)
    elif fault["landed"]:  # the limit applies to writes from now on, as a disk that fills up
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (FSIZE, resource.RLIM_INFINITY))
    fault["rc"] = finish(proc)
    # A signal sent as the run exited finds it gone; a limit set after the last save, unmet.
    fault["landed"] = fault["landed"] and fault["rc"] != 0
    if kind == "corrupt":
        fault["damaged"] = damage(ckpt, rng)
    return fault


def inject_nvme(kind: str, proc: subprocess.Popen, run: pathlib.Path, rng: random.Random,
                window: float, env: dict) -> dict:
    """Under an NVMe run, after a checkpoint completes (half the trials) or at a random moment
    of its training: a second run on the same directory (its own checkpoints, another seed),
    4 KiB of a file flipped, or every file zeroed."""
    ckpt, after_save = run / "ckpt", rng.random() < 0.5
    # In the first half of the training: a second run takes seconds to reach the lock, and
    # damage after the run's last read of the files (its last save) would meet nothing.
    second = kind == "nvme-second"
    if after_save:
        wait_checkpoint(ckpt, proc, rng.randrange(2, STEPS // 2 + 1, 2))
    else:
        time.sleep(rng.uniform(0, window / 2))
    fault = {"moment": "after a checkpoint" if after_save else "mid-run",
             "before": sorted(complete_steps(ckpt)), "landed": proc.poll() is None}
    files = sorted((run / "nvme").rglob("slot*.bin"))
    if second:
        other = start(run, "second", STEPS, [*NVME, "--seed", "1", "--checkpoint-dir",
                                             "ckpt-second", "--metrics", "second.jsonl"], env)
        fault["second_rc"] = finish(other)
        fault["landed"] = fault["landed"] and proc.poll() is None  # refused while it ran
        fault["second_wrote"] = sorted(p.name for p in run.iterdir()
                                       if p.name.startswith(("ckpt-second", "second.jsonl")))
    elif kind == "nvme-flip":
        target = rng.choice(files)
        at = rng.randrange(0, max(1, target.stat().st_size - 4096) + 1, 4096)
        with open(target, "r+b") as f:
            f.seek(at)
            data = bytes(b ^ 0xFF for b in f.read(4096))
            f.seek(at)
            f.write(data)
        fault["damaged"] = {"how": "flip", "path": str(target.relative_to(run)), "offset": at}
        damaged = lambda: target.read_bytes()[at:at + len(data)] == data  # noqa: E731
    else:
        for target in files:
            with open(target, "r+b") as f:
                f.write(bytes(target.stat().st_size))
        fault["damaged"] = {"how": "zero", "path": f"{len(files)} files"}
        damaged = lambda: any(not p.read_bytes().strip(b"\0") for p in files)  # noqa: E731
    fault["landed"] = fault["landed"] and proc.poll() is None
    fault["rc"] = finish(proc)
    if not second:  # a run that ended well with the damage still there never read it again
        fault["unread"] = fault["rc"] == 0 and damaged()
        fault["landed"] = fault["landed"] and not fault["unread"]
    return fault


def wait_checkpoint(ckpt: pathlib.Path, proc: subprocess.Popen, step: int) -> None:
    while proc.poll() is None and step not in complete_steps(ckpt):
        time.sleep(0.02)


def differing(run: pathlib.Path, ref: pathlib.Path) -> list[int]:
    """The steps whose checkpoint in the run holds other arrays than the reference's at the
    same step (their digests, as saved, differ): saved from a state the reference never had."""
    digests = lambda d, s: json.loads((d / str(s) / "meta" / "metadata").read_text())["digests"]
    return sorted(s for s in complete_steps(run / "ckpt")
                  if s in complete_steps(ref / "ckpt") and digests(run / "ckpt", s) != digests(
                      ref / "ckpt", s))


def damage(ckpt: pathlib.Path, rng: random.Random) -> dict | None:
    """One of several damages to the newest complete checkpoint, chosen at random."""
    if not (steps := complete_steps(ckpt)):
        return None
    step, how = max(steps), rng.choice(DAMAGES)
    root = ckpt / str(step)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    target = {"delete-opt_state": root / "opt_state",
              "delete-params-_METADATA": root / "params" / ORBAX_TREE_FILES[0]}.get(
                  how, rng.choice(files))
    size = target.stat().st_size if target.is_file() else None
    if how == "flip":
        data = bytearray(target.read_bytes())
        for i in rng.sample(range(len(data)), min(8, len(data))):
            data[i] ^= 0xFF
        target.write_bytes(bytes(data))
    elif how == "truncate":
        os.truncate(target, target.stat().st_size // 2)
    elif target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    return {"step": step, "how": how, "path": str(target.relative_to(ckpt)), "bytes": size}


def trial(kind: str, n: int, work: pathlib.Path, env: dict, rng: random.Random,
          ref: tuple[dict[int, float], float, float]) -> dict:
    """One run, one fault at a random moment, one ``--resume`` to the end, checked."""
    run = work / f"{kind}-{n}"
    run.mkdir()
    (run / "nvme").mkdir()
    ckpt, extra = run / "ckpt", NVME if kind.startswith("nvme") else []
    proc = start(run, "run", STEPS, extra, env)
    wait_records(run, proc)
    fault = inject(kind, proc, run, rng, ref[1] if kind in ("kill", "corrupt") else ref[2],
                   env)
    after = complete_steps(ckpt)
    resumed = finish(start(run, "resume", TOTAL, [*extra, "--resume"], env))
    out = {"kind": kind, "trial": n, **fault, "after": sorted(after), "resume_rc": resumed,
           **check(run, fault, after, resumed == 0, ref[0])}
    if extra:
        out.update(nvme_outcome(run, out, work / "reference-nvme"))
    return out


def nvme_outcome(run: pathlib.Path, t: dict, ref: pathlib.Path) -> dict:
    """Whether the run stopped naming the damaged file, the damage was overwritten before it was
    read, the second run was refused in one line having written nothing; and the checkpoints
    that differ from the uninterrupted run's."""
    bad = differing(run, ref)
    if t["kind"] == "nvme-second":
        err = (run / "second.err").read_text()
        ok = t["second_rc"] == 2 and not t["second_wrote"] and len(err.splitlines()) == 1 \
            and "the NVMe tier's directory nvme/process0 is being written by process" in err
        outcome = "refused" if ok else "apart" if t["second_rc"] == 0 and not t["landed"] \
            else "missed"
    else:
        named = any(re.search(r"file nvme/process0/slot\d+\.bin is damaged", e)
                    for e in t["errors"])
        outcome = ("stopped" if t["rc"] == 1 and named
                   else "missed" if t["rc"] != 0 or not t["bit_exact"]
                   else "rewritten" if t["unread"] else "healed")
    return {"outcome": "missed" if bad else outcome, "from_damaged": bad}


def check(run: pathlib.Path, fault: dict, after: set[int], resumed: bool,
          ref: dict[int, float]) -> dict:
    """What the trial is judged by: lost checkpoints, exact losses, tracebacks, detection."""
    err = (run / "run.err").read_text() + (run / "resume.err").read_text()
    damaged = (fault.get("damaged") or {}).get("step")
    named = {int(s) for s in re.findall(r"^warning: .*?checkpoint (?:step )?(\d+)\b.*"
                                        r"(?:corrupt|cannot be read|falling back)", err, re.M)}
    lost = (set(fault["before"]) - after - {damaged}) | (named & set(fault["before"]) - {damaged})
    got = losses(run)
    out = {"lost": sorted(lost), "resume_step": resume_step(run),
           "bit_exact": resumed and got == ref,
           "differs": sorted(s for s in ref if got.get(s) != ref[s]),
           "traceback": "Traceback" in err,
           "errors": [line for line in err.splitlines() if line.startswith("error:")]}
    if damaged is not None:
        out["outcome"] = ("refused" if not resumed else "fell back" if damaged in named
                          else "harmless" if out["bit_exact"] else "missed")
    return out


def resume_step(run: pathlib.Path) -> int | None:
    """The step the resume started from, as its stdout says (0: it found no checkpoint)."""
    text = (run / "resume.out").read_text()
    if m := re.search(r"resumed from step (\d+)|the checkpoint is at step (\d+)", text):
        return int(m.group(1) or m.group(2))
    return 0 if "starting fresh" in text else None


def summarize(trials: list[dict]) -> list[dict]:
    """One row per kind, in the order the kinds ran."""
    rows = []
    for kind in dict.fromkeys(t["kind"] for t in trials):
        ts = [t for t in trials if t["kind"] == kind]
        outcomes = [t["outcome"] for t in ts if "outcome" in t]
        rows.append({
            "kind": kind, "trials": len(ts), "landed": sum(t["landed"] for t in ts),
            "checkpoints_lost": sum(len(t["lost"]) for t in ts),
            "from_damaged": sum(len(t["from_damaged"]) for t in ts)
            if kind.startswith("nvme") else "-",
            "bit_exact": sum(t["bit_exact"] for t in ts),
            "tracebacks": sum(t["traceback"] for t in ts),
            "damage": ", ".join(f"{o} {outcomes.count(o)}"
                                for o in (NVME_OUTCOMES if kind.startswith("nvme")
                                          else OUTCOMES) if o in outcomes) or "-",
            "exit_codes": f"run {codes(t['rc'] for t in ts)}; "
                          f"resume {codes(t['resume_rc'] for t in ts)}"})
    return rows


def codes(rcs) -> str:
    """``143 x3, SIGKILL x1``: each exit code seen, how often, commonest first; a process that
    a signal ended (Popen's negative code) by the signal's name."""
    rcs = [signal.Signals(-rc).name if rc < 0 else str(rc) for rc in rcs]
    seen = sorted(dict.fromkeys(rcs), key=rcs.count, reverse=True)  # ties: first seen first
    return ", ".join(f"{rc} x{rcs.count(rc)}" for rc in seen)


def format_table(rows: list[dict]) -> str:
    """Markdown, as it goes into docs/guides/checkpoints.md and nvme.md."""
    lines = ["| fault | trials | fault landed | checkpoints lost | checkpoints from damaged "
             "state | resumes bit-exact | tracebacks | damage | exit codes |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['trials']} | {r['landed']} | {r['checkpoints_lost']} "
                     f"| {r['from_damaged']} | {r['bit_exact']}/{r['trials']} "
                     f"| {r['tracebacks']} | {r['damage']} | {r['exit_codes']} |")
    return "\n".join(lines)


def describe(t: dict) -> str:
    """One line per trial, for the log: enough to find the run directory's story."""
    bits = [f"{t['kind']} #{t['trial']}: landed={t['landed']} rc={t['rc']}",
            f"resume from {t['resume_step']} rc={t['resume_rc']}",
            f"lost={t['lost']} exact={t['bit_exact']} traceback={t['traceback']}"]
    if t.get("damaged"):
        d = t["damaged"]
        bits.append(f"damaged {d['how']} {d['path']}: {t['outcome']}")
    if t["kind"].startswith("nvme"):
        bits.append(f"{t['moment']}: {t['outcome']}, from damaged state {t['from_damaged']}"
                    + (f", second run rc={t['second_rc']}" if "second_rc" in t else ""))
    return "; ".join(bits)


def versions() -> dict:
    """What the figures were measured with, for the JSON beside them."""
    out = {"python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d")}
    for name in ("jax", "jaxlib", "orbax-checkpoint"):
        out[name] = importlib.metadata.version(name)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        work = pathlib.Path(args.workdir or tmp).absolute()
        work.mkdir(parents=True, exist_ok=True)
        env = environment(work)
        refs = {}
        trials = []
        for kind in args.kinds:
            family = tuple(NVME) if kind.startswith("nvme") else ()
            if family not in refs:
                refs[family] = ref = reference(work, env, family)
                print(f"reference{' (NVMe)' * bool(family)}: {len(ref[0])} steps, training "
                      f"window {ref[1]:.1f} s", flush=True)
            for n in range(args.trials):
                trials.append(trial(kind, n, work, env, rng, refs[family]))
                print(describe(trials[-1]), flush=True)
    rows = summarize(trials)
    print(format_table(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"rows": rows, "trials": trials, "seed": args.seed, "versions": versions()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
