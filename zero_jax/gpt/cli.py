"""train.py's flags: parsed, and checked before anything is built or written, then turned
into the config."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import tempfile

from zero_jax.safetensors_writer import not_a_save

DESCRIPTION = "Train a GPT with ZeRO stage 0-3 on every device there is: train.py --stage 3"
MAX_DEVICES = 4096  # --devices: more than any data axis here; XLA aborts on absurd CPU counts
SEEDS = 2**32  # jax.random.key keeps a seed's low 32 bits (no x64): larger ones would collide


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, as for every bad input
        sys.exit(fail(message))


def process() -> str:
    """``"[process i] "`` once several processes run: every error names its process."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return ""
    return f"[process {jax.process_index()}] "


def fail(message: str, code: int = 2) -> int:
    print(f"error: {process()}{message}", file=sys.stderr)
    return code


# The library's arguments its refusals name, as a train.py user sets them: a refusal naming the
# first gets the second beside it (the library speaks of its own API, never of these flags).
AS_SET = (("tile_mb", "zero.tile_mb"), ("layers=", "zero.transformer_layers"),
          ("accum_steps", "train.accum_steps"), ("bucket_bytes", "zero.bucket_mb"),
          ("min_shard_elems", "zero.min_shard_elems"), ("prefetch", "zero.prefetch"),
          ("partition=True", "zero.partition_activations"), ("gather=", "zero.gather"),
          ("Offload(", "zero.offload_optimizer"), ("pass devices", "--devices"),
          ("keep=", "--keep"))


def in_flags(message: str) -> str:
    """A library refusal with the config keys and flags that set what it names."""
    named = [key for phrase, key in AS_SET if phrase in message and key not in message]
    return f"{message} (train.py: {', '.join(named)})" if named else message


def warn(message: str) -> None:
    print(f"warning: {process()}{message}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from zero_jax.gpt.config import CONFIG_DIR  # every run reads a config next

    shipped = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    p = Parser(description=DESCRIPTION, epilog=(
        "exit codes: 0 done; 1 a failure while running (a checkpoint that cannot be written, a "
        "lost peer); 2 bad input, refused before anything is written; 3 training diverged: "
        "train.max_bad_steps steps in a row (default 5) had a non-finite loss or gradient, or "
        "one such step's update went in, and nothing was saved from the first of them on; with "
        "0 the run goes on and saves, and exits 3 if it ends in such steps; 130 / 143 / 129 "
        "stopped by Ctrl-C / SIGTERM / SIGHUP (saved as it stopped)"))
    p.add_argument("--stage", type=int, help="ZeRO stage 0-3 (default: the config's, 3)")
    p.add_argument("--config", default="tiny",
                   help=f"YAML file, or a name in configs/: {shipped}")
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
    p.add_argument("--data", help="text file, .jsonl of {\"text\": ...} records, or a directory "
                   "of them (bytes as ids, or with --init-from its tokenizer.json's ids), .bin of "
                   "uint16 or .npy of token ids (default: the Python standard library's sources)")
    p.add_argument("--eval-data", metavar="FILE", help="evaluate on this file (as --data "
                   "reads it) every train.eval_every steps, training on all of --data (default: "
                   "--data's last tenth, held out)")
    p.add_argument("--metrics", help="write one JSON object per step to this file")
    p.add_argument("--report", help="write the memory/communication report as JSON here")
    p.add_argument("--init-from", metavar="DIR", help="start from a Hugging Face GPT-2, Llama, "
                   "Mistral, Qwen2, Qwen3 or Phi-3 directory's weights (config.json, safetensors; "
                   "docs/guides/weights.md), or a Hub model id (org/name) downloaded into the "
                   "Hub's cache (zero_jax[hf])")
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
    ckpt.add_argument("--save-safetensors", metavar="DIR", help="at each --save-every and at "
                      "the end, DIR holds the latest parameters as a Hugging Face directory "
                      "(config.json, model.safetensors), each process writing its own shards "
                      "(docs/guides/weights.md)")
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
            ("--eval-data", args.eval_data, "a file or directory, or leave it out"),
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
    if problem := check_outputs(args):
        return problem
    args.save_every = 0 if args.save_every is None else args.save_every
    args.keep = 3 if args.keep is None else args.keep
    return None


def check_outputs(args: argparse.Namespace) -> str | None:
    """--metrics, --report and --save-safetensors: writable, and not over each other."""
    if args.metrics and args.report and same_file(args.metrics, args.report):
        return (f"--metrics and --report both name {args.metrics}: each would overwrite the "
                "other; pass two files")
    for flag, path in [("--metrics", args.metrics), ("--report", args.report)]:
        if path and (problem := unwritable(path)):
            return f"{flag} {path} {problem}"
    if (out := args.save_safetensors) is None:
        return None
    if not out.strip():
        return f"--save-safetensors {out!r} names nothing: pass a directory"
    if problem := unwritable_dir(out):
        return f"--save-safetensors {out} {problem}"
    ckpt = args.checkpoint_dir and os.path.realpath(args.checkpoint_dir)
    if ckpt and (os.path.realpath(out) == ckpt or ckpt in map(
            str, pathlib.Path(os.path.realpath(out)).parents)):
        return (f"--save-safetensors {out} is inside --checkpoint-dir {args.checkpoint_dir}: "
                "pass a directory outside it")
    if ckpt and os.path.realpath(out) in map(str, pathlib.Path(ckpt).parents):
        return (f"--save-safetensors {out} holds --checkpoint-dir {args.checkpoint_dir}, which "
                "each save there would delete: pass a directory outside it")
    if problem := not_a_save(out):
        return f"--save-safetensors {problem}"
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


def load_config(args: argparse.Namespace) -> dict:
    """The config: --config's file, then --deepspeed-config's keys (the mapping printed), then
    --set, then the flags that stand for keys (--stage, --steps, ...)."""
    from zero_jax.gpt import config as configs

    if args.zero3_size == "local":  # one group per process
        import jax

        args.zero3_size = jax.local_device_count()
    elif args.zero3_size is not None:
        try:
            args.zero3_size = int(args.zero3_size)
        except ValueError:
            raise ValueError(f"--zero3-size must be a number of devices or 'local' (got "
                             f"{args.zero3_size!r})") from None
    overrides = list(args.set)
    if args.init_from:  # the model section from config.json, before --set
        from zero_jax.gpt import hf

        args.init_from = hub_directory(args.init_from, configs.ConfigError)
        overrides = hf.config_overrides(args.init_from) + overrides
        window_notice(args, hf.read_config(args.init_from))
        if rates := hf.dropout(args.init_from):
            print(f"--init-from {args.init_from}: its config.json sets "
                  f"{', '.join(f'{k} {v:g}' for k, v in rates.items())}; the demo's models "
                  "train without dropout", flush=True)
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


# A Hugging Face Hub model id, org/name (a path that does not exist here)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_directory(source: str, error: type[Exception]) -> str:
    """--init-from's directory: ``source`` itself, or for a Hub model id where no such path
    exists, the snapshot ``huggingface_hub`` downloads into its cache (config, safetensors and
    tokenizer files only; fetched once, then read from the cache; ``HF_HUB_OFFLINE=1``: the
    cache alone). ``error``: raised with one line where it cannot."""
    if os.path.exists(source) or not HUB_ID.fullmatch(source):
        return source
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise error(f"--init-from {source} is no directory here; reading it from the Hugging "
                    "Face Hub needs huggingface_hub: pip install 'zero_jax[hf]'") from None
    try:
        return snapshot_download(source, allow_patterns=["*.json", "*.safetensors",
                                                         "tokenizer.model"])
    except Exception as e:  # the Hub's errors: not found, gated, offline, network
        why = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]
        raise error(f"--init-from {source} is no directory here, and the Hugging Face Hub did "
                    f"not give it ({type(e).__name__}: {why}): pass a local directory, or a "
                    "model id the Hub has (a gated one after huggingface-cli login)") from None


def window_notice(args: argparse.Namespace, model: dict) -> None:
    """Say that --init-from trains on shorter windows than the model declares (a Llama's 1,024
    tokens of its 131,072, as Hugging Face's run_clm starts), unless --set chose them."""
    declared = model.get("max_positions", 0)
    if model["seq_len"] < declared and not any(s.startswith("model.seq_len=") for s in args.set):
        print(f"--init-from {args.init_from}: training on windows of {model['seq_len']:,} tokens "
              f"of the {declared:,} it declares; --set model.seq_len=N for longer ones",
              flush=True)


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
