"""ZeRO-Infinity's NVMe tier: the update's swap bandwidth beside the disk's own, same files.

    python bench/nvme.py [--params-m 32] [--chunk-mb 64] [--buffers 4] [--path DIR]
                         [--rounds 5] [--drop-caches]

An MLP of ``--params-m`` million parameters trains with AdamW at stage 2 over the devices, its
master and moments (12 bytes a parameter) in files under ``--path``. Each round times the
tier's update (read, optimizer, write back, band by band) and then a plain sequential pass over
the same files in chunks of the same size (read each chunk, write it back: the rate the disk
allows). Both report GB/s of bytes read plus written, medians over rounds, and their ratio (the
target is at least 0.7). Each round also runs one update without the bands' checksums (CRC-32
made a constant, so nothing is computed or compared), for what they cost. Without
``--drop-caches`` (root only) both go through the page cache, so they measure the same cached
I/O path; with it, each pass starts from the disk.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time

import harness  # bench/harness.py, beside this script
import numpy as np


def options(p) -> None:
    p.add_argument("--params-m", type=float, default=32.0)
    p.add_argument("--chunk-mb", type=float, default=64.0)
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--path", default=None, help="a directory on the disk to measure")
    p.add_argument("--drop-caches", action="store_true")


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def sequential(files: list[str], chunk: int) -> float:
    """Seconds to read each file in ``chunk``-byte pieces and write each piece back."""
    buf = bytearray(chunk)
    start = time.perf_counter()
    for name in files:
        fd = os.open(name, os.O_RDWR)
        try:
            offset = 0
            while n := os.preadv(fd, [buf], offset):
                os.pwrite(fd, memoryview(buf)[:n], offset)
                offset += n
        finally:
            os.close(fd)
    return time.perf_counter() - start


@contextlib.contextmanager
def checksums_off(tier, tiers):
    """The tier's update with ``nvme.checksum`` a constant: every sum 0, every check passes.
    The files' true sums are set afterwards (untimed), for the next update's checks."""
    for sums in tier._sums:
        sums[:] = [0] * len(sums)
    real, tiers.checksum = tiers.checksum, lambda data: 0
    try:
        yield
    finally:
        tiers.checksum = real
        for j, f in enumerate(tier.files):
            data = np.fromfile(f, np.uint8)
            tier._sums[j] = [real(data[b.start:b.start + b.nbytes]) for b in tier._placed[j][0]]


def main() -> None:
    args = harness.parse_args(__doc__.splitlines()[0], options)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from zero_jax import Nvme, Offload, init_state, make_mesh, make_plan, make_train_step
    from zero_jax import nvme as tiers

    width = 1024
    layers = max(1, round(args.params_m * 1e6 / width ** 2))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x_BxD):
            for _ in range(layers):
                x_BxD = jnp.tanh(nn.Dense(width)(x_BxD))
            return x_BxD

    mesh = make_mesh(args.devices)
    model, x_BxD = MLP(), jnp.ones((mesh.size * 2, width))
    init = lambda key: model.init(key, x_BxD)  # noqa: E731
    loss_fn = lambda params, x: jnp.mean(jnp.square(model.apply(params, x)))  # noqa: E731
    tx = optax.adamw(1e-4)
    path = args.path or tempfile.mkdtemp(prefix="zero_jax-nvme-", dir=".")
    plan = make_plan(jax.eval_shape(init, jax.random.key(0)), mesh, 2, offload=Offload(
        optimizer=1.0, nvme=Nvme(path, chunk_mb=args.chunk_mb, buffers=args.buffers)))
    step = make_train_step(plan, loss_fn, tx)
    tier = step.tier
    batch = jax.device_put(x_BxD, NamedSharding(mesh, P("data")))
    state, _ = step(init_state(plan, init, tx, jax.random.key(0)), batch)  # warm up

    update, timed, checked = tier.update, {True: [], False: []}, [True]

    def timed_update(grads, *program):
        jax.block_until_ready(grads)  # the backward is not the tier's time
        drop_caches(args.drop_caches)
        start = time.perf_counter()
        out = update(grads, *program)
        timed[checked[0]].append(time.perf_counter() - start)
        return out
    tier.update = timed_update

    raw = []
    for _ in range(args.rounds):
        for checked[0] in (True, False):
            with contextlib.nullcontext() if checked[0] else checksums_off(tier, tiers):
                state, _ = step(state, batch)
        drop_caches(args.drop_caches)
        raw.append(sequential(tier.files, tier.nvme.chunk_bytes))
    moved = tier.read_bytes + tier.written_bytes
    pipe_gbs, bare_gbs, raw_gbs = (moved / statistics.median(timed[True]) / 1e9,
                                   moved / statistics.median(timed[False]) / 1e9,
                                   2 * tier.bytes / statistics.median(raw) / 1e9)

    print(harness.header("MLP", mesh, args.rounds, 1))
    print(f"{sum(x.size for x in jax.tree.leaves(state.params)) / 1e6:.1f} M parameters, "
          f"{tier.bytes / 2**20:.0f} MiB in {len(tier.files)} files under {path}; "
          f"chunk {args.chunk_mb} MiB x {args.buffers} buffers; page cache "
          f"{'dropped before each pass' if args.drop_caches else 'kept'}")
    print("| pass | GB/s (read + written) | ratio |")
    print("|---|---|---|")
    print(f"| the tier's update | {pipe_gbs:.2f} | {pipe_gbs / raw_gbs:.2f} |")
    print(f"| the same without checksums | {bare_gbs:.2f} | {bare_gbs / raw_gbs:.2f} |")
    print(f"| sequential read + write back | {raw_gbs:.2f} | 1.00 |")
    print(f"the checksums: {statistics.median(timed[True]) - statistics.median(timed[False]):.3f}"
          f" s of the update's {statistics.median(timed[True]):.3f} s (medians), "
          f"{(bare_gbs / pipe_gbs - 1) * 100:+.1f}%")


if __name__ == "__main__":
    main()
