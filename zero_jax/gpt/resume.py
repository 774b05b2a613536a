"""Where a run starts: its data, its checkpoint directory, the checkpoint it resumes from."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

import jax

from zero_jax.checkpoint import Checkpoints, CorruptCheckpointError
from zero_jax.gpt import data, hf
from zero_jax.gpt.cli import warn
from zero_jax.gpt.experiment import check_compatible
from zero_jax.state import init_state


@dataclasses.dataclass
class Start:
    """Where a run starts, found once before anything is compiled: its data, its checkpoint
    directory (locked), and the checkpoint it resumes from, if any."""

    tokens: object  # what training reads (without the held-out tenth when it evaluates)
    ckpts: object = None  # --checkpoint-dir's Checkpoints: where this run saves
    source: object = None  # the Checkpoints it resumes from (ckpts, or train.ckpt_load_path's)
    step: int | None = None  # the step it resumes from; None: a fresh initialization
    seed: int = 0  # of the data order: the checkpoint's when resuming
    records: list = dataclasses.field(default_factory=list)  # the metrics file, line by line
    overwrite: list[int] = dataclasses.field(default_factory=list)  # --overwrite deletes these
    corrupt: list[int] = dataclasses.field(default_factory=list)  # steps that did not read
    held_out: object = None  # the tokens train.eval_every evaluates on (or --eval-data's)
    tokenizer: str | None = None  # the sha256 of the tokenizer.json that read text data

    def __enter__(self) -> Start:
        return self

    def __exit__(self, *exc) -> None:
        for ckpts in {id(c): c for c in (self.ckpts, self.source) if c}.values():
            ckpts.close()


def find_start(exp, cfg: dict, args: argparse.Namespace) -> Start:
    """Data first, then checkpoints: a run refused for its data writes nothing. The state
    comes from --resume's latest checkpoint in --checkpoint-dir, else train.ckpt_load_path's
    latest, else a fresh initialization."""
    m = exp.model
    tokenizer = data.Tokenizer.of(args.init_from) if args.init_from else None
    source = args.data or "the standard library corpus"
    only = cfg["train"]["completion_only"]
    tokens = prompts_as_set(read_tokens(args.data, source, m, args, tokenizer), source, only)
    held = None
    if args.eval_data:
        if not cfg["train"]["eval_every"]:
            raise ValueError(f"--eval-data {args.eval_data} is evaluated every train.eval_every "
                             "steps, which is 0: set --set train.eval_every=N, or leave "
                             "--eval-data out")
        source = f"--eval-data {args.eval_data}"
        held = prompts_as_set(read_tokens(args.eval_data, source, m, args, tokenizer), source,
                              only)
    elif cfg["train"]["eval_every"]:
        tokens, held = data.held_out(tokens, m.seq_len, source)
    start = Start(tokens, seed=cfg["train"]["seed"], held_out=held,
                  tokenizer=tokenizer.sha256 if tokenizer and data.is_text(args.data) else None)
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


def read_tokens(path: str | None, source: str, model, args: argparse.Namespace,
                tokenizer: data.Tokenizer | None):
    """``path``'s token ids; text read by --init-from's tokenizer, and refused where that
    directory has none: a pretrained model reads its tokenizer's ids, not bytes."""
    text = data.is_text(path)
    if text and args.init_from and tokenizer is None:
        raise ValueError(f"{source} is text, but --init-from {args.init_from}'s model reads "
                         f"its tokenizer's ids and the directory holds no {data.Tokenizer.FILE}: "
                         "copy the model's tokenizer.json there, or pass token ids (.bin of "
                         "uint16, .npy)")
    tick = time.perf_counter()
    tokens = data.load_tokens(path, tokenizer if text else None)
    if text and tokenizer and jax_primary():  # one line for the run, not one per process
        print(f"{source}: {len(tokens):,} tokens by {tokenizer.path} in "
              f"{time.perf_counter() - tick:.1f} s")
    data.check_tokens(tokens, model.vocab_size, model.seq_len, source)
    return tokens


def prompts_as_set(tokens, source: str, completion_only: bool):
    """``tokens`` as train.completion_only trains on them: prompt-completion records' prompts
    kept marked (their tokens are read, not predicted), or trained on like their completions;
    completion_only on data without prompts is refused."""
    if not completion_only:
        return data.unprompted(tokens)
    if not data.prompted(tokens):
        raise ValueError(f"train.completion_only trains on the completions of a .jsonl's "
                         f'{{"prompt": ..., "completion": ...}} records, and {source} has none: '
                         "pass such records, or leave train.completion_only false")
    return tokens


def held_out_share(cfg: dict, args: argparse.Namespace) -> float:
    """The share of --data's stream held out from training: its last tenth with
    train.eval_every, none when --eval-data holds the evaluation's tokens."""
    return data.HELD_OUT if cfg["train"]["eval_every"] and not args.eval_data else 0.0


def load_path(load: str):
    """train.ckpt_load_path's checkpoints, read only."""
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
        if meta.get("data", {}).get("tokenizer") != start.tokenizer and not args.allow_other_data:
            raise ValueError("the checkpoint's text was read by another tokenizer than this "
                             f"run's ({tokenizer_name(meta['data'].get('tokenizer'))} against "
                             f"{tokenizer_name(start.tokenizer)}): pass the same --init-from "
                             "directory, or --allow-other-data to go on with other data")
        held = held_out_share(cfg, args)
        was = meta.get("data", {}).get("held_out", 0.0)
        if held != was and not args.allow_other_data:
            trains_on = lambda f: "all but the held-out tenth" if f else "all"
            raise ValueError(f"the checkpoint trained on {trains_on(was)} of its data, this run "
                             f"on {trains_on(held)} (train.eval_every holds out the last "
                             f"tenth, unless --eval-data gives the held-out data): set "
                             "train.eval_every and --eval-data as they were, or pass "
                             "--allow-other-data to go on with other data")
        start.seed = meta["data"]["seed"]  # the data order goes on where it stopped
        return step
    raise ValueError(f"no checkpoint in {start.source.path} can be read (see the warnings "
                     "above): pass another --checkpoint-dir, or --overwrite without --resume")


def tokenizer_name(sha256: str | None) -> str:
    return f"tokenizer.json of sha256 {sha256[:12]}" if sha256 else "none, bytes as ids"


def set_aside(start: Start, e) -> None:
    """Report a corrupted step; it is moved aside only once an older one has restored."""
    start.corrupt.append(e.step)
    older = [s for s in start.source.steps() if s < e.step and s not in start.corrupt]
    warn(f"{e}; " + (f"falling back to checkpoint {older[-1]}" if older
                     else "no older checkpoint"))


def restore(start: Start, target, cfg: dict, args: argparse.Namespace, exp):
    """The resume step's state, falling back past corrupted checkpoints, saying so."""
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
    if start.overwrite:
        start.ckpts.remove_all()
        print(f"--overwrite: deleted checkpoints {', '.join(map(str, start.overwrite))} in "
              f"{start.ckpts.path}")
    if start.step is not None:
        return restore(start, target, cfg, args, exp)
    if args.init_from:
        return init_state(exp.plan, hf.load(exp.plan, args.init_from), exp.tx)
    return init_state(exp.plan, exp.init, exp.tx, jax.random.key(start.seed))


def jax_primary() -> bool:
    """Process 0 writes the report and metrics files."""
    return jax.process_index() == 0


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


def checkpoint_meta(exp, cfg: dict, args: argparse.Namespace, start: Start, step: int) -> dict:
    """What a checkpoint needs besides arrays to resume exactly and to be checked."""
    plan = exp.plan
    source = os.path.abspath(args.data) if args.data else None
    return {"config": cfg,
            "init_from": os.path.abspath(args.init_from) if args.init_from else None,
            "data": {"source": source, "seed": start.seed, "next_batch": step,
                     "held_out": held_out_share(cfg, args), "tokenizer": start.tokenizer},
            "writer": {"stage": plan.stage, "devices": plan.mesh.size,
                       "processes": len({d.process_index for d in plan.mesh.devices.flat}),
                       "platform": plan.mesh.devices.flat[0].platform}}
