"""Train a GPT with ZeRO stage 0-3 on every device there is: `python train.py --stage 3`.

With no accelerator the CPU is split into simulated devices (8 unless --devices says
otherwise), so every shard is its own buffer and every collective really runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pathlib
import re
import signal
import sys
import tempfile
import threading
import time

SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal, as shells report
DIVERGED = 3  # the exit code of a run the divergence guard stopped (train.max_bad_steps)
MAX_DEVICES = 4096  # --devices: more than any data axis here; XLA aborts on absurd CPU counts
SEEDS = 2**32  # jax.random.key keeps a seed's low 32 bits (no x64): larger ones would collide


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, as for every bad input
        sys.exit(fail(message))


PROCESS = ""  # "[process i] " once several processes run: every error names its process


def fail(message: str, code: int = 2) -> int:
    print(f"error: {PROCESS}{message}", file=sys.stderr)
    return code


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0], epilog=(
        "exit codes: 0 done; 1 a failure while running (a checkpoint that cannot be written, a "
        "lost peer); 2 bad input, refused before anything is written; 3 training diverged: "
        "train.max_bad_steps steps in a row (default 5; 0 turns the guard off) had a non-finite "
        "loss or gradient, or one such step's update went in, and nothing was saved from the "
        "first of them on; 130 / 143 stopped by Ctrl-C / SIGTERM"))
    p.add_argument("--stage", type=int, help="ZeRO stage 0-3 (default: the config's, 3)")
    p.add_argument("--config", default="tiny",
                   help="YAML file, or a name in configs/: tiny, gpt2-124m, gpt-1.3b, gpt-7.5b")
    p.add_argument("--zero3-size", metavar="K",
                   help="hierarchical ZeRO: stage 3 within groups of K devices, optimizer state "
                   "over all; 'local' = one group per process/host (default: off)")
    p.add_argument("--tensor-parallel", type=int, metavar="T",
                   help="tensor parallelism: a data x model mesh, T adjacent devices per group "
                        "(config mesh.tensor_parallel; default 1)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the config's)")
    p.add_argument("--seed", type=int, help="seed of initialization and data order, 0 to "
                   f"{SEEDS - 1}")
    p.add_argument("--devices", type=int, help="devices on the data axis, at most "
                   f"{MAX_DEVICES} (default: all; 8 simulated CPU devices when there is no "
                   "accelerator)")
    p.add_argument("--data", help="text file, directory of text files, or .bin of uint16 token "
                   "ids (default: the Python standard library's sources, as bytes)")
    p.add_argument("--metrics", help="write one JSON object per step to this file")
    p.add_argument("--report", help="write the memory/communication report as JSON here")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the step on abstract arrays, print the report, train nothing")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="with --dry-run: plan for devices of this memory (80GB, 80GiB): compile "
                   "every stage x offload x remat policy not fixed by --stage or --set, and "
                   "name the layout that fits and communicates least")
    p.add_argument("--host-memory", metavar="SIZE",
                   help="with --device-memory: each host's memory (e.g. 1TB)")
    p.add_argument("--devices-per-host", type=int, metavar="K",
                   help="with --device-memory: devices sharing one host's memory (default: "
                   "this machine's devices)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save sharded orbax checkpoints here (at the end, and every --save-every)")
    p.add_argument("--save-every", type=int, metavar="N",
                   help="also save every N steps (default: only at the end)")
    p.add_argument("--keep", type=int, metavar="K", help="keep the last K (default 3)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir, on any "
                   "stage and device count; --steps is the total to reach")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a --checkpoint-dir that holds checkpoints, deleting them")
    p.add_argument("--allow-other-data", action="store_true",
                   help="resume on another --data than the checkpoint was trained on")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optimizer.name=sgd (repeatable)")
    add_observability(p)
    add_multi_process(p)
    return p.parse_args(argv)


def add_observability(p: argparse.ArgumentParser) -> None:
    """Figures, TensorBoard, profiler traces and DeepSpeed configs."""
    see = p.add_argument_group("observability (docs/guides/observability.md)")
    see.add_argument("--plot", metavar="DIR", help="draw the report's memory by stage and "
                     "communication (the planner's layouts), and the training curves, as PNG "
                     "and SVG with the numbers as JSON (needs matplotlib: zero_jax[plot])")
    see.add_argument("--tensorboard", metavar="DIR", help="write each step's metrics as "
                     "TensorBoard scalars, and the report's headline as text (needs "
                     "tensorboardX: zero_jax[tensorboard])")
    see.add_argument("--profile", metavar="DIR", help="trace --profile-steps with the JAX "
                     "profiler (for TensorBoard and Perfetto), beside the step's compiled HLO")
    see.add_argument("--profile-steps", metavar="A:B", help="with --profile: steps A to B-1 "
                     "(default 2:4, the two steps after the first; 1:2 in a one-step run)")
    see.add_argument("--deepspeed-config", metavar="FILE", help="a DeepSpeed JSON config, "
                     "mapped onto the config (printed); --set and flags override it")


def add_multi_process(p: argparse.ArgumentParser) -> None:
    """The flags of one process of several (one per host)."""
    multi = p.add_argument_group("several processes, one per host (docs/guides/multi-host.md)")
    multi.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0's address (default: $JAX_COORDINATOR_ADDRESS)")
    multi.add_argument("--num-processes", type=int, metavar="N",
                       help="processes in the run (default: $JAX_NUM_PROCESSES)")
    multi.add_argument("--process-id", type=int, metavar="I",
                       help="this process, 0 to N-1 (default: $JAX_PROCESS_ID)")
    multi.add_argument("--distributed", action="store_true",
                       help="join a process group JAX detects (Cloud TPU, Kubernetes, ...); "
                       "SLURM and Open MPI with several tasks are detected without it")
    multi.add_argument("--peer-timeout", type=float, default=30, metavar="S",
                       help="stop when a peer is lost or hangs this long, and the longest wait "
                       "for the coordinator at start-up (default 30)")


OPTIONAL = {"--plot": ("matplotlib", "plot"), "--tensorboard": ("tensorboardX", "tensorboard")}


def check_observability(args: argparse.Namespace) -> str | None:
    """--plot, --tensorboard, --profile: directories, their packages, the profiled steps."""
    import importlib.util

    for flag in ("--plot", "--tensorboard", "--profile", "--deepspeed-config"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not value.strip():
            what = "a file" if "config" in flag else "a directory"
            return f"{flag} {value!r} names nothing: pass {what}"
        if value and "config" not in flag and (problem := unwritable_dir(value)):
            return f"{flag} {value} {problem}"
        if value and flag in OPTIONAL and importlib.util.find_spec(OPTIONAL[flag][0]) is None:
            return (f"{flag} needs {OPTIONAL[flag][0]}, which is not installed: pip install "
                    f"'zero_jax[{OPTIONAL[flag][1]}]'")
    if args.profile_steps is None:
        return None
    if not args.profile:
        return "--profile-steps needs --profile DIR: where the trace goes"
    a, sep, b = args.profile_steps.partition(":")
    try:
        args.profile_steps = (int(a), int(b)) if sep else None
    except ValueError:
        args.profile_steps = None
    if args.profile_steps is None or not 1 <= args.profile_steps[0] < args.profile_steps[1]:
        return (f"--profile-steps {a}{sep}{b} is not A:B with 1 <= A < B (steps A to B-1, "
                "counted from 1): e.g. --profile-steps 2:4")
    return None


def unwritable_dir(path: str) -> str | None:
    """Why directory ``path`` cannot be made or written, found now; nothing is created."""
    p = pathlib.Path(path).absolute()
    if p.exists() and not p.is_dir():
        return "is a file: pass a directory (made when missing)"
    existing = next(q for q in (p, *p.parents) if q.exists())
    try:  # a probe file, removed at once: permissions alone do not tell (root, /proc)
        if not existing.is_dir():
            raise NotADirectoryError
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".zero_jax-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError:
        return f"cannot be written ({existing} is not a writable directory): pass another"
    return None


def check_args(args: argparse.Namespace) -> str | None:
    """The flags that need no config: refused before jax is even imported. Fills in the
    defaults of the checkpoint flags, which mean something only with --checkpoint-dir."""
    for flag, value, instead in [
            ("--config", args.config, "a YAML file or a name in configs/"),
            ("--data", args.data, "a file or directory, or leave it out for the default corpus"),
            ("--checkpoint-dir", args.checkpoint_dir, "a directory, or leave it out"),
            ("--metrics", args.metrics, "a file name, or leave it out"),
            ("--report", args.report, "a file name, or leave it out"),
            ("--coordinator", args.coordinator, "HOST:PORT, or leave it out")]:
        if value is not None and not value.strip():
            return f"{flag} {value!r} names nothing: pass {instead}"
    if not (0 < args.peer_timeout < float("inf")):  # nan fails too
        return (f"--peer-timeout must be a positive finite number of seconds (got "
                f"{args.peer_timeout:g})")
    for flag, value, low in [("--devices", args.devices, 1), ("--save-every", args.save_every, 0),
                             ("--keep", args.keep, 1)]:
        if value is not None and value < low:
            return f"{flag} must be at least {low} (got {value})"
    if args.devices is not None and args.devices > MAX_DEVICES:
        return (f"--devices must be at most {MAX_DEVICES} (got {args.devices}); leave it out to "
                "use every device there is")
    if args.seed is not None and not 0 <= args.seed < SEEDS:
        return (f"--seed must be 0 to {SEEDS - 1} (got {args.seed}): jax.random.key keeps 32 "
                "bits of it")
    if (args.device_memory or args.host_memory) and not (args.dry_run and args.device_memory
                                                          and args.host_memory):
        return ("--device-memory and --host-memory plan layouts: pass both, with --dry-run, "
                "e.g. --dry-run --device-memory 80GB --host-memory 1TB")
    if args.devices_per_host is not None and args.devices_per_host < 1:
        return f"--devices-per-host must be at least 1 (got {args.devices_per_host})"
    for flag in ("device_memory", "host_memory"):
        if (size := getattr(args, flag)) is not None:
            if (value := memory_size(size)) is None:
                return (f"--{flag.replace('_', '-')} {size!r} is not a memory size: write e.g. "
                        "80GB, 80GiB or 1TB")
            setattr(args, flag, value)
    if not args.checkpoint_dir:
        given = [flag for flag, on in [("--save-every", args.save_every is not None),
                                       ("--keep", args.keep is not None),
                                       ("--resume", args.resume),
                                       ("--overwrite", args.overwrite)] if on]
        if given:
            return (f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} "
                    "--checkpoint-dir DIR: without it nothing is saved or read")
    if args.resume and args.overwrite:
        return "--resume continues the checkpoints that --overwrite would delete: pass one"
    if args.metrics and args.report and same_file(args.metrics, args.report):
        return (f"--metrics and --report both name {args.metrics}: each would overwrite the "
                "other; pass two files")
    for flag, path in [("--metrics", args.metrics), ("--report", args.report)]:
        if path and (problem := unwritable(path)):
            return f"{flag} {path} {problem}"
    args.save_every = 0 if args.save_every is None else args.save_every
    args.keep = 3 if args.keep is None else args.keep
    return None


UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "K": 2**10, "M": 2**20,
         "G": 2**30, "T": 2**40, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def memory_size(text: str) -> int | None:
    """Bytes of ``"80GB"`` (1e9), ``"80GiB"`` or ``"80G"`` (2**30), ``"1TB"``; None if it is
    not a size."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        return None
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written, found now rather than after hours of training; a probe
    file is removed again, so nothing is left behind."""
    p = pathlib.Path(path)
    if p.is_dir():
        return "is a directory: pass a file name"
    if not p.parent.is_dir():
        return f"cannot be written: {p.parent} is not an existing directory"
    existed = p.exists()
    try:
        open(p, "a").close()
    except OSError as e:
        return f"cannot be written ({e.strerror}): pass a writable path"
    if not existed:  # another process of the same run may have removed its probe already
        p.unlink(missing_ok=True)
    return None


class Stop:
    """SIGTERM (preemption) or Ctrl-C: finish the step, save, exit 143 or 130. A second Ctrl-C
    exits at once; orbax renames a save only when complete, so the one in flight is dropped and
    the last complete checkpoint stays."""

    def __init__(self, enabled: bool = True):
        self.signum: int | None = None
        self.previous: dict = {}
        self.enabled = enabled

    def __enter__(self) -> Stop:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in SIGNAL_EXIT}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            print("\nerror: interrupted again: stopped at once; a save in flight is dropped, the "
                  "last complete checkpoint is kept", file=sys.stderr, flush=True)
            os._exit(SIGNAL_EXIT[signal.SIGINT])
        self.signum = self.signum or signum


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := check_args(args) or check_observability(args):
        return fail(problem)
    from zero_jax.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices or 8)
    from zero_jax import distributed  # jax is imported from here on

    try:
        spec = distributed.settings(args.coordinator, args.num_processes, args.process_id,
                                    auto=args.distributed)
        if spec is not None:
            distributed.initialize(spec, args.peer_timeout)
    except distributed.StartupError as e:
        return fail(str(e))
    if spec is None:
        return run_main(args)
    global PROCESS
    import jax

    PROCESS = f"[process {jax.process_index()}] "
    if jax.process_index():
        sys.stdout = open(os.devnull, "w")  # one progress bar, one report: process 0's
    watchdog = distributed.Watchdog(args.peer_timeout).start()
    try:
        code = run_main(args, watchdog)
    except Exception as e:  # reach the user with the process id, and stop the peers at once
        import traceback

        watchdog.settle(e)  # a lost peer is named by the watchdog, not by gloo's socket error
        traceback.print_exc()
        fail(f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}")
        code = 1
    if code:
        watchdog.failed(f"exit code {code}, see its error above")
        watchdog.linger()
        sys.stderr.flush()
        os._exit(code)  # not JAX's shutdown barrier: the peers will not reach it
    watchdog.stop()
    return 0


def run_main(args: argparse.Namespace, watchdog=None) -> int:
    if args.zero3_size == "local":
        import jax

        args.zero3_size = jax.local_device_count()
    elif args.zero3_size is not None:
        try:
            args.zero3_size = int(args.zero3_size)
        except ValueError:
            return fail(f"--zero3-size must be a number of devices or 'local' (got "
                        f"{args.zero3_size!r})")
    with Stop(enabled=not args.dry_run) as stop:  # a dry run has nothing to save
        from zero_jax import distributed
        from zero_jax.checkpoint import CheckpointError
        from zero_jax.gpt import config as configs

        run = None
        try:
            cfg = load_config(args)
            if problem := profile_window(args, cfg["train"]["steps"]):
                return fail(problem)
            local = {"coordinator", "num_processes", "process_id", "distributed"}
            distributed.agree("configuration", {"config": cfg, "arguments": {
                k: v for k, v in vars(args).items() if k not in local}}, args.peer_timeout)
            run = Run(cfg, args, stop, watchdog)
            return run.dry_run() if args.dry_run else run.train()
        except (configs.ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
            return fail(str(e))
        finally:
            if run:
                run.close()


def load_config(args: argparse.Namespace) -> dict:
    """The config: --config's file, then --deepspeed-config's keys (the mapping printed), then
    --set, then the flags that stand for keys (--stage, --steps, ...)."""
    from zero_jax.gpt import config as configs

    overrides = list(args.set)
    for flag, key in [("stage", "zero.stage"), ("steps", "train.steps"),
                      ("seed", "train.seed"), ("zero3_size", "zero.zero3_size"),
                      ("tensor_parallel", "mesh.tensor_parallel")]:
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if args.deepspeed_config:
        import jax

        from zero_jax.gpt import deepspeed

        try:  # DeepSpeed's batch sizes count per data-parallel device
            tp = configs.load(args.config, overrides)["mesh"]["tensor_parallel"]
        except configs.ConfigError:
            tp = 1
        mapped, lines = deepspeed.translate(deepspeed.read(args.deepspeed_config),
                                            (args.devices or jax.device_count()) // tp,
                                            args.deepspeed_config)
        print("\n".join(lines), flush=True)
        overrides = mapped + overrides
    return configs.load(args.config, overrides)


def profile_window(args: argparse.Namespace, steps: int) -> str | None:
    """--profile-steps within the run's steps (default: 2 and 3, or what the run has)."""
    if not args.profile:
        return None
    if args.profile_steps is None:
        args.profile_steps = (2, min(4, steps + 1)) if steps > 1 else (1, 2)
        return None
    a, b = args.profile_steps
    if b > steps + 1:
        return (f"--profile-steps {a}:{b} reaches past the run's {steps} steps (it traces "
                f"steps {a} to {b - 1}): pass B of at most {steps + 1}")
    return None


class Run:
    """One configured run: data, the experiment it trains, and where its outputs go."""

    def __init__(self, cfg: dict, args: argparse.Namespace, stop: Stop, watchdog=None):
        import jax

        from zero_jax.gpt.experiment import Experiment, mesh_for

        self.cfg, self.args, self.stop, self.watchdog = cfg, args, stop, watchdog
        self.primary = jax.process_index() == 0  # writes the report and metrics files
        self.exp = Experiment.build(cfg, mesh_for(cfg, args.devices))
        self.seed = cfg["train"]["seed"]
        self.ckpts, self.source, self.resume_step, self.corrupt = None, None, None, []
        self.records: list[tuple[int, str]] = []  # a resumed run's metrics file, line by line
        self.overwrite: list[int] = []
        if args.dry_run:
            return
        try:
            self.open()
        except BaseException:
            self.close()  # the lock: a refused run leaves the directory as it found it
            raise

    def open(self) -> None:
        """Data first, then checkpoints: a run refused for its data writes nothing."""
        from zero_jax.checkpoint import Checkpoints
        from zero_jax.gpt import data

        args, cfg = self.args, self.cfg
        m = self.exp.model
        self.tokens = data.load_tokens(args.data)
        data.check_tokens(self.tokens, m.vocab_size, m.seq_len,
                          args.data or "the standard library corpus")
        # Where the state comes from: --resume's latest checkpoint in --checkpoint-dir, else
        # train.ckpt_load_path's latest, else a fresh initialization.
        if args.checkpoint_dir:
            self.ckpts = Checkpoints(args.checkpoint_dir, keep=args.keep)  # takes the lock
            if (steps := self.ckpts.steps()) and not args.resume:
                if not args.overwrite:
                    raise ValueError(
                        f"{self.ckpts.path} holds checkpoints of another run (steps "
                        f"{', '.join(map(str, steps))}): pass --resume to continue it, another "
                        "--checkpoint-dir, or --overwrite to delete them")
                self.overwrite = steps  # deleted once the run is known to start
        if args.resume:
            self.source = self.ckpts
            self.resume_step = self.ckpts.latest_step()
            if self.resume_step is None:
                print(f"no checkpoint in {self.ckpts.path}: starting fresh")
        load = cfg["train"]["ckpt_load_path"]
        if load and self.resume_step is None:
            try:
                self.source = Checkpoints(load, create=False, read_only=True)
            except ValueError as e:
                raise ValueError(f"train.ckpt_load_path: {e}") from e
            for step in self.source.foreign:
                warn(f"{self.source.path / str(step)} holds no zero_jax checkpoint: skipped")
            self.resume_step = self.source.latest_step()
            if self.resume_step is None:
                raise ValueError(f"train.ckpt_load_path {self.source.path} holds no complete "
                                 "checkpoint: point it at a --checkpoint-dir of an earlier run")
        if self.resume_step is not None:
            self.resume_step, self.meta = self.readable_meta(self.resume_step)
            if args.metrics and self.primary and os.path.exists(args.metrics):
                self.records = read_metrics(args.metrics)  # continued: read now, before training

    def readable_meta(self, newest: int) -> tuple[int, dict]:
        """The newest step from ``newest`` down whose metadata reads and fits this run; a
        corrupted one is reported, and moved aside when we own the directory."""
        from zero_jax.checkpoint import CorruptCheckpointError

        for step in reversed([s for s in self.source.steps()
                              if s <= newest and s not in self.corrupt]):
            try:
                meta = self.source.meta(step)
            except CorruptCheckpointError as e:
                self.set_aside(e)
                continue
            self.check_compatible(meta)
            return step, meta
        raise ValueError(f"no checkpoint in {self.source.path} can be read (see the warnings "
                         "above): pass another --checkpoint-dir, or --overwrite without --resume")

    def set_aside(self, e) -> None:
        """Report a corrupted step; it is moved aside only once an older one has restored."""
        self.corrupt.append(e.step)
        older = [s for s in self.source.steps() if s < e.step and s not in self.corrupt]
        warn(f"{e}; " + (f"falling back to checkpoint {older[-1]}" if older
                         else "no older checkpoint"))

    def check_compatible(self, meta: dict) -> None:
        from zero_jax.gpt.experiment import check_compatible

        check_compatible(meta, self.cfg, self.exp.mesh.devices.flat[0].platform)
        saved = meta.get("data", {}).get("source")
        here = os.path.abspath(self.args.data) if self.args.data else None
        saved = os.path.abspath(saved) if saved else None
        if saved != here and not self.args.allow_other_data:
            raise ValueError(f"the checkpoint was trained on --data {saved or '(the default)'} "
                             f"but this run reads {here or '(the default)'}: pass the same "
                             "--data, or --allow-other-data to go on with other data")
        self.seed = meta["data"]["seed"]  # the data order goes on where it stopped

    def close(self) -> None:
        for ckpts in {id(c): c for c in (self.ckpts, self.source) if c}.values():
            ckpts.close()

    def report(self, state) -> tuple[dict, object]:
        from zero_jax import report
        from zero_jax.peak import compile_with_peak

        lowered = self.exp.step.lower(state, self.exp.batch_shape)
        compiled, peak = compile_with_peak(lowered)
        r = report.build(self.exp.plan, state, lowered, compiled, peak)
        print(report.format_table(r))
        return r, compiled

    def write_report(self, r: dict) -> None:
        if self.args.report and self.primary:
            with open(self.args.report, "w") as f:
                json.dump(r, f, indent=1)

    def dry_run(self) -> int:
        from zero_jax import report
        from zero_jax.state import abstract_state

        plan = self.exp.plan
        if self.args.device_memory:
            return self.plan_layouts()
        r, _ = self.report(abstract_state(plan, self.exp.tx))
        if plan.outer is None:  # the flat stages side by side, on the same mesh
            r["stages"] = report.stages_table(plan, self.exp.tx)
            print("\n" + report.format_stages(r["stages"], r["n_params"], plan.dp_size))
        self.write_report(r)
        self.draw(r)
        return 0

    def plan_layouts(self) -> int:
        """The planner: every stage x offload x remat policy x tensor-parallel size of this
        config, compiled on abstract arrays, against --device-memory and --host-memory."""
        import jax

        from zero_jax import planner
        from zero_jax.gpt.experiment import Experiment, mesh_for
        from zero_jax.state import abstract_state

        if self.exp.plan.outer is not None:
            raise ValueError("the planner compares the flat stages; drop zero3_size")
        args = self.args
        per_host = args.devices_per_host or jax.local_device_count()
        rows = []
        for layout, cfg in self.layouts(per_host):
            exp = Experiment.build(cfg, mesh_for(cfg, args.devices))
            state = abstract_state(exp.plan, exp.tx)
            compiled = exp.step.lower(state, exp.batch_shape).compile()
            rows.append(planner.measure(layout, exp.plan, state, compiled))
        best = planner.choose(rows, args.device_memory, args.host_memory, per_host)
        self.print_layouts(rows, best, per_host)
        plan = {"device_memory": args.device_memory, "host_memory": args.host_memory,
                "devices_per_host": per_host, "devices": self.exp.mesh.size,
                "best": None if best is None else best.layout,
                "candidates": [{**c.layout, "device_bytes": c.device,
                                "device_state_bytes": c.device_state, "temp_bytes": c.temp,
                                "model_state_bytes": c.model_states,
                                "host_bytes_per_host": c.host_state * per_host,
                                "fits": c.fits, "comm_bytes": c.comm,
                                "host_traffic_bytes": c.host_traffic} for c in rows]}
        self.write_report(plan)
        self.draw(plan)
        return 0

    def layouts(self, per_host: int):
        """(layout, config) for each candidate: what the command line did not fix (--stage,
        --tensor-parallel, model.remat, zero.offload_*) varies. Tensor parallelism (T a divisor
        of the devices per host that cuts the heads, the MLP and the vocabulary) is tried at
        stage 3 with partitioned activations and no offload, as ZeRO's paper trains its
        largest models."""
        import copy

        from zero_jax.gather import REMAT

        args, z, m = self.args, self.cfg["zero"], self.cfg["model"]
        fixed = lambda key: any(s.startswith(key) for s in args.set)
        offloads = {"none": ("none", "none"), "optimizer": ("cpu", "none"),
                    "params": ("cpu", "cpu")}
        if fixed("zero.offload_"):
            offloads = {"as set": (z["offload_optimizer"]["device"], z["offload_params"])}
        tps = [self.cfg["mesh"]["tensor_parallel"]]
        if args.tensor_parallel is None and not fixed("mesh.tensor_parallel"):
            tps = [t for t in range(1, per_host + 1) if per_host % t == 0 and self.exp.mesh.size
                   % t == 0 and all(m[k] % t == 0 for k in ("n_heads", "d_ff", "vocab_size"))]
        stages = [args.stage] if args.stage is not None else range(4)
        for t, stage, (offload, (opt, params)), remat in itertools.product(
                tps, stages, offloads.items(),
                [m["remat"]] if fixed("model.remat") else REMAT):
            if (params == "cpu" and (stage != 3 or self.cfg["train"]["accum_steps"] > 1)) or \
                    (t > 1 and (stage != 3 or opt != "none")):
                continue
            cfg = copy.deepcopy(self.cfg)
            ratio = z["offload_optimizer"]["ratio"] if offload == "as set" else 1.0
            cfg["zero"].update(stage=stage, offload_params=params, partition_activations=t > 1,
                               offload_optimizer={"device": opt, "ratio": ratio})
            cfg["model"]["remat"], cfg["mesh"]["tensor_parallel"] = remat, t
            yield {"stage": stage, "offload": offload, "remat": remat, "tp": t}, cfg

    def print_layouts(self, rows: list, best, per_host: int) -> None:
        """The candidates as a table, and the advice."""
        from zero_jax import planner

        device, host = self.args.device_memory, self.args.host_memory
        unit, div = ("GiB", 2**30) if device >= 2**30 else ("MiB", 2**20)
        print(f"layouts of {self.exp.model.n_params:,} parameters on {self.exp.mesh.size} "
              f"devices of {device / div:.1f} {unit}, {per_host} per host of {host / div:.1f} "
              f"{unit} (fits: within {planner.HEADROOM:.0%} of both); {unit} per device, host "
              f"per host, communication per device and step\n")
        print(f"  {'stage':<6}{'offload':<10}{'remat':<8}{'tp':>3}{'device':>9}{'(state':>9}"
              f"{'+ temp)':>9}{'host':>9}{'fits':>6}{'comm MiB':>10}{'host<->dev MiB':>16}")
        for c in rows:
            lo = c.layout
            print(f"  {lo['stage']:<6}{lo['offload']:<10}{lo['remat']:<8}{lo['tp']:>3}"
                  f"{c.device / div:>9.2f}{c.device_state / div:>9.2f}{c.temp / div:>9.2f}"
                  f"{c.host_state * per_host / div:>9.2f}{'yes' if c.fits else 'no':>6}"
                  f"{c.comm / 2**20:>10.2f}{c.host_traffic / 2**20:>16.2f}")
        if best is None:
            print("\nnothing fits: more devices, a smaller model or train.batch_size")
            return
        lo = best.layout
        flags = [f"--stage {lo['stage']}", f"--set model.remat={lo['remat']}"]
        if lo["offload"] in ("optimizer", "params"):
            flags.append("--set zero.offload_optimizer.device=cpu")
        if lo["offload"] == "params":
            flags.append("--set zero.offload_params=cpu")
        if lo["tp"] > 1:
            flags += [f"--tensor-parallel {lo['tp']}", "--set zero.partition_activations=true"]
        print(f"\nfits and communicates least: stage {lo['stage']}, offload {lo['offload']}, "
              f"remat {lo['remat']}, tensor parallel {lo['tp']}: {' '.join(flags)}")

    def restore(self, target):
        """The resume step's state, falling back past corrupted checkpoints, saying so."""
        from zero_jax.checkpoint import CorruptCheckpointError

        while True:
            tick = time.perf_counter()
            try:
                state, _ = self.source.restore(target, self.resume_step)
            except CorruptCheckpointError as e:
                self.set_aside(e)
                self.resume_step, self.meta = self.readable_meta(e.step - 1)
                continue
            print(f"resumed from step {self.resume_step} of {self.source.path} in "
                  f"{time.perf_counter() - tick:.2f} s (digests checked in "
                  f"{self.source.verify_s * 1e3:.0f} ms)")
            if self.source is self.ckpts:  # ours: the corrupted steps make way for new saves
                for bad in self.corrupt:
                    warn(f"corrupted checkpoint {bad} moved aside to "
                         f"{self.ckpts.quarantine(bad)}")
            return state

    def open_metrics(self, first: int):
        """The metrics file, line-buffered; on resume, the records after ``first`` (from a run
        that went further than its last checkpoint) are dropped, since they are trained again."""
        if not self.args.metrics or not self.primary:
            return None
        path = pathlib.Path(self.args.metrics)
        if first and path.exists():
            keep = "".join(line for step, line in self.records if step <= first)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a kill leaves the old file
            tmp.write_text(keep)
            os.replace(tmp, path)
        return open(path, "a" if first else "w", buffering=1)

    def train(self) -> int:
        from zero_jax import fit
        from zero_jax.checkpoint import CheckpointError
        from zero_jax.state import abstract_state

        t, exp, ckpts, stop = self.cfg["train"], self.exp, self.ckpts, self.stop
        target = abstract_state(exp.plan, exp.tx)
        r, step = self.report(target)  # compiled on abstract arrays: nothing allocated yet
        if problem := fit.check(step, list(exp.mesh.devices.flat)):
            return fail(f"{problem}: use {'a higher --stage, ' * (exp.plan.stage < 3)}"
                        "precision.param_dtype=bf16, zero.offload_grads, a smaller model or "
                        "train.batch_size, or --dry-run to see the report")
        self.add_stages(r)
        state = self.start(target, r)
        first = int(state.step)
        if first >= t["steps"]:
            print(f"nothing to do: the checkpoint is at step {first} and --steps is {t['steps']}")
            return 0
        losses, start, skipped, done_steps, saved = [], time.perf_counter(), 0, first, None
        guard = Guard(t["max_bad_steps"], self.cfg["precision"]["min_loss_scale"])
        bar, rows = self.progress(first)
        out = Outputs(self, first, r, step, bar.write)
        try:
            for i in bar:
                if stop.signum:
                    break
                batch = self.batch(i, rows)
                if self.watchdog:
                    self.watchdog.reach(i + 1)
                out.before(i + 1)
                state, m, record = self.timed(step, state, batch, i + 1)
                skipped += m["skipped"]
                done_steps = i + 1
                stop_now = guard.update(m, i + 1)
                out.after(i + 1, record)
                losses.append(m["loss"])
                bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
                if ckpts:
                    saved = self.save_if_due(state, i + 1, guard.bad_from is None, bar) or saved
                if stop_now:
                    break
            if ckpts and (done := ckpts.finish()):
                bar.write(str(done))
        except CheckpointError as e:
            bar.close()
            return fail(str(e), 1)
        finally:
            bar.close()
            out.close()
        self.draw(r, out.records)
        if stop.signum:
            return self.stopped(done_steps, saved, guard.bad_from)
        if guard.bad_from is not None:  # max_bad_steps in a row, or the run ended in a streak
            return self.diverged(guard.bad_from, done_steps, guard.last_finite, guard.diverged)
        return self.done(first, losses, time.perf_counter() - start, skipped)

    def add_stages(self, r: dict) -> None:
        """With --plot, the flat stages side by side (as a dry run reports them), for the
        memory figure; the report written then holds them too."""
        from zero_jax import report

        if self.args.plot and self.exp.plan.outer is None:
            r["stages"] = report.stages_table(self.exp.plan, self.exp.tx)

    def draw(self, r: dict, records: list[dict] | None = None) -> None:
        """--plot: the figures of the report (or the planner's) and of the metrics; a resumed
        run's curves from its whole metrics file."""
        if not (self.args.plot and self.primary):
            return
        import jax

        from zero_jax import plot

        if self.args.metrics and records is not None and os.path.exists(self.args.metrics):
            records = plot.read_records(self.args.metrics)
        stats = jax.devices()[0].memory_stats() or {}
        paths = plot.draw(r, records, self.args.plot, stats.get("bytes_limit"))
        print(f"figures: {', '.join(p.name for p in paths if p.suffix == '.png')} in "
              f"{self.args.plot}")

    def done(self, first: int, losses: list[float], elapsed: float, skipped: int) -> int:
        import numpy as np

        steps = self.cfg["train"]["steps"]
        print(f"done: steps {first + 1}-{steps} in {elapsed:.1f} s, loss {losses[0]:.3f} -> "
              f"{float(np.mean(losses[-10:])):.3f} (mean of last 10), "
              f"{(steps - first) * self.exp.tokens_per_step / elapsed:,.0f} tokens/s"
              + (f", {skipped} steps skipped (gradient not finite)" if skipped else ""))
        return 0

    def batch(self, i: int, rows):
        """Batch ``i`` as a global array, this process building only its ``rows``."""
        from zero_jax import distributed
        from zero_jax.gpt import data

        exp, t = self.exp, self.cfg["train"]
        return distributed.global_array(exp.batch_sharding, exp.batch_shape.shape, data.batch(
            self.tokens, i, t["batch_size"], exp.model.seq_len, self.seed, rows))

    def progress(self, first: int):
        """The progress bar over the steps left, and this process's rows of each batch."""
        from tqdm import tqdm

        from zero_jax import distributed

        t, exp = self.cfg["train"], self.exp
        bar = tqdm(range(first, t["steps"]), desc=f"stage {exp.plan.stage}", unit="step",
                   mininterval=0.5, initial=first, total=t["steps"], disable=not self.primary)
        return bar, distributed.local_rows(exp.batch_sharding, exp.batch_shape.shape)

    def timed(self, step, state, batch, n: int):
        """Step ``n``, waited for: the new state, its metrics as numbers, the metrics record."""
        tick = time.perf_counter()
        state, m = step(state, batch)
        m = {k: float(v) for k, v in m.items()}  # waits for the step
        m["skipped"] = int(m["skipped"])
        tps = self.exp.tokens_per_step / (time.perf_counter() - tick)
        return state, m, {"step": n, **m, "tokens_per_s": tps}

    def start(self, target, r: dict):
        """The state to train from: --overwrite's deletion done, restored or initialized; the
        report written."""
        import jax

        from zero_jax.state import init_state

        if self.overwrite:
            self.ckpts.remove_all()
            print(f"--overwrite: deleted checkpoints {', '.join(map(str, self.overwrite))} in "
                  f"{self.ckpts.path}")
        if self.resume_step is not None:
            state = self.restore(target)
        else:
            exp = self.exp
            state = init_state(exp.plan, exp.init, exp.tx, jax.random.key(self.seed))
        self.write_report(r)
        return state

    def save_if_due(self, state, step: int, allowed: bool, bar) -> int | None:
        """Save at --save-every, at the last step and on a stop signal, unless not ``allowed``
        (a streak of bad steps); report finished saves. Returns the step saved, if any."""
        every, saved = self.args.save_every, None
        if ((every and step % every == 0) or step == self.cfg["train"]["steps"]
                or self.stop.signum) and allowed:
            self.ckpts.save(state, self.checkpoint_meta(step))
            saved = step
            bar.write(f"saving checkpoint {step} (training goes on)")
        if done := self.ckpts.poll():
            bar.write(str(done))
        return saved
    def newest_checkpoint(self) -> str:
        if not self.ckpts:
            return "nothing was saved (no --checkpoint-dir)"
        if (newest := self.ckpts.latest_step()) is None:
            return f"no checkpoint is in {self.ckpts.path}"
        return f"the newest checkpoint, from before it, is {newest} in {self.ckpts.path}"

    def diverged(self, bad_from: int, step: int, last_finite: int | None, stopped: bool) -> int:
        """The divergence guard's one line: which steps, the last good one, what is kept."""
        n = step - bad_from + 1
        why = ("its update went in" if n < self.cfg["train"]["max_bad_steps"] and stopped
               else "the run ended in it" if not stopped
               else f"train.max_bad_steps is {self.cfg['train']['max_bad_steps']}")
        good = (f"the last step with a finite loss was {last_finite}" if last_finite
                else "no step of this run had a finite loss")
        print(f"error: {PROCESS}training diverged: step{'s' if n > 1 else ''} "
              f"{bad_from}{f'-{step}' if n > 1 else ''} had a non-finite loss or gradient "
              f"({n} in a row; {why}); {good}; nothing saved since, {self.newest_checkpoint()}: "
              "resume from it with a lower optimizer.lr, or a larger optimizer.warmup_steps",
              file=sys.stderr)
        return DIVERGED

    def stopped(self, step: int, saved: int | None, bad_from: int | None = None) -> int:
        name = signal.Signals(self.stop.signum).name
        if saved == step:
            what = f"checkpoint {step} saved in {self.ckpts.path}; continue with --resume"
        elif bad_from is not None:
            what = (f"not saved: steps {bad_from}-{step} had a non-finite loss or gradient; "
                    f"{self.newest_checkpoint()}")
        elif self.ckpts:
            what = "nothing new to save"
        else:
            what = "not saved (no --checkpoint-dir)"
        print(f"stopped by {name} after step {step}: {what}", file=sys.stderr)
        return SIGNAL_EXIT[self.stop.signum]

    def checkpoint_meta(self, step: int) -> dict:
        """What a checkpoint needs besides arrays to resume exactly and to be checked."""
        plan = self.exp.plan
        source = os.path.abspath(self.args.data) if self.args.data else None
        return {"config": self.cfg,
                "data": {"source": source, "seed": self.seed, "next_batch": step},
                "writer": {"stage": plan.stage, "devices": plan.mesh.size,
                           "processes": len({d.process_index for d in plan.mesh.devices.flat}),
                           "platform": plan.mesh.devices.flat[0].platform}}


class Outputs:
    """Where each step's record goes besides the progress bar, from process 0: --metrics,
    --tensorboard, and the --profile trace around --profile-steps."""

    def __init__(self, run: Run, first: int, r: dict, compiled, write=print):
        args, self.write = run.args, write
        self.metrics = run.open_metrics(first)
        self.records: list[dict] | None = [] if args.plot else None
        self.writer, self.tracing, self.window = None, False, None
        if not run.primary:
            return
        if args.tensorboard:
            from tensorboardX import SummaryWriter

            # A resumed run hides the old events past its checkpoint (trained again).
            self.writer = SummaryWriter(args.tensorboard, purge_step=first + 1 if first else None,
                                        flush_secs=10)
            self.writer.add_text("report", headline(r), first)
        if args.profile:
            self.window, self.dir = args.profile_steps, pathlib.Path(args.profile)
            self.dir.mkdir(parents=True, exist_ok=True)
            # The trace's events are named by the program's instructions: the HLO says what
            # each one is (all_gather.3 -> an all-gather of which shapes, in which loop).
            (self.dir / "train_step.hlo.txt").write_text(compiled.as_text())

    def before(self, step: int) -> None:
        if self.window and step == self.window[0]:
            import jax

            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.tracing = True

    def after(self, step: int, record: dict) -> None:
        if self.metrics:
            self.metrics.write(json.dumps(finite_record(record), allow_nan=False) + "\n")
        if self.records is not None:
            self.records.append(finite_record(record))
        if self.writer:
            for key, value in record.items():
                if key != "step":
                    self.writer.add_scalar(f"train/{key}", value, step)
        if self.tracing and step == self.window[1] - 1:
            self.stop_trace()

    def stop_trace(self) -> None:
        import jax

        self.tracing = False
        jax.profiler.stop_trace()
        a, b = self.window
        self.write(f"profile of steps {a}-{b - 1} in {self.dir} (open it with TensorBoard's "
                   "profile plugin, or its perfetto_trace.json.gz in ui.perfetto.dev)")

    def close(self) -> None:
        if self.tracing:  # a run stopped inside the window: what was traced is kept
            self.stop_trace()
        if self.metrics:
            self.metrics.close()
        if self.writer:
            self.writer.close()


def headline(r: dict) -> str:
    """The report's headline figures, as Markdown for TensorBoard's text tab."""
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    rows = [("ZeRO stage", r["stage"]), ("mesh", f"{mesh} ({r['platform']})"),
            ("parameters", f"{r['n_params']:,}"),
            ("model states per device", f"{mib(sum(r['per_device_bytes'].values()))} (ZeRO "
             f"formula {mib(sum(r['zero_formula_bytes'].values()))})"),
            ("host memory per device", mib(sum(r["per_device_host_bytes"].values()))),
            ("compiled temp per device", mib(r["compiled"]["temp_bytes"])),
            ("communication per step", f"{mib(r['comm_bytes_per_step'])} (ZeRO theory "
             f"{mib(r['comm_bytes_theory'])}, {r['comm_theory_formula']})")]
    if r.get("peak"):
        rows.append(("peak per device", mib(r["peak"]["peak_bytes"])))
    return "| figure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def read_metrics(path: str) -> list[tuple[int, str]]:
    """The records of a metrics file as ``(step, line)``, each line ending in a newline. A last
    line cut short (a process killed while writing it) is dropped with a warning; any other line
    that is not a JSON object is refused (``ValueError``), naming the file and the line."""
    lines = pathlib.Path(path).read_text(errors="replace").splitlines(keepends=True)
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            if n == len(lines) and not line.endswith("\n"):
                warn(f"--metrics {path}: its last line (line {n}) was cut short, by a run "
                     "killed while writing it: dropped")
                break
            what = f"{e.msg.removesuffix(' at')} at column {e.colno}"
            raise ValueError(f"--metrics {path}: line {n} is not JSON ({what}): remove that "
                             "line, or pass another --metrics") from None
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
            what = ("its step is not a number" if isinstance(record, dict)
                    else f"it holds a JSON {type(record).__name__}")
            raise ValueError(f"--metrics {path}: line {n} is not a record of a step ({what}): "
                             "remove that line, or pass another --metrics")
        records.append((record.get("step", 0), line if line.endswith("\n") else line + "\n"))
    return records


class Guard:
    """The divergence guard: a streak of bad steps (``bad_step``) stops the run once it is
    train.max_bad_steps long (0: never), or at once when a bad step's update went in; nothing
    is saved while a streak lasts, so the newest checkpoint is from before it."""

    def __init__(self, max_bad: int, min_loss_scale: float):
        self.max_bad, self.min_loss_scale = max_bad, min_loss_scale
        self.bad_from: int | None = None  # the first step of the current streak
        self.last_finite: int | None = None  # the last step with a finite loss
        self.diverged = False

    def update(self, m: dict, step: int) -> bool:
        """Record step ``step``'s metrics; whether to stop now."""
        if math.isfinite(m["loss"]):
            self.last_finite = step
        bad = self.max_bad > 0 and bad_step(m, self.min_loss_scale)
        self.bad_from = (self.bad_from or step) if bad else None
        self.diverged = bad and (step + 1 - self.bad_from >= self.max_bad or not m["skipped"])
        return self.diverged


def bad_step(m: dict, min_loss_scale: float) -> bool:
    """A step that did not train: its loss or gradient was not finite, or it was skipped. Not
    one that fp16's loss scaler skipped while it can still lower the scale: that is the scaler
    finding its level, as it does at the start of every fp16 run."""
    if math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and not m["skipped"]:
        return False
    return not (m["skipped"] and math.isfinite(m["loss"])
                and m.get("loss_scale", 0.0) > min_loss_scale)


def finite_record(record: dict) -> dict:
    """``record`` as strict JSON can hold it: a non-finite float becomes null, and the keys
    that held one are listed under ``nonfinite``."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, "nonfinite": bad}


def warn(message: str) -> None:
    print(f"warning: {PROCESS}{message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
