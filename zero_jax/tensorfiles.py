"""safetensors files, read by memory map and written as a stream, with no client library.

The format is an 8-byte little-endian header length, a JSON header (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`` with offsets into the data after the header, and an optional
``"__metadata__"`` of strings), then the raw little-endian bytes of each tensor, C order. So a
tensor is a ``numpy.memmap`` of the file, and a slice of it reads only the pages it touches:
each process reads the bytes of its own shards, never a whole tensor it does not hold.

A sharded set is several files and ``model.safetensors.index.json`` (``{"metadata":
{"total_size"}, "weight_map": {name: file}}``), as Hugging Face writes them. A tensor stored
as MXFP4 blocks and scales (GPT-OSS's experts) is read as the floats they hold
(``zero_jax.mxfp4``), under its own name.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import ml_dtypes
import numpy as np

from zero_jax import mxfp4

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # the reference implementation's bound on the JSON header


class WeightsError(ValueError):
    """Weights that cannot be read, written or mapped as asked; one line: what and the fix."""


class Info(NamedTuple):
    file: pathlib.Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(file: pathlib.Path) -> dict[str, Info]:
    """Every tensor of one file, checked against the file's size before any byte is read."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            raw = f.read(n) if n is not None and n <= min(MAX_HEADER, size - 8) else None
    except OSError as e:
        raise WeightsError(f"cannot read {file}: {e.strerror}") from None
    if raw is None:
        raise WeightsError(f"{file} is not a safetensors file (its header length is missing or "
                           "beyond the file): re-save or re-download it")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{file} has a corrupt safetensors header ({e}): re-save or "
                           "re-download it") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{file} has a corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    start, out = 8 + n, {}
    for name, entry in header.items():
        out[name] = info = _entry(file, name, entry, start)
        if info.offset + info.nbytes > size:
            raise WeightsError(f"{file} is truncated: tensor {name} ends at byte "
                               f"{info.offset + info.nbytes}, the file has {size}; re-save or "
                               "re-download it")
    return out


def _entry(file: pathlib.Path, name: str, entry, start: int) -> Info:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        ok = dtype in DTYPES and all(isinstance(d, int) and d >= 0 for d in shape) \
            and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise WeightsError(f"{file} has a corrupt safetensors header: the entry of {name} is "
                           f"{json.dumps(entry)[:100]}; re-save or re-download it")
    info = Info(file, np.dtype(DTYPES[dtype]), tuple(shape), start + begin)
    if end - begin != info.nbytes:
        raise WeightsError(f"{file} has a corrupt safetensors header: {name} is {dtype} "
                           f"{list(shape)} ({info.nbytes} bytes) but spans {end - begin} bytes")
    return info


class TensorFiles:
    """The tensors of a safetensors file, a sharded set (its index) or a directory of either,
    by name; ``view(name)`` is a read-only memory map that reads nothing until sliced.

    ``bytes_read`` counts the bytes of every slice taken through ``read``: what this process
    read of the files, tensor by tensor.
    """

    def __init__(self, source: str | os.PathLike):
        path = pathlib.Path(source)
        if path.is_dir():
            path = path / INDEX if (path / INDEX).exists() else _single(path)
        if not path.exists():
            raise WeightsError(f"{path} does not exist: pass a .safetensors file, its "
                               f"{INDEX}, or a directory holding them")
        files = _index(path) if path.name.endswith(".json") else [path]
        self.tensors: dict[str, Info] = {}
        for file in files:
            for name, info in read_header(file).items():
                if name in self.tensors:
                    raise WeightsError(f"tensor {name} is in both {self.tensors[name].file} "
                                       f"and {file}: keep one")
                self.tensors[name] = info
        self.source, self.bytes_read = path, 0
        self._maps: dict[pathlib.Path, np.memmap] = {}
        self._mxfp4: dict[str, tuple[Info, Info]] = {}
        for name, (blocks, scales) in mxfp4.pairs(list(self.tensors)).items():
            pair = self.tensors.pop(blocks), self.tensors.pop(scales)
            if why := mxfp4.problem(*((i.dtype, i.shape) for i in pair)):
                raise WeightsError(f"tensor {name} in {pair[0].file} is stored as MXFP4, but "
                                   f"{why}: re-save or re-download it")
            self._mxfp4[name] = pair
            self.tensors[name] = Info(pair[0].file, np.dtype(np.float32),
                                      mxfp4.shape(pair[0].shape), pair[0].offset)

    def _raw(self, info: Info) -> np.ndarray:
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, np.uint8, mode="r")
        raw = self._maps[info.file][info.offset:info.offset + info.nbytes]
        return raw.view(info.dtype).reshape(info.shape)

    def view(self, name: str) -> np.ndarray | mxfp4.Mxfp4:
        if name in self._mxfp4:
            return mxfp4.Mxfp4(*(self._raw(info) for info in self._mxfp4[name]))
        return self._raw(self.tensors[name])

    def read(self, view: np.ndarray | mxfp4.Mxfp4) -> np.ndarray:
        """The bytes of ``view`` (a slice of ``view(name)``), copied out and counted."""
        self.bytes_read += view.nbytes
        return np.array(view)


def _single(directory: pathlib.Path) -> pathlib.Path:
    found = sorted(directory.glob("*.safetensors"))
    if len(found) == 1 or (directory / SINGLE).exists():
        return directory / SINGLE if (directory / SINGLE).exists() else found[0]
    what = f"{len(found)} .safetensors files and no {INDEX}" if found else \
        "no .safetensors file"
    raise WeightsError(f"{directory} holds {what}: pass one file, or a directory with "
                       f"{SINGLE} or {INDEX}")


def _index(path: pathlib.Path) -> list[pathlib.Path]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        assert all(isinstance(f, str) for f in files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError):
        raise WeightsError(f"{path} is not a safetensors index (JSON with a weight_map of "
                           "tensor names to files): re-save or re-download it") from None
    for f in files:
        if not (path.parent / f).is_file():
            raise WeightsError(f"{path} names {f}, which is not in {path.parent}: copy it "
                               "there, or re-download the set")
    return [path.parent / f for f in files]


# Writing ----------------------------------------------------------------------------------------


class Spec(NamedTuple):
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def plan_files(specs: list[Spec], max_shard_bytes: int | None) -> list[list[Spec]]:
    """The tensors of each file, in order: a new file whenever the next tensor would pass
    ``max_shard_bytes`` (a tensor larger than it gets a file of its own), as Hugging Face
    shards."""
    groups: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if max_shard_bytes and groups[-1] and size + s.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    return groups


def header(specs: list[Spec], metadata: dict[str, str] | None = None) -> bytes:
    """A file's header for ``specs``' tensors in order (its 8-byte length included): computed
    from the shapes alone, so every process of a run computes the same one."""
    entries, offset = {}, 0
    if metadata:
        entries["__metadata__"] = metadata
    for s in specs:
        entries[s.name] = {"dtype": NAMES[np.dtype(s.dtype)], "shape": list(s.shape),
                           "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data 8-byte aligned, as the reference writer pads
    return struct.pack("<Q", len(raw)) + raw


def write_file(file: pathlib.Path, specs: list[Spec], arrays: Iterable[np.ndarray],
               metadata: dict[str, str] | None = None) -> None:
    """Write ``specs``' tensors, one array at a time from ``arrays`` (in the same order), so
    that only one tensor is in memory while the file is written."""
    with open(file, "wb") as f:
        f.write(header(specs, metadata))
        for s, x in zip(specs, arrays, strict=True):
            x = np.ascontiguousarray(x, dtype=s.dtype)
            if x.shape != tuple(s.shape):
                raise WeightsError(f"{s.name}: got shape {x.shape}, declared {s.shape}")
            f.write(x.astype(x.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8))
            x = None  # not held while the next is made


def shard_names(count: int) -> list[str]:
    """The files of a set of ``count``, as Hugging Face names them."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index(names: list[str], groups: list[list[Spec]]) -> str:
    """``model.safetensors.index.json`` of a set of several files."""
    return json.dumps({"metadata": {"total_size": sum(s.nbytes for g in groups for s in g)},
                       "weight_map": {s.name: n for n, g in zip(names, groups, strict=True)
                                      for s in g}}, indent=2)


def write_set(out: pathlib.Path, specs: list[Spec], arrays: Iterator[np.ndarray],
              max_shard_bytes: int | None = None, metadata: dict[str, str] | None = None
              ) -> list[pathlib.Path]:
    """``out/model.safetensors``, or with ``max_shard_bytes`` as many files as that takes
    (``model-00001-of-00003.safetensors``, ...) and their index. Returns the files."""
    groups = plan_files(specs, max_shard_bytes)
    names = shard_names(len(groups))
    for name, group in zip(names, groups, strict=True):
        write_file(out / name, group, (next(arrays) for _ in group), metadata)
    if len(groups) == 1:
        return [out / SINGLE]
    (out / INDEX).write_text(index(names, groups))
    return [out / n for n in names] + [out / INDEX]
