"""What happens to a model's blocks at stage 3: made whole as they run, rematerialized for
their backward, gathered one ahead.

- ``layers``: ``Layers``, the declaration (which blocks, their remat, Pa, tiling, gather unit);
- ``runtime``: ``Runtime``, built once per step, entered once per trace of the loss;
- ``remat``: what a block keeps for its backward (policies, Pa, offload) and every remat;
- ``linen``, ``nnx``: the two frameworks' hooks; ``modules``: gathering module by module;
- ``prefetch``: gathering one block ahead, one mechanism with three cases (a scanned stack's
  loop, handoffs between blocks called one after another, the module before);
- ``scan``, ``chain``: finding those scanned stacks and those blocks while the loss is traced;
- ``tiling``: a parameter too large to gather whole, gathered a tile at a time.
"""

from zero_jax.blocks.layers import GATHER, REMAT, Layers
from zero_jax.blocks.nnx import nnx_merge
from zero_jax.blocks.remat import BLOCK_INPUT, Saved, remat_policy
from zero_jax.blocks.runtime import Runtime

__all__ = ["BLOCK_INPUT", "GATHER", "REMAT", "Layers", "Runtime", "Saved", "nnx_merge",
           "remat_policy"]
