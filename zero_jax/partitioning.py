"""Tensor-parallel rules read from a Flax model's own partitioning metadata.

A model already annotated for tensor parallelism (MaxText style: linen's
``nn.with_logical_partitioning`` with ``nn.logical_axis_rules``, or ``nn.with_partitioning``
with mesh axis names; NNX's ``sharding_names`` / ``nnx.with_partitioning`` metadata) needs no
hand written table: each parameter whose annotation puts the mesh axis ``model`` on a dimension
becomes a ``Rule`` for its exact path. The other axes of an annotation are ignored: where the
data axes cut a leaf is ZeRO's rule, per stage.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from zero_jax.mesh import MODEL
from zero_jax.plan import Rule, path_str


def tensor_parallel_rules(boxed: Any, logical_rules: Sequence[tuple[str, Any]] | None = None
                          ) -> list[Rule]:
    """``Rule(path, model_dim=d)`` for every annotated parameter of ``boxed`` that the
    annotation places on ``model``: linen variables as ``init`` or ``jax.eval_shape(init, ...)``
    return them, still boxed (pass ``nn.unbox(boxed)`` to ``make_plan``), or an NNX state
    (``nnx.state(model, nnx.Param)``, made with ``nnx.use_eager_sharding(False)``: zero_jax
    places the parameters). Logical names are mapped by ``logical_rules`` (else by the active
    ``nn.logical_axis_rules``); a name that is a mesh axis stays one."""
    from flax import nnx

    rules = []
    flat = jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, (nn.meta.AxisMetadata, nnx.Variable)))[0]
    for path, leaf in flat:
        axes = _mesh_axes(leaf, logical_rules)
        if axes is None:
            continue
        on_model = [d for d, a in enumerate(axes)
                    if a == MODEL or (isinstance(a, tuple) and MODEL in a)]
        if on_model:
            rules.append(Rule(f"^{re.escape(path_str(path))}$",
                              model_dim=on_model[0] - len(axes)))
    return rules


def _mesh_axes(leaf: Any, logical_rules: Sequence[tuple[str, Any]] | None) -> tuple | None:
    """The mesh axes a linen box or NNX variable annotates its dimensions with; None: none."""
    from flax import nnx

    if isinstance(leaf, nn.LogicallyPartitioned):
        return tuple(nn.logical_to_mesh_axes(leaf.names, logical_rules))
    if isinstance(leaf, nn.Partitioned):
        return tuple(leaf.names)
    if not isinstance(leaf, nnx.Variable):
        return None
    meta = leaf.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if not names:
        return None
    logical = tuple(None if n == MODEL else n for n in names)
    mapped = nn.logical_to_mesh_axes(logical, logical_rules)
    return tuple(MODEL if n == MODEL else m for n, m in zip(names, mapped, strict=True))
