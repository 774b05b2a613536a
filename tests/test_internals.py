"""The private and unstable APIs zero_jax relies on live in ``zero_jax/internals.py`` alone, and
each still does what we rely on: when an upgrade breaks one, its test names it."""

import contextlib
import inspect
import os
import pathlib
import re
import subprocess
import sys

import flax.core.lift
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import SUBPROCESS_ENV
from flax import nnx

from zero_jax import internals

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKED = ", ".join(f"{k} {v}" for k, v in internals.CHECKED.items())
# What only internals.py may spell: jax's private modules, Flax's lifted scan assigned, a class
# swapped, orbax's file names, the XLA pass.
FENCED = [r"\bjax\._src\b", r"lift\.scan\s*=", r"__class__\s*=", r"_CHECKPOINT_METADATA",
          r"[\"']_METADATA[\"']", r"manifest\.ocdbt", r"cse_barrier_expander"]


@pytest.mark.parametrize("pattern", FENCED)
def test_internals_are_reached_from_one_module(pattern):
    paths = [*(ROOT / "zero_jax").rglob("*.py"), ROOT / "train.py", *(ROOT / "bench").glob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in paths if p.name != "internals.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert not found, f"{pattern} outside zero_jax/internals.py: {found}"


def broke(name: str) -> str:
    return f"internal {name} changed (checked on {CHECKED}): see zero_jax/internals.py"


def test_compute_on_primitive():
    p = internals.compute_on_primitive()
    assert isinstance(p, jax.extend.core.Primitive) and p.name == "compute_on", \
        broke("jax._src.compute_on.compute_on_p")


def test_trace_state_tells_one_trace_from_another():
    """Prefetch by module waits on the previous module's inputs only from the same trace."""
    states = {}

    def inner(y):
        states["inner"] = internals.trace_state()
        return y

    def f(x):
        states["outer"], states["again"] = internals.trace_state(), internals.trace_state()
        return jax.checkpoint(inner)(x)
    jax.make_jaxpr(f)(1.0)
    name = "jax.extend.core.get_opaque_trace_state"
    assert states["outer"] == states["again"], broke(name)
    assert states["outer"] != states["inner"], broke(name)


def test_distributed_client():
    try:
        client = internals.distributed_client()
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{broke('jax._src.distributed.global_state.client')}: {e}")
    assert client is None, broke("jax._src.distributed.global_state.client (None before init)")


def test_compile_afresh_makes_the_compiler_compile(monkeypatch):
    """The suite runs with JAX's persistent compilation cache on (conftest): a program compiled
    before, without dumps, and compiled again for them (``compile_with_peak``) still writes
    them; met a third time, its breakdown is the one kept beside the cache, with no compile
    for dumps; a new program compiled for its dumps is written to JAX's cache too."""
    import jax._src.compiler

    import zero_jax.peak as peak

    assert os.environ.get("JAX_COMPILATION_CACHE_DIR")
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0 + 1.0)
    lowered = f.lower(jnp.ones((64, 48)))
    lowered.compile()
    first = peak.compile_with_peak(lowered)[1]
    assert first["peak_bytes"] > 0, \
        broke("jax._src.compiler._cache_read (a cached program dumps nothing)")
    with monkeypatch.context() as m:  # the kept split, not a second compile for dumps
        m.setattr(peak.internals, "compile_afresh", lambda: pytest.fail("compiled for dumps"))
        assert peak.compile_with_peak(lowered)[1] == first
    x = jnp.ones((128, 48))
    other = peak.compile_with_peak(f.lower(x))[1]  # its own, not the kept one
    assert other["peak_bytes"] > first["peak_bytes"]
    with monkeypatch.context() as m:  # and its program: loaded, not compiled, from here on
        m.setattr(jax._src.compiler, "backend_compile_and_load",
                  lambda *a, **k: pytest.fail("compiled again"))
        f.lower(x).compile()


def test_exact_residuals_takes_out_only_the_wide_roundings():
    """JAX rounds what a checkpoint saves to its own dtype; ``exact_residuals`` takes that out
    for float32 (no bit changes) and leaves it for bfloat16, where it matters."""
    def grad():  # a new function each time: a traced one is cached, with or without the swap
        saving = jax.checkpoint(lambda x: jnp.sin(x) * x,
                                policy=jax.checkpoint_policies.everything_saveable)
        return jax.grad(lambda x: saving(x).astype(jnp.float32).sum())

    rounded = lambda dtype: str(jax.make_jaxpr(grad())(jnp.ones(3, dtype))).count(
        "reduce_precision")
    assert rounded(jnp.float32) > 0 and rounded(jnp.bfloat16) > 0, broke(
        "jax._src.ad_checkpoint._insert_reduce_precision (residuals no longer rounded)")
    x = jnp.linspace(-2.0, 3.0, 3)
    with internals.exact_residuals():
        assert rounded(jnp.float32) == 0 and rounded(jnp.bfloat16) > 0, broke(
            "jax._src.ad_checkpoint._insert_reduce_precision (the swap is not seen)")
        exact = jax.jit(grad())(x)
    np.testing.assert_array_equal(exact, jax.jit(grad())(x))


def test_flax_lift_scan_and_checkpoint_are_what_nn_scan_and_nn_remat_call():
    original = flax.core.lift.scan
    args = set(inspect.signature(original).parameters)
    from zero_jax.blocks.scan import _SCAN_ARGS

    assert set(_SCAN_ARGS) <= args, broke("flax.core.lift.scan's arguments")
    called = []

    def wrap(lifted):
        def spy(*a, **k):
            called.append(lifted.__name__)
            return lifted(*a, **k)
        return spy

    class Layer(flax.linen.Module):
        @flax.linen.compact
        def __call__(self, c, _):
            return flax.linen.Dense(2)(c), None

    # Classes made before the swap (at import) hold the transform in their methods' closures.
    made_before = (flax.linen.scan(Layer, variable_axes={"params": 0},
                                   split_rngs={"params": True}, length=2),
                   flax.linen.remat(Layer))
    for made_now in (False, True):
        called.clear()
        with internals.flax_lift("scan", wrap), internals.flax_lift("checkpoint", wrap):
            stack, remat = (flax.linen.scan(Layer, variable_axes={"params": 0},
                                            split_rngs={"params": True}, length=2),
                            flax.linen.remat(Layer)) if made_now else made_before
            stack().init(jax.random.key(0), jnp.ones((1, 2)), None)
            remat().init(jax.random.key(0), jnp.ones((1, 2)), None)
        when = "made while swapped" if made_now else "made before the swap"
        assert "scan" in called, broke(f"flax.core.lift.scan (nn.scan {when} no longer calls "
                                       "it)")
        assert "checkpoint" in called, broke(f"flax.core.lift.checkpoint (nn.remat {when} no "
                                             "longer calls it)")
    assert flax.core.lift.scan is original
    # Restored: the classes made before hold Flax's own transforms again.
    for cls, fn in zip(made_before, (original, flax.core.lift.checkpoint), strict=True):
        assert any(cell.cell_contents is fn for method in vars(cls).values()
                   for cell in getattr(method, "__closure__", None) or ())


def test_nnx_scan_is_swapped_where_user_code_calls_it():
    from flax import nnx

    original, called = nnx.scan, []

    def wrap(scan):
        def spy(f, **k):
            called.append(True)
            return scan(f, **k)
        return spy

    with internals.nnx_scan(wrap):
        out = nnx.scan(lambda c, x: (c + x, x), in_axes=(nnx.Carry, 0))(0.0, jnp.arange(3.0))
    assert called and float(out[0]) == 3.0, broke("flax.nnx.scan (the swap is not seen)")
    assert nnx.scan is original


def test_set_class_on_an_nnx_module():
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    class Doubled(nnx.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    x = jnp.ones((1, 2))
    before = layer(x)
    internals.set_class(layer, Doubled)
    np.testing.assert_allclose(layer(x), 2 * before, err_msg=broke("NNX module __class__ swap"))


def test_orbax_writes_the_files_we_check(tmp_path):
    manager = ocp.CheckpointManager(tmp_path, item_names=("state", "meta"))
    manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": jnp.ones(4)}),
                                            meta=ocp.args.JsonSave({"a": 1})))
    manager.wait_until_finished()
    manager.close()
    step = tmp_path / "1"
    assert (step / internals.ORBAX_STEP_FILE).exists(), broke("orbax's step file name")
    for name in internals.ORBAX_TREE_FILES:
        assert (step / "state" / name).exists(), broke(f"orbax's {name}")
    assert (step / "meta" / internals.ORBAX_JSON_FILE).exists(), broke("orbax's JSON file name")


def test_orbax_names_what_a_failed_save_or_restore_leaves():
    """A failed save's asyncio noise is recognized by orbax's temporary directory suffix and
    its write coroutine's name, a failed restore's by its read coroutine's
    (``checkpoint.quiet_background_errors``)."""
    import inspect

    from orbax.checkpoint._src.path import atomicity_types
    from orbax.checkpoint._src.serialization import serialization

    assert atomicity_types.TMP_DIR_SUFFIX == internals.ORBAX_TMP_SUFFIX, broke(
        "orbax's temporary directory suffix")
    assert f"def {internals.ORBAX_WRITE_COROUTINE}(" in inspect.getsource(
        serialization.async_serialize_from_host), broke("orbax's write coroutine")
    assert inspect.iscoroutinefunction(getattr(serialization, internals.ORBAX_READ_COROUTINE,
                                               None)), broke("orbax's read coroutine")


def test_the_disabled_xla_pass_keeps_remat_barriers():
    """Without the pass, remat's optimization barriers survive the CPU compiler; with it they
    are gone (what lets CSE merge a block's backward gather into its forward one)."""
    code = ("import jax, jax.numpy as jnp\n"
            "f = jax.checkpoint(lambda x: jnp.sin(jnp.sin(x)), prevent_cse=True)\n"
            "g = jax.jit(jax.grad(lambda x: f(x).sum()))\n"
            "print('opt-barrier' in g.lower(jnp.ones(3)).compile().as_text())")
    kept = {}
    for flags in ("", f"--xla_disable_hlo_passes={internals.CSE_BARRIER_PASS}"):
        run = subprocess.run([sys.executable, "-c", code], env={**SUBPROCESS_ENV,
                             "XLA_FLAGS": flags}, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        kept[bool(flags)] = run.stdout.strip() == "True"
    assert kept == {False: False, True: True}, broke(f"XLA pass {internals.CSE_BARRIER_PASS}")


def test_importing_zero_jax_keeps_the_barriers_on_cpu_only(monkeypatch):
    """``keep_remat_barriers`` (run by ``import zero_jax``) adds the pass to the passes
    XLA_FLAGS already disables when the CPU runs the programs, and leaves a GPU's flags alone
    (its compiler refuses the flag)."""
    from zero_jax.mesh import keep_remat_barriers

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=foo --xla_foo=1")
    keep_remat_barriers()
    keep_remat_barriers()  # once only
    assert os.environ["XLA_FLAGS"] == \
        f"--xla_foo=1 --xla_disable_hlo_passes=foo,{internals.CSE_BARRIER_PASS}"
    for platforms in ("cuda", "tpu,cpu"):
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
        keep_remat_barriers()
        assert os.environ["XLA_FLAGS"] == "--xla_foo=1", platforms


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_one_trace_installs_every_hook_and_removes_them_all(fails):
    """``Runtime.tracing``: inside, Flax's scan and checkpoint lifts and ``nnx.scan`` are
    prefetch's, a linen interceptor is on and ``internals.BLOCKS`` holds the trace; after, as
    it returns or raises, every one of them is as it was."""
    import flax.linen as nn

    from zero_jax.blocks import Runtime, chain

    before = (flax.core.lift.scan, flax.core.lift.checkpoint, nnx.scan)
    seen = []
    rt = Runtime(("blocks",), prefetch=True)
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with rt.tracing(chain.Chain(None, rt.saved)) as trace:
            seen.append((flax.core.lift.scan, flax.core.lift.checkpoint, nnx.scan))
            assert internals.BLOCKS.get() is trace
            assert len(nn.module._global_interceptor_stack) == 1  # noqa: SLF001
            if fails:
                raise RuntimeError("the loss failed")
    assert all(a is not b for a, b in zip(seen[0], before, strict=True))
    assert (flax.core.lift.scan, flax.core.lift.checkpoint, nnx.scan) == before
    assert internals.BLOCKS.get() is None
    assert not nn.module._global_interceptor_stack  # noqa: SLF001
