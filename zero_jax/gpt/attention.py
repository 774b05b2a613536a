"""Causal self-attention of the demo's models: ``jax.nn.dot_product_attention``.

On GPUs cuDNN's flash attention never writes the ``(batch, heads, t, t)`` scores to HBM, in
the forward or the backward, and skips the masked half; XLA's implementation (the CPU mesh,
fp32) is the plain einsum and softmax, with the scores and the softmax in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "xla", "cudnn")  # model.attention
# Queries per block of the soft-capped attention: its fp32 scores are (batch, heads, 512, t) at a
# time, each block's recomputed in the backward, never the whole (batch, heads, t, t).
QUERY_BLOCK = 512
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def cudnn_fits(platform: str, dtype, head_dim: int) -> str | None:
    """Why cuDNN's flash attention cannot run here (None: it can): a CUDA GPU, bf16 or fp16,
    a head dimension of at most 128 and a multiple of 8 (what jax checks before Hopper)."""
    if platform not in ("gpu", "cuda"):
        return f"it runs on CUDA GPUs only (these devices are {platform})"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return f"it computes in bf16 or fp16 (this model computes in {jnp.dtype(dtype).name})"
    if head_dim > 128 or head_dim % 8:
        return f"its head dimension must be at most 128 and a multiple of 8 (got {head_dim})"
    return None


def resolve(choice: str, platform: str, dtype, head_dim: int, einsums: bool = False) -> str:
    """``model.attention`` for these devices: "auto" is cuDNN where it fits, else XLA;
    ``einsums``: the model's attention has soft caps or sinks, which no fused kernel computes
    (``causal`` runs its einsums whatever is asked): XLA's."""
    if choice not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {', '.join(IMPLEMENTATIONS)} (got "
                         f"{choice!r})")
    if choice == "auto":
        return "xla" if einsums or cudnn_fits(platform, dtype, head_dim) else "cudnn"
    return choice


def causal(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str,
           window: int = 0, scale: float | None = None, softcap: float = 0.0,
           sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention of ``(batch, t, heads, head_dim)`` queries over keys and values with
    ``heads`` or fewer heads (grouped-query: query head i reads key head i // (heads / kv)).
    ``window``: each query reads its own and the ``window - 1`` keys before it (Mistral's and
    Phi-3's sliding window, as Hugging Face masks it); 0, or a window the sequence fits in,
    is the whole causal attention, with no window passed down (the same program). ``scale``:
    the scores' factor (default 1 / sqrt(head_dim)); ``softcap`` (Gemma 2's): the scores
    are ``softcap * tanh(scores / softcap)``, which no fused kernel computes: the einsums;
    ``sinks`` (GPT-OSS's, one logit per head): a column of each row's softmax that no value
    is read for, so that a query can attend to nothing; the einsums too."""
    local = (window - 1, 0) if 0 < window < q.shape[1] else None
    if softcap or sinks is not None:
        return _einsums(q, k, v, scale or q.shape[-1] ** -0.5, softcap, local, sinks)
    impl = resolve(implementation, jax.default_backend(), q.dtype, q.shape[-1])
    if impl == "cudnn" and jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        impl = "xla"  # the fp32 trace of init, shapes only (a bf16 step was checked to fit)
    attend = lambda *qkv: jax.nn.dot_product_attention(*qkv, scale=scale, is_causal=True,
                                                       local_window_size=local,
                                                       implementation=impl)
    if impl == "xla" and q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA's form asks for fp32 scores, which the CPU backend has no fp16 dot for
        return attend(*[x.astype(jnp.float32) for x in (q, k, v)]).astype(q.dtype)
    return attend(q, k, v)


def _einsums(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, cap: float,
             local: tuple[int, int] | None, sinks: jax.Array | None) -> jax.Array:
    """The attention of each ``QUERY_BLOCK`` queries at a time (all at once where the
    sequence is no multiple of it), each block rematerialized for the backward. With a window,
    a block reads only the keys it can see, its own and the window's before them: at 4,096
    tokens and GPT-OSS's 128, 639 keys of 4,096 a block."""
    b, t, h, dh = q.shape
    n = t // QUERY_BLOCK if t > QUERY_BLOCK and t % QUERY_BLOCK == 0 else 1
    blocks = q.reshape(b, n, t // n, h, dh).swapaxes(0, 1)
    block = jax.checkpoint(lambda args: _block(*args, k, v, scale, cap, local, sinks))
    out = jax.lax.map(block, (blocks, jnp.arange(n) * (t // n)))
    return out.swapaxes(0, 1).reshape(b, t, h, dh)


def _block(q: jax.Array, first: jax.Array, k: jax.Array, v: jax.Array, scale: float,
           cap: float, local: tuple[int, int] | None, sinks: jax.Array | None) -> jax.Array:
    """Queries ``first`` on over the keys they can see (with a window, the ``span`` from the
    first it lets them see; else all): the scores in fp32, capped, masked, their softmax (with
    the sinks' column) in the inputs' dtype (as transformers' eager attention computes it), the
    kv heads shared by groups of queries."""
    b, c, h, dh = q.shape
    g, start = k.shape[2], 0
    if local and (span := c + local[0]) < k.shape[1]:
        start = jnp.clip(first - local[0], 0, k.shape[1] - span)
        k, v = (jax.lax.dynamic_slice_in_dim(x, start, span, 1) for x in (k, v))
    groups = q.reshape(b, c, g, h // g, dh)
    scores = jnp.einsum("btgrd,bsgd->bgrts", groups, k,
                        preferred_element_type=jnp.float32) * scale
    if cap:
        scores = cap * jnp.tanh(scores / cap)
    i, j = first + jnp.arange(c)[:, None], start + jnp.arange(k.shape[1])[None, :]
    seen = (j <= i) & ((i - j <= local[0]) if local else True)
    scores = jnp.where(seen, scores, -jnp.inf)
    if sinks is None:
        p = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    else:  # the sink's column in the sum, not in what is read
        sink = sinks.astype(jnp.float32).reshape(1, g, h // g, 1, 1)
        top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, -1, keepdims=True), sink))
        e = jnp.exp(scores - top)
        p = (e / (jnp.sum(e, -1, keepdims=True) + jnp.exp(sink - top))).astype(q.dtype)
    return jnp.einsum("bgrts,bsgd->btgrd", p, v).reshape(b, c, h, dh)
