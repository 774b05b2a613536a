"""``Layers``: the model's blocks and everything the runtime does with them, declared once."""

from __future__ import annotations

import dataclasses

REMAT = ("full", "dots", "none", "offload")
GATHER = ("block", "module")


@dataclasses.dataclass(frozen=True)
class Layers:
    """The model's blocks and what each keeps for its backward, declared together as FSDP2
    wraps each block once: ``pattern``, a regular expression over module paths (unrolled
    blocks "h_\\d+", or an ``nn.scan`` stack "blocks"); ``remat``, the policy of the blocks
    stage 3 rematerializes (``REMAT``, ``remat_policy``); ``partition``, their saved inputs cut
    over the ``model`` axis (ZeRO-R's partitioned activation checkpoints; needs tensor
    parallelism and stage 3); ``tile_mb``, a bound in MB above which a block's parameter is
    never gathered whole but one tile at a time by the layer that uses it (ZeRO-Infinity's
    memory-centric tiling, ``zero_jax.blocks.tiling``; stage 3); ``gather``, what stage 3
    gathers together (``GATHER``): the whole ``block`` as it runs and again for its backward
    (FSDP2's unit), or each ``module`` in it with parameters of its own, as that module runs
    (DeepSpeed ZeRO-3's hooks, the partitioner's FSDP): at most one module's weights whole at
    a time, for up to a third more gathering (``zero_jax.blocks.modules``); ``prefetch``
    (stage 3), the next block's weights gathered while this one computes (by module, the next
    module's), so that the gather hides behind compute, for one more block (or module) held
    whole (``zero_jax.blocks.runtime``)."""

    pattern: str
    remat: str = "full"
    partition: bool = False
    tile_mb: float | None = None
    gather: str = "block"
    prefetch: bool = False

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Layers needs a regular expression over module paths (got "
                             f"{self.pattern!r})")
        if self.remat not in REMAT:
            raise ValueError(f"remat must be one of {', '.join(REMAT)} (got {self.remat!r})")
        if self.gather not in GATHER:
            raise ValueError(f"Layers: gather must be one of {', '.join(GATHER)} (got "
                             f"{self.gather!r})")
        if self.tile_mb is not None and (isinstance(self.tile_mb, bool) or not isinstance(
                self.tile_mb, int | float) or self.tile_mb <= 0):
            raise ValueError(f"Layers: tile_mb must be a positive number of MB, or None "
                             f"(got {self.tile_mb!r})")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"Layers: prefetch must be True or False (got {self.prefetch!r})")

    @property
    def tile_bytes(self) -> int:
        """The tile bound in bytes; 0: no tiling."""
        return 0 if self.tile_mb is None else int(self.tile_mb * 2**20)
