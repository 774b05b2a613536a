"""MXFP4 tensors read as the floats they hold, as transformers dequantizes GPT-OSS's experts.

OCP's microscaling FP4: ``X_blocks``, uint8 ``(*prefix, rows, groups, 16)``, holds two FP4 (e2m1)
values a byte, low nibble first, 32 a group; ``X_scales``, uint8 ``(*prefix, rows, groups)``,
one power of two per group, ``2 ** (scale - 127)``. Together they are the tensor ``X`` of
``(*prefix, 32 groups, rows)``: each row's values along the second-to-last axis (transformers'
``convert_moe_packed_tensors`` transposes them so, the layout of GPT-OSS's unquantized experts).
Every value is a float32 exactly. A slice reads only the blocks and scales of the groups it
touches, so each process reads about its own shards' share, as of any other tensor.
"""

from __future__ import annotations

import numpy as np

FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# each byte's two values, low nibble first, as one 8-byte word: one take a byte (``take`` with
# mode "clip" skips the bounds checks that make numpy's indexing 20 times slower here)
PAIRS = np.stack([FP4[np.arange(256) & 15], FP4[np.arange(256) >> 4]], -1).view(np.uint64)[:, 0]
GROUP = 32  # values a scale covers
SUFFIXES = ("_blocks", "_scales")


def pairs(names: list[str]) -> dict[str, tuple[str, str]]:
    """The tensors a set holds as MXFP4: ``X`` for each ``X_blocks`` beside an ``X_scales``."""
    there = set(names)
    return {n[:-len(SUFFIXES[0])]: (n, n[:-len(SUFFIXES[0])] + SUFFIXES[1]) for n in names
            if n.endswith(SUFFIXES[0]) and n[:-len(SUFFIXES[0])] + SUFFIXES[1] in there}


def problem(blocks: tuple[np.dtype, tuple[int, ...]], scales: tuple[np.dtype, tuple[int, ...]]
            ) -> str | None:
    """Why a pair of (dtype, shape)s is no MXFP4 tensor (None: it is one)."""
    (bd, bs), (sd, ss) = blocks, scales
    if bd != np.uint8 or sd != np.uint8:
        return f"its blocks and scales are {bd} and {sd}, not uint8"
    if len(bs) < 3 or bs[-1] != GROUP // 2 or tuple(ss) != tuple(bs[:-1]):
        return (f"its blocks are {list(bs)} and scales {list(ss)}, not (..., rows, groups, 16) "
                "and (..., rows, groups)")
    return None


def shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the tensor blocks of ``blocks_shape`` hold."""
    *prefix, rows, groups, _ = blocks_shape
    return (*prefix, groups * GROUP, rows)


class Mxfp4:
    """The floats of ``blocks`` and ``scales`` (memory maps), or a slice of them: sliced
    (``[index]``, steps of 1) and taken as an array (``np.asarray``), it reads and decodes only
    the groups the slice touches; ``nbytes``, what that reads of the files."""

    def __init__(self, blocks: np.ndarray, scales: np.ndarray,
                 index: tuple[slice, ...] | None = None):
        self.blocks, self.scales = blocks, scales
        self.index = index or tuple(slice(0, n) for n in shape(blocks.shape))
        self.dtype, self.ndim = np.dtype(np.float32), len(self.index)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.index)

    def reshape(self, new: tuple[int, ...]) -> Mxfp4:
        if tuple(new) != self.shape:
            raise ValueError(f"an MXFP4 tensor of {list(self.shape)} read as {list(new)}: "
                             "map it without a split")
        return self

    def transpose(self, *axes) -> Mxfp4:
        raise ValueError("an MXFP4 tensor is read in its own layout: map it without a transpose")

    def __getitem__(self, index) -> Mxfp4:
        index = index if isinstance(index, tuple) else (index,)
        index += (slice(None),) * (self.ndim - len(index))
        out = []
        for s, outer in zip(index, self.index, strict=True):
            if not isinstance(s, slice) or s.indices(1)[2] != 1:
                raise ValueError("an MXFP4 tensor is read in slices of step 1")
            start, stop, _ = s.indices(outer.stop - outer.start)
            out.append(slice(outer.start + start, outer.start + max(start, stop)))
        return Mxfp4(self.blocks, self.scales, tuple(out))

    def _where(self) -> tuple[tuple, int]:
        *prefix, k, rows = self.index
        first = k.start // GROUP
        return (*prefix, rows, slice(first, -(-k.stop // GROUP))), first

    @property
    def nbytes(self) -> int:
        where, _ = self._where()
        return self.blocks[where].nbytes + self.scales[where].nbytes

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """Decoded a leading index (an expert) at a time, into the one array returned: the
        intermediates stay small enough for the allocator to reuse, where fresh pages for each
        whole-size one cost more than the decoding."""
        where, first = self._where()
        packed, scales = self.blocks[where], self.scales[where]
        k = self.index[-2]
        cut = slice(k.start - first * GROUP, k.stop - first * GROUP)
        out = np.empty(self.shape, np.float32)
        for i in np.ndindex(*out.shape[:-2]):
            values = np.take(PAIRS, np.asarray(packed[i]).astype(np.intp), mode="clip")
            values = values.view(np.float32).reshape(*packed.shape[-3:-1], GROUP)
            values *= np.ldexp(np.float32(1), np.asarray(scales[i]).astype(np.int32) - 127)[
                ..., None]
            out[i] = values.reshape(values.shape[0], -1)[:, cut].T
        return out.astype(dtype or np.float32, copy=False)
