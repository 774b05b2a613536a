"""Train a GPT with ZeRO stage 0-3 on every device there is: `python train.py --stage 3`.

With no accelerator the CPU is split into simulated devices (8 unless --devices says
otherwise), so every shard is its own buffer and every collective really runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
# For steps compiled only to be measured: LLVM's optimizations act below the HLO, so the
# buffers and collectives are the same without them (tests/flags.py).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_parallel_codegen_split_count": 1}


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
        "train.max_bad_steps steps in a row (default 5) had a non-finite loss or gradient, or "
        "one such step's update went in, and nothing was saved from the first of them on; with "
        "0 the run goes on and saves, and exits 3 if it ends in such steps; 130 / 143 stopped "
        "by Ctrl-C / SIGTERM"))
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
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optimizer.name=sgd (repeatable)")
    add_planner(p)
    add_checkpoints(p)
    add_observability(p)
    add_multi_process(p)
    return p.parse_args(argv)


def add_planner(p: argparse.ArgumentParser) -> None:
    """The machine the planner plans for: it compiles every layout the flags leave open."""
    plan = p.add_argument_group("the planner, with --dry-run (docs/guides/offload.md)")
    plan.add_argument("--device-memory", metavar="SIZE", help="plan for devices of this "
                      "memory (80GB, 80GiB): compile every stage x offload x remat policy not "
                      "fixed by --stage or --set, and name the layout that fits and "
                      "communicates least")
    plan.add_argument("--host-memory", metavar="SIZE",
                      help="with --device-memory: each host's memory (e.g. 1TB)")
    plan.add_argument("--nvme-memory", metavar="SIZE", help="with --device-memory: each "
                      "host's NVMe disk; also plan the layouts whose optimizer is offloaded "
                      "with it in files (ZeRO-Infinity's NVMe tier)")
    plan.add_argument("--devices-per-host", type=int, metavar="K", help="with "
                      "--device-memory: devices sharing one host's memory (default: this "
                      "machine's devices)")


def add_checkpoints(p: argparse.ArgumentParser) -> None:
    """Where checkpoints go, how many stay, and what a resumed run may change."""
    ckpt = p.add_argument_group("checkpoints (docs/guides/checkpoints.md)")
    ckpt.add_argument("--checkpoint-dir", metavar="DIR", help="save sharded orbax "
                      "checkpoints here (at the end, and every --save-every)")
    ckpt.add_argument("--save-every", type=int, metavar="N",
                      help="also save every N steps (default: only at the end)")
    ckpt.add_argument("--keep", type=int, metavar="K", help="keep the last K (default 3)")
    ckpt.add_argument("--resume", action="store_true", help="continue from the latest "
                      "complete checkpoint in --checkpoint-dir, on any stage and device "
                      "count; --steps is the total to reach")
    ckpt.add_argument("--overwrite", action="store_true", help="start afresh in a "
                      "--checkpoint-dir that holds checkpoints, deleting them")
    ckpt.add_argument("--allow-other-data", action="store_true",
                      help="resume on another --data than the checkpoint was trained on")


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
    if args.nvme_memory and not args.device_memory:
        return "--nvme-memory plans layouts: pass it with --dry-run --device-memory --host-memory"
    for flag in ("device_memory", "host_memory", "nvme_memory"):
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
        self.compiling = False  # while XLA compiles, Python runs no handler until it returns
        self.wakeup: tuple[int, int] | None = None  # the C handler's pipe, and the old fd

    def __enter__(self) -> Stop:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in SIGNAL_EXIT}
            # The C-level handler writes each signal to this pipe at once, even while the main
            # thread is inside a compile: a thread answers then, not after the compile.
            read, write = os.pipe()
            os.set_blocking(write, False)
            self.wakeup = (write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            threading.Thread(target=self.acknowledge, args=(read,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.wakeup:
            signal.set_wakeup_fd(self.wakeup[1])
            os.close(self.wakeup[0])  # the thread reads the end of the pipe and returns

    def acknowledge(self, read: int) -> None:
        """Say at once that a signal during compilation was heard: the run stops when the
        compile returns, before any state exists, so there is nothing to save yet."""
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while data := pipe.read(16):
                if self.compiling and any(n in SIGNAL_EXIT for n in data):
                    name = signal.Signals(next(n for n in data if n in SIGNAL_EXIT)).name
                    print(f"\n{name} during compilation: stopping once it returns; nothing to "
                          "save yet", file=sys.stderr, flush=True)

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
    from zero_jax import distributed, supervise  # jax is imported from here on

    try:
        spec = distributed.settings(args.coordinator, args.num_processes, args.process_id,
                                    auto=args.distributed)
        if spec is not None and not supervise.attach():  # the worker runs as our child
            return supervise.run([sys.executable, os.path.abspath(__file__),
                                  *(sys.argv[1:] if argv is None else argv)],
                                 spec.get("process_id"), args.checkpoint_dir)
        if spec is not None:
            group = distributed.initialize(spec, args.peer_timeout)
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
    watchdog.checkpoints = args.checkpoint_dir  # named when a peer is lost
    supervise.track(lambda: (group.process_id, watchdog.reached, group.coordinator or "-"))
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
        from zero_jax.checkpoint import CheckpointError, quiet_background_errors
        from zero_jax.gpt import config as configs

        quiet_background_errors()  # a failed save is its one CheckpointError line below
        try:
            cfg = load_config(args)
            if problem := profile_window(args, cfg["train"]["steps"]):
                return fail(problem)
            local = {"coordinator", "num_processes", "process_id", "distributed"}
            distributed.agree("configuration", {"config": cfg, "arguments": {
                k: v for k, v in vars(args).items() if k not in local}}, args.peer_timeout)
            exp = build(cfg, args)
            if args.dry_run:
                return plan_layouts(exp, cfg, args) if args.device_memory else \
                    dry_run(exp, args)
            with find_start(exp, cfg, args) as start:
                return train(exp, cfg, args, start, stop, watchdog)
        except (configs.ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
            return fail(str(e))
        except OutputError as e:  # --report of a dry run
            return fail(str(e), 1)


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


def build(cfg: dict, args: argparse.Namespace):
    from zero_jax.gpt.experiment import Experiment, mesh_for

    return Experiment.build(cfg, mesh_for(cfg, args.devices))


@dataclasses.dataclass
class Start:
    """Where a run starts, found once before anything is compiled: its data, its checkpoint
    directory (locked), and the checkpoint it resumes from, if any."""

    tokens: object
    ckpts: object = None  # --checkpoint-dir's Checkpoints: where this run saves
    source: object = None  # the Checkpoints it resumes from (ckpts, or train.ckpt_load_path's)
    step: int | None = None  # the step it resumes from; None: a fresh initialization
    seed: int = 0  # of the data order: the checkpoint's when resuming
    records: list = dataclasses.field(default_factory=list)  # the metrics file, line by line
    overwrite: list[int] = dataclasses.field(default_factory=list)  # --overwrite deletes these
    corrupt: list[int] = dataclasses.field(default_factory=list)  # steps that did not read

    def __enter__(self) -> Start:
        return self

    def __exit__(self, *exc) -> None:
        for ckpts in {id(c): c for c in (self.ckpts, self.source) if c}.values():
            ckpts.close()


def find_start(exp, cfg: dict, args: argparse.Namespace) -> Start:
    """Data first, then checkpoints: a run refused for its data writes nothing. The state
    comes from --resume's latest checkpoint in --checkpoint-dir, else train.ckpt_load_path's
    latest, else a fresh initialization."""
    from zero_jax.checkpoint import Checkpoints
    from zero_jax.gpt import data

    m = exp.model
    tokens = data.load_tokens(args.data)
    data.check_tokens(tokens, m.vocab_size, m.seq_len, args.data or "the standard library corpus")
    start = Start(tokens, seed=cfg["train"]["seed"])
    try:
        if args.checkpoint_dir:
            start.ckpts = Checkpoints(args.checkpoint_dir, keep=args.keep)  # takes the lock
            if (steps := start.ckpts.steps()) and not args.resume:
                if not args.overwrite:
                    raise ValueError(
                        f"{start.ckpts.path} holds checkpoints of another run (steps "
                        f"{', '.join(map(str, steps))}): pass --resume to continue it, another "
                        "--checkpoint-dir, or --overwrite to delete them")
                start.overwrite = steps  # deleted once the run is known to start
        if args.resume:
            start.source, start.step = start.ckpts, start.ckpts.latest_step()
            if start.step is None:
                print(f"no checkpoint in {start.ckpts.path}: starting fresh")
        if (load := cfg["train"]["ckpt_load_path"]) and start.step is None:
            start.source = load_path(load)
            start.step = start.source.latest_step()
        if start.step is not None:
            start.step = readable_step(start, start.step, cfg, args, exp)
            if args.metrics and jax_primary() and os.path.exists(args.metrics):
                start.records = read_metrics(args.metrics)  # read now, before training
    except BaseException:
        start.__exit__()  # the lock: a refused run leaves the directory as it found it
        raise
    return start


def load_path(load: str):
    """train.ckpt_load_path's checkpoints, read only."""
    from zero_jax.checkpoint import Checkpoints

    try:
        source = Checkpoints(load, create=False, read_only=True)
    except ValueError as e:
        raise ValueError(f"train.ckpt_load_path: {e}") from e
    for step in source.foreign:
        warn(f"{source.path / str(step)} holds no zero_jax checkpoint: skipped")
    if source.latest_step() is None:
        raise ValueError(f"train.ckpt_load_path {source.path} holds no complete "
                         "checkpoint: point it at a --checkpoint-dir of an earlier run")
    return source


def readable_step(start: Start, newest: int, cfg: dict, args: argparse.Namespace, exp) -> int:
    """The newest step from ``newest`` down whose metadata reads and fits this run (its data
    seed taken); a corrupted one is reported, and moved aside once an older one restores."""
    from zero_jax.checkpoint import CorruptCheckpointError
    from zero_jax.gpt.experiment import check_compatible

    for step in reversed([s for s in start.source.steps()
                          if s <= newest and s not in start.corrupt]):
        try:
            meta = start.source.meta(step)
        except CorruptCheckpointError as e:
            set_aside(start, e)
            continue
        check_compatible(meta, cfg, exp.mesh.devices.flat[0].platform)
        saved = meta.get("data", {}).get("source")
        here = os.path.abspath(args.data) if args.data else None
        saved = os.path.abspath(saved) if saved else None
        if saved != here and not args.allow_other_data:
            raise ValueError(f"the checkpoint was trained on --data {saved or '(the default)'} "
                             f"but this run reads {here or '(the default)'}: pass the same "
                             "--data, or --allow-other-data to go on with other data")
        start.seed = meta["data"]["seed"]  # the data order goes on where it stopped
        return step
    raise ValueError(f"no checkpoint in {start.source.path} can be read (see the warnings "
                     "above): pass another --checkpoint-dir, or --overwrite without --resume")


def set_aside(start: Start, e) -> None:
    """Report a corrupted step; it is moved aside only once an older one has restored."""
    start.corrupt.append(e.step)
    older = [s for s in start.source.steps() if s < e.step and s not in start.corrupt]
    warn(f"{e}; " + (f"falling back to checkpoint {older[-1]}" if older
                     else "no older checkpoint"))


def restore(start: Start, target, cfg: dict, args: argparse.Namespace, exp):
    """The resume step's state, falling back past corrupted checkpoints, saying so."""
    from zero_jax.checkpoint import CorruptCheckpointError

    while True:
        tick = time.perf_counter()
        try:
            state, _ = start.source.restore(target, start.step)
        except CorruptCheckpointError as e:
            set_aside(start, e)
            start.step = readable_step(start, e.step - 1, cfg, args, exp)
            continue
        print(f"resumed from step {start.step} of {start.source.path} in "
              f"{time.perf_counter() - tick:.2f} s (digests checked in "
              f"{start.source.verify_s * 1e3:.0f} ms)")
        if start.source is start.ckpts:  # ours: the corrupted steps make way for new saves
            for bad in start.corrupt:
                warn(f"corrupted checkpoint {bad} moved aside to "
                     f"{start.ckpts.quarantine(bad)}")
        return state


def initial_state(start: Start, target, cfg: dict, args: argparse.Namespace, exp):
    """The state to train from: --overwrite's deletion done, then restored or initialized."""
    import jax

    from zero_jax.state import init_state

    if start.overwrite:
        start.ckpts.remove_all()
        print(f"--overwrite: deleted checkpoints {', '.join(map(str, start.overwrite))} in "
              f"{start.ckpts.path}")
    if start.step is not None:
        return restore(start, target, cfg, args, exp)
    return init_state(exp.plan, exp.init, exp.tx, jax.random.key(start.seed))


def jax_primary() -> bool:
    """Process 0 writes the report and metrics files."""
    import jax

    return jax.process_index() == 0


def compile_report(exp, state) -> tuple[dict, object]:
    """The step compiled for ``state`` (abstract arrays: nothing allocated), and its report."""
    from zero_jax import report
    from zero_jax.peak import compile_with_peak

    lowered = exp.step.lower(state, exp.batch_shape)
    compiled, peak = compile_with_peak(lowered)
    r = report.build(exp.plan, state, lowered, compiled, peak, exp.block_input)
    print(report.format_table(r))
    return r, compiled


class OutputError(Exception):
    """--metrics or --report could not be written (a full disk, say): one line, exit 1."""

    def __init__(self, flag: str, path: str, e: OSError):
        super().__init__(f"{flag} {path}: {e.strerror or e}")


def write_json(path: str | None, obj: dict) -> None:
    if path and jax_primary():
        try:
            with open(path, "w") as f:
                json.dump(obj, f, indent=1)
        except OSError as e:
            raise OutputError("--report", path, e) from None


def dry_run(exp, args: argparse.Namespace) -> int:
    """The report of the compiled step, and the flat stages side by side on the same mesh."""
    from zero_jax import report
    from zero_jax.state import abstract_state

    plan = exp.plan
    r, _ = compile_report(exp, abstract_state(plan, exp.tx))
    if plan.outer is None:
        r["stages"] = report.stages_table(plan, exp.tx)
        print("\n" + report.format_stages(r["stages"], r["n_params"], plan.dp_size))
    if args.plot and plan.outer is None:
        r["compiled_stages"] = compiled_stages(exp, r)
    write_json(args.report, r)
    draw(args, r)
    return 0


def compiled_stages(exp, r: dict) -> list[dict]:
    """For --plot's figures, every flat stage's step compiled with this run's other settings
    (``layouts.at_stage``), so that the stages compare on equal terms: this run's stage from its
    report ``r``, the others compiled here on abstract arrays, on the CPU with LLVM's
    optimizations off (the same buffers and collectives, in about 0.6x the time)."""
    from zero_jax import report
    from zero_jax.gpt import layouts
    from zero_jax.gpt.experiment import Experiment
    from zero_jax.state import abstract_state

    others = [s for s in range(4) if s != exp.plan.stage]
    print(f"\ncompiling stages {', '.join(map(str, others))} for the figures", flush=True)
    cpu = exp.mesh.devices.flat[0].platform == "cpu"
    rows = {exp.plan.stage: report.stage_summary(r)}
    for stage in others:
        try:
            e = Experiment.build(layouts.at_stage(exp.cfg, stage), exp.mesh)
        except ValueError as err:  # a setting not built at that stage: the figures go without
            print(f"  stage {stage} not compiled: {err}")
            continue
        state = abstract_state(e.plan, e.tx)
        lowered = e.step.lower(state, e.batch_shape)
        compiled = lowered.compile(FAST_COMPILE if cpu else None)
        rows[stage] = report.stage_summary(report.build(e.plan, state, lowered, compiled,
                                                        block_input=e.block_input))
    rows = [rows[s] for s in sorted(rows)]
    print(report.format_compiled(rows))
    return rows


def plan_layouts(exp, cfg: dict, args: argparse.Namespace) -> int:
    """The planner: every layout this config leaves open, compiled on abstract arrays, against
    --device-memory and --host-memory."""
    import jax

    from zero_jax import planner
    from zero_jax.gpt import layouts
    from zero_jax.peak import compile_with_peak
    from zero_jax.state import abstract_state

    if exp.plan.outer is not None:
        raise ValueError("the planner compares the flat stages; drop zero3_size")
    per_host, n = args.devices_per_host or jax.local_device_count(), exp.mesh.size

    def measure(layout: dict, c: dict):
        e = build(c, args)
        state = abstract_state(e.plan, e.tx)
        compiled, peak = compile_with_peak(e.step.lower(state, e.batch_shape))
        return planner.measure(layout, e.plan, state, compiled, peak)

    pairs = list(layouts.candidates(cfg, args.set, args.stage, args.tensor_parallel, per_host, n))
    rows = [measure(layout, c) for layout, c in pairs]
    # Prefetch holds a gathered layer more, gathering by block a block more than by module: a
    # stage 3 layout whose device does not fit is compiled again without prefetch, and by
    # module (where the command line left them open).
    for (layout, c), row in zip(pairs, list(rows), strict=True):
        if row.device > planner.HEADROOM * args.device_memory:
            for other in (layouts.without_prefetch(layout, c, args.set),
                          layouts.by_module(layout, c, args.set)):
                if other:
                    rows.append(measure(*other))
    fit = lambda row: planner.fits(row, args.device_memory, args.host_memory, per_host)
    for (layout, c), row in zip(pairs, rows[:len(pairs)], strict=True):  # T > 1 below stage 3
        while fit(row) and (lower := layouts.lower_stage(layout, c, args.stage)):
            layout, c = lower
            rows.append(row := measure(layout, c))
    off = cfg["zero"]["offload_optimizer"]
    if args.nvme_memory:  # the NVMe tier: the host-offload layouts, their state on the disk
        rows += [planner.on_nvme(r, int(off["buffer_count"] * off["buffer_mb"] * 2**20),
                                 per_host) for r in rows
                 if r.layout["offload"] in ("optimizer", "params")]
    fits = lambda: planner.choose(rows, args.device_memory, args.host_memory, per_host,
                                  args.nvme_memory or 0)
    best = fits()
    if best is None:  # ZeRO-Infinity's tiling, where a bound can cut the largest leaf
        for layout, c in layouts.tiled(cfg, args.set, args.stage, args.tensor_parallel,
                                       planner.largest_block_leaf_bytes(exp.plan)):
            with contextlib.suppress(ValueError):  # no tile of some leaf within this bound
                rows.append(measure(layout, c))
        best = fits()
    untried = layouts.untried(cfg, args.set, [r.layout for r in rows]) if best is None else []
    print(planner.format_table(rows, best, args.device_memory, args.host_memory, per_host,
                               exp.model.n_params, n, untried)
          + (f": {layouts.flags(best.layout)}" if best else ""))
    verdict = planner.as_json(rows, best, args.device_memory, args.host_memory, per_host, n)
    write_json(args.report, verdict)
    draw(args, verdict)
    return 0


def draw(args: argparse.Namespace, r: dict, records: list[dict] | None = None) -> None:
    """--plot: the figures of the report (or the planner's) and of the metrics; a resumed
    run's curves from its whole metrics file."""
    if not (args.plot and jax_primary()):
        return
    import jax

    from zero_jax import plot

    if args.metrics and records is not None and os.path.exists(args.metrics):
        records = plot.read_records(args.metrics)
    stats = jax.devices()[0].memory_stats() or {}
    paths = plot.draw(r, records, args.plot, stats.get("bytes_limit"))
    print(f"figures: {', '.join(p.name for p in paths if p.suffix == '.png')} in {args.plot}")


class Hook:
    """Told before step ``n`` runs, called with its results (``n, state, metrics, record``),
    closed at the end."""

    def before(self, n: int) -> None:
        pass

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsFile(Hook):
    """A hook: one strict-JSON line per step, line-buffered. On resume, the records after
    ``first`` (from a run that went further than its last checkpoint) are dropped, since they
    are trained again."""

    def __init__(self, path: str, first: int, records: list[tuple[int, str]]):
        p = pathlib.Path(path)
        if first and p.exists():
            keep = "".join(line for step, line in records if step <= first)
            tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")  # a kill leaves the old file
            tmp.write_text(keep)
            os.replace(tmp, p)
        self.file = open(p, "a" if first else "w", buffering=1)
        self.path, self.failed = path, False

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        try:
            self.file.write(json.dumps(finite_record(record), allow_nan=False) + "\n")
        except OSError as e:
            self.failed = True
            raise OutputError("--metrics", self.path, e) from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError as e:  # the line that failed is flushed again: said already
            if not self.failed:
                raise OutputError("--metrics", self.path, e) from None


class Saver(Hook):
    """A hook: save at --save-every, at the last step and on a stop signal, unless the
    divergence guard is in a streak of bad steps; report finished saves."""

    def __init__(self, ckpts, every: int, last: int, stop: Stop, guard: Guard, bar, meta,
                 whole=lambda state: state):
        self.ckpts, self.every, self.last, self.stop = ckpts, every, last, stop
        self.guard, self.bar, self.meta = guard, bar, meta
        self.whole = whole  # the state to save: with the NVMe tier, read back from its files
        self.saved: int | None = None  # the newest step saved
        self.n, self.state = None, None  # the newest step trained, for a stop signal's save

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        self.n, self.state = n, state
        if (self.every and n % self.every == 0) or n == self.last or self.stop.signum:
            self.save()
        if done := self.ckpts.poll():
            self.bar.write(str(done))

    def save(self) -> None:
        if self.saved != self.n and self.guard.bad_from is None:
            self.ckpts.save(self.whole(self.state), self.meta(self.n))
            self.saved = self.n
            self.bar.write(f"saving checkpoint {self.n} (training goes on)")

    def finish(self, force: bool = False) -> None:
        """Wait for the saves in flight. A stop signal that came after this step's check (in
        the poll, say) still saves the step: the loop then stops before training another; so
        does ``force`` (an output that failed)."""
        if (self.stop.signum or force) and self.n is not None:
            self.save()
        if done := self.ckpts.finish():
            self.bar.write(str(done))
        self.state = None


class Tally(Hook):
    """A hook: the losses, the skipped steps, the throughput so far (the progress bar's and the
    summary's figure alike), and the records for --plot's curves (kept only for them: a long
    run's records add up). Without a terminal (output to a file), a plain line every tenth of
    the run instead of the bar's redrawn one."""

    def __init__(self, bar, tokens_per_step: int, keep_records: bool = False):
        self.bar, self.losses, self.skipped = bar, [], 0
        self.records: list[dict] | None = [] if keep_records else None
        self.tokens_per_step, self.tokens_per_s = tokens_per_step, 0.0
        self.start = time.perf_counter()
        self.every = max(1, (bar.total - bar.n) // 10) if bar.disable and jax_primary() else 0

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        self.losses.append(m["loss"])
        self.skipped += m["skipped"]
        if self.records is not None:
            self.records.append(finite_record(record))
        self.tokens_per_s = len(self.losses) * self.tokens_per_step / (
            time.perf_counter() - self.start)
        self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{self.tokens_per_s:,.0f}")
        if self.every and (len(self.losses) % self.every == 0 or n == self.bar.total):
            print(f"step {n}/{self.bar.total}: loss {m['loss']:.3f}, "
                  f"{self.tokens_per_s:,.0f} tokens/s", flush=True)


class TensorBoard(Hook):
    """A hook: each step's record as TensorBoard scalars, the report's headline as text."""

    def __init__(self, directory: str, first: int, r: dict):
        from tensorboardX import SummaryWriter

        # A resumed run hides the old events past its checkpoint (trained again).
        self.writer = SummaryWriter(directory, purge_step=first + 1 if first else None,
                                    flush_secs=10)
        self.writer.add_text("report", headline(r), first)

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(f"train/{key}", value, n)

    def close(self) -> None:
        self.writer.close()


class Profile(Hook):
    """A hook: a JAX profiler trace around --profile-steps, beside the step's compiled HLO."""

    def __init__(self, directory: str, window: tuple[int, int], compiled, write=print):
        self.dir, self.window, self.write = pathlib.Path(directory), window, write
        self.tracing = False
        self.dir.mkdir(parents=True, exist_ok=True)
        # The trace's events are named by the program's instructions: the HLO says what each
        # one is (all_gather.3 -> an all-gather of which shapes, in which loop).
        (self.dir / "train_step.hlo.txt").write_text(compiled.as_text())

    def before(self, n: int) -> None:
        if n == self.window[0]:
            import jax

            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.tracing = True

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        if self.tracing and n == self.window[1] - 1:
            self.close()

    def close(self) -> None:
        """Also when a run stops inside the window: what was traced is kept."""
        if not self.tracing:
            return
        import jax

        self.tracing = False
        jax.profiler.stop_trace()
        a, b = self.window
        self.write(f"profile of steps {a}-{b - 1} in {self.dir} (open it with TensorBoard's "
                   "profile plugin, or its perfetto_trace.json.gz in ui.perfetto.dev)")


def compile_checked(exp, target, stop: Stop, figures: bool = False):
    """``(report, compiled step)``, or the exit code: a signal during the compile (nothing
    restored or initialized yet, nothing written), or a model that cannot fit. ``figures``:
    the stages the figures compare too, in the report (``stages``, ``compiled_stages``)."""
    from zero_jax import fit, report

    stop.compiling = True  # before the line that says so: a signal after it is answered
    print("compiling the train step", flush=True)
    try:
        r, step = compile_report(exp, target)
        problem = fit.check(step, list(exp.mesh.devices.flat))
        if figures and not problem and exp.plan.outer is None:
            r["stages"] = report.stages_table(exp.plan, exp.tx)
            r["compiled_stages"] = compiled_stages(exp, r)
    finally:
        stop.compiling = False
    if stop.signum:
        print(f"stopped by {signal.Signals(stop.signum).name} during compilation: nothing "
              "trained, nothing saved", file=sys.stderr)
        return SIGNAL_EXIT[stop.signum]
    if problem:
        return fail(f"{problem}: use {'a higher --stage, ' * (exp.plan.stage < 3)}"
                    "precision.param_dtype=bf16, zero.offload_grads, a smaller model or "
                    "train.batch_size, or --dry-run to see the report")
    return r, step


def train(exp, cfg: dict, args: argparse.Namespace, start: Start, stop: Stop,
          watchdog=None) -> int:
    """Compile, check the fit, start (restore or initialize), then the loop and its hooks."""
    from zero_jax import nvme
    from zero_jax.checkpoint import CheckpointError
    from zero_jax.state import abstract_state

    t = cfg["train"]
    target = abstract_state(exp.plan, exp.tx)
    compiled = compile_checked(exp, target, stop, figures=bool(args.plot))
    if isinstance(compiled, int):
        return compiled
    r, step = compiled
    state = initial_state(start, target, cfg, args, exp)
    first = int(state.step)
    try:
        write_json(args.report, r)
    except OutputError as e:
        return fail(f"{e}; stopped before training (at step {first})", 1)
    if first >= t["steps"]:
        print(f"nothing to do: the checkpoint is at step {first} and --steps is {t['steps']}")
        return 0
    guard = Guard(t["max_bad_steps"], cfg["precision"]["min_loss_scale"])
    bar, rows = progress(exp, t["steps"], first)
    tally, saver = Tally(bar, exp.tokens_per_step, keep_records=bool(args.plot)), None
    hooks: list[Hook] = [tally]
    if start.ckpts:  # before the outputs: a step whose record cannot be written is saved
        hooks.append(saver := Saver(start.ckpts, args.save_every, t["steps"], stop, guard,
                                    bar, lambda n: checkpoint_meta(exp, cfg, args, start.seed,
                                                                   n), whole_state(step, target)))
    if args.metrics and jax_primary():
        hooks.append(MetricsFile(args.metrics, first, start.records))
    if args.tensorboard and jax_primary():
        hooks.append(TensorBoard(args.tensorboard, first, r))
    if args.profile and jax_primary():
        hooks.append(Profile(args.profile, args.profile_steps, step, bar.write))
    tick, done_steps = time.perf_counter(), first
    try:
        done_steps = loop(exp, step, state, start, t, bar, rows, hooks, guard, stop, watchdog)
        if saver:
            saver.finish()
    except (CheckpointError, nvme.NvmeError) as e:
        if watchdog:  # a save's collective that failed: a lost peer is named by the watchdog
            watchdog.settle(e)
        return fail(str(e), 1)
    except OutputError as e:
        return output_failed(e, saver, first + len(tally.losses))
    finally:
        bar.close()
        for hook in hooks:
            hook.close()
    draw(args, r, tally.records)
    saved = saver.saved if saver else None
    if stop.signum:
        return stopped(stop, done_steps, saved, start.ckpts, guard.bad_from)
    if guard.streak_from is not None:  # max_bad_steps in a row, or the run ended in a streak
        return diverged(t["max_bad_steps"], guard, done_steps, start.ckpts)
    return done(t["steps"], first, tally, time.perf_counter() - tick,
                f"checkpoint {saved} in {start.ckpts.path}" if saved else
                newest_checkpoint(start.ckpts, "from before this run"))


def whole_state(step, target):
    """What a checkpoint saves of a trained state: itself, or with the NVMe tier, the state
    with its master and optimizer state read back from the files (laid out as ``target``)."""
    tier = getattr(step, "tier", None)
    return (lambda state: state) if tier is None else (lambda state: tier.give(state, target))


def loop(exp, step, state, start: Start, t: dict, bar, rows, hooks: list, guard: Guard,
         stop: Stop, watchdog) -> int:
    """Train until the last step, a stop signal or the divergence guard; each step's results
    go to every hook. Returns the last step trained."""
    done_steps = int(state.step)
    for i in bar:
        if stop.signum:
            break
        batch = make_batch(exp, start, t["batch_size"], i, rows)
        if watchdog:
            watchdog.reach(i + 1)
        for hook in hooks:
            hook.before(i + 1)
        state, m, record = timed(exp, step, state, batch, i + 1)
        done_steps = i + 1
        stop_now = guard.update(m, i + 1)
        for hook in hooks:
            hook(i + 1, state, m, record)
        if stop_now:
            break
    return done_steps


def output_failed(e: OutputError, saver: Saver | None, step: int) -> int:
    """A --metrics write that failed mid-run: the step trained is saved (unless the
    divergence guard forbids it), then one line and exit 1."""
    from zero_jax.checkpoint import CheckpointError

    what = ""
    if saver:
        try:
            saver.finish(force=True)
            if saver.saved == step:
                what = f"; checkpoint {step} saved in {saver.ckpts.path}"
        except CheckpointError as c:
            what = f"; {c}"
    return fail(f"{e}; stopped after step {step}{what}", 1)


def progress(exp, steps: int, first: int):
    """The progress bar over the steps left, and this process's rows of each batch."""
    from tqdm import tqdm

    from zero_jax import distributed

    bar = tqdm(range(first, steps), desc=f"stage {exp.plan.stage}", unit="step",
               mininterval=0.5, initial=first, total=steps,
               disable=not (jax_primary() and sys.stderr.isatty()))
    return bar, distributed.local_rows(exp.batch_sharding, exp.batch_shape.shape)


def make_batch(exp, start: Start, batch_size: int, i: int, rows):
    """Batch ``i`` as a global array, this process building only its ``rows``."""
    from zero_jax import distributed
    from zero_jax.gpt import data

    return distributed.global_array(exp.batch_sharding, exp.batch_shape.shape, data.batch(
        start.tokens, i, batch_size, exp.model.seq_len, start.seed, rows))


def timed(exp, step, state, batch, n: int):
    """Step ``n``, waited for: the new state, its metrics as numbers, the metrics record."""
    tick = time.perf_counter()
    state, m = step(state, batch)
    m = {k: float(v) for k, v in m.items()}  # waits for the step
    m["skipped"] = int(m["skipped"])
    tps = exp.tokens_per_step / (time.perf_counter() - tick)
    return state, m, {"step": n, **m, "tokens_per_s": tps}


def done(steps: int, first: int, tally: Tally, elapsed: float, saved: str) -> int:
    import numpy as np

    losses = tally.losses
    last = min(10, len(losses))
    print(f"done: steps {first + 1}-{steps} in {elapsed:.1f} s, loss {losses[0]:.3f} -> "
          f"{float(np.mean(losses[-last:])):.3f} (mean of last {last}), "
          f"{tally.tokens_per_s:,.0f} tokens/s"
          + (f", {tally.skipped} steps skipped (gradient not finite)" if tally.skipped else "")
          + f"; {saved}")
    return 0


def newest_checkpoint(ckpts, when: str = "from before it") -> str:
    if not ckpts:
        return "nothing was saved (no --checkpoint-dir)"
    if (newest := ckpts.latest_step()) is None:
        return f"no checkpoint is in {ckpts.path}"
    return f"the newest checkpoint, {when}, is {newest} in {ckpts.path}"


def diverged(max_bad: int, guard: Guard, step: int, ckpts) -> int:
    """The divergence guard's one line: which steps, the last good one, what is kept."""
    bad_from, n = guard.streak_from, step - guard.streak_from + 1
    why = ("its update went in" if n < max_bad and guard.diverged
           else "the run ended in it" if not guard.diverged
           else f"train.max_bad_steps is {max_bad}")
    good = (f"the last step with a finite loss was {guard.last_finite}" if guard.last_finite
            else "no step of this run had a finite loss")
    fix = "with a lower optimizer.lr, or a larger optimizer.warmup_steps"
    if not max_bad:  # the guard off: the run went on to its last step, and saved as it went
        newest = newest_checkpoint(ckpts, "saved as it went")
        kept = f"train.max_bad_steps 0 kept it going, {newest}: train again from before step " \
               f"{bad_from} {fix}"
    else:
        kept = f"nothing saved since, {newest_checkpoint(ckpts)}: resume from it {fix}"
    print(f"error: {PROCESS}training diverged: step{'s' if n > 1 else ''} "
          f"{bad_from}{f'-{step}' if n > 1 else ''} had a non-finite loss or gradient "
          f"({n} in a row; {why}); {good}; {kept}", file=sys.stderr)
    return DIVERGED


def stopped(stop: Stop, step: int, saved: int | None, ckpts, bad_from: int | None) -> int:
    name = signal.Signals(stop.signum).name
    if saved == step:
        what = f"checkpoint {step} saved in {ckpts.path}; continue with --resume"
    elif bad_from is not None:
        what = (f"not saved: steps {bad_from}-{step} had a non-finite loss or gradient; "
                f"{newest_checkpoint(ckpts)}")
    elif ckpts:
        what = "nothing new to save"
    else:
        what = "not saved (no --checkpoint-dir)"
    print(f"stopped by {name} after step {step}: {what}", file=sys.stderr)
    return SIGNAL_EXIT[stop.signum]


def checkpoint_meta(exp, cfg: dict, args: argparse.Namespace, seed: int, step: int) -> dict:
    """What a checkpoint needs besides arrays to resume exactly and to be checked."""
    plan = exp.plan
    source = os.path.abspath(args.data) if args.data else None
    return {"config": cfg,
            "data": {"source": source, "seed": seed, "next_batch": step},
            "writer": {"stage": plan.stage, "devices": plan.mesh.size,
                       "processes": len({d.process_index for d in plan.mesh.devices.flat}),
                       "platform": plan.mesh.devices.flat[0].platform}}


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
    train.max_bad_steps long, or at once when a bad step's update went in; nothing is saved
    while a streak lasts, so the newest checkpoint is from before it. Off (0), it stops and
    holds back nothing, but a run that ends in a streak is still not reported done."""

    def __init__(self, max_bad: int, min_loss_scale: float):
        self.max_bad, self.min_loss_scale = max_bad, min_loss_scale
        self.streak_from: int | None = None  # the first step of the current streak
        self.last_finite: int | None = None  # the last step with a finite loss
        self.diverged = False

    @property
    def bad_from(self) -> int | None:
        """The streak that holds back saves: none with the guard off."""
        return self.streak_from if self.max_bad > 0 else None

    def update(self, m: dict, step: int) -> bool:
        """Record step ``step``'s metrics; whether to stop now."""
        if math.isfinite(m["loss"]):
            self.last_finite = step
        bad = bad_step(m, self.min_loss_scale)
        self.streak_from = (self.streak_from or step) if bad else None
        self.diverged = self.bad_from is not None and (
            step + 1 - self.bad_from >= self.max_bad or not m["skipped"])
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
