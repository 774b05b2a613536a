"""Eight simulated CPU devices, set before jax is imported, and the shared small model
(``tests/lm.py``)."""

import atexit
import gc
import json
import os
import pathlib
import re
import shutil
import struct
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tracing makes millions of short-lived objects while the heap of kept jaxprs and programs grows:
# at Python's default thresholds the collector took 3.9 s in 4,167 collections of the 94 s
# test_blocks.py ran (2026-11-28); at these, 0.6 s in 25.
gc.set_threshold(50_000, 50, 1000)
# The compiler's settings: fast, and exact where a test compares bits (tests/flags.py).
from flags import FAST_COMPILE  # noqa: E402

# A test that runs one program for many steps compiles it with them (``compiler_options``):
# the default model's step then runs 2.3x faster, for 20% more compile time.
OPTIMIZED = {"xla_backend_optimization_level": 2}
# For train.py and other programs the tests start: they choose their own device count.
# The programs the suite runs and starts compile the same steps many times (train.py's default
# run, above all): JAX's persistent compilation cache, one per test session, compiles each once.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zj-cache-")
    # Made by the process that reads this first (pytest's; xdist's workers and the programs
    # started inherit it), which removes it as it exits: not left in /tmp.
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
SUBPROCESS_ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                  "XLA_FLAGS": FAST_COMPILE}
# For the train.py runs that train: LLVM's level 1 runs as fast as level 2 and compiles about as
# fast as level 0 (train.py's default run, 60 steps: 32 s at 0, 18 s at 1; the three files of
# train.py runs: 235 -> 209 s). Not for compile-bound ones (the multi-process runs: 74 -> 98 s).
# Those with the default emitters; with the older ones test_cli + test_checkpoint took 244 s at
# level 1 and 231 s at 0 (one run each, side by side): within the noise, so left at 1.
TRAIN_ENV = {**SUBPROCESS_ENV,
             "XLA_FLAGS": FAST_COMPILE.replace("level=0", "level=1")}
# train.py flags the tests share. ONE_LAYER: the default model cut to one layer, for runs its
# depth proves nothing more in. FIXED_SCHEDULE: the learning-rate schedule whatever --steps is
# (with decay_steps 0 it ends at --steps, a constant of the program), so a run resumed for
# more steps loads its first run's program from the persistent cache.
ONE_LAYER = ["--set", "model.n_layers=1"]
FIXED_SCHEDULE = ["--set", "optimizer.decay_steps=20"]
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

from zero_jax.mesh import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from lm import LM, SMALL, batches, init_fn, lm_loss  # noqa: E402

from zero_jax.mesh import make_mesh  # noqa: E402

N = 8
ROOT = pathlib.Path(__file__).resolve().parent.parent


def example(path: str, name: str) -> str:
    """The Python code block after ``<!-- name -->`` in the Markdown file ``path`` (relative to
    the repository), as the docs show it."""
    text = (ROOT / path).read_text()
    block = re.search(rf"<!-- {name} -->\n```python\n(.*?)```\n", text, re.S)
    assert block, f"{path} lost its example {name}"
    return block.group(1)


def png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk."""
    head = pathlib.Path(path).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def check_files(fig: pathlib.Path, name: str) -> dict:
    """A figure's three files (``plot``): an 800 x 450 PNG, an SVG, and its JSON sidecar, read."""
    assert png_size(fig / f"{name}.png") == (800, 450)
    assert (fig / f"{name}.svg").read_text().lstrip().startswith("<?xml")
    return json.loads((fig / f"{name}.json").read_text())


def rel(a, b) -> float:
    """Norm-relative difference of two arrays."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tree_rel(tree_a, tree_b) -> float:
    """Norm-relative difference of two whole trees, as one vector."""
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64))
                                     for x in jax.tree.leaves(t)])
    return rel(flat(tree_a), flat(tree_b))


def max_rel(tree_a, tree_b) -> float:
    """The largest norm-relative difference of two trees' leaves."""
    return max(rel(a, b) for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b),
                                         strict=True))


def local_bytes(tree) -> int:
    """Bytes device 0 really holds: read off the arrays' addressable shards."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.fixture(scope="session")
def mesh():
    assert len(jax.devices()) == N
    return make_mesh(N)


def small_problem() -> tuple:
    """(model, init, loss_fn, batches) of the suite's small language model (``tests/lm.py``)."""
    model = LM(SMALL)
    return model, init_fn(model), lm_loss(model), batches(SMALL, 10)


small = pytest.fixture(small_problem, scope="session", name="small")


KEY = jax.random.key(42)
CLIP = 0.5
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.5),
    "adamw": lambda: optax.chain(optax.clip_by_global_norm(CLIP),
                                 optax.adamw(3e-3, weight_decay=0.1)),
}


def optax_steps(loss_fn, tx, params, batches) -> dict:
    """Plain optax on one device, one jitted step per batch: each step's loss and gradient,
    the final parameters and optimizer state."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    opt_state, losses, grads = tx.init(params), [], []
    for b in batches:
        params, opt_state, loss, g = step(params, opt_state, b)
        losses.append(float(loss))
        grads.append(g)
    return {"losses": np.array(losses), "grads": grads, "params": params,
            "opt_state": opt_state}


def reference_runs(small: tuple) -> dict:
    """Per optimizer: ``optax_steps`` over the small model's 10 batches, from ``init(KEY)``."""
    _, init, loss_fn, batches = small
    return {name: optax_steps(loss_fn, make_tx(), init(KEY), batches)
            for name, make_tx in OPTIMIZERS.items()}


reference = pytest.fixture(reference_runs, scope="session", name="reference")


def equations(jaxpr, skip: str | None = None, loop=None, scans=None):
    """Every equation of a jaxpr and of the jaxprs inside it, with the index of the scan it runs
    in (program order: the forward layer loop first), or None; ``skip`` names a primitive left
    out, contents and all."""
    scans = [0] if scans is None else scans
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == skip:
            continue
        yield eqn, loop
        here = loop
        if eqn.primitive.name == "scan":
            here, scans[0] = scans[0], scans[0] + 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner, skip, here, scans)


# The files that take the most CPU (seconds of a run alone, -n 0, 2 cores), started first:
# with two workers taking whole files, a heavy file started last leaves the other idle at the
# end. xdist would otherwise start the files with the most tests first.
HEAVIEST = ["test_tensor_parallel.py", "test_hardening.py", "test_checkpoint.py",
            "test_blocks.py", "test_cli.py", "test_multiprocess.py", "test_weights.py",
            "test_precision.py", "test_prefetch.py", "test_nvme.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVIEST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file



def figures_follow(r: dict) -> dict:
    """--plot's figures of report ``r`` (its own stage compiled, as a hierarchical or tensor-
    parallel run's is): communication as a pair of bars per mesh axes, each the report's
    collectives over those axes beside ZeRO's theory for them; memory as the stage compiled,
    its state from the shardings. The communication groups, by axes."""
    from zero_jax import plot

    _, data = plot.communication(r)
    groups = {g["axes"]: g for g in data["groups"]}
    for axes, g in groups.items():
        assert g["measured_total"] == sum(c["volume"] for c in r["collectives"]
                                          if c["axes"] == axes)
        assert g["theory_bytes"] == r["comm_bytes_theory_by_axes"].get(axes, 0)
    _, data = plot.memory_by_stage(r)
    (bar,) = data["bars"]
    parts = ("params", "master", "opt_state")
    assert bar["stage"] == r["stage"] and data["counts"] == "compiled"
    assert {k: bar[k] for k in parts} == {k: r["per_device_bytes"][k] for k in parts}
    return groups
