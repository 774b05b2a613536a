"""Tensor-parallel rules read from a Flax model's own partitioning metadata.

A model already annotated for tensor parallelism (MaxText style: ``nn.with_logical_partitioning``
with ``nn.logical_axis_rules``, or ``nn.with_partitioning`` with mesh axis names) needs no hand
written table: each parameter whose annotation puts the mesh axis ``model`` on a dimension
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
from zero_jax.rules import Rule, path_str


def tensor_parallel_rules(boxed: Any, logical_rules: Sequence[tuple[str, Any]] | None = None
                          ) -> list[Rule]:
    """``Rule(path, model_dim=d)`` for every annotated parameter of ``boxed`` (the variables as
    ``init`` or ``jax.eval_shape(init, ...)`` return them, still boxed) that the annotation
    places on ``model``. Logical names are mapped by ``logical_rules`` (else by the active
    ``nn.logical_axis_rules``). Pass ``nn.unbox(boxed)`` to ``make_plan``."""
    rules = []
    flat = jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))[0]
    for path, leaf in flat:
        if not isinstance(leaf, nn.Partitioned):
            continue
        axes = (nn.logical_to_mesh_axes(leaf.names, logical_rules)
                if isinstance(leaf, nn.LogicallyPartitioned) else leaf.names)
        on_model = [d for d, a in enumerate(axes)
                    if a == MODEL or (isinstance(a, tuple) and MODEL in a)]
        if on_model:
            rules.append(Rule(f"^{re.escape(path_str(path))}$",
                              model_dim=on_model[0] - len(axes)))
    return rules
