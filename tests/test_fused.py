"""Fused attention and the chunked loss compute what the plain einsums and full logits compute,
gradients too, and the experts' grouped matmul what ``ragged_dot`` does; the vocabulary's
padding is never predicted; and the saved H100 program of ``gpt2-124m`` (tests/data) holds
neither the attention scores nor the full logits; the experts with a capacity drop the pairs
past each expert's cap, first choices first, and compute the rest as without one."""

import gzip
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import max_rel, tree_rel

import zero_jax as zj
from zero_jax.gpt import attention
from zero_jax.gpt.llama import swiglu
from zero_jax.gpt.model import GPT, LAYERS, GPTConfig, gelu, init_fn, lm_loss
from zero_jax.gpt.moe import MoE, grouped_matmul
from zero_jax.losses import cross_entropy, mean_cross_entropy

DATA = pathlib.Path(__file__).resolve().parent / "data"
KEYS = jax.random.split(jax.random.key(0), 4)


def plain_attention(q, k, v, window=0, scale=None, cap=0.0, sinks=None):
    """The models' attention before: scores, a causal mask, softmax, fp32 throughout here;
    with a ``window`` each query sees the ``window`` keys up to its own (Mistral's); scores
    times ``scale``, capped at ``cap`` by a tanh (Gemma 2's); ``sinks``, a column of each head's
    logit beside the scores in the softmax, dropped after it (GPT-OSS's, as transformers)."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * (scale or 1 / math.sqrt(q.shape[-1]))
    if cap:
        scores = cap * jnp.tanh(scores / cap)
    t = q.shape[1]
    seen = jnp.tril(jnp.ones((t, t), bool))
    if window:
        seen &= ~jnp.tril(seen, -window)
    scores = jnp.where(seen, scores, jnp.finfo(scores.dtype).min)
    if sinks is not None:
        column = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([scores, column], -1), axis=-1)[..., :-1]
        return jnp.einsum("bhts,bshd->bthd", p, v)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)


# GPT-2's heads, Llama's grouped-query, and a sliding window of 7 of the 24 tokens
@pytest.mark.parametrize("kv_heads, window", [(4, 0), (2, 0), (2, 7)])
def test_fused_attention_equals_the_plain_one_with_gradients(kv_heads, window):
    q = jax.random.normal(KEYS[0], (2, 24, 4, 16))
    k, v = (jax.random.normal(key, (2, 24, kv_heads, 16)) for key in KEYS[1:3])
    w = jax.random.normal(KEYS[3], q.shape)  # a loss that weighs every output differently
    plain = lambda *a: plain_attention(*a, window)
    # Jitted, here and below: op by op each operation is a program compiled of its own.
    ref, g_ref = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(plain(*a) * w),
                                            (0, 1, 2)))(q, k, v)
    for impl in ("auto", "xla"):
        fused = lambda *a: jnp.sum(attention.causal(*a, impl, window) * w)  # noqa: B023
        ours, g_ours = jax.jit(jax.value_and_grad(fused, (0, 1, 2)))(q, k, v)
        assert abs(float(ours - ref)) <= 1e-5 * abs(float(ref))
        np.testing.assert_allclose(jax.jit(attention.causal, static_argnums=(3, 4))(
            q, k, v, impl, window), jax.jit(plain)(q, k, v), atol=1e-5)
        assert max_rel(g_ours, g_ref) < 1e-5
    if window:  # the window changes what is attended to
        assert abs(float(ref) - float(jnp.sum(plain_attention(q, k, v) * w))) > 1e-2


@pytest.mark.parametrize("window, block", [(0, 512), (7, 512), (7, 8), (3, 8)])
def test_softcapped_attention_equals_the_plain_one_with_gradients(window, block, monkeypatch):
    """Gemma 2's attention: scores scaled by query_pre_attn_scalar^-1/2 (not the head's),
    capped at 2 by a tanh (small enough to change them), grouped-query, with and without a
    window, the 24 queries at once and in blocks of 8 (with a window, each block reading only
    the keys it sees): the plain einsums' values and gradients."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    q = jax.random.normal(KEYS[0], (2, 24, 4, 16)) * 3
    k, v = (jax.random.normal(key, (2, 24, 2, 16)) for key in KEYS[1:3])
    w = jax.random.normal(KEYS[3], q.shape)
    plain = lambda *a: jnp.sum(plain_attention(*a, window, 0.1, 2.0) * w)
    ours = lambda *a: jnp.sum(attention.causal(*a, "auto", window, 0.1, 2.0) * w)
    (ref, g_ref), (got, g_got) = (jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, k, v)
                                  for f in (plain, ours))
    assert abs(float(got - ref)) <= 1e-5 * abs(float(ref)) and max_rel(g_got, g_ref) < 1e-5
    uncapped = float(jnp.sum(plain_attention(q, k, v, window, 0.1) * w))
    assert abs(uncapped - float(ref)) > 1e-2  # the cap changes what is attended to


@pytest.mark.parametrize("window, block", [(0, 512), (7, 512), (7, 8), (3, 8)])
def test_attention_with_sinks_equals_the_plain_one_with_gradients(window, block, monkeypatch):
    """GPT-OSS's attention: a sink logit per head in each softmax, grouped-query, with and
    without a window, the 24 queries at once and in blocks of 8 (with a window, each block
    reading only the keys it sees: 14 and 10 of 24): the plain einsums' values and gradients,
    the sinks' own too."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    q = jax.random.normal(KEYS[0], (2, 24, 4, 16)) * 3
    k, v = (jax.random.normal(key, (2, 24, 2, 16)) for key in KEYS[1:3])
    w, sinks = jax.random.normal(KEYS[3], q.shape), jnp.array([-1.0, 0.5, 2.0, 4.0])
    plain = lambda *a: jnp.sum(plain_attention(*a[:3], window, sinks=a[3]) * w)
    ours = lambda *a: jnp.sum(attention.causal(*a[:3], "auto", window, sinks=a[3]) * w)
    (ref, g_ref), (got, g_got) = (jax.jit(jax.value_and_grad(f, (0, 1, 2, 3)))(q, k, v, sinks)
                                  for f in (plain, ours))
    assert abs(float(got - ref)) <= 1e-5 * abs(float(ref)) and max_rel(g_got, g_ref) < 1e-5
    sinkless = float(jnp.sum(plain_attention(q, k, v, window) * w))
    assert abs(sinkless - float(ref)) > 1e-2  # the sinks change what is attended to


def test_softcapped_attention_never_holds_the_whole_scores(monkeypatch):
    """At 2,048 tokens the soft-capped attention's gradient holds a block of 512 queries'
    fp32 scores at a time: its compiled temp is under a third of the whole sequence's at once
    (measured at 4,096 tokens, 8 heads of 64: 275 against 2,072 MiB)."""
    q = jax.ShapeDtypeStruct((1, 2048, 8, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 2048, 4, 64), jnp.float32)
    loss = lambda q, k, v: jnp.sum(attention.causal(q, k, v, "xla", 0, 0.1, 50.0))
    temp = {}
    for block in (512, 2048):
        monkeypatch.setattr(attention, "QUERY_BLOCK", block)
        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
        temp[block] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[512] < temp[2048] / 3, temp


def test_gelu_and_its_written_gradient_equal_flax_gelu():
    """The demo's GELU (a custom VJP, fp32 inside) against ``nn.gelu``'s autodiff: the same
    fp32 forward, the derivative within 1e-5 (both within 4e-6 of fp64's); in bf16 the fp32
    value rounded once, and a bf16 gradient."""
    x = jax.random.normal(KEYS[0], (4096,)) * 4
    ours, vjp = jax.vjp(gelu, x)
    ref, vjp_ref = jax.vjp(jax.nn.gelu, x)
    np.testing.assert_array_equal(ours, ref)
    ones = jnp.ones_like(x)
    np.testing.assert_allclose(vjp(ones)[0], vjp_ref(ones)[0], rtol=0, atol=1e-5)
    xb = x.astype(jnp.bfloat16)
    np.testing.assert_array_equal(gelu(xb), jax.nn.gelu(xb.astype(jnp.float32)).astype(xb.dtype))
    bf16_grad = jax.vjp(gelu, xb)[1](ones.astype(xb.dtype))[0]
    assert bf16_grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(bf16_grad.astype(jnp.float32), vjp_ref(ones)[0], atol=2e-2)


def test_swiglu_and_its_written_gradient_equal_autodiff():
    """Llama's SwiGLU (a custom VJP, fp32 inside) against ``nn.silu(gate) * up``'s autodiff:
    the same fp32 forward, the gradients within 1e-5; a bf16 forward rounded once."""
    gate, up = (jax.random.normal(key, (4096,)) * 4 for key in KEYS[:2])
    ours, vjp = jax.vjp(swiglu, gate, up)
    ref, vjp_ref = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)
    np.testing.assert_array_equal(ours, ref)
    ones = jnp.ones_like(gate)
    for a, b in zip(vjp(ones), vjp_ref(ones), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    gb, ub = gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)
    rounded = jax.nn.silu(gb.astype(jnp.float32)) * ub.astype(jnp.float32)
    assert swiglu(gb, ub).dtype == jnp.bfloat16
    np.testing.assert_array_equal(swiglu(gb, ub), rounded.astype(jnp.bfloat16))


def test_auto_picks_cudnn_only_where_it_runs():
    assert attention.resolve("auto", "gpu", jnp.bfloat16, 64) == "cudnn"
    assert attention.resolve("auto", "cpu", jnp.bfloat16, 64) == "xla"
    assert attention.resolve("auto", "gpu", jnp.float32, 64) == "xla"
    assert attention.resolve("auto", "gpu", jnp.bfloat16, 256) == "xla"
    with pytest.raises(ValueError, match="attention must be one of auto, xla, cudnn"):
        attention.resolve("flash", "gpu", jnp.bfloat16, 64)


@pytest.mark.parametrize("sizes", [[10, 0, 25, 5], [40, 0, 0, 0], [0, 0, 0, 40], [1, 0, 0, 0],
                                   [0, 3, 0, 0, 0, 4, 0, 0], "random"])
def test_grouped_matmul_equals_ragged_dot_with_gradients(sizes):
    """Runs of every length, empty groups, every row in the first or the last group, one row,
    300 rows in 5 groups of random sizes (tiles of 64): the rows' products and both gradients
    those of ``jax.lax.ragged_dot`` within 1e-6 relative (fp32); in bf16 the fp32 result
    rounded, and gradients in bf16 within its rounding."""
    rng = np.random.default_rng(0)
    if sizes == "random":
        sizes = np.bincount(rng.integers(0, 5, 300), minlength=5)
    sizes = jnp.array(sizes, jnp.int32)
    m, groups = int(sizes.sum()), len(sizes)
    x, w, dy = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                for s in ((m, 8), (groups, 8, 6), (m, 6)))
    loss = lambda f: lambda x, w: jnp.sum(f(x, w, sizes) * dy)  # noqa: E731
    ours, grads = jax.jit(jax.value_and_grad(loss(grouped_matmul), (0, 1)))(x, w)
    ref, ref_grads = jax.value_and_grad(loss(jax.lax.ragged_dot), (0, 1))(x, w)
    np.testing.assert_allclose(grouped_matmul(x, w, sizes), jax.lax.ragged_dot(x, w, sizes),
                               rtol=1e-6, atol=1e-6)
    assert max_rel(grads, ref_grads) < 1e-6 and abs(ours - ref) <= 1e-5 * abs(ref)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    exact = jax.lax.ragged_dot(xb.astype(jnp.float32), wb.astype(jnp.float32), sizes)
    np.testing.assert_allclose(grouped_matmul(xb, wb, sizes).astype(jnp.float32), exact,
                               rtol=2 ** -8, atol=2 ** -8)
    bf16 = jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, w, sizes).astype(jnp.float32) * dy),
                    (0, 1))(xb, wb)
    assert [g.dtype for g in bf16] == [jnp.bfloat16] * 2 and max_rel(bf16, ref_grads) < 1e-2
    # the weights' gradient summed in fp32 over each group's rows, rounded once
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    dw = jax.grad(lambda w: jnp.sum(jax.lax.ragged_dot(f32(xb), w, sizes) * f32(
        dy.astype(jnp.bfloat16))))(f32(wb))
    np.testing.assert_allclose(f32(bf16[1]), f32(dw.astype(jnp.bfloat16)), rtol=2 ** -8,
                               atol=1e-6)


def test_grouped_matmul_computes_the_routed_rows_not_every_group():
    """4,096 rows over 32 groups of 128 x 256 weights: ``ragged_dot`` as jax 0.10.2 compiles
    it for the CPU multiplies every row by every group's weights (a temporary 32 times the
    rows'); the grouped matmul one tile of rows at a time by its group's weights, no product
    larger than a tile's, and its compiled step holds a tenth of the temporary."""
    m, d, f, groups = 4096, 128, 256, 32
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
    args = (jax.ShapeDtypeStruct((m, d), jnp.float32), jax.ShapeDtypeStruct((groups, d, f),
                                                                            jnp.float32), sizes)
    step = lambda f_: jax.jit(jax.grad(  # noqa: E731
        lambda x, w, s: jnp.sum(f_(x, w, s) ** 2), (0, 1))).lower(*args).compile()
    ours, ref = step(grouped_matmul), step(jax.lax.ragged_dot)
    # each product of ours: one tile (128 rows: 4,096 / 32 groups) by one group's weights
    dots = re.findall(r"= f32\[([\d,]+)\]\S* dot\(", ours.as_text())
    assert dots and all(math.prod(map(int, s.split(","))) <= 128 * max(d, f) for s in dots), dots
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(ref) >= groups * m * f * 4 and temp(ours) < temp(ref) / 10, (temp(ours),
                                                                              temp(ref))
    # bf16 weights: their gradient is written in bf16 as each group's fp32 sum grows; the
    # program as written holds no fp32 stack of every group's weights (twice their bytes; the
    # CPU compiler upcasts bf16 weights for its dots, so read before it: the H100 program,
    # docs/benchmarks/cpu-mesh.md)
    bf16 = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in args[:2]] + [sizes]
    text = str(jax.make_jaxpr(jax.grad(lambda x, w, s: jnp.sum(grouped_matmul(x, w, s).astype(
        jnp.float32) ** 2), (0, 1)))(*bf16))
    assert f"bf16[{groups},{d},{f}]" in text and f"f32[{groups},{d},{f}]" not in text


def test_a_capacity_drops_the_pairs_past_each_experts_cap_first_choices_first():
    """24 tokens, 4 experts, top 2, the router leaning on expert 0: with a capacity factor of
    1 (12 pairs an expert) the output and every gradient (the router's through the weights
    too) those of a sum over the kept pairs, each by its expert's weights: every token's
    first choice in token order, then
    every second choice (GShard's priority), each expert's first 12 (some dropped, so not
    the uncapped output); with a factor of 2 (24: every token) nothing is
    dropped, and both equal the uncapped MoE's; a factor of 4 (48) holds 24 too, each token
    choosing an expert once: its buffer is (4, 24, d), not (4, 48, d)."""
    e, k, d, f, tokens = 4, 2, 8, 16, 24
    moe = lambda factor: MoE(e, k, f, True, swiglu, capacity_factor=factor)  # noqa: E731
    h = jax.random.normal(KEYS[0], (2, tokens // 2, d))
    params = moe(0.0).init(KEYS[1], h)
    params["params"]["router"] = params["params"]["router"].at[:, 0].add(2.0)
    p = params["params"]

    def reference(p, h, keep):
        """The experts' output as the sum over the pairs ``keep`` marks, each pair by its
        own expert's weights."""
        x = h.reshape(-1, d)
        probs = jax.nn.softmax(x @ p["router"], axis=-1)
        w, chosen = jax.lax.top_k(probs, k)
        w = w / w.sum(-1, keepdims=True)
        ws = {n: p[n][chosen] for n in ("gate", "up", "down")}  # (tokens, k, ...) each
        mid = swiglu(jnp.einsum("td,tkdf->tkf", x, ws["gate"]),
                     jnp.einsum("td,tkdf->tkf", x, ws["up"]))
        y = jnp.einsum("tkf,tkfd->tkd", mid, ws["down"]) * w[..., None]
        return jnp.where(jnp.asarray(keep)[..., None], y, 0).sum(1).reshape(h.shape)

    x = np.asarray(h.reshape(-1, d))
    chosen = np.asarray(jax.lax.top_k(jax.nn.softmax(x @ p["router"], -1), k)[1])
    runs = {}
    for factor, cap in ((1.0, 12), (2.0, 24), (0.0, None)):
        taken, keep = np.zeros(e, int), [[True] * k for _ in range(tokens)]
        for j in range(k):  # first choices, then second, each in token order
            for t in range(tokens):
                keep[t][j] = cap is None or taken[chosen[t, j]] < cap
                taken[chosen[t, j]] += 1
        out = lambda p, factor=factor: moe(factor).apply({"params": p}, h)[0]  # noqa: E731
        loss = lambda p, fn: jnp.sum(fn(p) * jnp.cos(jnp.arange(d)))  # noqa: E731
        ref_fn = lambda p, keep=keep: reference(p, h, keep)  # noqa: E731
        runs[factor] = out(p), jax.grad(loss)(p, out)
        np.testing.assert_allclose(runs[factor][0], ref_fn(p), rtol=1e-5, atol=1e-6)
        assert max_rel(runs[factor][1], jax.grad(loss)(p, ref_fn)) < 1e-5
        dropped = sum(not kept for row in keep for kept in row)
        assert (dropped > 0) == (factor == 1.0), (factor, dropped)
    assert max_rel(runs[2.0], runs[0.0]) < 1e-6
    assert not np.allclose(runs[1.0][0], runs[0.0][0], atol=1e-3)
    out = lambda p: moe(4.0).apply({"params": p}, h)[0]  # noqa: E731
    assert max_rel((out(p), jax.grad(loss)(p, out)), runs[0.0]) < 1e-6
    text = str(jax.make_jaxpr(out)(p))
    assert f"f32[{e},{tokens},{d}]" in text and f"[{e},{2 * tokens},{d}]" not in text


@pytest.mark.parametrize("vocab,valid,chunk", [(256, 256, 64), (256, 250, 48), (256, 250, 1000),
                                               (384, 130, 64), (100, 97, 48)])
def test_chunked_loss_equals_full_logits_with_gradients(vocab, valid, chunk):
    """Chunks that do and do not divide the 3 x 40 tokens, one chunk for all; a head of
    ``vocab`` columns of which ``valid`` are the vocabulary: the log-sum-exp's blocks (128)
    with padding in some, whole blocks of padding (384), none (100: two passes)."""
    x = jax.random.normal(KEYS[0], (3, 40, 32))
    head = jax.random.normal(KEYS[1], (32, vocab)) * 0.2
    y = jax.random.randint(KEYS[2], (3, 40), 0, valid)

    def plain(x, head):
        logits = (x @ head)[..., :valid]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def chunked(x, head):
        return cross_entropy(x, head, y, valid=valid, chunk=chunk).mean()

    def mean(x, head):  # the gradients from the forward pass, scaled by the cotangent
        return mean_cross_entropy(x, head, y, valid=valid, chunk=chunk)

    ref, g_ref = jax.jit(jax.value_and_grad(plain, (0, 1)))(x, head)
    for loss in (chunked, mean):
        ours, g_ours = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, head)
        assert abs(float(ours - ref)) <= 1e-5 * float(ref)
        assert max_rel(g_ours, g_ref) < 1e-5
        assert not np.any(np.asarray(g_ours[1][:, valid:]))  # the padding learns nothing
    assert abs(float(jax.jit(mean)(x, head) - ref)) <= 1e-5 * float(ref)  # forward alone
    scaled = jax.jit(jax.grad(lambda x, head: 3.0 * mean(x, head), (0, 1)))(x, head)
    assert max_rel(scaled, jax.tree.map(lambda g: 3.0 * g, g_ref)) < 1e-5
    # Weighted: tokens left out (padding, prompts) and counted twice, against optax's mean of
    # the weighted losses; the left-out tokens' hidden states get no gradient.
    w = jax.random.randint(KEYS[3], (3, 40), 0, 3).astype(jnp.float32)

    def plain_weighted(x, head):
        ce = optax.softmax_cross_entropy_with_integer_labels((x @ head)[..., :valid], y)
        return jnp.sum(ce * w) / jnp.sum(w)

    ref, g_ref = jax.jit(jax.value_and_grad(plain_weighted, (0, 1)))(x, head)
    ours, g_ours = jax.jit(jax.value_and_grad(
        lambda x, head: mean_cross_entropy(x, head, y, valid=valid, chunk=chunk, weights=w),
        (0, 1)))(x, head)
    assert abs(float(ours - ref)) <= 1e-5 * float(ref) and max_rel(g_ours, g_ref) < 1e-5
    assert not np.any(np.asarray(g_ours[0])[np.asarray(w) == 0])
    none = jax.jit(jax.value_and_grad(lambda x, head: mean_cross_entropy(
        x, head, y, valid=valid, chunk=chunk, weights=jnp.zeros_like(w)), (0, 1)))(x, head)
    assert float(none[0]) == 0 and not any(np.any(np.asarray(g)) for g in none[1])


def test_softcapped_loss_equals_full_logits_with_gradients():
    """Gemma 2's final logits, ``cap * tanh(logits / cap)``, inside the chunked loss: the
    plain loss's value and gradients, the padded vocabulary's columns still learning nothing."""
    x = jax.random.normal(KEYS[0], (3, 40, 32))
    head = jax.random.normal(KEYS[1], (32, 256))
    y = jax.random.randint(KEYS[2], (3, 40), 0, 250)

    def plain(x, head, cap=3.0):
        logits = (x @ head)[..., :250]
        logits = cap * jnp.tanh(logits / cap) if cap else logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    ref, g_ref = jax.jit(jax.value_and_grad(plain, (0, 1)))(x, head)
    for loss in (cross_entropy, mean_cross_entropy):
        f = lambda x, head: jnp.mean(loss(x, head, y, valid=250, chunk=48,  # noqa: B023
                                          softcap=3.0))
        got, g_got = jax.jit(jax.value_and_grad(f, (0, 1)))(x, head)
        assert abs(float(got - ref)) <= 1e-5 * float(ref) and max_rel(g_got, g_ref) < 1e-5
        assert not np.any(np.asarray(g_got[1][:, 250:]))
    assert abs(float(plain(x, head, 0.0)) - float(ref)) > 1.0  # the cap counts


def test_embedding_gradient_sums_in_fp32():
    """``take_rows``'s gradient is the plain lookup's, summed in fp32 and rounded once: a bf16
    table's rows read 300 times each come back within bf16's rounding of the fp32 sum, where
    the plain lookup's bf16 scatter-add drifts by tens of percent; and the gradient's program
    scatters into an fp32 table."""
    table = jax.random.normal(KEYS[0], (50, 8)).astype(jnp.bfloat16)
    ids = jax.random.randint(KEYS[1], (4, 300), 0, 4)  # four rows, each read ~300 times

    def loss(lookup):
        return lambda t, i: jnp.sum(lookup(t, i).astype(jnp.float32) ** 2)
    exact = jax.jit(jax.grad(loss(lambda t, i: t[i])))(table.astype(jnp.float32), ids)
    grad = jax.jit(jax.grad(loss(zj.take_rows)))
    ours, plain = grad(table, ids), jax.jit(jax.grad(loss(lambda t, i: t[i])))(table, ids)
    assert ours.dtype == jnp.bfloat16
    scale = float(jnp.abs(exact).max())
    assert max_rel(ours.astype(jnp.float32), exact) < 2 ** -7
    assert float(jnp.abs(plain.astype(jnp.float32) - exact).max()) > 0.05 * scale
    text = grad.lower(table, ids).as_text(dialect="hlo")  # the CPU backend expands scatters
    assert re.findall(r"(\w+)\[[\d,]+\]\{[\d,]+\} scatter\(", text) == ["f32"]
    x = jax.random.normal(KEYS[2], (50, 8))  # fp32 tables: the plain lookup's gradient
    np.testing.assert_allclose(jax.jit(jax.grad(loss(zj.take_rows)))(x, ids),
                               jax.jit(jax.grad(loss(lambda t, i: t[i])))(x, ids), rtol=1e-6)


def test_chunked_loss_refuses_bad_shapes_in_one_line():
    x, head = jnp.zeros((4, 8)), jnp.zeros((8, 16))
    with pytest.raises(ValueError, match=r"hidden \(4, 8\) must be labels \(5,\)"):
        cross_entropy(x, head, jnp.zeros(5, jnp.int32))
    with pytest.raises(ValueError, match="valid 17 must be in 1..16"):
        cross_entropy(x, head, jnp.zeros(4, jnp.int32), valid=17)
    with pytest.raises(ValueError, match=r"weights \(3,\) must be shaped as labels \(4,\)"):
        mean_cross_entropy(x, head, jnp.zeros(4, jnp.int32), weights=jnp.ones(3))


@pytest.fixture(scope="module")
def padded():
    """A GPT-2 of vocabulary 250 padded to 256, its parameters and a batch."""
    cfg = GPTConfig(vocab_size=250, vocab_multiple=128, d_model=32, n_layers=2, n_heads=4,
                    d_ff=64, seq_len=16, remat="none")
    model = GPT(cfg)
    params = jax.jit(init_fn(model))(jax.random.key(1))  # op by op: slower
    tokens = jax.random.randint(KEYS[3], (8, cfg.seq_len + 1), 0, cfg.vocab_size)
    return model, params, tokens


def test_padded_vocabulary_is_never_predicted(padded):
    """The demo's loss (fused attention, chunks, padding masked) equals optax on the logits the
    model returns, which leave the padding out; the padded rows of the tied embedding get no
    gradient."""
    model, params, tokens = padded
    assert params["wte"].shape == (256, 32)

    def plain(p):
        logits = model.apply({"params": p}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    # its shape only: op by op the forward took seconds
    assert jax.eval_shape(lambda p: model.apply({"params": p}, tokens[:, :-1]),
                          params).shape[-1] == 250
    ref, g_ref = jax.jit(jax.value_and_grad(plain))(params)  # op by op: slower
    ours, g_ours = jax.jit(jax.value_and_grad(lm_loss(model)))(params, tokens)
    assert abs(float(ours - ref)) <= 1e-5 * float(ref)
    assert max_rel(g_ours, g_ref) < 1e-5
    assert not np.any(np.asarray(g_ours["wte"][250:]))


def test_stage_3_with_the_padded_vocabulary_equals_one_device(padded, mesh):
    model, params, tokens = padded
    tx = optax.adamw(1e-2)
    plan = zj.make_plan(jax.eval_shape(lambda: params), mesh, stage=3, layers=LAYERS)
    state = zj.init_state(plan, params, tx)
    step = zj.make_train_step(plan, lm_loss(model), tx)
    grad = jax.jit(jax.value_and_grad(lm_loss(model)))  # one device's (op by op: slower)
    ref, opt = params, tx.init(params)
    for _ in range(2):
        state, metrics = step(state, tokens)
        value, grads = grad(ref, tokens)
        updates, opt = tx.update(grads, opt, ref)
        ref = optax.apply_updates(ref, updates)
        assert abs(float(metrics["loss"]) - float(value)) <= 1e-5 * float(value)
    assert tree_rel(state.params, ref) < 1e-5  # over the tree: Adam magnifies noise leaves


@pytest.fixture(scope="module")
def masked(padded, mesh):
    """Rows padded to 0-16 valid tokens, a row a device, so the devices' counts differ (one has
    none); ``mean_cross_entropy(weights=...)`` returned as ``zj.Weighted``, and one device's
    optax mean over every valid token of the batch."""
    model, params, tokens = padded
    lengths = jax.random.randint(KEYS[0], (tokens.shape[0], 1), 1, tokens.shape[1])
    lengths = lengths.at[0].set(0)  # one device's row all padding: it adds nothing
    w = (jnp.arange(tokens.shape[1] - 1)[None, :] < lengths).astype(jnp.float32)

    def loss_fn(p, batch):
        toks, weights = batch
        x, head = model.apply({"params": p}, toks[:, :-1], method="features")
        mean = mean_cross_entropy(x, head, toks[:, 1:], valid=250, weights=weights)
        return zj.Weighted(mean * jnp.sum(weights), jnp.sum(weights))

    def plain(p, batch):
        toks, weights = batch
        logits = model.apply({"params": p}, toks[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:])
        return jnp.sum(ce * weights) / jnp.sum(weights)

    plan = zj.make_plan(jax.eval_shape(lambda: params), mesh, stage=3, layers=LAYERS)
    return plan, params, (tokens, w), loss_fn, jax.jit(jax.value_and_grad(plain))


def test_a_masked_loss_gives_stage_3_the_global_means_gradient(masked):
    """Stage 3's gradients equal one device's of the mean over every valid token of the batch
    (a mean of the devices' means would not)."""
    plan, params, batch, loss_fn, grad = masked
    # Jitted: op by op the stage-3 gradient took ~15 s.
    grad_fn = jax.jit(zj.make_grad_fn(plan, loss_fn))
    sharded = grad_fn(zj.init_state(plan, params, optax.sgd(0.5)).params, batch)[1]
    assert tree_rel(sharded, grad(params, batch)[1]) < 1e-5


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_masked_loss_trains_on_the_global_mean_at_stage_3(masked, opt):
    """Two steps of the masked loss at stage 3 train as optax does on one device."""
    plan, params, batch, loss_fn, grad = masked
    tx = {"sgd": optax.sgd(0.5), "adamw": optax.adamw(1e-2)}[opt]
    state = zj.init_state(plan, params, tx)
    step, ref, opt_state = zj.make_train_step(plan, loss_fn, tx), params, tx.init(params)
    for _ in range(2):
        state, metrics = step(state, batch)
        value, grads = grad(ref, batch)
        updates, opt_state = tx.update(grads, opt_state, ref)
        ref = optax.apply_updates(ref, updates)
        assert abs(float(metrics["loss"]) - float(value)) <= 1e-5 * float(value)
    assert tree_rel(state.params, ref) < 1e-5


def test_a_checkpoint_from_before_the_padding_resumes_only_unpadded():
    """gpt2-124m's 50,257 are padded to 50,304 now: a checkpoint written before holds 50,257
    rows and is refused, naming the key; with vocab_multiple 1 it resumes. The tiny config's
    256 is padded to itself: nothing to refuse."""
    from zero_jax.checkpoint import CheckpointError
    from zero_jax.gpt import config as configs
    from zero_jax.gpt.experiment import check_compatible

    for name, refused in (("gpt2-124m", True), ("tiny", False)):
        old = configs.load(name)
        del old["model"]["vocab_multiple"]
        if refused:
            with pytest.raises(CheckpointError, match=r"model.vocab_multiple=1 but the config "
                                                      r"says 128"):
                check_compatible({"config": old}, configs.load(name))
        else:
            check_compatible({"config": old}, configs.load(name))
        check_compatible({"config": old}, configs.load(name, ["model.vocab_multiple=1"]))


def test_the_saved_h100_program_holds_no_scores_and_no_full_logits():
    """``gpt2-124m`` at batch 32 x 1024 on one H100, bf16 (``bench/gpu.py``'s compile, made with
    no GPU present: jax and its CUDA 13 plugin 0.10.2). Attention is cuDNN's flash attention
    (forward, its recompute, backward), no buffer holds a (batch, heads, t, t) score tensor or
    the (tokens, vocabulary) logits, one 8,192-token chunk's at most; the one scatter, the
    embedding's gradient, sums in fp32 (in bf16 it took 8.7 of 80 ms on an H200); the estimate
    (bench/estimate.py) reads at most 135 GB of HBM a step (128.2 in this program, 345 before
    the fused attention and the chunked loss) and at least 53% MFU (56.0%; 24%) against the
    model's FLOPs."""
    sys.path.insert(0, str(DATA.parent.parent / "bench"))
    import estimate
    import gpu

    text = gzip.open(DATA / "gpt2-124m-stage-0-h100.hlo.gz", "rt").read()
    fmha = re.findall(r'custom_call_target="__cudnn\$(fmha\w*)"', text)
    assert sorted(fmha) == ["fmhaSoftmax", "fmhaSoftmax", "fmhaSoftmaxBackward"]
    assert re.findall(r"(\w+)\[[\d,]+\]\{[\d,]+\} scatter\(", text) == ["f32"]
    model = GPTConfig(vocab_size=50257, vocab_multiple=128, d_model=768, n_layers=12,
                      n_heads=12, d_ff=3072, seq_len=1024)  # configs/gpt2-124m.yaml
    b, t, v = 32, model.seq_len, model.padded_vocab
    shapes = {tuple(int(d) for d in dims.split(",")) for dims in
              re.findall(r"(?:bf16|f32|f16)\[([\d,]+)\]", text)}
    assert not {s for s in shapes if s.count(t) >= 2}  # no t x t
    largest = max(math.prod(s) for s in shapes if v in s)
    assert largest <= 8192 * v < b * t * v  # one chunk of logits at most
    e = estimate.estimate(text, estimate.H100, 1, gpu.flops_per_token(model) * b * t)
    assert e["hbm_bytes"] <= 135e9 and e["mfu"] >= 0.53, e


def test_the_saved_h100_program_attends_in_the_sliding_window():
    """``configs/llama.yaml`` at 1,024 tokens with a 256-token sliding window, batch 8 on one
    H100 (the deviceless compile above): cuDNN's flash attention takes the window (forward,
    its recompute, backward), and no buffer holds a t x t mask or score tensor."""
    text = gzip.open(DATA / "llama-window-256-stage-0-h100.hlo.gz", "rt").read()
    fmha = re.findall(r'custom_call_target="__cudnn\$(fmha\w*)"', text)
    assert sorted(fmha) == ["fmhaSoftmax", "fmhaSoftmax", "fmhaSoftmaxBackward"]
    assert re.findall(r'"sliding_window_length":\s*(\d+)', text) == ["256"] * 3
    shapes = {tuple(int(d) for d in dims.split(",")) for dims in
              re.findall(r"(?:pred|bf16|f32|f16)\[([\d,]+)\]", text)}
    assert not {s for s in shapes if s.count(1024) >= 2}
