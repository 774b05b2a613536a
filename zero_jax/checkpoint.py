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
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import serialization

from zero_jax.step import TrainState

PyTree = Any
FORMAT = 1
ITEMS = TrainState._fields[1:]  # every field but the step, which names the checkpoint


def _items(state: TrainState) -> dict[str, PyTree]:
    """The state's fields that are present, each as a tree of plain dicts under its name."""
    return {name: {name: serialization.to_state_dict(getattr(state, name))}
            for name in ITEMS if getattr(state, name) is not None}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message says why and what to do."""


@dataclasses.dataclass
class SaveStats:
    step: int
    started: float  # perf_counter at the save call
    blocked_s: float  # how long training waited for the save call
    total_s: float | None = None  # until the checkpoint was complete on disk
    size_bytes: int | None = None

    def __str__(self) -> str:
        return (f"checkpoint {self.step}: {self.size_bytes / 2**20:.1f} MiB on disk, saved in "
                f"{self.total_s:.2f} s, of which {self.blocked_s:.2f} s blocked training")


def _flat(tree: PyTree, prefix: str = "") -> dict[str, Any]:
    """``{"params/blocks/qkv/kernel": leaf}`` for a tree of nested dicts."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}/"))
        return out
    return {prefix.rstrip("/"): tree}


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
    """The checkpoints of one run directory: save every so often, keep the last ``keep``."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, create: bool = True):
        path = pathlib.Path(directory).absolute()
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} is a file: pass a directory")
        if not path.exists() and not create:
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        if path.exists() and not os.access(path, os.R_OK | os.X_OK):
            raise CheckpointError(f"checkpoint directory {path} is not readable")
        if keep < 1:
            raise CheckpointError(f"--keep must be at least 1 (got {keep})")
        self.path = path
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                               enable_async_checkpointing=True,
                                               cleanup_tmp_directories=True)
        handlers = {name: ocp.StandardCheckpointHandler() for name in ITEMS}
        handlers["meta"] = ocp.JsonCheckpointHandler()
        self.manager = ocp.CheckpointManager(path, options=options, item_handlers=handlers)
        self.pending: SaveStats | None = None

    def latest_step(self) -> int | None:
        """The newest complete checkpoint; a save that never finished does not count."""
        return self.manager.latest_step()

    def save(self, state: TrainState, meta: dict) -> SaveStats:
        """Start writing ``state``; returns once the arrays are copied off the devices, while
        the files are written in the background. ``meta`` must be JSON."""
        self.finish()
        step = int(state.step)
        start = time.perf_counter()
        try:
            items = {k: ocp.args.StandardSave(v) for k, v in _items(state).items()}
            self.manager.save(step, args=ocp.args.Composite(
                meta=ocp.args.JsonSave({"format": FORMAT, "step": step, **meta}), **items))
        except Exception as e:  # a write that fails before going to the background
            raise self._failed(step, e) from e
        self.pending = SaveStats(step, start, time.perf_counter() - start)
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
        step = self._step(step)
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta

    def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """Read step ``step`` (default: the latest) into ``target``'s shapes and shardings.

        ``target`` is a ``TrainState`` of ``jax.ShapeDtypeStruct``s with shardings, e.g.
        ``abstract_state(plan, tx)`` of any stage on any mesh. Nothing on disk is changed.
        """
        step = self._step(step)
        stored = self.manager.item_metadata(step)
        wanted = _items(target)
        have = {name for name in ITEMS if (self.path / str(step) / name).exists()}
        for name in sorted(have ^ set(wanted)):
            where = "the checkpoint" if name in have else "the state being restored"
            raise CheckpointError(f"checkpoint step {step} in {self.path} does not fit: {name} "
                                  f"is only in {where} (a different precision policy?)")
        for name, tree in wanted.items():
            if problem := first_mismatch(_flat(_tree_of(stored[name])), _flat(tree)):
                raise CheckpointError(f"checkpoint step {step} in {self.path} does not fit: "
                                      f"{problem}")
        restored = self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore(),
            **{k: ocp.args.StandardRestore(v) for k, v in wanted.items()}))
        fields = {name: serialization.from_state_dict(getattr(target, name),
                                                      restored[name][name])
                  for name in wanted}
        step_array = jax.device_put(jax.numpy.asarray(step, target.step.dtype),
                                    target.step.sharding)
        return target._replace(step=step_array, **fields), restored.meta

    def read_params(self, step: int | None = None, sharding: Any = None) -> PyTree:
        """The fp32 parameters alone (the master copy when there is one), whole, on one device
        (or into ``sharding``). Needs no model: the tree and shapes come from the checkpoint."""
        step = self._step(step)
        name = "master" if (self.path / str(step) / "master").exists() else "params"
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        stored = _tree_of(self.manager.item_metadata(step)[name])[name]
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype,
                                                             sharding=sharding), stored)
        restored = self.manager.restore(step, args=ocp.args.Composite(**{
            name: ocp.args.StandardRestore({name: target})}))
        return restored[name][name]

    def _failed(self, step: int | None, e: BaseException) -> CheckpointError:
        which = f" {step}" if step is not None else ""
        return CheckpointError(f"saving checkpoint{which} in {self.path} failed: "
                               f"{_first_line(e)}; older checkpoints are kept")

    def close(self) -> None:
        self.manager.close()

    def _step(self, step: int | None) -> int:
        steps = self.manager.all_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.path}")
        if step is None:
            return max(steps)
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {self.path}; it has "
                                  f"{', '.join(map(str, sorted(steps)))}")
        return step


def _tree_of(metadata: Any) -> PyTree:
    tree = getattr(metadata, "tree", metadata)
    return tree if tree is not None else {}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
