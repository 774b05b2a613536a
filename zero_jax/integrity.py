"""Digests of sharded arrays that do not depend on the layout, computed shard by shard.

A checkpoint written by 8 devices at stage 3 may be read back by 4 at stage 1, so a digest of
each shard's bytes could not be checked after a restore. Instead each element contributes a
mixed hash of (its bits, its *global* flat index), and the digest of an array is the sum of
those mod 2**64: every device sums the elements of its own shard (replicas once), and the
partial sums add up to the same value in any layout. Nothing is ever gathered.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

_K1, _K2, _K3 = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F),
                 np.uint64(0x94D049BB133111EB))


def _global_index(shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """The row-major flat index in the whole array of every element of one shard."""
    flat = np.zeros((), np.uint64)
    stride = 1
    for size, cut in reversed(list(zip(shape, index, strict=True))):
        start, stop, _ = cut.indices(size)
        flat = np.add.outer(np.arange(start, stop, dtype=np.uint64) * np.uint64(stride), flat)
        stride *= size
    return flat


def _shard_sum(data: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    if data.dtype == np.bool_:
        data = data.astype(np.uint8)
    bits = data.view(f"u{data.dtype.itemsize}").astype(np.uint64)
    with np.errstate(over="ignore"):  # arithmetic mod 2**64 is the point
        h = bits * _K1 + (_global_index(shape, index) + np.uint64(1)) * _K2
        h ^= h >> np.uint64(31)
        h *= _K3
        h ^= h >> np.uint64(29)
        return int(h.sum(dtype=np.uint64))


def digest(x: Any) -> tuple[str, bool]:
    """``("float32:1f3a...", all_finite)`` of one array: its dtype, the layout-independent
    digest as hex, and whether every element is finite (True for integers)."""
    total, finite = _local(x)
    if jax.process_count() > 1:  # every process holds some shards: add up their sums
        from jax.experimental import multihost_utils

        parts = np.array([total >> 32, total & 0xFFFFFFFF, finite], np.uint32)
        gathered = np.asarray(multihost_utils.process_allgather(parts)).reshape(-1, 3)
        total = sum((int(hi) << 32) | int(lo) for hi, lo, _ in gathered)
        finite = bool(gathered[:, 2].all())
    return f"{x.dtype}:{total % 2**64:016x}", finite


def block_sum(data: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...],
              chunk: int = 1 << 16) -> int:
    """Block ``index`` of an array of ``shape``'s part of its digest (mod 2**64): the parts of
    blocks that tile the array add up to its digest, so a reader checks an array it reads one
    block at a time. At most ``chunk`` elements at a time, cut along the outermost axes: what
    it allocates stays a few times the chunk, not a few times the block (uint64 per element)."""
    index = tuple(slice(*cut.indices(n)[:2]) for cut, n in zip(index, shape, strict=True))
    if data.size <= chunk:
        return _shard_sum(data, index, shape)
    axis = next(a for a, n in enumerate(data.shape) if n > 1)
    rows = max(1, chunk // math.prod(data.shape[axis + 1:]))
    total = 0
    for start in range(0, data.shape[axis], rows):
        stop = min(start + rows, data.shape[axis])
        first = index[axis].start
        cut = (*index[:axis], slice(first + start, first + stop), *index[axis + 1:])
        total += block_sum(data[(slice(None),) * axis + (slice(start, stop),)], cut, shape,
                           chunk)
    return total % 2**64


def _local(x: Any) -> tuple[int, bool]:
    """The digest sum mod 2**64 and finiteness of the shards this process holds."""
    x = x if isinstance(x, jax.Array) else jax.numpy.asarray(x)
    total, finite = 0, True
    for shard in x.addressable_shards:
        if shard.replica_id != 0:  # each element once, whatever the replication
            continue
        data = np.asarray(shard.data)
        total += _shard_sum(data, shard.index, x.shape)
        if jax.numpy.issubdtype(data.dtype, jax.numpy.inexact):
            finite = finite and bool(np.isfinite(data).all())
    return total % 2**64, finite


def digests(tree: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Digests of a flat ``{path: array}`` dict, and the paths holding non-finite values."""
    out, bad = {}, []
    for path, leaf in tree.items():
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
            continue
        out[path], finite = digest(leaf)
        if not finite:
            bad.append(path)
    return out, bad
