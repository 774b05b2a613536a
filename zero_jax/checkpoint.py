"""Sharded, asynchronous orbax checkpoints that restore onto any mesh and any stage.

A checkpoint stores arrays by their global shape: every device writes its own shards, and a
restore reads into whatever shardings the target asks for. So a checkpoint written at stage 3
on 8 devices restores at stage 1 on 4, or on one device, with no conversion step: the target
is ``abstract_state(plan, tx)`` of the new run.

Layout of step ``S`` under the directory: one orbax PyTree of plain nested dicts per field of
the ``TrainState`` (``S/params``, ``S/opt_state``, and ``S/master``, ``S/loss_scale``,
``S/skipped``), and ``S/meta`` (JSON: step, config, data position, who wrote it). Orbax writes
into a temporary directory and renames it when complete, so a save killed half-way is never
listed as a step.

Integrity: ``S/meta`` records a layout-independent digest of every array (``integrity.py``),
computed shard by shard at save and checked after every restore, so a corrupted file is
refused (``CorruptCheckpointError``, naming the step and the array) instead of trained on. A
state with non-finite values is never saved. One process writes a directory at a time (a
``flock``, ``lock.py``); readers (``read_only=True``) never create, clean up or delete anything.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import sys
import time
import traceback
import warnings
from typing import Any

import jax

from zero_jax import integrity
from zero_jax.internals import (
    ORBAX_JSON_FILE,
    ORBAX_READ_COROUTINE,
    ORBAX_STEP_FILE,
    ORBAX_TMP_SUFFIX,
    ORBAX_TREE_FILES,
    ORBAX_WRITE_COROUTINE,
)
from zero_jax.lock import LockedError, WriterLock
from zero_jax.offload import DEVICE, in_host_memory
from zero_jax.state import TrainState

PyTree = Any
FORMAT = 2  # 2: meta holds "digests"; format 1 checkpoints restore unverified
ITEMS = TrainState._fields[1:]  # every field but the step, which names the checkpoint


def _is_variable(x: Any) -> bool:
    """An NNX ``Variable`` (without importing NNX, which a linen run never loads)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def _names(tree: PyTree) -> list[str]:
    """The name of each of ``jax.tree.leaves(tree)``: its key path, "h_0/Dense_0/kernel", as
    flax's state dicts spell plain dicts, tuples and optax's named tuples (so checkpoints
    written from those read as before). Any pytree has them, NNX's ``State`` too, whose
    ``Variable`` is named by where it sits, not by its ``value`` attribute."""
    names = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        inner = [jax.tree_util.keystr(p, simple=True, separator="/")
                 for p, _ in jax.tree_util.tree_flatten_with_path(node)[0]]
        names += [name if len(inner) == 1 else f"{name}/{p}" for p in inner]
    return names


def _nested(flat: dict[str, Any]) -> dict:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``: what orbax stores."""
    out: dict = {}
    for name, leaf in flat.items():
        *parents, last = name.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return out


def _items(state: TrainState) -> dict[str, PyTree]:
    """The state's fields that hold arrays, each as a tree of plain dicts under its name. A
    field with none (a stateless optimizer's state) is not written: orbax writes no files for
    it, and its structure comes back from the restore target."""
    items = {}
    for name in ITEMS:
        field = getattr(state, name)
        if leaves := jax.tree.leaves(field):
            items[name] = {name: _nested(dict(zip(_names(field), leaves, strict=True)))}
    return items


def _unflat(target: PyTree, flat: dict[str, Any]) -> PyTree:
    """``target``'s tree with its leaves read from ``flat`` by name."""
    leaves = [flat[name] for name in _names(target)]
    return jax.tree.unflatten(jax.tree.structure(target), leaves)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message says why and what to do."""


class CorruptCheckpointError(CheckpointError):
    """A step whose files are missing, unreadable or do not match their digests."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class NonFiniteStateError(CheckpointError):
    """The state to save holds NaN or infinity: saving it would rotate good checkpoints out."""


@dataclasses.dataclass
class SaveStats:
    step: int
    started: float  # perf_counter at the save call
    blocked_s: float  # how long training waited for the save call
    total_s: float | None = None  # until the checkpoint was complete on disk
    size_bytes: int | None = None
    digest_s: float = 0.0  # of blocked_s: digests and the finiteness check

    def __str__(self) -> str:
        return (f"checkpoint {self.step}: {self.size_bytes / 2**20:.1f} MiB on disk, saved in "
                f"{self.total_s:.2f} s, of which {self.blocked_s:.2f} s blocked training "
                f"({self.digest_s * 1e3:.0f} ms digests)")


def _flat(tree: PyTree, prefix: str = "") -> dict[str, Any]:
    """``{"params/blocks/qkv/kernel": leaf}`` for a tree of nested dicts."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}/"))
        return out
    return {prefix.rstrip("/"): tree}


def _cast(master: PyTree, like: PyTree) -> PyTree:
    """``master`` in ``like``'s dtypes and shardings (memory kinds too)."""
    def one(x, t):
        return (jax.device_put(x, DEVICE) if in_host_memory(x) else x).astype(t.dtype)
    return jax.jit(lambda m: jax.tree.map(one, m, like),
                   out_shardings=jax.tree.map(lambda t: t.sharding, like))(master)


def first_mismatch(stored: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """The first path whose presence or shape differs between two flat trees, described."""
    for path in sorted(set(stored) | set(wanted)):
        if path not in stored:
            return f"{path} is not in the checkpoint"
        if path not in wanted:
            return f"{path} is in the checkpoint but not in the model/optimizer being restored"
        a, b = tuple(stored[path].shape), tuple(wanted[path].shape)
        if a != b:
            return f"{path} has shape {a} in the checkpoint but {b} here"
    return None


class Checkpoints:
    """The checkpoints of one run directory: save every so often, keep the last ``keep``.

    A writer (the default) holds the directory's lock until ``close()`` and removes what its
    own killed saves left behind; a reader (``read_only=True``) changes nothing on disk, so it
    is safe next to a writer. Numbered subdirectories that hold nothing of ours are listed in
    ``foreign`` and skipped by readers; a writer refuses them (orbax would not save below them).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, create: bool = True,
                 read_only: bool = False):
        ocp = _orbax()
        path = pathlib.Path(directory).absolute()
        create = create and not read_only
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} is a file: pass a directory")
        if not path.exists() and not create:
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        if path.exists() and not os.access(path, os.R_OK | os.X_OK):
            raise CheckpointError(f"checkpoint directory {path} is not readable")
        if keep < 1:
            raise CheckpointError(f"keep must be at least 1 (got {keep})")
        self.path, self.read_only, self.lock = path, read_only, None
        self.created = create and not path.exists()  # removed by close() if left empty
        if not read_only:
            try:
                path.mkdir(parents=True, exist_ok=True)
                if jax.process_index() == 0:  # one run, one lock: its first process holds it
                    self.lock = WriterLock(path)
            except LockedError as e:
                raise CheckpointError(str(e)) from None
            except OSError as e:
                raise CheckpointError(f"cannot write checkpoints into {path}: "
                                      f"{e.strerror}") from None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, create=False,
            enable_async_checkpointing=not read_only, cleanup_tmp_directories=not read_only)
        handlers = {name: ocp.StandardCheckpointHandler() for name in ITEMS}
        handlers["meta"] = ocp.JsonCheckpointHandler()
        self.manager = ocp.CheckpointManager(path, options=options, item_handlers=handlers)
        self.pending: SaveStats | None = None
        self.verify_s = 0.0  # how long the last restore spent checking digests
        self.foreign = [s for s in self.manager.all_steps() if not self._ours(s)]
        if self.foreign and not read_only:
            names = ", ".join(f"{s}/" for s in sorted(self.foreign))
            self.close()
            raise CheckpointError(f"checkpoint directory {path} holds {names}, which "
                                  f"{'is' if len(self.foreign) == 1 else 'are'} not a zero_jax "
                                  "checkpoint: move it out, or use another directory")

    def _ours(self, step: int) -> bool:
        d = self.path / str(step)
        return any((d / name).exists() for name in (ORBAX_STEP_FILE, "meta", *ITEMS))

    def steps(self) -> list[int]:
        """The complete checkpoints, oldest first (foreign numbered directories left out)."""
        return sorted(s for s in self.manager.all_steps() if s not in self.foreign)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint; a save that never finished does not count."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, state: TrainState, meta: dict) -> SaveStats:
        """Start writing ``state``; returns once the arrays are copied off the devices, while
        the files are written in the background. ``meta`` must be JSON, without the keys the
        checkpoint records itself (``format``, ``digests``, a ``step`` but the state's).

        Refuses (``NonFiniteStateError``) a state with NaN or infinity in its parameters,
        master copy or optimizer state, and a step not newer than the latest on disk."""
        ocp = _orbax()
        self.finish()
        step = int(state.step)
        if state.opt_state is None:
            raise CheckpointError(
                "this state's master and optimizer state live in the NVMe tier's files: save "
                "step.whole(state) instead")
        if self.read_only:
            raise CheckpointError(f"{self.path} was opened read-only")
        _check_meta(meta, step)
        if (latest := self.latest_step()) is not None and step <= latest:
            raise CheckpointError(f"cannot save step {step} in {self.path}: it already holds "
                                  f"step {latest}")
        start = time.perf_counter()
        items = _items(state)
        sums, bad = integrity.digests(_flat({k: v[k] for k, v in items.items()}))
        if bad := [p for p in bad if p.split("/")[0] in ("params", "master", "opt_state")]:
            raise NonFiniteStateError(
                f"the state at step {step} has non-finite values in {bad[0]}"
                f"{f' and {len(bad) - 1} more arrays' if len(bad) > 1 else ''}: not saved, "
                f"older checkpoints are kept")
        digest_s = time.perf_counter() - start
        try:
            saved = self.manager.save(step, args=ocp.args.Composite(
                meta=ocp.args.JsonSave({"format": FORMAT, "step": step, **meta,
                                        "digests": sums}),
                **{k: ocp.args.StandardSave(v) for k, v in items.items()}))
        except Exception as e:  # a write that fails before going to the background
            raise self._failed(step, e) from e
        if not saved:
            raise CheckpointError(f"orbax declined to save step {step} in {self.path}")
        self.pending = SaveStats(step, start, time.perf_counter() - start, digest_s=digest_s)
        return self.pending

    def poll(self) -> SaveStats | None:
        """The stats of the save in flight if it has just completed (cheap; call every step)."""
        if self.pending and not self.manager.is_saving_in_progress():
            return self.finish()
        return None

    def finish(self) -> SaveStats | None:
        """Wait for the save in flight; raise its error if it failed. Returns its stats."""
        done, self.pending = self.pending, None
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # orbax reports failed writes as ValueError, OSError, ...
            raise self._failed(done.step if done else None, e) from e
        if done:
            done.total_s = time.perf_counter() - done.started
            done.size_bytes = sum(f.stat().st_size for f in
                                  (self.path / str(done.step)).rglob("*") if f.is_file())
        return done

    def meta(self, step: int | None = None) -> dict:
        ocp = _orbax()
        step = self._step(step)
        with self._reading(step, "meta/metadata"):
            meta = self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore())).meta
        if not isinstance(meta, dict) or meta.get("step") != step:
            raise CorruptCheckpointError(step, f"checkpoint step {step} in {self.path} cannot "
                                         "be read: meta/metadata is not this step's metadata")
        return meta

    def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """Read step ``step`` (default: the latest) into ``target``'s shapes and shardings, and
        check every array against the digest recorded at save.

        ``target`` is a ``TrainState`` of ``jax.ShapeDtypeStruct``s with shardings, e.g.
        ``abstract_state(plan, tx)`` of any stage on any mesh, under any precision policy but
        fp16 from another (its loss scale is state no other keeps). Nothing on disk is changed.
        Raises ``CorruptCheckpointError`` for missing, unreadable or altered files.
        """
        ocp = _orbax()
        step = self._step(step)
        meta = self.meta(step)
        wanted = _items(target)
        self._check_present(step, meta, wanted)
        sources = self._sources(step, meta, target, wanted)
        reads = {sources[name]: {sources[name]: tree[name]} for name, tree in wanted.items()
                 if sources[name]}
        for name, tree in reads.items():
            with self._reading(step, name):
                stored = _tree_of(self.manager.item_metadata(step)[name])
            if problem := first_mismatch(_flat(stored), _flat(tree)):
                raise CheckpointError(f"checkpoint step {step} in {self.path} does not fit: "
                                      f"{problem}")
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                **{k: ocp.args.StandardRestore(v) for k, v in reads.items()}))
        except Exception as e:  # find the item that fails, to name it
            for name, tree in reads.items():
                with self._reading(step, name):
                    self.manager.restore(step, args=ocp.args.Composite(
                        **{name: ocp.args.StandardRestore(tree)}))
            with self._reading(step, "/".join(sorted(reads))):
                raise e
        restored = {name: restored[name] for name in reads}
        self._verify(step, meta, restored)
        fields = {name: _unflat(getattr(target, name), _flat(restored[source][source]))
                  for name, source in sources.items() if source}
        if "params" not in fields:  # another policy's checkpoint: cast from the fp32 copy
            fields["params"] = _cast(fields["master"], target.params)
        step_array = jax.device_put(jax.numpy.asarray(step, target.step.dtype),
                                    target.step.sharding)
        user = {k: v for k, v in meta.items() if k not in ("format", "digests")}
        return target._replace(step=step_array, **fields), user

    def _sources(self, step: int, meta: dict, target: TrainState,
                 wanted: dict) -> dict[str, str | None]:
        """The checkpoint's item each field of ``target`` is read from (None: the compute copy,
        cast from the master). Precision policies keep different copies (fp32 its parameters
        alone; bf16 and fp16, and an offloaded optimizer in fp32, a compute copy beside an fp32
        master) of the same fp32 values, so a state restores under any of them: its master
        from the checkpoint's fp32 copy, its compute copy that cast, as every step makes it."""
        # The items the checkpoint holds arrays of (an optimizer without state writes none).
        have = {path.split("/")[0] for path in meta["digests"]} if "digests" in meta else \
            {name for name in ITEMS if (self.path / str(step) / name).exists()}
        sources = {name: name for name in wanted}
        if "master" in wanted:
            sources["master"] = "master" if "master" in have else "params"
            if sources["master"] == "params" or self._dtypes(step, "params") != \
                    {leaf.dtype for leaf in jax.tree.leaves(target.params)}:
                sources["params"] = None
        elif "master" in have:
            sources["params"] = "master"
        read = {source for source in sources.values() if source}
        ignored = {"master", "params"} | ({"loss_scale"} if target.loss_scale is None else set())
        for name in sorted((read - have) | (have - read - ignored)):
            if name in have and getattr(target, name) is not None:  # held here, but empty
                with self._reading(step, name):
                    stored = _tree_of(self.manager.item_metadata(step)[name])
                raise CheckpointError(f"checkpoint step {step} in {self.path} does not fit: "
                                      f"{first_mismatch(_flat(stored), {})}")
            if name == "loss_scale":
                raise CheckpointError(f"checkpoint step {step} in {self.path} holds no loss "
                                      "scale (written without fp16): an fp16 run cannot resume "
                                      "it; resume it in bf16 or fp32")
            where = "the checkpoint" if name in have else "the state being restored"
            raise CheckpointError(f"checkpoint step {step} in {self.path} does not fit: {name} "
                                  f"is only in {where} (a different optimizer?)")
        return sources

    def _dtypes(self, step: int, name: str) -> set:
        with self._reading(step, name):
            stored = _tree_of(self.manager.item_metadata(step)[name])
        return {leaf.dtype for leaf in _flat(stored).values()}

    def read_params(self, step: int | None = None, sharding: Any = None) -> PyTree:
        """The fp32 parameters alone (the master copy when there is one), whole, on one device
        (or into ``sharding``), checked against their digests. Needs no model: the tree and
        shapes come from the checkpoint."""
        ocp = _orbax()
        step = self._step(step)
        meta = self.meta(step)
        name = "master" if (self.path / str(step) / "master").exists() else "params"
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        with self._reading(step, name):
            stored = _tree_of(self.manager.item_metadata(step)[name])[name]
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype,
                                                                 sharding=sharding), stored)
            restored = self.manager.restore(step, args=ocp.args.Composite(**{
                name: ocp.args.StandardRestore({name: target})}))
        self._verify(step, meta, {name: restored[name]})
        return restored[name][name]

    def quarantine(self, step: int) -> pathlib.Path:
        """Move a corrupted step aside (``S.corrupt``): kept for inspection, no longer a step,
        so the run can save that step again. Writers only."""
        if self.read_only:
            raise CheckpointError(f"{self.path} was opened read-only")
        source = self.path / str(step)
        target, n = self.path / f"{step}.corrupt", 1
        while target.exists():
            n += 1
            target = self.path / f"{step}.corrupt{n}"
        if jax.process_index() == 0:
            source.rename(target)
        _all_processes_here("quarantine")
        self.manager.reload()
        return target

    def remove_all(self) -> list[int]:
        """Delete every checkpoint (a run told to overwrite the directory). Writers only."""
        if self.read_only:
            raise CheckpointError(f"{self.path} was opened read-only")
        steps = self.steps()
        if jax.process_index() == 0:
            for step in steps:
                shutil.rmtree(self.path / str(step))
        _all_processes_here("remove_all")
        self.manager.reload()
        return steps

    def _check_present(self, step: int, meta: dict, wanted: dict) -> None:
        """An item the digests say was written, or whose directory is there, must have its
        files: one gone is damage (so a resume falls back), not a different model or policy."""
        written = {path.split("/")[0] for path in meta.get("digests") or {}}
        for name in sorted(wanted):
            there = (self.path / str(step) / name).exists()
            missing = _missing_file(self.path / str(step), name) if there else \
                name in written and f"{step}/{name}/"
            if missing:
                raise CorruptCheckpointError(step, f"checkpoint step {step} in {self.path} "
                                             f"cannot be read: {missing} is missing")

    def _verify(self, step: int, meta: dict, restored: dict) -> None:
        """Every restored array against the digest recorded at save (format 2 on)."""
        recorded = meta.get("digests")
        if recorded is None:
            return
        start = time.perf_counter()
        for path, leaf in _flat({k: v[k] for k, v in restored.items()}).items():
            want = recorded.get(path)
            if want is None:
                raise CorruptCheckpointError(step, f"checkpoint step {step} in {self.path} is "
                                             f"corrupted: meta records no digest of {path}")
            got, _ = integrity.digest(leaf)
            if got.split(":")[0] == want.split(":")[0] and got != want:
                raise CorruptCheckpointError(
                    step, f"checkpoint step {step} in {self.path} is corrupted: {path} does "
                    f"not match the digest recorded when it was saved (files under "
                    f"{self.path / str(step) / path.split('/')[0]})")
        self.verify_s = time.perf_counter() - start

    def _reading(self, step: int, item: str):
        return _Reading(self, step, item)

    def _failed(self, step: int | None, e: BaseException) -> CheckpointError:
        which = f" {step}" if step is not None else ""
        try:  # a full disk is the usual cause: say how full
            free = f" ({shutil.disk_usage(self.path).free / 2**30:.1f} GiB free there)"
        except OSError:
            free = ""
        return CheckpointError(f"saving checkpoint{which} in {self.path}{free} failed: "
                               f"{_first_line(e)}; older checkpoints are kept")

    def close(self) -> None:
        """Wait for nothing, stop orbax's threads, release the lock (call ``finish`` first)."""
        self.manager.close()
        if self.lock:
            self.lock.release()
            self.lock = None
        if self.created:
            try:
                self.path.rmdir()  # only if empty: a run that wrote nothing leaves nothing
            except OSError:
                pass

    def _step(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.path}")
        if step is None:
            return max(steps)
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {self.path}; it has "
                                  f"{', '.join(map(str, sorted(steps)))}")
        return step


class _Reading:
    """Any failure while reading one item of a step, as one line naming the step and file."""

    def __init__(self, ckpts: Checkpoints, step: int, item: str):
        self.where, self.step, self.item = ckpts.path / str(step), step, item

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, CheckpointError) or not isinstance(e, Exception):
            return False
        missing = _missing_file(self.where, self.item)
        what = f"{missing} is missing" if missing else f"{self.item}: {_first_line(_root(e))}"
        raise CorruptCheckpointError(self.step, f"checkpoint step {self.step} in "
                                     f"{self.where.parent} cannot be read: {what}") from None


def _check_meta(meta: dict, step: int) -> None:
    """``meta`` as it must be to come back from ``restore``: JSON, and none of the keys the
    checkpoint writes itself (a ``step`` other than the state's made the checkpoint read as
    corrupted)."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"meta must be a dict (got {type(meta).__name__}): nothing saved")
    if "step" in meta and meta["step"] != step:
        raise CheckpointError(f"meta's step {meta['step']!r} is not the state's step {step}, "
                              "which the checkpoint records (restore returns it in meta): "
                              "store yours under another key; nothing saved")
    if clash := [k for k in ("format", "digests") if k in meta]:
        raise CheckpointError(f"meta key {clash[0]!r} is the checkpoint's own: store yours "
                              "under another key; nothing saved")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"meta must be JSON (dicts, lists, strings, numbers, booleans, "
                              f"None): {e}; nothing saved") from None


def _root(e: BaseException) -> BaseException:
    """The innermost cause: orbax wraps TensorStore's error, which names the array and the
    file, in one that names neither."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _missing_file(step_dir: pathlib.Path, items: str) -> str | None:
    """The first file orbax needs that is not there, relative to the checkpoint directory."""
    for item in items.split("/")[0:1] if items.startswith("meta") else items.split("/"):
        needed = [ORBAX_JSON_FILE] if item == "meta" else ORBAX_TREE_FILES
        for name in needed:
            if not (step_dir / item / name).exists():
                return f"{step_dir.name}/{item}/{name}"
    return None


def _tree_of(metadata: Any) -> PyTree:
    tree = getattr(metadata, "tree", metadata)
    return tree if tree is not None else {}


class _OrbaxErrors(logging.Filter):
    """Orbax's own error records, and asyncio's about orbax's tasks and futures: a task names
    orbax's code; a future names nothing, but its exception's traceback runs through orbax or
    (a write tensorstore failed) its message names orbax's temporary directory."""

    def filter(self, record: logging.LogRecord) -> bool:
        orbax = f"{os.sep}orbax{os.sep}"
        tb = record.exc_info[2] if record.exc_info else None
        text = record.getMessage()
        return not (record.levelno >= logging.ERROR and (
            orbax in record.pathname or orbax in text or ORBAX_TMP_SUFFIX in text
            or any(orbax in frame.filename for frame in traceback.extract_tb(tb))))


class _NoStepMetadata(logging.Filter):
    """Orbax's warning that a step has no step metadata file (``ORBAX_STEP_FILE``: a save
    killed as it finished, say): the step reads without it, and its arrays are checked by their
    digests."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Metadata file does not exist") and
                    str(record.args and record.args[0]).endswith(ORBAX_STEP_FILE))


def _orbax():
    """orbax.checkpoint, imported when a checkpoint is first opened: a run that saves nothing
    never needs it, and its import is a sizeable part of a run's start (docs/testing.md)."""
    import orbax.checkpoint as ocp

    absl = logging.getLogger("absl")
    if not any(isinstance(f, _NoStepMetadata) for f in absl.filters):
        absl.addFilter(_NoStepMetadata())
    return ocp


def quiet_background_errors() -> None:
    """Keep a failed save or restore to the one line its ``CheckpointError`` says. A failed
    restore leaves its other array reads pending, each raising again when the garbage
    collector closes it (``sys.unraisablehook``). Orbax logs each failed
    background write with its traceback (absl's logger) before ``finish`` raises it, and the
    asyncio loops it closes on the way out leave "Event loop is closed" tracebacks behind
    (``sys.unraisablehook``), as do its tasks nobody awaits once the save has failed
    (asyncio's logger: "Task exception was never retrieved", the same of futures), and the
    writes it never started warn, unawaited, at exit. For a program that reports
    ``CheckpointError`` itself, as train.py does; everything else passes through."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OrbaxErrors) for f in logger.filters):
            logger.addFilter(_OrbaxErrors())
    # The writes a failed save never started, collected unawaited at exit.
    warnings.filterwarnings("ignore", f"coroutine '.*{ORBAX_WRITE_COROUTINE}' was never awaited",
                            RuntimeWarning)
    previous = sys.unraisablehook
    if getattr(previous, "quiets_orbax", False):  # called again (train.main, export.main)
        return

    def hook(unraisable) -> None:
        e = unraisable.exc_value
        closed = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
        if not closed and getattr(unraisable.object, "__name__", None) != ORBAX_READ_COROUTINE:
            previous(unraisable)

    hook.quiets_orbax = True
    sys.unraisablehook = hook


def _first_line(e: BaseException) -> str:
    text = [line.strip() for line in str(e).splitlines() if len(line.strip()) > 3]
    return (text[0] if text else type(e).__name__)[:200]


def _all_processes_here(name: str) -> None:
    """A barrier after process 0 changed the directory, before the others read it again."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"zero_jax checkpoint {name}")
