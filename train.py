"""Train a GPT with ZeRO stage 0-3 on every device there is: `python train.py --stage 3`.

With no accelerator the CPU is split into simulated devices (8 unless --devices says
otherwise), so every shard is its own buffer and every collective really runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import signal
import sys
import tempfile
import time
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where they are used: jax loads after the arguments are checked
    from zero_jax.loop import Checkpointer, DivergenceGuard, OutputError, Preemption

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
        "0 the run goes on and saves, and exits 3 if it ends in such steps; 130 / 143 / 129 "
        "stopped by Ctrl-C / SIGTERM / SIGHUP (saved as it stopped)"))
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
    p.add_argument("--init-from", metavar="DIR", help="start from a Hugging Face GPT-2 or "
                   "Llama directory's weights (config.json, safetensors; docs/guides/weights.md)")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := check_args(args) or check_observability(args):
        return fail(problem)
    from zero_jax.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices or 8)
    from zero_jax import distributed, supervise  # jax is imported from here on

    # make_plan's warning for a loop of one's own: the report below says it for this one.
    warnings.filterwarnings("ignore", "stage 3 gathers .* once per step", UserWarning)

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
    from zero_jax.loop import OutputError, Preemption

    with Preemption(enabled=not args.dry_run) as stop:  # a dry run has nothing to save
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
            exp = build(cfg, args)  # with the NVMe tier, its directory locked: see tier_closed
            with tier_closed(exp):
                if args.dry_run:
                    return plan_layouts(exp, cfg, args) if args.device_memory else \
                        dry_run(exp, args)
                with find_start(exp, cfg, args) as start:
                    return train(exp, cfg, args, start, stop, watchdog)
        except (configs.ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
            return fail(str(e))
        except OutputError as e:  # --report of a dry run
            return fail(str(e), 1)


@contextlib.contextmanager
def tier_closed(exp):
    """The NVMe tier's directory released when the run ends, also when ``main`` is called in
    a process that goes on (the process's exit would release it)."""
    try:
        yield
    finally:
        if tier := getattr(exp.step, "tier", None):
            tier.close()


def load_config(args: argparse.Namespace) -> dict:
    """The config: --config's file, then --deepspeed-config's keys (the mapping printed), then
    --set, then the flags that stand for keys (--stage, --steps, ...)."""
    from zero_jax.gpt import config as configs

    overrides = list(args.set)
    if args.init_from:  # the model section from config.json, before --set
        from zero_jax.gpt import hf

        overrides = hf.config_overrides(args.init_from) + overrides
    for flag, key in [("stage", "zero.stage"), ("steps", "train.steps"),
                      ("seed", "train.seed"), ("zero3_size", "zero.zero3_size"),
                      ("tensor_parallel", "mesh.tensor_parallel")]:
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if args.deepspeed_config:
        import jax

        from zero_jax.gpt import deepspeed

        # The run's own config: what "auto" takes. DeepSpeed's batch sizes count per
        # data-parallel device.
        run = configs.merge(args.config, overrides)
        tp = max(1, run["mesh"]["tensor_parallel"])
        mapped, lines = deepspeed.translate(deepspeed.read(args.deepspeed_config),
                                            (args.devices or jax.device_count()) // tp,
                                            args.deepspeed_config, run)
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

    exp = Experiment.build(cfg, mesh_for(cfg, args.devices))
    if args.init_from:  # its tensors checked against the model before anything is written
        from zero_jax.gpt import hf

        hf.load(exp.plan, args.init_from, check_only=True)
    return exp


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
    if args.init_from:
        from zero_jax.gpt import hf

        return init_state(exp.plan, hf.load(exp.plan, args.init_from), exp.tx)
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


def write_json(path: str | None, obj: dict) -> None:
    from zero_jax.loop import OutputError

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
    """The planner: the layouts this config leaves open that can change the answer, compiled on
    abstract arrays, against --device-memory and --host-memory (``zero_jax.gpt.sweep``)."""
    import jax

    from zero_jax import planner
    from zero_jax.gpt import layouts, sweep
    from zero_jax.peak import compile_with_peak

    if exp.plan.outer is not None:
        raise ValueError("the planner compares the flat stages; drop zero3_size")
    per_host, n = args.devices_per_host or jax.local_device_count(), exp.mesh.size

    def measure(e, state, layout: dict):
        compiled, peak = compile_with_peak(e.step.lower(state, e.batch_shape))
        return planner.measure(layout, e.plan, state, compiled, peak)

    machine = sweep.Machine(args.device_memory, args.host_memory, per_host, args.nvme_memory or 0)
    search = sweep.Search(cfg, args.set, args.stage, args.tensor_parallel, n, machine,
                          lambda c: build(c, args), measure,
                          planner.largest_block_leaf_bytes(exp.plan))
    best = search.run()
    rows = search.rows + search.nvme
    untried = layouts.untried(cfg, args.set, [r.layout for r in rows]) if best is None else []
    print(("\n" + search.summary() if search.summary() else "") + "\n"
          + planner.format_table(rows, best, args.device_memory, args.host_memory, per_host,
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


class Tally:
    """A hook: the losses, the skipped steps, the throughput so far (the progress bar's and the
    summary's figure alike), and the records for --plot's curves (kept only for them: a long
    run's records add up). Without a terminal (output to a file), a plain line every tenth of
    the run instead of the bar's redrawn one."""

    def __init__(self, bar, tokens_per_step: int, keep_records: bool = False):
        from zero_jax.loop import finite_record

        self.bar, self.losses, self.skipped, self.finite = bar, [], 0, finite_record
        self.records: list[dict] | None = [] if keep_records else None
        self.tokens_per_step, self.tokens_per_s = tokens_per_step, 0.0
        self.start = time.perf_counter()
        self.every = max(1, (bar.total - bar.n) // 10) if bar.disable and jax_primary() else 0

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        self.losses.append(m["loss"])
        self.skipped += m["skipped"]
        if self.records is not None:
            self.records.append(self.finite(record))
        self.tokens_per_s = len(self.losses) * self.tokens_per_step / (
            time.perf_counter() - self.start)
        self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{self.tokens_per_s:,.0f}")
        if self.every and (len(self.losses) % self.every == 0 or n == self.bar.total):
            print(f"step {n}/{self.bar.total}: loss {m['loss']:.3f}, "
                  f"{self.tokens_per_s:,.0f} tokens/s", flush=True)

    def before(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def compile_checked(exp, target, stop: Preemption, figures: bool = False):
    """``(report, compiled step)``, or the exit code: a signal during the compile (nothing
    restored or initialized yet, nothing written), or a model that cannot fit. ``figures``:
    the stages the figures compare too, in the report (``stages``, ``compiled_stages``)."""
    from zero_jax import fit, report
    from zero_jax.loop import SIGNAL_EXIT

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


def train(exp, cfg: dict, args: argparse.Namespace, start: Start, stop: Preemption,
          watchdog=None) -> int:
    """Compile, check the fit, start (restore or initialize), then the loop and its hooks."""
    from zero_jax import nvme
    from zero_jax.checkpoint import CheckpointError
    from zero_jax.loop import Checkpointer, DivergenceGuard, OutputError
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
    guard = DivergenceGuard(t["max_bad_steps"], cfg["precision"]["min_loss_scale"], warn)
    bar, rows = progress(exp, t["steps"], first)
    tally, saver = Tally(bar, exp.tokens_per_step, keep_records=bool(args.plot)), None
    if start.ckpts:  # before the outputs: a step whose record cannot be written is saved
        saver = Checkpointer(start.ckpts, args.save_every, t["steps"], stop, guard,
                             lambda n: checkpoint_meta(exp, cfg, args, start.seed, n),
                             whole_state(step, target), bar.write)
    hooks = [tally, *([saver] if saver else []), *outputs(args, start, r, step, first, bar)]
    tick, done_steps = time.perf_counter(), first
    try:
        done_steps = loop(exp, step, state, start, t, bar, rows, hooks, guard, stop, watchdog)
        if saver:
            saver.finish()
    except (CheckpointError, nvme.NvmeError) as e:
        if watchdog:  # a save's collective that failed: a lost peer is named by the watchdog
            watchdog.settle(e)
        return fail(tier_failed(e, saver) if isinstance(e, nvme.NvmeError) else str(e), 1)
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


def outputs(args: argparse.Namespace, start: Start, r: dict, step, first: int, bar) -> list:
    """The hooks that write the run's files (process 0's): --metrics, --tensorboard,
    --profile."""
    from zero_jax.loop import MetricsFile, Profile, TensorBoard

    if not jax_primary():
        return []
    hooks = [MetricsFile(args.metrics, first, start.records, "--metrics")] if args.metrics \
        else []
    if args.tensorboard:
        hooks.append(TensorBoard(args.tensorboard, first, headline(r)))
    if args.profile and args.profile_steps[0] <= first:  # a resumed run: never reached
        a, b = args.profile_steps
        warn(f"--profile-steps {a}:{b} starts at step {a}, but this run resumes after step "
             f"{first}: nothing is traced; pass --profile-steps A:B with A above {first}")
    if args.profile:
        hooks.append(Profile(args.profile, args.profile_steps, step, bar.write))
    return hooks


def tier_failed(e, saver: Checkpointer | None) -> str:
    """The NVMe tier's files failed or were damaged: the saves in flight (all read back, and
    checked, before it) are finished, and the line says where to resume from."""
    from zero_jax.checkpoint import CheckpointError

    if saver is None:
        return f"{e}; {newest_checkpoint(None)}"
    try:
        saver.ckpts.finish()
    except CheckpointError as c:
        return f"{e}; {c}"
    return f"{e}; {newest_checkpoint(saver.ckpts)}: continue from it with --resume"


def whole_state(step, target):
    """What a checkpoint saves of a trained state: itself, or with the NVMe tier, the state
    with its master and optimizer state read back from the files (laid out as ``target``)."""
    tier = getattr(step, "tier", None)
    return (lambda state: state) if tier is None else (lambda state: tier.give(state, target))


def loop(exp, step, state, start: Start, t: dict, bar, rows, hooks: list,
         guard: DivergenceGuard, stop: Preemption, watchdog) -> int:
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


def output_failed(e: OutputError, saver: Checkpointer | None, step: int) -> int:
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


def diverged(max_bad: int, guard: DivergenceGuard, step: int, ckpts) -> int:
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


def stopped(stop: Preemption, step: int, saved: int | None, ckpts,
            bad_from: int | None) -> int:
    from zero_jax.loop import SIGNAL_EXIT

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


def warn(message: str) -> None:
    print(f"warning: {PROCESS}{message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
