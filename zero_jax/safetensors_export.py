"""A checkpoint's parameters written as safetensors, streamed one parameter at a time.

Needs no mesh and no accelerator: each parameter is restored alone from the orbax checkpoint
(orbax's partial restore, as a numpy array), checked against its digest, cut into the tensors
the mapping names and written, before the next is read. Host memory is bounded by the largest
parameter (a scanned stack's leaf holds all its layers), not by the model.
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable

import numpy as np

from zero_jax import integrity
from zero_jax.checkpoint import Checkpoints, CorruptCheckpointError
from zero_jax.tensorfiles import WeightsError, write_set
from zero_jax.weights import Mapping, by_path, export_arrays, export_specs


class LeafReader:
    """The parameters of one step of a checkpoint, one at a time (the fp32 master when the run
    kept one): ``shapes`` by path, and ``read(path)`` as a numpy array, digest-checked."""

    def __init__(self, ckpts: Checkpoints, step: int, meta: dict):
        import orbax.checkpoint as ocp

        self.ckpts, self.step, self.digests = ckpts, step, meta.get("digests")
        self.name = "master" if (ckpts.path / str(step) / "master").exists() else "params"
        self.directory = ckpts.path / str(step) / self.name
        self.handler = ocp.PyTreeCheckpointHandler()
        with ckpts._reading(step, self.name):
            tree = self.handler.metadata(self.directory).tree[self.name]
        self.shapes = {p: tuple(m.shape) for p, m in _flat(tree).items()}

    def read(self, path: str) -> np.ndarray:
        import orbax.checkpoint as ocp

        item, args = _nested(path, 0), _nested(path, ocp.RestoreArgs(restore_type=np.ndarray))
        with self.ckpts._reading(self.step, self.name):
            out = self.handler.restore(self.directory, args=ocp.args.PyTreeRestore(
                item={self.name: item}, restore_args={self.name: args}, partial_restore=True))
        x = _flat(out[self.name])[path]
        key = f"{self.name}/{path}"
        if self.digests is not None and integrity.host_digest(x) != self.digests.get(key):
            raise CorruptCheckpointError(self.step, f"checkpoint step {self.step} in "
                                         f"{self.ckpts.path} is corrupted: {key} does not match "
                                         "the digest recorded when it was saved")
        return x

    def close(self) -> None:
        self.handler.close()


def write(ckpts: Checkpoints, meta: dict, out: pathlib.Path, dtype: str,
          mapping: Mapping | Callable[[dict], Mapping] | None = None,
          max_shard_bytes: int | None = None,
          extra: Callable[[pathlib.Path, dict], None] | None = None) -> list[pathlib.Path]:
    """Step ``meta["step"]``'s parameters as safetensors in ``out`` (created), named by
    ``mapping`` (or a function of the checkpoint's meta that returns one; default: by path).
    Every name and shape is checked before anything is written; the files are written into a
    hidden sibling directory, renamed to ``out`` when complete (``extra(directory, meta)``
    adds files to it first, e.g. a config.json)."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    reader = LeafReader(ckpts, meta["step"], meta)
    try:
        mapping = mapping(meta) if callable(mapping) else mapping
        mapping = mapping or by_path(list(reader.shapes))
        specs = export_specs(mapping, reader.shapes, dtype)
        names = [s.name for s, *_ in specs]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise WeightsError(f"the mapping writes tensor {twice} twice: give each row its "
                               "own name")
        partial = out.with_name(f".{out.name}.partial")  # renamed to ``out`` once complete
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            arrays = export_arrays(mapping, specs, reader.read)
            files = write_set(partial, [s for s, *_ in specs], arrays, max_shard_bytes,
                              {"format": "pt", "step": str(meta["step"])})
            if extra is not None:
                extra(partial, meta)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        partial.rename(out)
        return [out / f.name for f in files]
    finally:
        reader.close()


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}/")
                .items()}
    return {prefix.rstrip("/"): tree}


def _nested(path: str, value) -> dict:
    for part in reversed(path.split("/")):
        value = {part: value}
    return value
