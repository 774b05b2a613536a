"""Safetensors in and out: load and export throughput beside the disk's sequential read.

    python bench/weights.py [--gb 1.0] [--leaves 8] [--path DIR]

Writes a safetensors file of ``--gb`` GB of fp32 parameters (``--leaves`` of them) under
``--path``, then times, in one run: a plain sequential read of the file (1 GiB chunks'
worth of 64 MiB reads), ``load_params`` into a stage-3 plan on every device (each device's
shard from the memory map), a checkpoint save of that state, and the streamed export back to
safetensors (``python -m zero_jax.export --format safetensors``'s code). GB/s of the file's
bytes for each. Nothing drops the page cache: the file was just written, so the read and the
load come from memory as much as the disk allows.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

from zero_jax.mesh import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import export  # noqa: E402
from zero_jax.tensorfiles import Spec, TensorFiles, write_set  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--leaves", type=int, default=8)
    p.add_argument("--path", default=None)
    args = p.parse_args(argv)
    root = pathlib.Path(tempfile.mkdtemp(dir=args.path, prefix="zj-weights-"))
    rows = int(args.gb * 1e9 / 4 / args.leaves / 1024) // 8 * 8
    specs = [Spec(f"w{i}", np.dtype(np.float32), (rows, 1024)) for i in range(args.leaves)]
    rng = np.random.default_rng(0)
    write_set(root, specs, (rng.standard_normal(s.shape, np.float32) for s in specs))
    file = root / "model.safetensors"
    size = file.stat().st_size
    print(f"{size / 1e9:.2f} GB in {args.leaves} tensors of {specs[0].nbytes / 2**20:.0f} MiB, "
          f"{jax.device_count()} devices ({jax.devices()[0].platform})")

    start = time.perf_counter()
    with open(file, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    rate("sequential read", size, start)

    shapes = {s.name: jax.ShapeDtypeStruct(s.shape, np.float32) for s in specs}
    plan = zj.make_plan(shapes, zj.make_mesh(), stage=3)
    files = TensorFiles(file)
    start = time.perf_counter()
    params = jax.block_until_ready(zj.load_params(plan, files))
    rate("load_params, stage 3", size, start)
    assert files.bytes_read == sum(s.nbytes for s in specs)  # each byte once

    state = zj.init_state(plan, params, optax.sgd(0.1))
    ckpts = zj.Checkpoints(root / "ckpt")
    start = time.perf_counter()
    ckpts.save(state, {})
    ckpts.finish()
    ckpts.close()
    rate("checkpoint save (orbax)", size, start)
    del state, params

    start = time.perf_counter()
    export.export(str(root / "ckpt"), str(root / "out"), safetensors={})
    rate("export --format safetensors", size, start)
    print(f"files under {root} (delete when done)")


def rate(what: str, size: int, start: float) -> None:
    s = time.perf_counter() - start
    print(f"  {what:30s} {s:6.2f} s  {size / s / 1e9:5.2f} GB/s", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
