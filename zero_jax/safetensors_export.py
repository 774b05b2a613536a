"""A checkpoint's parameters written as safetensors, streamed one storage chunk at a time.

Needs no mesh and no accelerator: each stored array is opened with tensorstore through orbax's
metadata (its name and zarr layout in the checkpoint's OCDBT store) and read one chunk of its
storage grid at a time (a chunk is the shard one device wrote, or smaller), checked against the
array's digest as the chunks' parts add up, and each chunk's bytes written at their offsets in
the tensors the mapping names (``safetensors_writer.Layout``): a chunk of a scanned stack spans
its layers, and each layer's part goes into that layer's tensor. Host memory is bounded by a
stored chunk (decoded and compressed) and its copy as written, not by a parameter nor the model.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator

import numpy as np

from zero_jax import integrity
from zero_jax.checkpoint import Checkpoints, CorruptCheckpointError
from zero_jax.safetensors_writer import Layout
from zero_jax.weights import Mapping, by_path

# One chunk decoded at a time; the OCDBT store's cache of B-tree nodes small, not orbax's 100 MB.
CONTEXT = {"data_copy_concurrency": {"limit": 1}, "file_io_concurrency": {"limit": 4},
           "cache_pool#ocdbt": {"total_bytes_limit": 4 << 20}}


class LeafReader:
    """The parameters of one step of a checkpoint (the fp32 master when the run kept one):
    ``shapes`` by path, and ``blocks(path)``, the array one stored chunk at a time."""

    def __init__(self, ckpts: Checkpoints, step: int, meta: dict):
        import orbax.checkpoint as ocp
        import tensorstore as ts

        self.ckpts, self.step, self.digests = ckpts, step, meta.get("digests")
        self.name = "master" if (ckpts.path / str(step) / "master").exists() else "params"
        self.directory = ckpts.path / str(step) / self.name
        with ckpts._reading(step, self.name):
            tree = ocp.PyTreeCheckpointHandler().metadata(self.directory)
        self.arrays = _flat(tree.tree[self.name])
        self.zarr3 = bool(tree.use_zarr3)
        self.shapes = {p: tuple(m.shape) for p, m in self.arrays.items()}
        self.context = ts.Context(CONTEXT)

    def blocks(self, path: str) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
        """``(index, values)`` of each chunk of the stored array, in turn; a chunk that does
        not match the digest recorded at save raises once the array's last chunk is read."""
        import orbax.checkpoint as ocp
        import tensorstore as ts

        m = self.arrays[path]
        info = ocp.type_handlers.ParamInfo(name=m.name, parent_dir=pathlib.Path(m.directory),
                                           use_zarr3=self.zarr3, ts_context=self.context)
        with self.ckpts._reading(self.step, self.name):
            store = ts.open(ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True),
                            context=self.context, read=True).result()
        shape, chunk = tuple(store.shape), tuple(store.chunk_layout.read_chunk.shape)
        total = 0
        for start in itertools.product(*(range(0, n, c) for n, c in zip(shape, chunk,
                                                                        strict=True))):
            index = tuple(slice(a, min(a + c, n)) for a, c, n in zip(start, chunk, shape,
                                                                      strict=True))
            with self.ckpts._reading(self.step, self.name):
                x = store[index].read().result()
            total = (total + integrity.block_sum(x, index, shape)) % 2**64
            yield index, x
            x = None  # not held while the next is read
        key = f"{self.name}/{path}"
        if self.digests is not None and f"{m.dtype}:{total:016x}" != self.digests.get(key):
            raise CorruptCheckpointError(self.step, f"checkpoint step {self.step} in "
                                         f"{self.ckpts.path} is corrupted: {key} does not match "
                                         "the digest recorded when it was saved")


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

    reader = LeafReader(ckpts, meta["step"], meta)
    mapping = mapping(meta) if callable(mapping) else mapping
    layout = Layout(mapping or by_path(list(reader.shapes)), reader.shapes, jnp.dtype(dtype),
                    max_shard_bytes, {"format": "pt", "step": str(meta["step"])})
    partial = out.with_name(f".{out.name}.partial")  # renamed to ``out`` once complete
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        files = layout.create(partial)
        fds = [os.open(partial / name, os.O_WRONLY) for name in layout.names]
        try:
            for path in reader.shapes:
                for index, x in reader.blocks(path):
                    layout.write(fds, path, index, x)
        finally:
            for fd in fds:
                os.close(fd)
        if extra is not None:
            extra(partial, meta)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(out)
    return [out / f.name for f in files]


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}/")
                .items()}
    return {prefix.rstrip("/"): tree}
