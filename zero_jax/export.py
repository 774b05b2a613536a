"""Export a checkpoint's parameters, whole, for plain orbax and Flax to read, or as safetensors.

    python -m zero_jax.export CKPT_DIR OUT [--step N] [--dtype bf16]
    python -m zero_jax.export CKPT_DIR OUT --format safetensors [--max-shard-size 5GB]

Writes ``OUT/params`` (a standard orbax PyTree checkpoint of the parameter tree, one device's
worth, no optimizer state) and ``OUT/config.json`` (the step, the dtype, and the ``config`` the
run stored in the checkpoint's metadata, if any). It works for any model's checkpoint: the tree
and the shapes are read from the checkpoint itself. Reading it needs orbax, not zero_jax::

    params = orbax.checkpoint.StandardCheckpointer().restore(f"{OUT}/params")  # OUT absolute

``--format safetensors`` writes ``OUT/model.safetensors`` (or shards and their index), one
tensor per parameter named by its path (``blocks.qkv.kernel``), streamed one stored chunk at a
time (``zero_jax/safetensors_export.py``); ``python -m zero_jax.gpt.hf`` writes the demo's
models as a Hugging Face directory.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import sys
import tempfile

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export(checkpoint_dir: str, out: str, step: int | None = None, dtype: str = "fp32",
           safetensors: dict | None = None) -> dict:
    """Write the consolidated parameters of ``step`` (default: latest); returns config.json.
    With ``safetensors`` (``zero_jax.safetensors_export.write``'s keyword arguments, ``{}``
    for names by path), safetensors files instead, streamed one stored chunk at a time."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from zero_jax.checkpoint import CheckpointError, Checkpoints, CorruptCheckpointError

    if dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype})")
    target = pathlib.Path(out).absolute()
    if target.exists():
        raise CheckpointError(f"{target} already exists: pass a new directory to export into")
    if holder := _checkpoint_dir_above(target, pathlib.Path(checkpoint_dir)):
        raise CheckpointError(f"cannot export into {target}: it is inside the checkpoint "
                              f"directory {holder}, where a run would take it for a checkpoint "
                              "(or rotate it away); pass a path outside it")
    if problem := _unwritable(target):
        raise CheckpointError(f"cannot export into {target}: {problem}; pass a writable path")
    ckpts = Checkpoints(checkpoint_dir, create=False, read_only=True)  # never deletes anything
    try:
        for foreign in ckpts.foreign:
            print(f"warning: {ckpts.path / str(foreign)} holds no zero_jax checkpoint: skipped",
                  file=sys.stderr)
        try:
            meta = ckpts.meta(step)
            if safetensors is not None:
                from zero_jax import safetensors_export

                safetensors_export.write(ckpts, meta, target, DTYPES[dtype], **safetensors)
                return {"step": meta["step"], "dtype": DTYPES[dtype]}
            params = ckpts.read_params(meta["step"])
        except CorruptCheckpointError as e:
            raise CheckpointError(f"{e}; {_older(ckpts, e.step)}") from None
    finally:
        ckpts.close()
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(DTYPES[dtype])), params)
    try:
        target.mkdir(parents=True)
        saver = ocp.StandardCheckpointer()
        saver.save(target / "params", params)
        saver.wait_until_finished()
        config = {"step": meta["step"], "dtype": DTYPES[dtype], "config": meta.get("config")}
        (target / "config.json").write_text(json.dumps(config, indent=1))
    except OSError as e:
        raise CheckpointError(f"writing {target} failed: {e.strerror}") from None
    return config


def _older(ckpts, step: int) -> str:
    """The newest checkpoint before ``step`` that reads whole, as ``train.py --resume`` would
    fall back to it: named, not exported in its place."""
    from zero_jax.checkpoint import CorruptCheckpointError

    for older in reversed([s for s in ckpts.steps() if s < step]):
        try:
            ckpts.read_params(ckpts.meta(older)["step"])
        except CorruptCheckpointError:
            continue
        return f"checkpoint {older} reads: export it with --step {older}"
    return "no older checkpoint reads"


def _checkpoint_dir_above(target: pathlib.Path, source: pathlib.Path) -> pathlib.Path | None:
    """The checkpoint directory ``target`` would be inside: the one exported from, or any that
    holds zero_jax checkpoints (numbered directories with ``meta``) or a writer's lock."""
    from zero_jax.lock import NAME

    real = pathlib.Path(os.path.realpath(target))
    if pathlib.Path(os.path.realpath(source)) in real.parents:
        return source.absolute()
    for above in real.parents:
        try:
            if (above / NAME).exists() or any(p.name.isdigit() and (p / "meta").is_dir()
                                              for p in above.iterdir()):
                return above
        except OSError:  # not there yet, or not readable: nothing to take it for a checkpoint
            continue
    return None


def _unwritable(target: pathlib.Path) -> str | None:
    """Why nothing can be created at ``target``, found before the checkpoint is read."""
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    try:
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        return f"{parent} is not writable ({e.strerror})"
    return None


def _size(text: str) -> int:
    """``5GB``, ``200MiB``, ``1000000``: bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30}
    number = text.rstrip("BbKkMmGgIi")
    try:
        size = int(float(number) * units[text[len(number):].upper()])
        assert size > 0
    except (ValueError, KeyError, AssertionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 5GB or "
                                         "500MiB") from None
    return size


def _return_freed_memory() -> None:
    """A streamed export frees each block before reading the next. glibc raises its mmap
    threshold to the largest block freed (up to 32 MiB), after which such blocks come from the
    heap, which a stream of them fragments (8 parameters of 16 MiB: 309 MB peak, 264 MB with
    the threshold fixed at 1 MiB): fixed, each buffer goes back to the system when dropped."""
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, like train.py
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m zero_jax.export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint_dir")
    p.add_argument("out")
    p.add_argument("--step", type=int, help="default: the latest complete checkpoint")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16")
    p.add_argument("--format", choices=("orbax", "safetensors"), default="orbax",
                   help="safetensors: tensors named by parameter path, streamed")
    p.add_argument("--max-shard-size", type=_size, metavar="SIZE", help="with --format "
                   "safetensors: files of at most SIZE (e.g. 5GB) and their index")
    args = p.parse_args(argv)
    if args.max_shard_size and args.format != "safetensors":
        p.error("--max-shard-size needs --format safetensors")
    from zero_jax.checkpoint import CheckpointError, quiet_background_errors
    from zero_jax.tensorfiles import WeightsError

    quiet_background_errors()  # a checkpoint that cannot be read is its one line below
    if args.format == "safetensors":
        _return_freed_memory()
    try:
        config = export(args.checkpoint_dir, args.out, args.step, args.dtype,
                        {"max_shard_bytes": args.max_shard_size}
                        if args.format == "safetensors" else None)
    except (CheckpointError, WeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {config['step']} parameters ({config['dtype']}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
