"""Pretrained weights in, trained weights out: safetensors tensors mapped onto a plan's parameters.

A ``Mapping`` is a table, declared like the placement rules: one ``Tensor`` row per parameter,
naming the checkpoint tensor(s) it comes from and the few transforms real checkpoints need
(a transpose, an axis split into heads, per-layer tensors stacked into a scanned stack's
layer axis, several tensors fused along a new axis). ``load_params`` builds the parameters
already sharded by the plan: each device's shard is read from a memory map of its own bytes
(``jax.make_array_from_callback``), so no process reads a whole tensor it holds only part of.
The same table, run backwards, names and shapes the tensors ``export`` writes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from zero_jax.plan import Plan, path_str
from zero_jax.tensorfiles import Spec, TensorFiles, WeightsError

PyTree = Any
LAYER = "{layer}"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One row of a mapping: the checkpoint tensor(s) of one parameter, and how they become it.

    ``name`` holds ``{layer}`` for one tensor per layer of a scanned stack, stacked along the
    parameter's first axis. A tuple of names is fused: their (transformed) tensors stacked
    along a new axis ``fuse_axis`` of the (per-layer) parameter, e.g. separate q, k and v
    projections into one ``(d, 3, heads, head_dim)`` kernel. Each tensor is first transposed
    by ``transpose`` (PyTorch's ``(out, in)`` Linear weight is ``(1, 0)`` of a Flax kernel),
    then its axis ``split[0]`` is split into the sizes ``split[1]`` (one may be -1), e.g.
    ``(1, (heads, -1))`` for a Flax ``DenseGeneral``'s heads. ``pad`` ``(axis, n)``: the
    tensor fills the first n entries of that axis (after the transpose); the parameter may be
    longer there, its rest read as zeros and left out on export (a vocabulary padded to a
    multiple of 128 for its GEMMs). ``take`` ``(axis, start, stop)``: the parameter is that
    range of the tensor's axis, before anything else (one tensor holding several parameters,
    as Phi-3's ``qkv_proj``); the rows that share such a tensor must tile it, and an export
    writes each parameter into its range.
    """

    name: str | tuple[str, ...]
    path: str
    transpose: tuple[int, ...] | None = None
    split: tuple[int, tuple[int, ...]] | None = None
    fuse_axis: int = 0
    pad: tuple[int, int] | None = None
    take: tuple[int, int, int] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return self.name if isinstance(self.name, tuple) else (self.name,)

    @property
    def stacked(self) -> bool:
        return any(LAYER in n for n in self.names)

    @property
    def fused(self) -> bool:
        return isinstance(self.name, tuple)

    def tensor_names(self, layers: int) -> list[list[str]]:
        """The names per layer (one list when not stacked), per fused part."""
        if not self.stacked:
            return [list(self.names)]
        return [[n.replace(LAYER, str(i)) for n in self.names] for i in range(layers)]

    def forward_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A checkpoint tensor's shape after the take, transpose and split (one layer, one
        part)."""
        if self.take is not None:
            axis, start, stop = self.take
            if not (0 <= axis < len(shape) and 0 <= start < stop <= shape[axis]):
                raise WeightsError(f"Tensor({self.name!r}).take {self.take} is not a range of "
                                   f"an axis of its shape {shape}")
            shape = shape[:axis] + (stop - start,) + shape[axis + 1:]
        if self.transpose is not None:
            if sorted(self.transpose) != list(range(len(shape))):
                raise WeightsError(f"Tensor({self.name!r}).transpose {self.transpose} is not a "
                                   f"permutation of the axes of its shape {shape}")
            shape = tuple(shape[a] for a in self.transpose)
        if self.split is not None:
            axis, sizes = self.split
            axis %= len(shape)
            known = math.prod(s for s in sizes if s != -1)
            sizes = tuple(shape[axis] // known if s == -1 else s for s in sizes)
            if math.prod(sizes) != shape[axis]:
                raise WeightsError(f"Tensor({self.name!r}).split cannot cut axis {axis} of "
                                   f"{shape} into {self.split[1]}")
            shape = shape[:axis] + sizes + shape[axis + 1:]
        return shape

    def view(self, x: np.ndarray) -> np.ndarray:
        """``x`` transformed: a view of it (transposes and splits copy nothing)."""
        shape = self.forward_shape(x.shape)
        if self.take is not None:
            axis, start, stop = self.take
            x = x[(slice(None),) * axis + (slice(start, stop),)]
        if self.transpose is not None:
            x = x.transpose(self.transpose)
        return x.reshape(shape)

    def backward(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """One part of one layer of the parameter as the checkpoint tensor of ``shape``."""
        if self.transpose is not None:
            inverse = tuple(np.argsort(self.transpose))
            x = x.reshape(tuple(shape[a] for a in self.transpose)).transpose(inverse)
        return x.reshape(shape)


@dataclasses.dataclass(frozen=True)
class Mapping:
    """Checkpoint tensors -> parameters. ``ignore``: regular expressions of checkpoint tensors
    that are not parameters (buffers, a head tied to the embedding) and are left unread.
    ``prefix`` is put before every name (``"transformer."`` for a model saved with its head)."""

    tensors: tuple[Tensor, ...]
    ignore: tuple[str, ...] = ()
    prefix: str = ""

    def rows(self, paths: list[str]) -> dict[str, Tensor]:
        """Each parameter's row (by its path); a row naming no parameter, a parameter set
        twice or by no row are errors."""
        rows: dict[str, Tensor] = {}
        for t in self.tensors:
            if t.path not in paths:
                raise WeightsError(f"the mapping sets {t.path} (from {t.name}), which is not a "
                                   f"parameter of the model; its paths look like "
                                   f"{paths[0]!r}")
            if t.path in rows:
                raise WeightsError(f"the mapping sets parameter {t.path} twice (from "
                                   f"{rows[t.path].name} and {t.name}): keep one row")
            rows[t.path] = t
        if unset := [p for p in paths if p not in rows]:
            raise WeightsError(f"the mapping sets no value for parameter {unset[0]}"
                               f"{f' and {len(unset) - 1} more' if len(unset) > 1 else ''}: "
                               "add a Tensor row for it")
        return rows


def by_path(paths: list[str]) -> Mapping:
    """The default mapping of any model: one tensor per parameter, named by its path with dots
    (``blocks.qkv.kernel``), whole (a scanned stack's layers in one tensor)."""
    return Mapping(tuple(Tensor(p.replace("/", "."), p) for p in paths))


def _paths(shapes: PyTree) -> dict[str, jax.ShapeDtypeStruct]:
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return {path_str(k): v for k, v in flat}


@dataclasses.dataclass
class _Source:
    """One parameter's checkpoint tensors, checked against its shape."""

    row: Tensor
    names: list[list[str]]  # per layer, per fused part (prefixed)
    shape: tuple[int, ...] = ()  # the parameter's, per layer

    def read(self, files: TensorFiles, index: tuple[slice, ...], dtype) -> np.ndarray:
        layers = range(len(self.names))[index[0]] if self.row.stacked else [0]
        rest = index[1:] if self.row.stacked else index
        pieces = [self._layer(files, self.names[i], rest) for i in layers]
        out = np.stack(pieces) if self.row.stacked else pieces[0]
        return out.astype(dtype, copy=False)

    def _layer(self, files: TensorFiles, names: list[str], index: tuple) -> np.ndarray:
        if self.row.pad:
            return _read_padded(files, self.row, names[0], index, self.shape)
        if not self.row.fused:
            return files.read(self.row.view(files.view(names[0]))[index])
        ax = self.row.fuse_axis
        part = index[:ax] + index[ax + 1:]
        return np.stack([files.read(self.row.view(files.view(names[k]))[part])
                         for k in range(len(names))[index[ax]]], axis=ax)


def _read_padded(files: TensorFiles, row: Tensor, name: str, index: tuple,
                 shape: tuple[int, ...]) -> np.ndarray:
    """A shard of a padded parameter (``shape`` per layer): the tensor's part of it, zeros
    past its end."""
    axis, n = row.pad
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    start, stop, _ = index[axis].indices(shape[axis])
    inside = slice(min(start, n), min(stop, n))
    out = files.read(row.view(files.view(name))[index[:axis] + (inside,) + index[axis + 1:]])
    width = [(0, 0)] * out.ndim
    width[axis] = (0, stop - start - out.shape[axis])
    return np.pad(out, width)


def _unpadded(row: Tensor, want: tuple[int, ...], got: tuple[int, ...]) -> tuple[int, ...]:
    """The parameter's shape ``want`` as the tensor of shape ``got`` (after the transpose)
    fills it: ``want`` itself where the padding makes up the difference, else ``got``."""
    if row.pad is None:
        return got
    axis, n = row.pad
    if len(got) == len(want) and got[axis] == n <= want[axis]:
        return got[:axis] + (want[axis],) + got[axis + 1:]
    return got


def _sources(files: TensorFiles, mapping: Mapping, shapes: PyTree) -> dict[str, _Source]:
    """Every parameter's tensors, with every name, shape and dtype checked before any byte is
    read; every tensor of the files used or ignored."""
    out, used, params, taken = {}, set(), _paths(shapes), {}
    for path, row in mapping.rows(list(params)).items():
        want = params[path]
        layers = want.shape[0] if row.stacked and want.shape else 0
        names = [[mapping.prefix + n for n in part] for part in row.tensor_names(layers)]
        per = want.shape[1:] if row.stacked else want.shape
        for name in (n for part in names for n in part):
            info = files.tensors.get(name)
            if info is None:
                raise WeightsError(f"tensor {name} (for parameter {path}) is missing from "
                                   f"{files.source}: pass the model's own weights, or fix the "
                                   "mapping")
            got = _unpadded(row, tuple(per), row.forward_shape(info.shape))
            got = got[:row.fuse_axis] + (len(names[0]),) + got[row.fuse_axis:] \
                if row.fused else got
            if got != tuple(per):
                raise WeightsError(f"tensor {name} in {info.file} has shape {list(info.shape)}, "
                                   f"which makes {list(got)} for parameter {path} of shape "
                                   f"{list(per)}{' per layer' if row.stacked else ''}: pass "
                                   "weights of this model's config, or fix the mapping")
            if _floating(info.dtype) != _floating(want.dtype):
                raise WeightsError(f"tensor {name} in {info.file} is {info.dtype}, parameter "
                                   f"{path} is {np.dtype(want.dtype)}: pass floating-point "
                                   "weights")
            used.add(name)
            if row.take is not None:
                taken.setdefault(name, []).append(row.take)
        out[path] = _Source(row, names, tuple(per))
    for name, ranges in taken.items():
        _check_taken(name, files.tensors[name], ranges)
    ignore = [re.compile(p) for p in mapping.ignore]
    for name, info in files.tensors.items():
        if name not in used and not any(p.search(name) for p in ignore):
            raise WeightsError(f"tensor {name} in {info.file} is not used by the mapping: "
                               "pass the model's own weights, or map or ignore it")
    return out


def _check_taken(name: str, info, ranges: list[tuple[int, int, int]]) -> None:
    """A tensor read in ranges is read whole, each element once: its parameters tile it."""
    at = 0
    for axis, start, stop in sorted(ranges, key=lambda r: r[1]):
        if axis != ranges[0][0] or start != at:
            break
        at = stop
    else:
        if at == info.shape[ranges[0][0]]:
            return
    raise WeightsError(f"tensor {name} in {info.file} is taken in ranges "
                       f"{sorted(ranges, key=lambda r: r[1])} that do not cover its shape "
                       f"{list(info.shape)} once: fix the mapping's take")


def _floating(dtype) -> bool:
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))  # bfloat16 included


def load_params(plan: Plan, source: str | os.PathLike | TensorFiles,
                mapping: Mapping | None = None) -> PyTree:
    """The parameters of ``plan`` read from safetensors, born in the optimizer's layout
    (``plan.opt_specs``) for ``init_state(plan, params, tx)``.

    ``source`` is a ``.safetensors`` file, a sharded set's ``model.safetensors.index.json``, a
    directory holding either, or an open ``TensorFiles`` (whose ``bytes_read`` then counts what
    this process read). Each device's shard is read by itself from a memory map: a process
    reads only the bytes of its own devices' shards. Raises ``WeightsError``, one line, before
    reading any tensor's bytes when a name, shape or dtype does not fit.
    """
    files, sources = check(plan, source, mapping)
    shardings = plan.shardings(plan.opt_specs)

    def build(path, want, sharding):
        src, done = sources[path_str(path)], {}

        def shard(index):  # devices holding the same piece share one read
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in done:
                done[key] = src.read(files, index, want.dtype)
            return done[key]
        return jax.make_array_from_callback(want.shape, sharding, shard)
    return jax.tree_util.tree_map_with_path(build, plan.shapes, shardings)


def check(plan: Plan, source: str | os.PathLike | TensorFiles, mapping: Mapping | None = None
          ) -> tuple[TensorFiles, dict[str, _Source]]:
    """``load_params``'s checks alone (headers only, no tensor read): for a program that must
    refuse bad weights before it writes anything."""
    files = source if isinstance(source, TensorFiles) else TensorFiles(source)
    mapping = mapping or by_path(list(_paths(plan.shapes)))
    return files, _sources(files, mapping, plan.shapes)


# Export ---------------------------------------------------------------------------------------


def export_specs(mapping: Mapping, shapes: dict[str, tuple[int, ...]], dtype
                 ) -> list[tuple[Spec, str, int | None, int | None]]:
    """The tensors the mapping writes for parameters of ``shapes`` (by path), in parameter
    order: ``(spec, path, layer, part)``; a checkpoint tensor's shape is the parameter's
    (per layer, per part) with the split merged and the transpose undone. A tensor that rows
    take ranges of is the spec of each of them (the whole tensor's shape), their ranges
    checked to tile it."""
    rows = mapping.rows(list(shapes))
    out = []
    for path, shape in shapes.items():
        row = rows[path]
        per = tuple(shape[1:] if row.stacked else shape)
        if row.fused:
            per = per[:row.fuse_axis] + per[row.fuse_axis + 1:]
        if row.split is not None:
            axis, sizes = row.split
            axis %= len(per) - len(sizes) + 1
            per = per[:axis] + (math.prod(per[axis:axis + len(sizes)]),) + \
                per[axis + len(sizes):]
        if row.pad is not None:
            per = per[:row.pad[0]] + (row.pad[1],) + per[row.pad[0] + 1:]
        if row.transpose is not None:
            per = tuple(per[a] for a in np.argsort(row.transpose))
        for layer, names in enumerate(row.tensor_names(shape[0] if row.stacked else 0)):
            for part, name in enumerate(names):
                out.append((Spec(mapping.prefix + name, np.dtype(dtype), per), path,
                            layer if row.stacked else None, part if row.fused else None))
    return _whole_taken(out, rows)


class _Exported(NamedTuple):
    """A tensor an export writes, as ``_check_taken`` names one."""
    shape: tuple[int, ...]
    file: str = "the export"


def _whole_taken(specs: list, rows: dict[str, Tensor]) -> list:
    """``export_specs``' rows that take ranges of one tensor, each given the whole tensor's
    spec: its shape theirs with the taken axis as long as their ranges, which must tile it."""
    taken: dict[str, list] = {}
    for spec, path, *_ in specs:
        if rows[path].take is not None:
            taken.setdefault(spec.name, []).append((rows[path].take, spec.shape))
    whole = {}
    for name, parts in taken.items():
        (axis, *_), shape = parts[0]
        full = shape[:axis] + (max(t[2] for t, _ in parts),) + shape[axis + 1:]
        _check_taken(name, _Exported(full), [t for t, _ in parts])
        if any(s[:axis] + s[axis + 1:] != shape[:axis] + shape[axis + 1:] or t[2] - t[1]
               != s[axis] for t, s in parts):
            raise WeightsError(f"the rows that take ranges of tensor {name} give it parts of "
                               f"shapes {[s for _, s in parts]}, which do not fit together: "
                               "fix the mapping's take")
        whole[name] = full
    return [(Spec(s.name, s.dtype, whole[s.name]), *rest) if s.name in whole else (s, *rest)
            for s, *rest in specs]


def export_arrays(mapping: Mapping, specs: list, leaf: Any) -> Iterator[np.ndarray]:
    """Each tensor of ``specs`` (``export_specs``), cut from its parameter: ``leaf(path)``
    reads a parameter whole; it is called once per parameter, in order, and only one is held."""
    rows = {t.path: t for t in mapping.tensors}
    if taken := [t for t in rows.values() if t.take is not None]:
        raise WeightsError(f"Tensor({taken[0].name!r}) takes a range of its tensor, which "
                           "export_arrays does not write: save with save_safetensors, which "
                           "writes each range in place")
    current = value = x = None
    for spec, path, layer, part in specs:
        if path != current:
            value = x = None  # the last parameter dropped before the next is read
            current, value = path, np.asarray(leaf(path))
        x = value if layer is None else value[layer]
        if part is not None:
            x = np.take(x, part, axis=rows[path].fuse_axis)
        if rows[path].pad is not None:
            x = np.take(x, range(rows[path].pad[1]), axis=rows[path].pad[0])
        yield rows[path].backward(x, spec.shape).astype(spec.dtype, copy=False)
