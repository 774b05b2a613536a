"""A mixture-of-experts MLP as Mixtral's, Qwen2-MoE's and Qwen3-MoE's: a router picks each
token's top ``experts_per_token`` of ``n_experts`` SwiGLU experts, whose outputs it sums
weighted by the router's softmax (renormalized over the chosen ones where ``moe_norm_topk``),
every token computed, none dropped, as transformers computes it; Qwen2-MoE's shared expert, a
SwiGLU every token takes, added as a sigmoid gate of the token weighs it.

The step runs each device's tokens in ``shard_map``, so routing is local: the device sorts its
(token, expert) pairs by expert and runs each expert's matmuls over its run of them
(``grouped_matmul``: tiles of rows, each by its expert's weights); no all-to-all. With a
``capacity_factor`` (GShard's and Switch Transformer's), each expert takes at most that times
its even share of the pairs, first choices first, each in token order (GShard's and
DeepSpeed's priority), the rest dropped (``capped``): three batched
GEMMs of static shapes instead of the tiles' loops, at that times the routed FLOPs.
The experts' weights are parameters like any other (``(n_experts, d, f)`` per layer): ZeRO cuts
them over the data axis, tensor parallelism over ``f`` (``TENSOR_PARALLEL``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero_jax.grads import batch_sum
from zero_jax.losses import _dot32, _varying
from zero_jax.plan import Rule
from zero_jax.weights import Tensor

# the experts' gate and up projections by columns, their down projection by rows
TENSOR_PARALLEL = (Rule(r"^blocks/moe/(shared_)?(gate|up)$", model_dim=-1),
                   Rule(r"^blocks/moe/(shared_)?down$", model_dim=-2))
# GPT-OSS's gate and up interleaved in one tensor: a pair's two columns on one rank
BIASED_TENSOR_PARALLEL = (Rule(r"^blocks/moe/gate_up(_bias)?$", model_dim=-1),
                          TENSOR_PARALLEL[1])
# Hugging Face's names under a layer: the router, and each expert's gate, up and down
_MLP = ("mlp.gate", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"))
NAMES = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.",
                     ("w1", "w3", "w2")),
         "qwen2_moe": _MLP, "qwen3_moe": _MLP, "olmoe": _MLP,
         # every expert's in one tensor: the router, gate and up fused, down
         "granitemoe": ("block_sparse_moe.router.layer", "block_sparse_moe.",
                        ("input_linear", "input_linear", "output_linear")),
         # every expert's in one tensor, (in, out) as they multiply, gate and up interleaved
         "gpt_oss": ("mlp.router", "mlp.experts.", ("gate_up_proj", "gate_up_proj",
                                                     "down_proj"))}


class MoE(nn.Module):
    """``(..., d)`` -> ``(..., d)``: the router ``(d, n_experts)`` and the experts' ``gate``
    and ``up`` ``(n_experts, d, f)`` and ``down`` ``(n_experts, f, d)``; ``gated(gate, up)``
    their activation (SwiGLU's). ``shared_d_ff``: the shared expert's width (0: none), its
    ``shared_gate``, ``shared_up``, ``shared_down`` and ``shared_router`` ``(d, 1)``.
    ``capacity_factor``: 0, every pair computed; else as ``capped``. ``biased`` (GPT-OSS's):
    the router has a bias (``router_bias``), the experts' gate and up are one ``gate_up``
    ``(n_experts, d, 2 f)``, their columns interleaved (gate, up, gate, ...: as its
    checkpoints hold them), and it and ``down`` have biases (``gate_up_bias``, ``down_bias``)."""

    n_experts: int
    experts_per_token: int
    d_ff: int
    norm_topk: bool
    gated: Callable[[jax.Array, jax.Array], jax.Array]
    shared_d_ff: int = 0
    capacity_factor: float = 0.0
    biased: bool = False

    @nn.compact
    def __call__(self, h: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The output, and the routing's statistics: for ``balance_loss``, ``(2, n_experts)``,
        the (token, choice) pairs each expert took and the sum of its router probabilities;
        for ST-MoE's router z-loss, the sum over tokens of the router logits' log-sum-exp
        squared."""
        d, e, k = h.shape[-1], self.n_experts, self.experts_per_token
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        router = self.param("router", nn.initializers.lecun_normal(), (d, e))
        if self.biased:
            ws = (self.param("gate_up", init, (e, d, 2 * self.d_ff)),
                  self.param("down", init, (e, self.d_ff, d)))
            bs = tuple(self.param(n, nn.initializers.zeros, (e, w)) for n, w in
                       (("gate_up_bias", 2 * self.d_ff), ("down_bias", d)))
        else:
            ws = (*(self.param(n, init, (e, d, self.d_ff)) for n in ("gate", "up")),
                  self.param("down", init, (e, self.d_ff, d)))
        x = h.reshape(-1, d)
        # the router's logits in the compute dtype, their softmax in fp32 (transformers')
        logits = x @ router.astype(x.dtype)
        if self.biased:
            logits = logits + self.param("router_bias", nn.initializers.zeros, (e,)).astype(
                x.dtype)
        logits = logits.astype(jnp.float32)
        p = jax.nn.softmax(logits, axis=-1)
        weights, chosen = jax.lax.top_k(p, k)
        if self.norm_topk:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        # the (token, expert) pairs in runs of one expert, as ragged_dot takes its groups; with
        # a capacity, each run the tokens' first choices, then their second...: what it keeps
        capped_ = bool(self.capacity_factor)
        if capped_:
            chosen, weights = chosen.T, weights.T
        order = jnp.argsort(chosen.reshape(-1), stable=True)
        token = order % x.shape[0] if capped_ else order // k
        sizes = jnp.bincount(chosen.reshape(-1), length=e).astype(jnp.int32)
        xs, ws = x[token], tuple(w.astype(x.dtype) for w in ws)
        bs = tuple(b.astype(x.dtype) for b in bs) if self.biased else None
        if capped_:
            c = capacity(x.shape[0], k, e, self.capacity_factor)
            out = capped(xs, ws, sizes, self.gated, c, bs)
        else:  # with biases, each pair's expert's, in the pairs' order
            rows = bs and tuple(b[chosen.reshape(-1)[order]] for b in bs)
            out = experts(lambda a, w: grouped_matmul(a, w, sizes), xs, ws, self.gated, rows)
        out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
        y = jnp.zeros_like(x).at[token].add(out)
        if self.shared_d_ff:
            y = y + self.shared(x)
        z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
        return y.reshape(h.shape), (jnp.stack([sizes.astype(jnp.float32), p.sum(0)]), z)

    def shared(self, x: jax.Array) -> jax.Array:
        """Qwen2-MoE's shared expert, times the sigmoid of its own gate."""
        d, f = x.shape[-1], self.shared_d_ff
        init = nn.initializers.lecun_normal()
        w = {n: self.param(f"shared_{n}", init, shape).astype(x.dtype) for n, shape in
             (("gate", (d, f)), ("up", (d, f)), ("down", (f, d)), ("router", (d, 1)))}
        out = self.gated(x @ w["gate"], x @ w["up"]) @ w["down"]
        return jax.nn.sigmoid(x @ w["router"]) * out


def _runs(sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Each of ``m`` sorted rows' group (``sizes[g]`` rows of group ``g``) and place in its
    group's run."""
    group = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=m)
    return group, jnp.arange(m) - (jnp.cumsum(sizes) - sizes)[group]


def capacity(tokens: int, k: int, n_experts: int, factor: float) -> int:
    """The pairs an expert takes at most: ``factor`` times its even share of the ``tokens``
    x ``k`` pairs, rounded up; never more than ``tokens``, each of which chooses an expert
    once (a larger buffer would only hold zeros)."""
    return min(tokens, max(1, math.ceil(factor * tokens * k / n_experts)))


def experts(matmul: Callable, xs: jax.Array, ws: tuple, gated: Callable,
            biases: tuple | None = None) -> jax.Array:
    """The experts' MLP over ``xs`` by ``matmul(xs, w)``: ``ws`` gate, up and down; with
    ``biases`` (GPT-OSS's, as ``xs`` reads them), ``gate_up`` and down, the gate and up the
    even and odd columns of ``gate_up``."""
    if biases is None:
        return matmul(gated(matmul(xs, ws[0]), matmul(xs, ws[1])), ws[2])
    both = matmul(xs, ws[0]) + biases[0]
    return matmul(gated(both[..., ::2], both[..., 1::2]), ws[1]) + biases[1]


def capped(xs: jax.Array, ws: tuple, sizes: jax.Array, gated: Callable,
           c: int, biases: tuple | None = None) -> jax.Array:
    """The experts' MLP over the sorted rows ``xs`` (``sizes[e]`` rows of expert ``e``),
    each expert taking its first ``c`` rows (``MoE`` sorts them by choice, then
    token), the others dropped (zeros out): the rows scattered into an ``(experts,
    capacity, d)`` buffer, and ``ws`` (with ``biases``, each expert's, as ``experts`` takes
    them) applied as batched GEMMs, whose shapes are static."""
    (m, d), e = xs.shape, sizes.shape[0]
    group, position = _runs(sizes, m)
    # past the buffer's end where dropped, each its own: the scatter skips it, the gather
    # reads zeros, and the indices stay unique
    slot = jnp.where(position < c, group * c + position, e * c + jnp.arange(m))
    buf = jnp.zeros((e * c, d), xs.dtype).at[slot].set(xs, mode="drop", unique_indices=True)
    buf = buf.reshape(e, c, d)
    biases = biases and tuple(b[:, None] for b in biases)
    out = experts(lambda a, w: jnp.einsum("ecd,edf->ecf", a, w), buf, ws, gated,
                  biases).reshape(e * c, -1)
    return out.at[slot].get(mode="fill", fill_value=0, unique_indices=True)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, sizes)``: rows ``x`` ``(m, d)`` in runs of one group,
    ``sizes[g]`` rows of group ``g`` (summing to ``m``), each run times ``w[g]`` (``w``:
    ``(groups, d, f)``), at the routed FLOPs. XLA's TPU compiler has a ragged dot, taken
    there; for CPUs and GPUs jax 0.10.2 lowers ``ragged_dot`` to a GEMM over every group's
    weights with the rows masked per group (``groups`` times the FLOPs, and a temporary as
    large), so there each run is padded to whole tiles of rows, and a loop multiplies each
    tile by its group's weights (``_tiles``): at most ``groups`` tiles of padding."""
    if jax.default_backend() == "tpu":
        return jax.lax.ragged_dot(x, w, sizes)
    (m, d), groups = x.shape, w.shape[0]
    # tiles of up to 128 rows, smaller where groups are smaller (less padding)
    tile = int(min(128, max(8, 1 << max(0, -(-m // groups) - 1).bit_length())))
    tiles = -(-m // tile) + groups  # every run padded to whole tiles fits in these
    padded = -(-sizes // tile) * tile
    ends = jnp.cumsum(padded)
    group, position = _runs(sizes, m)
    at = (ends - padded)[group] + position
    xp = jnp.zeros((tiles * tile, d), x.dtype).at[at].set(x, unique_indices=True)
    # each tile's group; the tiles past the last run hold zeros (any group's weights)
    of = jnp.minimum(jnp.sum(ends <= (jnp.arange(tiles) * tile)[:, None], axis=1), groups - 1)
    used = ends[-1] // tile
    out = _tiles(xp.reshape(tiles, tile, d), w, of, used)
    return out.reshape(tiles * tile, -1)[at]


@jax.custom_vjp
def _tiles(x: jax.Array, w: jax.Array, of: jax.Array, used: jax.Array) -> jax.Array:
    """``x[t] @ w[of[t]]`` for each of the first ``used`` tiles, one at a time, zeros after."""
    def one(t, out):
        return out.at[t].set(x[t] @ w[of[t]])
    return jax.lax.fori_loop(0, used, one, _varying(
        jnp.zeros((*x.shape[:2], w.shape[-1]), x.dtype), x, w))


def _tiles_fwd(x, w, of, used):
    return _tiles(x, w, of, used), (x, w, of, used)


def _tiles_bwd(residuals, dout):
    """The rows' gradient tile by tile as the forward; the weights' summed in fp32 over each
    group's tiles (contiguous: the rows come sorted), each group's sum written over its slot,
    in the weights' dtype, as it grows, never read back: the last write is the whole sum, and
    no fp32 stack of every group's gradient is held."""
    x, w, of, used = residuals

    def one(t, carry):
        dx, dw, acc = carry
        g, fresh = of[t], (t == 0) | (of[t] != of[jnp.maximum(t - 1, 0)])
        acc = jnp.where(fresh, 0.0, acc) + _dot32(x[t].T, dout[t])
        return dx.at[t].set(dout[t] @ w[g].T), dw.at[g].set(acc.astype(w.dtype)), acc

    zeros = lambda shape, dtype: _varying(jnp.zeros(shape, dtype), x, w, dout)  # noqa: E731
    dx, dw, _ = jax.lax.fori_loop(0, used, one, (zeros(x.shape, x.dtype),
                                                 zeros(w.shape, w.dtype),
                                                 zeros(w.shape[1:], jnp.float32)))
    return dx, dw, None, None


_tiles.defvjp(_tiles_fwd, _tiles_bwd)


def balance_loss(stats: jax.Array, tokens: int, whole_batch: bool = False) -> jax.Array:
    """Switch Transformer's load-balancing loss, as transformers' ``load_balancing_loss_func``
    (Mixtral's, the Qwen MoEs'): ``n_experts`` times the sum over experts of the share of
    (token, choice) pairs it took and its mean router probability, each over every layer's
    tokens; ``experts_per_token`` where routing is even. ``stats``: ``(layers, 2,
    n_experts)``, each layer's ``MoE`` statistics; ``tokens``: a layer's. Only the
    probabilities carry a gradient. ``whole_batch``: the statistics of every device's tokens
    (``zero_jax.batch_sum``), as Megatron's global-batch balance loss, not this device's."""
    if whole_batch:
        stats, tokens = batch_sum((stats, jnp.asarray(tokens, jnp.float32)))
    counts, probs = stats.sum(0) / (stats.shape[0] * tokens)
    return stats.shape[-1] * jnp.sum(jax.lax.stop_gradient(counts) * probs)


def rows(family: str, n_experts: int, layer: str, shared: bool, d_ff: int) -> list[Tensor]:
    """The mapping's rows of a layer's router and experts (``layer``: the names' prefix): each
    expert's PyTorch Linear weight transposed, the experts stacked on a new first axis; the
    shared expert's and its gate's (Qwen2-MoE's). GraniteMoE keeps every expert in one tensor
    (its gate and up projections in one, ``d_ff`` rows each): the experts' axis is its first.
    GPT-OSS's every expert in one tensor too, as they multiply (``MoE.biased``), with biases."""
    router, expert, (gate, up, down) = NAMES[family]
    if family == "gpt_oss":
        return [Tensor(f"{layer}{router}.weight", "blocks/moe/router", transpose=(1, 0)),
                Tensor(f"{layer}{router}.bias", "blocks/moe/router_bias"),
                *(Tensor(f"{layer}{expert}{name}{end}", f"blocks/moe/{ours}{end}")
                  for name, ours in ((gate, "gate_up"), (down, "down"))
                  for end in ("", "_bias"))]
    if family == "granitemoe":
        def stack(name: str, ours: str, take=None):
            return Tensor(f"{layer}{expert}{name}.weight", f"blocks/moe/{ours}",
                          transpose=(0, 2, 1), take=take)
        return [Tensor(f"{layer}{router}.weight", "blocks/moe/router", transpose=(1, 0)),
                stack(gate, "gate", (1, 0, d_ff)), stack(up, "up", (1, d_ff, 2 * d_ff)),
                stack(down, "down")]
    experts = lambda w: tuple(f"{layer}{expert.format(e=i)}{w}.weight"  # noqa: E731
                              for i in range(n_experts))
    out = [Tensor(f"{layer}{router}.weight", "blocks/moe/router", transpose=(1, 0)),
           *(Tensor(experts(w), f"blocks/moe/{ours}", transpose=(1, 0))
             for w, ours in ((gate, "gate"), (up, "up"), (down, "down")))]
    if shared:
        out += [Tensor(f"{layer}mlp.shared_expert.{w}.weight", f"blocks/moe/shared_{ours}",
                       transpose=(1, 0)) for w, ours in
                ((gate, "gate"), (up, "up"), (down, "down"))]
        out.append(Tensor(f"{layer}mlp.shared_expert_gate.weight", "blocks/moe/shared_router",
                          transpose=(1, 0)))
    return out
