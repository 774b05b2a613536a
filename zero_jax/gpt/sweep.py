"""The planner's search for the GPT demo: which layouts to compile, in which order, and which
to leave out because they cannot change the answer.

The answer is the fitting layout that communicates least, then moves least to and from the host
(``planner.choose``). So a layout is not compiled when its model state alone does not fit (read
from its shardings, before compiling); nor when it offloads and the same layout without offload
(same stage, remat and T) fits: offload moves where the state lives, not what the collectives
carry, so that one communicates as much and moves nothing to and from the host. A layout is
compiled again without prefetch or by module (which gather as much or more) only while nothing
that fits communicates less than it. Tensor parallelism is compiled when the command line asks
for it (``--tensor-parallel T``, ``mesh.tensor_parallel``) or when nothing fits without it;
tiling when nothing fits at all. The rows keep the full sweep's order, so ties resolve as they did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from zero_jax import planner
from zero_jax.gpt import layouts
from zero_jax.state import abstract_state


@dataclasses.dataclass
class Machine:
    """What the planner plans for: sizes in bytes."""
    device_memory: int
    host_memory: int
    per_host: int
    nvme_memory: int = 0


@dataclasses.dataclass
class Search:
    """``compile(experiment, state, layout) -> Candidate`` measures one layout; ``build(config)``
    makes its experiment (model, plan, step)."""
    cfg: dict
    sets: list[str]
    stage: int | None
    tensor_parallel: int | None
    devices: int
    machine: Machine
    build: Callable[[dict], Any]
    compile: Callable[[Any, Any, dict], planner.Candidate]
    largest_leaf_bytes: int  # the blocks' largest leaf that tiling may cut, compute dtype
    rows: list[planner.Candidate] = dataclasses.field(default_factory=list)
    nvme: list[planner.Candidate] = dataclasses.field(default_factory=list)  # rows on the disk
    left_out: dict[str, int] = dataclasses.field(default_factory=dict)
    progress: planner.Progress | None = None

    def fit(self, c: planner.Candidate) -> bool:
        m = self.machine
        return planner.fits(c, m.device_memory, m.host_memory, m.per_host)

    def best(self) -> planner.Candidate | None:
        m = self.machine
        return planner.choose(self.rows + self.nvme, m.device_memory, m.host_memory, m.per_host,
                              m.nvme_memory)

    def run(self) -> planner.Candidate | None:
        """Compile what can change the answer; the chosen candidate (None: nothing fits). The
        candidates then are ``rows + nvme``."""
        asked = layouts.tp_asked(self.sets, self.tensor_parallel)
        self.progress = planner.Progress(0, self.machine.device_memory)
        every = list(layouts.candidates(self.cfg, self.sets, self.stage, self.tensor_parallel,
                                        self.machine.per_host, self.devices))
        parallel = [] if asked else [(lo, c) for lo, c in every if lo["tp"] > 1]
        self.layouts([(lo, c) for lo, c in every if asked or lo["tp"] == 1])
        if parallel and self.best() is None:
            self.layouts(parallel)
        elif parallel:
            self.left_out["tensor-parallel layouts (one fits without: --tensor-parallel T "
                          "plans them)"] = len(parallel)
        if self.best() is None:  # ZeRO-Infinity's tiling, where a bound can cut the largest leaf
            tiled = list(layouts.tiled(self.cfg, self.sets, self.stage, self.tensor_parallel,
                                       self.largest_leaf_bytes))
            self.progress.total += len(tiled)
            for layout, c in tiled:
                try:
                    self.measure(layout, c)
                except ValueError:  # no tile of some leaf within this bound
                    self.progress.total -= 1
        return self.best()

    def layouts(self, pairs: Iterable[tuple[dict, dict]]) -> None:
        """Each candidate that can change the answer, then the recompiles of those whose
        device does not fit, then, for tensor parallelism, the stages below where it fits."""
        pairs = list(pairs)
        self.progress.total += len(pairs)
        measured = []
        for layout, c in pairs:
            if self.offloads_when_none_fits(layout):
                self.progress.total -= 1
                self.skip("offloaded layouts whose layout without offload fits")
                continue
            measured.append((layout, c, self.measure(layout, c)))
        for layout, c, row in measured:
            if row is None or row.device <= planner.HEADROOM * self.machine.device_memory:
                continue
            for other in (layouts.without_prefetch(layout, c, self.sets),
                          layouts.by_module(layout, c, self.sets)):
                if not other:
                    continue
                if self.beaten(row):
                    self.skip("recompiles without prefetch or by module (a layout that fits "
                              "communicates less)")
                else:
                    self.progress.total += 1
                    self.measure(*other)
        for layout, c, row in measured:  # T > 1 below stage 3, one stage at a time
            while row is not None and self.fit(row) and \
                    (lower := layouts.lower_stage(layout, c, self.stage)):
                layout, c = lower
                self.progress.total += 1
                row = self.measure(layout, c)

    def measure(self, layout: dict, c: dict) -> planner.Candidate | None:
        """The layout compiled and measured; None where its model state alone does not fit."""
        e = self.build(c)
        state = abstract_state(e.plan, e.tx)
        m = self.machine
        nvme_later = bool(m.nvme_memory) and layout["offload"] in ("optimizer", "params")
        if planner.state_exceeds(state, m.device_memory, m.host_memory, m.per_host,
                                 host_checked=not nvme_later):
            self.progress.total -= 1
            self.skip("layouts whose model state alone does not fit")
            return None
        row = self.compile(e, state, layout)
        self.rows.append(row)
        self.progress(row, self.fit(row), m.per_host)
        if nvme_later:  # the NVMe tier: the host-offload layouts, their state on the disk
            off = self.cfg["zero"]["offload_optimizer"]
            self.nvme.append(planner.on_nvme(row, int(off["buffer_count"] * off["buffer_mb"]
                                                      * 2**20), m.per_host))
        return row

    def offloads_when_none_fits(self, layout: dict) -> bool:
        """Whether ``layout`` offloads and the same layout without offload was compiled and
        fits: that one communicates as much and moves nothing to and from the host."""
        return layout["offload"] in ("optimizer", "params") and any(
            self.fit(r) and {**r.layout, "offload": "none"} == {**layout, "offload": "none"}
            and r.layout["offload"] == "none" for r in self.rows)

    def beaten(self, row: planner.Candidate) -> bool:
        """Whether a layout that fits communicates less than ``row`` (or as much, and moves
        less to and from the host): then ``row``'s recompiles, which gather as much or more
        and move as much, cannot be chosen."""
        return any(self.fit(r) and (r.comm, r.host_traffic) < (row.comm, row.host_traffic)
                   for r in self.rows)

    def skip(self, why: str) -> None:
        self.left_out[why] = self.left_out.get(why, 0) + 1

    def summary(self) -> str:
        """What the search did not compile, and why: one line, empty when nothing."""
        if not self.left_out:
            return ""
        return "not compiled, as they cannot change the answer: " + "; ".join(
            f"{why}: {n}" for why, n in self.left_out.items())
