"""Cross-entropy over a large vocabulary without ever holding the full logits.

A language model's loss is usually ``softmax_cross_entropy(hidden @ head, labels)``: the
logits, ``tokens x vocabulary`` in fp32, and their gradient are the largest buffers of the step
(GPT-2 at 8 K tokens a device: 1.6 GB each) and their HBM traffic a large share of its time.
``cross_entropy`` takes the head's matmul inside: the forward runs it chunk by chunk of tokens
and keeps only each token's log-sum-exp; the backward computes each chunk's logits again, and
from them the gradients of the hidden states and of the head (the head's accumulated in fp32
across chunks). Peak memory is one chunk's logits. ``mean_cross_entropy``, the mean a language
model trains on, computes the gradients in the forward pass instead, from the logits at hand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Tokens per chunk: 8192 x 50,304 logits, 824 MB in bf16, at a time. Each chunk reads and writes
# the head's fp32 gradient once (309 MB at GPT-2's 768 x 50,304): at 2048 tokens that was a fifth
# of the loss backward's HBM traffic, at 8192 a sixteenth (gpt2-124m, one H100, batch 32: 148.5 ->
# 141.7 GB a step by bench/estimate.py), and the compiled step's peak memory did not grow.
CHUNK_TOKENS = 8192
BLOCKS = 128  # blocks of a row that _logsumexp reduces in one pass each


def cross_entropy(hidden: jax.Array, head: jax.Array, labels: jax.Array, *,
                  valid: int | None = None, chunk: int = CHUNK_TOKENS,
                  softcap: float = 0.0) -> jax.Array:
    """Per-token ``-log softmax(hidden @ head)[label]``, shaped as ``labels``.

    ``hidden``: ``(..., d)``; ``head``: ``(d, vocab)`` (a tied embedding ``(vocab, d)`` is
    passed as ``.T``); ``labels``: integer ids below ``valid``. ``valid`` (default: all of
    ``vocab``) leaves the head's last columns out of the softmax: a vocabulary padded to a
    multiple of 128 for its GEMMs' sake, whose padding is then never predicted and gets no
    gradient. The softmax and its log-sum-exp run in fp32 whatever the inputs' dtype (on the
    logits as the GEMM rounds them to it, as a model's own head would); the gradients come
    back in the inputs' dtypes. ``chunk``: tokens per chunk. ``softcap`` (Gemma 2's final
    logit soft-capping; 0: none): the softmax is over ``softcap * tanh(logits / softcap)``.
    """
    x, y, valid, n = _chunks(hidden, head, labels, valid, chunk)
    loss = _chunked(x, head, y, (valid, float(softcap)))
    return loss.swapaxes(0, 1).reshape(-1)[:n].reshape(labels.shape)


def mean_cross_entropy(hidden: jax.Array, head: jax.Array, labels: jax.Array, *,
                       valid: int | None = None, chunk: int = CHUNK_TOKENS,
                       weights: jax.Array | None = None, softcap: float = 0.0) -> jax.Array:
    """``cross_entropy(...)``'s mean, with the gradients computed in the forward pass.

    A mean's cotangent is one scalar for every token, so the gradients of the hidden states
    and of the head can be computed while each chunk's logits are at hand, and scaled by it
    afterwards: the backward neither recomputes the logits (one of its four GEMMs) nor
    reads them again. Under ``jax.grad`` only; evaluated alone it is ``cross_entropy``'s
    forward. Holds the hidden states' gradient (the size of ``hidden``) and the head's (fp32)
    from the forward to the backward.

    ``weights`` (shaped as ``labels``; default all ones): the mean is ``sum(w ce) / sum(w)``,
    so that zeros leave tokens out (padding, a prompt that is not trained on). Each device
    then means over its own tokens: for the mean over the whole batch, return
    ``zero_jax.Weighted(mean * sum(w), sum(w))`` from the loss. With every weight 0 it is 0,
    and so are its gradients: a device whose rows are all padding adds nothing to that sum.
    """
    x, y, valid, n = _chunks(hidden, head, labels, valid, chunk)
    valid = (valid, float(softcap))  # the logits' static description: _logits
    count, size = y.shape
    if weights is None:
        token = jnp.arange(size)[None, :] * count + jnp.arange(count)[:, None]  # x[c, i]'s index
        return _chunked_mean(x, head, y, (token < n).astype(jnp.float32), valid, False)
    if weights.shape != labels.shape:
        raise ValueError(f"mean_cross_entropy: weights {weights.shape} must be shaped as "
                         f"labels {labels.shape}")
    w = jnp.pad(weights.reshape(n).astype(jnp.float32), (0, count * size - n))
    w = jax.lax.stop_gradient(w.reshape(size, count).swapaxes(0, 1))
    return _chunked_mean(x, head, y, w, valid, True)


def _chunks(hidden: jax.Array, head: jax.Array, labels: jax.Array, valid: int | None,
            chunk: int) -> tuple[jax.Array, jax.Array, int, int]:
    """The tokens as (chunks, tokens per chunk, d) and their labels, after checking them."""
    d, vocab = head.shape
    if hidden.shape[-1] != d or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"cross_entropy: hidden {hidden.shape} must be labels {labels.shape} "
                         f"+ (d,) with head (d, vocab) = {head.shape}")
    valid = vocab if valid is None else valid
    if not 0 < valid <= vocab:
        raise ValueError(f"cross_entropy: valid {valid} must be in 1..{vocab} (head's columns)")
    if chunk < 1:
        raise ValueError(f"cross_entropy: chunk must be at least 1 token (got {chunk})")
    n = labels.size
    size = min(chunk, n)
    count = -(-n // size)
    pad = count * size - n  # the last tokens' place filled with token 0 of label 0, dropped
    # Chunk c holds tokens c, c + count, c + 2 count, ...: a batch cut over devices (plain
    # jit, GSPMD) stays cut within every chunk, so no chunk lives on one device alone.
    x = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0))).reshape(size, count, d)
    y = jnp.pad(labels.reshape(n).astype(jnp.int32), (0, pad)).reshape(size, count)
    return x.swapaxes(0, 1), y.swapaxes(0, 1), valid, n


def _logits(x: jax.Array, head: jax.Array, valid: tuple[int, float]) -> jax.Array:
    """One chunk's logits in fp32, soft-capped where ``valid[1]`` is a cap, the padded columns
    (from ``valid[0]`` on) at -inf. The GEMM writes them in the inputs' dtype (half the HBM
    traffic of fp32 in bf16, as a model's own head would) and the reductions that read them
    upcast."""
    logits = jnp.dot(x, head).astype(jnp.float32)
    valid, cap = valid
    if cap:
        logits = cap * jnp.tanh(logits / cap)
    if valid < head.shape[1]:
        column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        logits = jnp.where(column < valid, logits, -jnp.inf)
    return logits


def _lse_and_loss(xc: jax.Array, head: jax.Array, yc: jax.Array, valid: tuple[int, float]
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One chunk's logits, each token's log-sum-exp and loss."""
    logits = _logits(xc, head, valid)
    lse = _logsumexp(logits)
    # the label's logit as a masked sum, a reduction over the vocabulary like the one beside
    # it (one read of the logits; over a vocabulary cut by tensor parallelism a sum of
    # scalars, where gathering the label's column of the head would move d each)
    column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    picked = jnp.sum(jnp.where(column == yc[:, None], logits, 0.0), axis=-1)
    return logits, lse, lse - picked


def _logsumexp(logits: jax.Array) -> jax.Array:
    """Each row's log-sum-exp, the logits read once: ``jax.nn.logsumexp`` takes the max, then
    the sum, two passes over them (XLA fuses neither into the GEMM that writes them), one of
    seven over each chunk's logits in ``cross_entropy``. Here each of ``BLOCKS`` blocks of the
    row reduces to a (max, sum of exp relative to it) pair in one pass, pairs rescaled to the
    larger max as they combine (flash attention's online softmax); then the blocks' pairs, a
    few per row, combine as ``jax.nn.logsumexp`` would. The blocks keep a vocabulary cut by
    tensor parallelism cut (partial pairs are all-reduced, not the logits gathered); a
    vocabulary that is no multiple of them takes the two passes. Rows of -inf only (the
    padding's columns are -inf) combine to (-inf, 0)."""
    rows, vocab = logits.shape
    if vocab % BLOCKS:
        return jax.nn.logsumexp(logits, axis=-1)

    def rescale(s, m, top):  # s exp(m - top), 0 where m is -inf
        return s * jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - top))

    def combine(a, b):
        (ma, sa), (mb, sb) = a, b
        m = jnp.maximum(ma, mb)
        return m, rescale(sa, ma, m) + rescale(sb, mb, m)
    blocks = logits.reshape(rows, BLOCKS, vocab // BLOCKS)
    m, s = jax.lax.reduce((blocks, jnp.ones_like(blocks)),
                          (jnp.array(-jnp.inf, logits.dtype), jnp.array(0, logits.dtype)),
                          combine, (2,))
    top = jnp.max(m, axis=-1)
    return top + jnp.log(jnp.sum(rescale(s, m, top[:, None]), axis=-1))


def _forward(x: jax.Array, head: jax.Array, y: jax.Array, valid: tuple[int, float]
             ) -> tuple[jax.Array, jax.Array]:
    """Per chunk: each token's loss and log-sum-exp (all the backward keeps)."""
    def body(_, xs):
        xc, yc = xs
        _, lse, loss = _lse_and_loss(xc, head, yc, valid)
        return None, (loss, lse)
    _, (loss, lse) = jax.lax.scan(body, None, (x, y))
    return loss, lse


def _grads(xc: jax.Array, head: jax.Array, yc: jax.Array, logits: jax.Array, lse: jax.Array,
           scale: jax.Array, cap: float) -> tuple[jax.Array, jax.Array]:
    """One chunk's d loss / d hidden and d loss / d head, both fp32, from its logits:
    d loss / d logits = (softmax - onehot) x ``scale`` (each token's cotangent), through the
    soft cap's tanh where there is one, in the inputs' dtype for the two GEMMs."""
    p = jnp.exp(logits - lse[:, None])
    p = p - jax.nn.one_hot(yc, head.shape[1], dtype=p.dtype)
    if cap:  # d cap tanh(z / cap) / dz = 1 - tanh^2; the padding's -inf columns have p = 0
        p = p * jnp.where(jnp.isfinite(logits), 1 - jnp.square(logits / cap), 0.0)
    dlogits = (p * scale[:, None]).astype(xc.dtype)
    return _dot32(dlogits, head.T), _dot32(xc.T, dlogits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked(x: jax.Array, head: jax.Array, y: jax.Array, valid: tuple[int, float]
             ) -> jax.Array:
    return _forward(x, head, y, valid)[0]


def _chunked_fwd(x, head, y, valid):
    loss, lse = _forward(x, head, y, valid)
    return loss, (x, head, y, lse)


def _chunked_bwd(valid, res, g):
    """Each chunk's logits again, then the two matmuls; the head's gradient summed over
    chunks in fp32."""
    x, head, y, lse = res

    def body(dhead, xs):
        xc, yc, lc, gc = xs
        dx, dh = _grads(xc, head, yc, _logits(xc, head, valid), lc, gc, valid[1])
        return dhead + dh, dx.astype(x.dtype)
    dhead, dx = jax.lax.scan(body, _varying(jnp.zeros(head.shape, jnp.float32), x, head, g),
                             (x, y, lse, g))
    return dx, dhead.astype(head.dtype), None


def _count(w: jax.Array, empty_is_zero: bool) -> jax.Array:
    """The mean's divisor: the weights' sum (1 where they are all 0 and ``empty_is_zero``)."""
    n = jnp.sum(w)
    return jnp.where(n > 0, n, 1.0) if empty_is_zero else n


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked_mean(x: jax.Array, head: jax.Array, y: jax.Array, w: jax.Array,
                  valid: tuple[int, float], empty_is_zero: bool) -> jax.Array:
    loss, _ = _forward(x, head, y, valid)
    return jnp.sum(loss * w) / _count(w, empty_is_zero)


def _chunked_mean_fwd(x, head, y, w, valid, empty_is_zero):
    """The loss and, chunk by chunk, its gradients for a cotangent of 1 per token (0 for the
    padding), in fp32: the softmax's gradient unscaled, in [-1, 1], so that in fp16 it does not
    underflow where the loss scale would have kept it (the scale comes with the cotangent)."""
    def body(dhead, xs):
        xc, yc, wc = xs
        logits, lse, loss = _lse_and_loss(xc, head, yc, valid)
        dx, dh = _grads(xc, head, yc, logits, lse, wc, valid[1])
        return dhead + dh, (jnp.sum(loss * wc), dx)
    dhead, (loss, dx) = jax.lax.scan(
        body, _varying(jnp.zeros(head.shape, jnp.float32), x, head, w), (x, y, w))
    n = _count(w, empty_is_zero)
    return jnp.sum(loss) / n, (dx, dhead, n, jnp.zeros((), x.dtype), head)


def _chunked_mean_bwd(valid, empty_is_zero, res, g):
    """The forward's gradients times the mean's cotangent over the token count."""
    dx, dhead, n, x_dtype, head = res
    return (dx * (g / n)).astype(x_dtype.dtype), (dhead * (g / n)).astype(head.dtype), None, None


def _dot32(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` accumulated and returned in fp32. The CPU backend has no fp16 x fp16 -> fp32
    dot: fp16 operands are upcast first there (bf16 and fp32 ask the GEMM for fp32)."""
    if a.dtype == jnp.float16 and jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _varying(zeros: jax.Array, *like: jax.Array) -> jax.Array:
    """``zeros`` per device over the manual mesh axes (``shard_map``) any of ``like`` varies
    over, as the scan's carry must be to take their products."""
    axes = set().union(*(jax.typeof(a).manual_axis_type.varying for a in like))
    return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
_chunked_mean.defvjp(_chunked_mean_fwd, _chunked_mean_bwd)
