"""ZeRO-Infinity's NVMe tier: the fp32 master and optimizer state in files, updated in bands.

With ``Offload(optimizer=1.0, nvme=Nvme(path))`` the compiled step stops after the gradient
(``make_train_step``): the offloaded state is not an argument of any program. The update runs
here, on the host, through the pieces this process owns: a band (some rows of every
parameter's piece) of the master and of every per-parameter part of the optimizer state is
read from its device's file in one read (the file holds the bands one after another), updated
by the same optax computation as in memory, and written back in one write, while the next band
is read and the previous one written (DeepSpeed's pipelined swapper). At most
``Nvme.buffers`` bands are alive at once, so the host holds buffers, not the state.

Cutting rows is exact when the optimizer is elementwise (SGD, momentum, Adam, AdamW, Lion):
``check_elementwise`` reads that off the update's jaxpr and refuses the rest (global-norm
clipping, Adafactor's factored moments), naming what it found.

The files are the state: a second run writing into them, or bytes changed under the run, would
be trained on and checkpointed without a sign. So a tier holds its directory's writer lock
(``zero_jax.lock``) from its construction to ``close()``, and keeps the CRC-32 of every band as
it wrote it: a band read back (by the update, or by ``give`` for a checkpoint) that does not
match stops with ``NvmeError`` naming the file and the band. The sums live in memory: every run
writes the files anew from a state (``take``, ``start``), so no run reads another's files.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
import threading
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core

from zero_jax.lock import LockedError, WriterLock
from zero_jax.offload import Nvme  # noqa: F401 (the policy, re-exported)
from zero_jax.plan import Leaf, Plan

PyTree = Any


# Primitives that keep their operands' shape yet mix their elements: a chunk of rows would see
# only its own rows, so an update that uses one cannot be computed chunk by chunk.
_MIXING = {"iota", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "rev",
           "gather", "scatter", "scatter-add", "scatter_add", "dynamic_slice",
           "dynamic_update_slice", "transpose", "reshape", "concatenate", "pad", "slice",
           "squeeze", "expand_dims", "dot_general", "conv_general_dilated", "fft",
           "random_bits", "random_seed", "random_wrap", "random_unwrap", "rng_bit_generator",
           "argsort", "top_k", "reduce_precision_mixed"}


def check_elementwise(update: Callable, *args: Any) -> None:
    """Raise unless every array result of ``update(*args)`` is computed element by element from
    the arrays of the same shape (scalars may be read anywhere): then the update of a chunk of
    rows needs only those rows. Read off the jaxpr, control flow and calls included."""
    closed = jax.make_jaxpr(update)(*args)
    problem = _first_mixing(closed.jaxpr)
    if problem:
        raise ValueError(
            f"the NVMe tier updates the optimizer state in chunks of rows, so the optimizer "
            f"must be elementwise (SGD, Adam, AdamW, Lion; clip by value, not by global norm); "
            f"this one uses {problem}: use Offload(optimizer=1.0) without nvme, or an "
            f"elementwise optimizer")


def _first_mixing(jaxpr) -> str | None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = [v for v in eqn.params.values() if _is_jaxpr(v)]
        subs += [b for v in eqn.params.values() if isinstance(v, tuple | list)
                 for b in v if _is_jaxpr(b)]
        for sub in subs:
            found = _first_mixing(getattr(sub, "jaxpr", sub))
            if found:
                return found
        if subs:
            continue
        shapes = {tuple(v.aval.shape) for v in eqn.invars
                  if not isinstance(v, jex_core.Literal) and hasattr(v.aval, "shape")
                  and v.aval.shape != ()}
        outs = {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")}
        if name in _MIXING and (shapes or outs - {()}):
            return f"'{name}'"
        if len(shapes) > 1:
            return f"'{name}' over arrays of shapes {sorted(shapes)}"
        if shapes and outs == {()}:
            return f"a reduction ('{name}' of a {list(shapes)[0]} array to a scalar)"
    return None


def _is_jaxpr(v) -> bool:
    return isinstance(v, jex_core.Jaxpr | jex_core.ClosedJaxpr)


@dataclasses.dataclass
class _Shard:
    """One unique piece of a parameter that this process updates: where it is, its files."""

    leaf: int
    slot: int  # its place among the parameter's pieces here: the band loop's outer index
    piece: tuple[int, ...]  # its shape
    split: int  # the dimension its bands cut: rows are its elements before and along it
    shape: tuple[int, int]  # as rows: (rows, elements per row), C order
    devices: list  # the devices holding this piece (replicas share one update)
    parts: list[int | None]  # its master (None) and its optimizer-state leaves


@dataclasses.dataclass
class _Band:
    """Where one band of a slot lies in the slot's file: ``nbytes`` from ``start``, each
    (parameter, part) ``(offset within the band, rows)``, one after another."""

    start: int
    nbytes: int
    where: dict[tuple[int, int | None], tuple[int, int]]


class Tier:
    """The files, and the chunked update through them, for one process.

    ``Tier(plan, tx)`` checks the path and the optimizer; ``take(state)`` writes a state's
    master and optimizer state to the files and returns the state without them (``start``,
    a new state's master and the optimizer's init, band by band);
    ``update(grads)`` runs the pipeline; ``give(state, shardings)`` reads them back into a
    whole state (for a checkpoint, or to compare); ``close()`` lets another tier use the
    directory (as the tier's garbage collection, or the process's exit, does)."""

    def __init__(self, plan: Plan, tx: optax.GradientTransformation):
        self.plan, self.nvme = plan, plan.offload.nvme
        self.tx = plan.optimizer(tx)
        self.root = os.path.join(self.nvme.path, f"process{jax.process_index()}")
        self._leaves: list[Leaf] = jax.tree.leaves(plan.leaves, is_leaf=lambda x: isinstance(
            x, Leaf))
        self._shapes = jax.tree.leaves(plan.shapes)
        self._p_tree = jax.tree.structure(plan.shapes)
        state_shape = jax.eval_shape(self.tx.init, plan.shapes)
        self._s_flat, self._s_tree = jax.tree.flatten(state_shape)
        # Per leaf of the state: the parameter it belongs to (-1: shared, like Adam's count).
        owners = jax.tree.leaves(plan.map_opt_state(
            tx, lambda x, i, leaf: i if x.shape == leaf.shape else -2,
            jax.tree.unflatten(self._p_tree, list(range(len(self._shapes)))), -1))
        for state_leaf, o in zip(self._s_flat, owners, strict=True):
            if o == -2:
                raise ValueError(
                    f"the NVMe tier updates the optimizer state in chunks of rows; this "
                    f"optimizer keeps state of shape {state_leaf.shape} for a parameter of "
                    f"another shape (factored moments): use an elementwise optimizer")
        self._owner: list[int] = owners
        self._shared_idx = [j for j, o in enumerate(self._owner) if o < 0]
        self._frozen = {i for i, leaf in enumerate(self._leaves) if leaf.frozen}
        self._shards = self._layout()
        self._check_optimizer()
        self._slots, self._nbands, self._rows = self._bands()
        self._placed = [self._place(slot) for slot in self._slots]
        self.check_path()
        self._lock = self._take_lock()
        self._sums: list[list[int]] = [[] for _ in self._slots]  # per band, as written
        self._kept_sums: list[list[tuple[int, int, int]]] = [[] for _ in self._slots]
        self._band = [self._piece_shape(i, r) for i, r in enumerate(self._rows)]
        self.band_fn = self._band_fn()
        self.band_program = jax.jit(self.band_fn)  # runs where its arguments are: the CPU
        self._init_program = jax.jit(lambda masters: jax.tree.leaves(
            self.tx.init(self._p_tree.unflatten(masters))))
        self._cpu = jax.local_devices(backend="cpu")[0]
        self.shared: list[np.ndarray] | None = None  # the shared state leaves, in memory
        self.read_bytes = self.written_bytes = 0  # of the last update
        self.high_water = 0  # the most chunk bytes alive at once, over all updates

    # -- layout ------------------------------------------------------------------------------
    def _layout(self) -> list[_Shard]:
        specs = jax.tree.leaves(self.plan.opt_specs, is_leaf=lambda x: isinstance(
            x, jax.sharding.PartitionSpec))
        shards = []
        # Rows small enough that one of every parameter's takes half a chunk at most.
        row_budget = self.nvme.chunk_bytes / (2 * len(self._shapes)) / (
            4 + sum(x.dtype.itemsize for x, o in zip(self._s_flat, self._owner, strict=True)
                    if o >= 0) / max(1, len(self._shapes)))
        for i, (shape, spec) in enumerate(zip(self._shapes, specs, strict=True)):
            sharding = jax.sharding.NamedSharding(self.plan.mesh, spec)
            pieces: dict[tuple, list] = collections.defaultdict(list)
            for device, index in sharding.addressable_devices_indices_map(
                    shape.shape).items():
                key = tuple((s.start, s.stop) for s in index)
                pieces[key].append((device, index))
            for k, where in enumerate(pieces.values()):  # in the order of the devices
                index = where[0][1]
                piece = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape.shape,
                                                                       strict=True))
                split = _split(piece, row_budget)
                rows, row = math.prod(piece[:split + 1]), math.prod(piece[split + 1:])
                parts = [None] + [j for j, o in enumerate(self._owner) if o == i]
                shards.append(_Shard(i, k, piece, split, (rows, row), [d for d, _ in where],
                                     parts))
        return shards

    def _place(self, slot: dict[int, _Shard]) -> tuple[list[_Band], dict, int]:
        """The layout of a slot's file: band after band, each one contiguous run of the rows
        of every trained piece's parts (one read and one write a band, as a sequential pass
        over the file makes); then the frozen pieces whole, which no step reads. Returns
        (bands, {(parameter, part): offset} of the frozen ones, the file's size)."""
        at, bands = 0, []
        for k in range(self._nbands):
            start, where = at, {}
            for i, s in sorted(slot.items()):
                a, b = self._span(s, k)
                if i in self._frozen or b <= a:
                    continue
                for p in s.parts:
                    where[i, p] = (at - start, b - a)
                    at += (b - a) * s.shape[1] * self._itemsize(p)
            bands.append(_Band(start, at - start, where))
        kept = {}
        for i, s in sorted(slot.items()):
            for p in s.parts if i in self._frozen else ():
                kept[i, p] = at
                at += s.shape[0] * s.shape[1] * self._itemsize(p)
        return bands, kept, at

    def _row_bytes(self, shard: _Shard) -> int:
        """Bytes of one row of a piece across its parts (master and state)."""
        return sum(shard.shape[1] * self._itemsize(p) for p in shard.parts)

    def _dtype(self, part: int | None):
        return jnp.float32 if part is None else self._s_flat[part].dtype

    def _itemsize(self, part: int | None) -> int:
        return np.dtype(self._dtype(part)).itemsize

    @property
    def bytes(self) -> int:
        """The bytes this process keeps in files."""
        return sum(s.shape[0] * self._row_bytes(s) for s in self._shards)

    @property
    def files(self) -> list[str]:
        """One file per slot (the pieces one device updates)."""
        return [os.path.join(self.root, f"slot{j}.bin") for j in range(len(self._slots))]

    def check_path(self) -> None:
        """One clear error, before anything is written, for a path that cannot hold the
        state: missing, not a directory, not writable, or without the room."""
        path = self.nvme.path
        if not os.path.isdir(path):
            raise ValueError(f"NVMe path {path} is not an existing directory: create it on a "
                             f"local disk, or set another")
        try:  # root passes os.access everywhere; a read-only file system still refuses
            # A name of this probe's own: the processes of a host share the path, and one's
            # removal of a common name failed another's check.
            fd, probe = tempfile.mkstemp(dir=path, prefix=".zero_jax-probe-")
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"NVMe path {path} is not writable ({e.strerror}): set a "
                             f"directory you can write to") from None
        existing = sum(os.path.getsize(f) for f in self.files if os.path.exists(f))
        free = shutil.disk_usage(path).free + existing
        if free < self.bytes:
            raise ValueError(f"NVMe path {path} has {free / 2**30:.3f} GiB free; this "
                             f"process's optimizer state needs {self.bytes / 2**30:.3f} GiB: "
                             f"free space there, or spread the state over more devices")

    def _take_lock(self) -> WriterLock:
        """This process's directory, locked: one run's state per directory (two would train
        each on the other's)."""
        try:
            os.makedirs(self.root, exist_ok=True)
            lock = WriterLock(self.root, "the NVMe tier's directory", (
                "two runs on one directory would train on each other's optimizer state; wait "
                "for it to finish, or give this run another NVMe path"))
        except LockedError as e:
            raise ValueError(str(e)) from None
        except OSError as e:
            raise ValueError(f"NVMe path {self.nvme.path}: cannot create {self.root} "
                             f"({e.strerror}): set a directory you can write to") from None
        self._release = weakref.finalize(self, lock.release)
        return lock

    def close(self) -> None:
        """Release the directory (the files stay); removed if this tier wrote nothing in it."""
        self._release()
        with contextlib.suppress(OSError):
            os.rmdir(self.root)

    # -- the update of one chunk --------------------------------------------------------------
    def _optimize(self, grads, opt_state, master):
        updates, opt_state = self.tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    def _check_optimizer(self) -> None:
        local = {s.leaf: s.shape for s in self._shards}
        grads = [jax.ShapeDtypeStruct(self._piece_shape(i, local[i][0]), jnp.float32)
                 for i in range(len(self._shapes))]
        state = [jax.ShapeDtypeStruct(x.shape, x.dtype) if o < 0 else
                 jax.ShapeDtypeStruct(self._piece_shape(o, local[o][0]), x.dtype)
                 for x, o in zip(self._s_flat, self._owner, strict=True)]
        check_elementwise(lambda g, s, m: self._optimize(
            self._p_tree.unflatten(g), self._s_tree.unflatten(s), self._p_tree.unflatten(m)),
            grads, state, grads)
        check_elementwise(lambda m: self.tx.init(self._p_tree.unflatten(m)), grads)

    def _piece_shape(self, i: int, rows: int) -> tuple[int, ...]:
        """The shape that ``rows`` rows of parameter ``i``'s piece are handed to the optimizer
        in: its rank and the dimensions after its split kept (masks by rank or shape still
        apply), ones before. A scalar stays a scalar."""
        s = next(s for s in self._shards if s.leaf == i)
        if not s.piece:
            return ()
        return (1,) * s.split + (rows,) + s.piece[s.split + 1:]

    def _bands(self) -> tuple[list[dict[int, _Shard]], int, list[int]]:
        """The update's work: per slot (the k-th piece of every parameter: one device's share),
        ``bands`` bands, each ``rows[i]`` rows of every parameter ``i`` (zeros past its end),
        about ``Nvme.chunk_bytes`` together."""
        slots: list[dict[int, _Shard]] = [{} for _ in range(max(s.slot for s in self._shards) + 1)]
        for s in self._shards:
            slots[s.slot][s.leaf] = s
        first = slots[0]
        total = sum(s.shape[0] * self._row_bytes(s) for s in first.values())
        bands = max(1, min(-(-2 * total // self.nvme.chunk_bytes),
                           max(s.shape[0] for s in first.values())))
        rows = [-(-first[i].shape[0] // bands) if i in first else 1
                for i in range(len(self._shapes))]
        return slots, bands, rows

    def _band_fn(self) -> Callable:
        """``fn(grads, masters, states) -> (masters, states, computes)`` over one band: the
        optimizer over the whole parameter tree, each leaf ``self._band[i]`` of its piece, so
        that XLA sees the program it sees in memory (it rewrites Adam's divisions by the bias
        corrections differently when fewer leaves share them), and rounds the same."""
        compute = self.plan.precision.compute

        def fn(grads, masters, states):
            new_m, new_s = self._optimize(self._p_tree.unflatten(grads),
                                          self._s_tree.unflatten(states),
                                          self._p_tree.unflatten(masters))
            new_m = jax.tree.leaves(new_m)
            return new_m, jax.tree.leaves(new_s), [m.astype(compute) for m in new_m]

        return fn

    # -- files --------------------------------------------------------------------------------
    def take(self, state):
        """Write ``state``'s master and optimizer state to the files; return the state without
        them (``master`` and ``opt_state`` None), the shared scalars kept here."""
        masters, states = jax.tree.leaves(state.master), jax.tree.leaves(state.opt_state)
        for j, slot in enumerate(self._slots):
            rows = {(i, p): _local(masters[i] if p is None else states[p], s).reshape(s.shape)
                    for i, s in slot.items() for p in s.parts}
            self._write_slot(j, lambda k, slot=slot, rows=rows: {
                (i, p): x[slice(*self._span(slot[i], k))] for (i, p), x in rows.items()})
        self.shared = [np.asarray(states[j]) for j in self._shared_idx]
        self._write_meta()
        return _moved(state)

    def start(self, state):
        """Write a new state's master, and the optimizer state ``tx.init`` gives it, to the
        files band by band, so that the optimizer state is never whole in memory; return the
        state without its master (``_new_state`` made none)."""
        masters, n, init = jax.tree.leaves(state.master), len(self._shapes), []
        for j, slot in enumerate(self._slots):
            rows = {i: _local(masters[i], s).reshape(s.shape) for i, s in slot.items()}

            def band(k, slot=slot, rows=rows):  # band k's master rows and tx.init's state
                band_m = [np.zeros(self._band[i], np.float32) for i in range(n)]
                for i, s in slot.items():
                    a, b = self._span(s, k)
                    band_m[i].reshape(self._rows[i], -1)[:max(0, b - a)] = rows[i][a:b]
                with jax.default_device(self._cpu):
                    init[:] = jax.device_get(self._init_program(band_m))
                span = lambda i: slice(0, len(range(*self._span(slot[i], k))))
                return {(i, p): rows[i][slice(*self._span(s, k))] if p is None else
                        init[p].reshape(self._rows[i], -1)[span(i)]
                        for i, s in slot.items() for p in s.parts}
            self._write_slot(j, band)
        self.shared = [np.asarray(init[j]) for j in self._shared_idx]
        self._write_meta()
        return _moved(state)

    def _write_slot(self, j: int, rows_of: Callable[[int], dict]) -> None:
        """Slot ``j``'s file, written band by band: ``rows_of(k)`` gives band k's rows of every
        piece's parts, ``{(parameter, part): rows}``, trained (into the band, one write) and
        frozen (into their place after the bands) alike; the checksum of each write kept."""
        bands, kept, size = self._placed[j]
        self._sums[j], self._kept_sums[j] = [], []
        try:
            fd = os.open(self.files[j], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                for k, band in enumerate(bands):
                    data = np.zeros(band.nbytes, np.uint8)
                    for (i, p), x in rows_of(k).items():
                        x = np.ascontiguousarray(x, self._dtype(p)).view(np.uint8).ravel()
                        if not x.nbytes:
                            continue
                        if i not in self._frozen:
                            data[band.where[i, p][0]:][:x.nbytes] = x
                        else:
                            s = self._slots[j][i]
                            at = kept[i, p] + self._span(s, k)[0] * s.shape[1] * \
                                self._itemsize(p)
                            _pwrite(fd, x, at, self.files[j])
                            self._kept_sums[j].append((at, x.nbytes, checksum(x)))
                    _pwrite(fd, data, band.start, self.files[j])
                    self._sums[j].append(checksum(data))
            finally:
                os.close(fd)
        except OSError as e:
            raise NvmeError(f"the NVMe tier's file {self.files[j]} could not be written ({e}): "
                            f"nothing was trained; free or fix the disk and start again") from None

    def give(self, state, shardings):
        """``state`` with its master and optimizer state read back from the files, laid out by
        ``shardings`` (``state_shardings``'s, or an ``abstract_state``): for a checkpoint, or
        to compare."""
        self._check_written()
        sharding = lambda tree: [getattr(x, "sharding", x) for x in jax.tree.leaves(tree)]
        m_sh, s_sh = sharding(shardings.master), sharding(shardings.opt_state)
        pieces: dict[tuple[int, int | None], list] = collections.defaultdict(list)
        for j, (slot, (bands, kept, _)) in enumerate(zip(self._slots, self._placed,
                                                        strict=True)):
            data = self._read_whole(j)
            rows = {(i, p): np.empty(s.shape, self._dtype(p)) for i, s in slot.items()
                    for p in s.parts}
            for k, band in enumerate(bands):
                for (i, p), (offset, n) in band.where.items():
                    a = self._span(slot[i], k)[0]
                    rows[i, p][a:a + n] = _view(data, band.start + offset, self._dtype(p),
                                                (n, slot[i].shape[1]))
            for (i, p), offset in kept.items():
                rows[i, p][:] = _view(data, offset, self._dtype(p), slot[i].shape)
            for (i, p), x in rows.items():
                pieces[i, p] += [jax.device_put(x.reshape(slot[i].piece), d)
                                 for d in slot[i].devices]
        masters: list[Any] = [None] * len(self._shapes)
        states: list[Any] = [None] * len(self._s_flat)
        for (i, part), arrays in pieces.items():
            sh, x = (m_sh[i], self._shapes[i]) if part is None else (s_sh[part],
                                                                      self._s_flat[part])
            whole = jax.make_array_from_single_device_arrays(
                x.shape, jax.sharding.NamedSharding(sh.mesh, sh.spec), arrays)
            (masters if part is None else states)[i if part is None else part] = \
                jax.device_put(whole, sh)
        for j, value in zip(self._shared_idx, self.shared, strict=True):
            states[j] = jax.device_put(value, s_sh[j])
        return state._replace(master=self._p_tree.unflatten(masters),
                              opt_state=self._s_tree.unflatten(states))

    def _check_written(self) -> None:
        if not all(self._sums):
            raise ValueError("the NVMe tier holds no state of its own yet: the state's master "
                             "and optimizer state are in another tier's files; hand this step "
                             "a whole state (init_state's, or a restored checkpoint)")

    def _read_whole(self, j: int) -> np.ndarray:
        """Slot ``j``'s file, every band and frozen piece checked against its checksum."""
        bands, _, size = self._placed[j]
        try:
            data = np.fromfile(self.files[j], np.uint8)
        except OSError as e:
            raise NvmeError(f"the NVMe tier's file {self.files[j]} cannot be read back ({e}): "
                            f"restart from the last checkpoint") from None
        if data.nbytes != size:
            raise NvmeError(f"the NVMe tier's file {self.files[j]} is {data.nbytes} bytes, not "
                            f"the {size} it was written with: it was damaged; restart from the "
                            f"last checkpoint")
        for k, band in enumerate(bands):
            self._check(j, k, data[band.start:band.start + band.nbytes])
        for at, n, crc in self._kept_sums[j]:
            if checksum(data[at:at + n]) != crc:
                raise NvmeError(self._damaged(j, f"the frozen bytes {at}-{at + n}"))
        return data

    def _check(self, j: int, k: int, data: np.ndarray) -> None:
        """Raise unless band ``k`` of slot ``j``, as read, is the band as written."""
        if checksum(data) != self._sums[j][k]:
            band = self._placed[j][0][k]
            raise NvmeError(self._damaged(j, f"band {k} of {self._nbands} (bytes {band.start}-"
                                             f"{band.start + band.nbytes})"))

    def _damaged(self, j: int, what: str) -> str:
        return (f"the NVMe tier's file {self.files[j]} is damaged: {what} does not match the "
                f"checksum written with it; nothing was trained on it or read back from it: "
                f"restart from the last checkpoint")

    def _write_meta(self) -> None:
        part = lambda p: "master" if p is None else f"optimizer state leaf {p}"
        meta = [{"file": os.path.basename(f), "bytes": size, "bands": self._nbands,
                 "pieces": [{"parameter": self._leaves[i].path, "part": part(p),
                             "rows": s.shape[0], "row_elements": s.shape[1],
                             "frozen": i in self._frozen}
                            for i, s in sorted(slot.items()) for p in s.parts]}
                for f, slot, (_, _, size) in zip(self.files, self._slots, self._placed,
                                                 strict=True)]
        with open(os.path.join(self.root, "layout.json"), "w") as fh:
            json.dump({"files": meta}, fh, indent=1)

    # -- the pipeline -------------------------------------------------------------------------
    def update(self, grads: PyTree, program: Callable | None = None
               ) -> dict[int, list[jax.Array]]:
        """``_update`` (with ``program`` for ``band_program``: one compiled with other options),
        a failed read or write said in one line."""
        self._check_written()
        try:
            return self._update(grads, program or self.band_program)
        except OSError as e:
            raise NvmeError(
                f"the NVMe tier's files under {self.root} failed mid-step ({e}): the optimizer "
                f"state there is partly updated; restart from the last checkpoint") from None

    def _update(self, grads: PyTree, program: Callable) -> dict[int, list[jax.Array]]:
        """One optimizer step over every piece this process owns, band by band: band k+1 is
        read and band k-1 written while band k is updated, at most ``Nvme.buffers`` bands
        alive. Returns each trained parameter's new compute copy, as the single-device arrays
        of its pieces, each put on its devices as soon as its slot is done."""
        flat = jax.tree.leaves(grads)
        buffers = _Buffers(self.nvme.buffers)
        self.read_bytes = self.written_bytes = 0
        out: dict[int, list[jax.Array]] = collections.defaultdict(list)
        with ThreadPoolExecutor(1) as reader, ThreadPoolExecutor(1) as writer:
            writes: list[Future] = []
            reads = collections.deque(reader.submit(self._read, j, k, buffers)
                                      for j in range(len(self._slots))
                                      for k in range(self._nbands))
            try:
                for j, slot in enumerate(self._slots):
                    mine = [i for i in slot if i not in self._frozen]
                    g = {i: _local(flat[i], slot[i]).reshape(slot[i].shape) for i in mine}
                    computes = {i: np.empty(slot[i].shape, self.plan.precision.compute)
                                for i in mine}
                    for k, band in enumerate(self._placed[j][0]):
                        data = reads.popleft().result()
                        shared = self._update_band(program, slot, k, band, data, g, computes)
                        writes.append(writer.submit(self._write, j, k, data, buffers))
                        self.read_bytes += band.nbytes
                        self.written_bytes += band.nbytes
                    for i in mine:
                        piece = computes[i].reshape(slot[i].piece)
                        out[i] += [jax.device_put(piece, d) for d in slot[i].devices]
                for w in writes:
                    w.result()  # a failed write raises here
            except BaseException:
                buffers.abort(len(reads))  # the reader may wait for a buffer never freed
                raise
        self.high_water = max(self.high_water, buffers.high_water)
        self.shared = shared
        return out

    def _update_band(self, program: Callable, slot: dict[int, _Shard], k: int, band: _Band,
                     data: np.ndarray, g: dict, computes: dict) -> list:
        """Band ``k`` of ``slot`` through the optimizer, its new rows written over the old in
        ``data`` (the band as read) and into ``computes`` (the compute copy); returns the new
        shared state."""
        rows, n = self._rows, len(self._shapes)
        zeros = lambda i, dtype: np.zeros(self._band[i], dtype)
        def view(i, p):  # the band's rows of piece i's part p, in ``data``
            offset, n = band.where[i, p]
            return _view(data, offset, self._dtype(p), (n, slot[i].shape[1]))

        def padded(i, p):  # the band's rows of piece i, zeros up to every band's row count
            x = view(i, p)
            if x.shape[0] == rows[i]:
                return x.reshape(self._band[i])
            full = np.zeros((rows[i], x.shape[1]), x.dtype)
            full[:x.shape[0]] = x
            return full.reshape(self._band[i])

        def grad(i):  # a view where the band is whole
            a, b = self._span(slot[i], k)
            if b - a == rows[i]:
                return g[i][a:b].reshape(self._band[i])
            x = zeros(i, np.float32)
            x.reshape(rows[i], -1)[:max(0, b - a)] = g[i][a:b]
            return x

        band_g = [grad(i) if i in g else zeros(i, np.float32) for i in range(n)]
        masters = [padded(i, None) if (i, None) in band.where else zeros(i, np.float32)
                   for i in range(n)]
        shared = iter(self.shared)
        states = [next(shared) if o < 0 else padded(o, j) if (o, j) in band.where
                  else zeros(o, x.dtype)
                  for j, (x, o) in enumerate(zip(self._s_flat, self._owner, strict=True))]
        with jax.default_device(self._cpu):  # numpy arguments go where the host computes
            new_m, new_s, new_c = jax.device_get(program(band_g, masters, states))
        for i, p in band.where:
            a, b = self._span(slot[i], k)
            new = (new_m[i] if p is None else new_s[p]).reshape(rows[i], -1)[:b - a]
            view(i, p)[:] = new
            if p is None:
                computes[i][a:b] = new_c[i].reshape(rows[i], -1)[:b - a]
        return [np.asarray(new_s[j]) for j in self._shared_idx]

    def _span(self, s: _Shard, k: int) -> tuple[int, int]:
        """The rows of piece ``s`` in band ``k`` (empty past its end)."""
        r = self._rows[s.leaf]
        return k * r, min(s.shape[0], (k + 1) * r)

    def _read(self, j: int, k: int, buffers: _Buffers) -> np.ndarray | None:
        """Band ``k`` of slot ``j``, in one read, once a buffer is free (None: aborted); and
        the kernel asked to start reading band k+1."""
        band, bands = self._placed[j][0][k], self._placed[j][0]
        if not buffers.take(band.nbytes):
            return None
        data = np.empty(band.nbytes, np.uint8)
        fd = os.open(self.files[j], os.O_RDONLY)
        try:
            got = os.preadv(fd, [memoryview(data)], band.start)
            if got != band.nbytes:
                raise OSError(f"{self.files[j]}: short read ({got} of {band.nbytes} bytes)")
            self._check(j, k, data)
            if k + 1 < len(bands):
                os.posix_fadvise(fd, bands[k + 1].start, bands[k + 1].nbytes,
                                 os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
        return data

    def _write(self, j: int, k: int, data: np.ndarray, buffers: _Buffers) -> None:
        band = self._placed[j][0][k]
        try:
            crc = checksum(data)
            _write_at(self.files[j], data, band.start)
            self._sums[j][k] = crc
        finally:
            buffers.free(band.nbytes)


class _Buffers:
    """At most ``n`` bands alive: a read waits for a buffer, a finished write frees one."""

    def __init__(self, n: int):
        self._free, self._stop, self._lock = threading.Semaphore(n), threading.Event(), \
            threading.Lock()
        self.alive = self.high_water = 0

    def take(self, nbytes: int) -> bool:
        self._free.acquire()
        if self._stop.is_set():
            return False
        with self._lock:
            self.alive += nbytes
            self.high_water = max(self.high_water, self.alive)
        return True

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.alive -= nbytes
        self._free.release()

    def abort(self, waiting: int) -> None:
        self._stop.set()
        for _ in range(waiting + 1):
            self._free.release()


class NvmeError(RuntimeError):
    """A read or write of the NVMe tier's files failed during a step."""


def _split(piece: tuple[int, ...], budget: float) -> int:
    """The first dimension whose trailing dimensions hold at most ``budget`` elements (the
    last, if none)."""
    for d in range(len(piece)):
        if math.prod(piece[d + 1:]) <= budget:
            return d
    return max(0, len(piece) - 1)


def _local(x: jax.Array, s: _Shard) -> np.ndarray:
    """The piece ``s`` of the global array ``x``, from a device of this process holding it."""
    for shard in x.addressable_shards:
        if shard.device == s.devices[0]:
            return np.asarray(shard.data)
    raise AssertionError("a piece with no local device")


def _moved(state):
    """``state`` without its master and optimizer state, whose arrays, now in the files, are
    deleted: the step consumes the state it is given, as a jitted step's donation does."""
    for x in jax.tree.leaves((state.master, state.opt_state)):
        if isinstance(x, jax.Array):
            x.delete()
    return state._replace(master=None, opt_state=None)


def _view(data: np.ndarray, offset: int, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes of ``data`` from ``offset`` as an array of ``shape`` (a view: writable)."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    return data[offset:offset + n].view(dtype).reshape(shape)


def checksum(data: np.ndarray) -> int:
    """The CRC-32 of a band's bytes (``uint8``), as written or as read."""
    return zlib.crc32(data)


def _write_at(path: str, data: np.ndarray, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        _pwrite(fd, data, offset, path)
    finally:
        os.close(fd)


def _pwrite(fd: int, data: np.ndarray, offset: int, path: str) -> None:
    if (done := os.pwrite(fd, memoryview(data), offset)) != data.nbytes:
        raise OSError(f"{path}: short write ({done} of {data.nbytes} bytes)")
