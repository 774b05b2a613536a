"""Many leaves, one collective: ZeRO-R's constant-size buffers, and ZeRO++'s int8 ones.

A bucket lays this device's pieces of several leaves end to end in one flat buffer, so that
one all-gather, reduce-scatter or all-reduce moves them all: one synchronization per layer
instead of one per leaf. A leaf cut along its own ``axis`` into N shards is, in the flat layout,
N rows, row i being device i's shard flattened (``rows`` / ``unrows``); concatenating leaves
along the rows keeps each device's chunk of the buffer exactly its shards, so every element is
moved and summed as by the leaf's own collective: bit-identical results.

Int8 (ZeRO++): weights are gathered as int8 blocks with one fp32 scale per ``block`` elements
of a leaf (qwZ), dequantized on arrival; gradients are cut into the rows each device will own,
quantized, exchanged all-to-all and summed locally in fp32 (qgZ), so nothing is summed in int8.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

AxisName = str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Comm:
    """How the leaves of one layer travel; static, part of a ``Shard``'s type."""

    bucket_bytes: int = 25 << 20  # a bucket's bound in gathered (whole-leaf) bytes; 0: per leaf
    quantize_weights: bool = False  # stage 3's parameter all-gathers in int8
    quantize_grads: bool = False  # gradient reduce-scatters in int8 (all-to-all, fp32 sum)
    quantize_block: int = 64  # elements per int8 scale
    # Each device's piece of a gathered bucket padded to a multiple of this many elements; 0:
    # by the devices (``make_plan``): 128 on TPUs, whose compiler turns an all-gather of pieces
    # that end inside a 128-element tile into an all-reduce of the whole bucket (twice the
    # bytes; docs/benchmarks/tpu-compile.md), else 1.
    align: int = 0

    def __post_init__(self):
        if self.quantize_block < 1 or self.bucket_bytes < 0 or self.align < 0:
            raise ValueError(f"Comm: quantize_block must be at least 1, bucket_bytes and align "
                             f"at least 0 (got {self.quantize_block}, {self.bucket_bytes}, "
                             f"{self.align})")


def buckets(sizes: list[int], bound: int) -> list[list[int]]:
    """Consecutive indices grouped so that each group's bytes stay within ``bound``; a leaf
    larger than the bound is a group of its own. ``bound`` 0: every leaf alone."""
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not groups or bound <= 0 or total + size > bound:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


def rows(x: jax.Array, axis: int, n: int) -> jax.Array:
    """A whole leaf as ``n`` rows, row i the flattened shard of device i (cut along ``axis``)."""
    shape = x.shape
    x = x.reshape(*shape[:axis], n, shape[axis] // n, *shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0).reshape(n, -1)


def unrows(r: jax.Array, axis: int, shard_shape: tuple[int, ...]) -> jax.Array:
    """The inverse of ``rows``: ``n`` rows of shards back into the whole leaf."""
    n = r.shape[0]
    x = jnp.moveaxis(r.reshape(n, *shard_shape), 0, axis)
    return x.reshape(*shard_shape[:axis], n * shard_shape[axis], *shard_shape[axis + 1:])


def _split(flat: jax.Array, shapes: list[tuple[int, ...]]) -> list[jax.Array]:
    """``flat``'s last axis cut into consecutive pieces of the sizes of ``shapes``."""
    out, start = [], 0
    for shape in shapes:
        out.append(jax.lax.slice_in_dim(flat, start, start + math.prod(shape), axis=-1))
        start += math.prod(shape)
    return out


def _blocking(sizes: list[int], block: int) -> list[tuple[int, int]]:
    """(block length, blocks) of each piece: a piece shorter than ``block`` is one short block."""
    return [(min(block, n), -(-n // min(block, n))) for n in sizes]


def quantize(pieces: list[jax.Array], block: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 along the last axis, one fp32 scale per ``block`` elements, the blocks cut
    within each piece (a leaf's), never across two: a bucket packs a layer norm's gains (about
    1) beside weights (about 0.02), and a shared scale would round the small ones away. A
    piece is padded with zeros to whole blocks. ``(q[..., Q] int8, scales[..., S] fp32)``."""
    qs, scales = [], []
    for piece, (b, blocks) in zip(pieces, _blocking([p.shape[-1] for p in pieces], block),
                                  strict=True):
        piece = piece.astype(jnp.float32)
        piece = jnp.pad(piece, [(0, 0)] * (piece.ndim - 1) + [(0, b * blocks - piece.shape[-1])])
        piece = piece.reshape(*piece.shape[:-1], blocks, b)
        scale = jnp.max(jnp.abs(piece), axis=-1) / 127.0
        q = jnp.round(piece / jnp.where(scale == 0, 1.0, scale)[..., None]).astype(jnp.int8)
        qs.append(q.reshape(*q.shape[:-2], -1))
        scales.append(scale)
    return jnp.concatenate(qs, axis=-1), jnp.concatenate(scales, axis=-1)


def dequantize(q: jax.Array, scale: jax.Array, sizes: list[int], block: int) -> jax.Array:
    """fp32 values of ``quantize``'s output for pieces of ``sizes``, concatenated, each piece's
    padding cut back off."""
    how = _blocking(sizes, block)
    out = []
    for n, (b, blocks), piece, s in zip(sizes, how, _split(q, [(b * k,) for b, k in how]),
                                        _split(scale, [(k,) for _, k in how]), strict=True):
        x = piece.reshape(*piece.shape[:-1], blocks, b).astype(jnp.float32) * s[..., None]
        out.append(x.reshape(*x.shape[:-2], -1)[..., :n])
    return jnp.concatenate(out, axis=-1)


@jax.named_scope("gathered")  # peak.kind counts what this makes as gathered weights
def all_gather(xs: list[jax.Array], axes: list[int], mesh_axis: AxisName, comm: Comm,
               to: str = "varying", after: tuple = ()) -> list[jax.Array]:
    """Whole leaves from this device's shards (each cut along its ``axes`` entry): one
    all-gather per bucket, in int8 with ``comm.quantize_weights``; ``to="invarying"``: the
    result is marked the same on every device (``jax.lax.all_gather``'s ``to``).

    ``after``: arrays that the gathered buckets wait for before they are cut into leaves. A
    loop that carries the leaves to its next iteration (prefetch) passes what its iteration
    computes from the old ones: the new leaves then come into being once the old are dead,
    and XLA writes them over the old in place, where it would otherwise copy both.

    Every bucket is cut into all its leaves before any leaf is used (``_cut``).
    """
    n = jax.lax.axis_size(mesh_axis)
    groups = buckets([x.size * x.dtype.itemsize * n for x in xs], comm.bucket_bytes)
    moved = []
    for group in groups:
        if len(group) == 1 and not comm.quantize_weights:
            i = group[0]
            moved.append(jax.lax.all_gather(xs[i], mesh_axis, axis=axes[i], tiled=True, to=to))
        elif comm.quantize_weights:
            q, scale = quantize([xs[i].reshape(-1) for i in group], comm.quantize_block)
            moved.append((jax.lax.all_gather(q, mesh_axis, axis=0, tiled=False, to=to),
                          jax.lax.all_gather(scale, mesh_axis, axis=0, tiled=False, to=to)))
        else:
            flat = jnp.concatenate([xs[i].reshape(-1) for i in group])
            if pad := -flat.size % max(comm.align, 1):  # never read back: _cut slices it off
                flat = jnp.pad(flat, (0, pad))
            moved.append(jax.lax.all_gather(flat, mesh_axis, axis=0, tiled=False, to=to))  # n x L
    if after:
        moved = jax.lax.optimization_barrier((moved, after))[0]
    out: list[jax.Array] = [None] * len(xs)
    for group, gathered in zip(groups, moved, strict=True):
        if len(group) == 1 and not comm.quantize_weights:
            out[group[0]] = gathered
            continue
        for i, leaf in zip(group, _cut(gathered, [xs[i] for i in group],
                                       [axes[i] for i in group], comm), strict=True):
            out[i] = leaf
    return out


def _cut(gathered, xs: list[jax.Array], axes: list[int], comm: Comm) -> list[jax.Array]:
    """The whole leaves of the shards ``xs`` out of their gathered bucket (``n x L``, or int8
    and scales), all copied out before any is used: else XLA fuses some slices into their
    consumers, and the whole bucket stays live beside the leaves already cut from it (through a
    block's backward; in prefetch's loops, beside the next layer's too). Once per step (the
    hierarchical gather after the update) it costs nothing: the same temp on tiny and wide."""
    if comm.quantize_weights:
        gathered = dequantize(*gathered, [x.size for x in xs],
                              comm.quantize_block).astype(xs[0].dtype)
    pieces = _split(gathered, [x.shape for x in xs])
    out = [unrows(r, axis, x.shape) for r, axis, x in zip(pieces, axes, xs, strict=True)]
    return jax.lax.optimization_barrier(out)


def reduce_scatter(gs: list[jax.Array], axes: list[int], mesh_axis: AxisName, dtype: str,
                   comm: Comm, hold: Any = ()) -> tuple[list[jax.Array], Any]:
    """This device's shard of each leaf's sum over devices, summed in ``dtype``: one
    reduce-scatter per bucket, or with ``comm.quantize_grads`` an int8 all-to-all of the
    rows each device owns and an fp32 sum where they arrive. Returns ``(shards, hold)``.

    ``hold``: arrays (any tree) passed back once every bucket is packed. A loop that carries
    the whole gradients to its next iteration (prefetch) computes the next ones from what it
    gets back: they then come into being once the old are packed, and XLA writes them over
    the old in place, where it would otherwise copy both.
    """
    n = jax.lax.axis_size(mesh_axis)
    groups = buckets([g.size * jnp.dtype(dtype).itemsize for g in gs], comm.bucket_bytes)
    alone = lambda group: len(group) == 1 and not comm.quantize_grads
    packed = []
    for group in groups:
        if alone(group):
            packed.append(gs[group[0]].astype(dtype))
            continue
        pieces = [rows(gs[i].astype(dtype), axes[i], n) for i in group]  # n rows each
        packed.append(quantize(pieces, comm.quantize_block) if comm.quantize_grads
                      else jnp.concatenate(pieces, axis=1))
    if jax.tree.leaves(hold):
        packed, hold = jax.lax.optimization_barrier((packed, hold))
    out: list[jax.Array] = [None] * len(gs)
    for group, buffer in zip(groups, packed, strict=True):
        if alone(group):
            i = group[0]
            out[i] = jax.lax.psum_scatter(buffer, mesh_axis, scatter_dimension=axes[i],
                                          tiled=True)
            continue
        if comm.quantize_grads:
            q, scale = (jax.lax.all_to_all(x, mesh_axis, 0, 0, tiled=True) for x in buffer)
            sizes = [gs[i].size // n for i in group]
            mine = jnp.sum(dequantize(q, scale, sizes, comm.quantize_block), axis=0).astype(dtype)
        else:
            mine = jax.lax.psum_scatter(buffer, mesh_axis, scatter_dimension=0, tiled=True)[0]
        shard_shapes = []
        for i in group:
            shape = list(gs[i].shape)
            shape[axes[i]] //= n
            shard_shapes.append(tuple(shape))
        for i, piece, shape in zip(group, _split(mine, shard_shapes), shard_shapes, strict=True):
            out[i] = piece.reshape(shape)
    return out, hold


def all_reduce(gs: list[jax.Array], mesh_axis: AxisName, dtype: str,
               comm: Comm) -> list[jax.Array]:
    """Each leaf summed over devices in ``dtype``: one all-reduce per bucket (DDP's)."""
    out: list[jax.Array] = [None] * len(gs)
    sizes = [g.size * jnp.dtype(dtype).itemsize for g in gs]
    for group in buckets(sizes, comm.bucket_bytes):
        if len(group) == 1:
            out[group[0]] = jax.lax.psum(gs[group[0]].astype(dtype), mesh_axis)
            continue
        flat = jax.lax.psum(jnp.concatenate([gs[i].astype(dtype).reshape(-1) for i in group]),
                            mesh_axis)
        for i, piece in zip(group, _split(flat, [gs[i].shape for i in group]), strict=True):
            out[i] = piece.reshape(gs[i].shape)
    return out
