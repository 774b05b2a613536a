"""safetensors written where each byte lies: the header from the shapes alone, then any block of
any parameter written at its own offsets (``pwrite``), in any order, by any process.

So a set is written from sharded arrays without gathering them (``save_safetensors``): every
process computes the same header, process 0 writes it and sizes the files, and each process
writes the bytes of the shards it owns (``replica_id == 0``); a block cut along an inner axis of
a tensor lies in runs (rows), each written at its offset. The offline export
(``safetensors_export``) writes a stored checkpoint the same way, one storage chunk at a time.
A multi-process save needs ``directory`` on a file system every process sees, as orbax does.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from zero_jax.loop import Hook, OutputError
from zero_jax.plan import path_str
from zero_jax.tensorfiles import INDEX, Spec, WeightsError, header, index, plan_files, shard_names
from zero_jax.weights import Mapping, Tensor, by_path, export_specs

PyTree = Any


class _Place(NamedTuple):
    file: int  # into Layout.names
    offset: int  # of the tensor's first byte in its file
    spec: Spec
    strides: tuple[int, ...]  # in elements, of the parameter's (per layer, per part) axes


class Layout:
    """The files, headers and byte offsets of every tensor ``mapping`` writes for parameters
    of ``shapes`` (by path), as ``write_set`` lays them out. Every name and shape is checked
    here, before any file is created."""

    def __init__(self, mapping: Mapping, shapes: dict[str, tuple[int, ...]], dtype: Any,
                 max_shard_bytes: int | None = None, metadata: dict[str, str] | None = None):
        specs = export_specs(mapping, shapes, dtype)
        self.shapes, self.rows = shapes, {t.path: t for t in mapping.tensors}
        tensors: dict[str, tuple[Spec, bool]] = {}  # once each: rows taking ranges share one
        for spec, path, *_ in specs:
            taken = self.rows[path].take is not None
            if spec.name in tensors and not (taken and tensors[spec.name][1]):
                raise WeightsError(f"the mapping writes tensor {spec.name} twice: give each "
                                   "row its own name")
            tensors.setdefault(spec.name, (spec, taken))
        self.groups = plan_files([spec for spec, _ in tensors.values()], max_shard_bytes)
        self.names = shard_names(len(self.groups))
        self.headers = [header(g, metadata) for g in self.groups]
        at = {}
        for file, group in enumerate(self.groups):
            offset = len(self.headers[file])
            for spec in group:
                at[spec.name], offset = (file, offset), offset + spec.nbytes
        self.where: dict[tuple, _Place] = {}
        for spec, path, layer, part in specs:
            row, (file, offset) = self.rows[path], at[spec.name]
            if row.take is not None:  # its range of the tensor, whose rows it cuts
                axis, start, _ = row.take
                offset += start * math.prod(spec.shape[axis + 1:]) * spec.dtype.itemsize
            self.where[path, layer, part] = _Place(file, offset, spec, _strides(row, spec.shape))

    def create(self, directory: pathlib.Path) -> list[pathlib.Path]:
        """Each file with its header, sized to hold every tensor; the index of several."""
        for name, raw, group in zip(self.names, self.headers, self.groups, strict=True):
            with open(directory / name, "wb") as f:
                f.write(raw)
                f.truncate(len(raw) + sum(s.nbytes for s in group))
        if len(self.names) == 1:
            return [directory / self.names[0]]
        (directory / INDEX).write_text(index(self.names, self.groups))
        return [directory / n for n in [*self.names, INDEX]]

    def write(self, fds: list[int], path: str, where: tuple[slice, ...], data: np.ndarray
              ) -> int:
        """Block ``data`` of parameter ``path`` (its index ``where`` in the parameter, as a
        shard's ``index``) into the tensors it belongs to; returns the bytes written."""
        row, shape = self.rows[path], self.shapes[path]
        box = [range(*s.indices(n)) for s, n in zip(where, shape, strict=True)]
        pieces = [(None, data, box)]
        if row.stacked:
            pieces = [(layer, data[layer - box[0].start], box[1:]) for layer in box[0]]
        written = 0
        for layer, x, rest in pieces:
            for part, y, cut in _parts(row, x, rest):
                if row.pad is not None:  # a padded vocabulary: its padding is not written
                    axis, n = row.pad
                    kept = range(cut[axis].start, min(cut[axis].stop, n))
                    if not kept:
                        continue
                    y, cut = np.take(y, range(len(kept)), axis=axis), [*cut[:axis], kept,
                                                                        *cut[axis + 1:]]
                place = self.where[path, layer, part]
                written += _write_box(fds[place.file], place, cut, y)
        return written

# What a Hugging Face directory holds beside its weights and config.json: the tokenizer, in the
# formats its families ship, its chat template and the generation defaults (copied beside the
# weights by a save's ``extra``, so that transformers and vLLM load the model whole); and
# everything besides the weights that a save may replace.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")
HF_FILES = ("config.json", *COMPANION_FILES)


def _parts(row: Tensor, x: np.ndarray, box: list[range]) -> list:
    """One layer's block as the blocks of its fused parts (the fused axis taken out)."""
    if not row.fused:
        return [(None, x, box)]
    ax, parts = row.fuse_axis, box[row.fuse_axis]
    return [(p, np.take(x, p - parts.start, axis=ax), box[:ax] + box[ax + 1:]) for p in parts]


def _strides(row: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of ``row.view`` of a C-order tensor of ``shape``: its transpose
    permutes them, its split cuts one axis's into the sub-axes' (no byte is touched)."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    if row.transpose is not None:
        strides = [strides[a] for a in row.transpose]
    if row.split is not None:
        axis = row.split[0] % len(shape)
        full = row.forward_shape(shape)
        sizes = full[axis:axis + len(full) - len(shape) + 1]
        strides[axis:axis + 1] = [strides[axis] * math.prod(sizes[j + 1:])
                                  for j in range(len(sizes))]
    return tuple(strides)


def _write_box(fd: int, place: _Place, box: list[range], data: np.ndarray) -> int:
    """``data``, the block ``box`` of a tensor's view, written at its offsets: axes ordered as
    the file holds them, the innermost ones that lie contiguously make one run, one
    ``pwrite`` per run (a block cut along an inner axis is a run per row)."""
    itemsize = place.spec.dtype.itemsize
    start = place.offset + itemsize * sum(r.start * s for r, s in zip(box, place.strides,
                                                                       strict=True))
    order = sorted(range(len(box)), key=lambda a: -place.strides[a])
    strides = [place.strides[a] for a in order]
    data = np.ascontiguousarray(np.transpose(data, order),
                                dtype=place.spec.dtype.newbyteorder("<"))
    k, run = len(order), 1
    while k and (data.shape[k - 1] == 1 or strides[k - 1] == run):
        run, k = run * data.shape[k - 1], k - 1
    offsets = np.zeros((), np.int64)
    for n, s in zip(data.shape[:k], strides[:k], strict=True):
        offsets = np.add.outer(offsets, np.arange(n, dtype=np.int64) * s * itemsize)
    raw, size = memoryview(data.reshape(-1).view(np.uint8)), run * itemsize
    for i, offset in enumerate((start + offsets.reshape(-1)).tolist()):
        _pwrite(fd, raw[i * size:(i + 1) * size], offset)
    return data.nbytes


def _pwrite(fd: int, raw: memoryview, offset: int) -> None:
    while raw:
        done = os.pwrite(fd, raw, offset)
        raw, offset = raw[done:], offset + done


class Saved(NamedTuple):
    files: list[pathlib.Path]
    bytes_written: int  # by this process: its own shards' bytes


def save_safetensors(params: PyTree, directory: str | os.PathLike, mapping: Mapping | None = None,
                     dtype: Any = np.float32, max_shard_bytes: int | None = None,
                     metadata: dict[str, str] | None = None,
                     extra: Callable[[pathlib.Path], None] | None = None) -> Saved:
    """``params`` (sharded ``jax.Array``s, any layout, any number of processes) as
    safetensors in ``directory``: ``model.safetensors``, or with ``max_shard_bytes`` shards and
    their index, named by ``mapping`` (default: by path), in ``dtype``. Each process writes only
    the shards it owns (``replica_id == 0``), straight from its devices: nothing is gathered.

    Called by every process. The files are written into a hidden sibling directory (``extra``
    adds files to it, e.g. a config.json, on process 0), which then replaces ``directory``:
    a save that fails leaves the previous one in place. A ``directory`` that holds anything
    else (a subdirectory, another file) is refused before anything is written."""
    flat = {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    layout = Layout(mapping or by_path(list(flat)), {p: tuple(np.shape(x)) for p, x in
                                                     flat.items()}, dtype, max_shard_bytes,
                    metadata)
    out = pathlib.Path(directory).absolute()
    if problem := not_a_save(out):
        raise WeightsError(f"save_safetensors: {problem}")
    partial = out.with_name(f".{out.name}.partial")
    first = jax.process_index() == 0
    files, written, failed = [], 0, None
    try:
        if first:
            try:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
                files = layout.create(partial)
            except OSError as e:
                failed = e
        _together("create its files", partial, failed)
        try:
            written = _write(layout, partial, flat)
            if first and extra is not None:
                extra(partial)
        except OSError as e:
            failed = e
        _together("write its shards", partial, failed)
    except OSError:  # nothing of this save is left behind
        if first:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if first:
        _replace(out, partial)
    _together("replace the directory", partial, None)
    return Saved([out / f.name for f in files] if first else [], written)


def _write(layout: Layout, partial: pathlib.Path, flat: dict) -> int:
    """This process's shards written into the files process 0 created; the bytes written."""
    try:
        fds = [os.open(partial / name, os.O_WRONLY) for name in layout.names]
    except FileNotFoundError as e:
        raise OSError(e.errno, f"process {jax.process_index()} does not see the files process 0 "
                      "created: every process must see the directory (a file system they "
                      "share, as for checkpoints)", e.filename) from None
    written = 0
    try:
        for path, x in flat.items():
            for shard, index in _owned(x):
                written += layout.write(fds, path, index, shard)
    finally:
        for fd in fds:
            os.close(fd)
    return written


def not_a_save(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` may not be replaced by a save: something in it that no save writes
    (safetensors files, their index, a config.json, COMPANION_FILES), which the
    replacement would delete with it; None: it may (missing, empty, or an earlier save)."""
    out = pathlib.Path(directory)
    if not out.exists():
        return None
    if not out.is_dir():
        return f"{out} is a file: pass a directory"
    for entry in sorted(out.iterdir()):
        ours = entry.name.endswith((".safetensors", ".safetensors.index.json")) or \
            entry.name in HF_FILES
        if not ours or entry.is_symlink() or not entry.is_file():
            return (f"{out} holds {entry.name}, which a save there would delete with the "
                    "directory: pass a new directory, or one an earlier save wrote")
    return None


def _owned(x: Any):
    """The blocks of ``x`` this process writes: its shards that are no other's replica."""
    if not isinstance(x, jax.Array):
        if jax.process_index() == 0:
            yield np.asarray(x), tuple(slice(None) for _ in np.shape(x))
        return
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            yield np.asarray(shard.data), shard.index


def _replace(out: pathlib.Path, new: pathlib.Path) -> None:
    """``new`` renamed to ``out``; an ``out`` already there is removed only after."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _together(what: str, partial: pathlib.Path, failed: OSError | None) -> None:
    """A barrier that tells every process whether each reached it without error: the one that
    failed raises its error, the others one naming it, where a plain barrier would leave them
    waiting for a process that left."""
    others: list[int] = []
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(failed is not None))
        others = [i for i, f in enumerate(np.ravel(flags)) if f and i != jax.process_index()]
    if failed is not None:
        raise failed
    if others:
        raise OSError(f"process {others[0]} could not {what} in {partial} (its error says why)")


def trained_params(state) -> PyTree:
    """The parameters to hand on: the fp32 master when the run keeps one."""
    return state.master if state.master is not None else state.params


class SafetensorsSaver(Hook):
    """A hook: the parameters as safetensors in ``directory`` every ``every`` steps, at step
    ``last`` and on a stop signal (``stop``, a ``Preemption``), not while the divergence
    guard (``guard``) is in a streak of bad steps; each save replaces the one before once it
    is complete. ``params(state)`` picks what to write (default: the fp32 master if kept, else
    the parameters; with the NVMe tier, the state read back); ``options`` are
    ``save_safetensors``'s (``mapping``, ``dtype``, ``max_shard_bytes``, ``extra``).
    Called by every process (the save has barriers), synchronous; a write that fails raises
    ``OutputError``."""

    def __init__(self, directory: str | os.PathLike, every: int, last: int, stop: Any = None,
                 guard: Any = None, params: Callable[[Any], PyTree] = trained_params, **options):
        self.directory, self.every, self.last, self.stop = directory, every, last, stop
        self.guard, self.params, self.options = guard, params, options
        self.saved: int | None = None  # the step in ``directory``

    def sync(self, n: int) -> bool:
        return bool(self.every and n % self.every == 0) or n == self.last or bool(
            self.stop is not None and self.stop.signum)

    def __call__(self, n: int, state, m: dict, record: dict) -> None:
        due = state is not None and self.sync(n)
        if due and self.saved != n and (self.guard is None or self.guard.bad_from is None):
            metadata = {"format": "pt", "step": str(n)}
            try:
                save_safetensors(self.params(state), self.directory, metadata=metadata,
                                 **self.options)
            except OSError as e:  # a full disk, say: the loop's outputs fail this way
                raise OutputError("safetensors directory", str(self.directory), e) from None
            self.saved = n
