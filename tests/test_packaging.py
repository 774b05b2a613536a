"""A built wheel holds the library, the GPT demo and its configs: installed without the clone
(not editable), its ``zero-jax-train`` command trains from another directory, and
``train.py`` there is the same command line."""

import pathlib
import shutil
import subprocess
import sys

import pytest
from conftest import ONE_LAYER, SUBPROCESS_ENV, TRAIN_ENV

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_built_wheel_trains_outside_the_clone(tmp_path):
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    # Built from a copy of what the wheel is made of: a build in the clone leaves build/ there,
    # whose stale files a later wheel could pick up.
    source = tmp_path / "source"
    for name in ("zero_jax", "configs"):
        shutil.copytree(ROOT / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    build = subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheel"),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp_path / "wheel").glob("zero_jax-*.whl"))
    site = tmp_path / "site"
    install = subprocess.run([*pip, "install", "-q", "--no-deps", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    assert sorted(p.name for p in (site / "zero_jax" / "gpt" / "configs").glob("*.yaml")) == \
        sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    # Every module of the library and the demo: a package left out of pyproject.toml's list
    # would otherwise be found in the clone (the test environment's editable install).
    modules = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*.py"))
    assert modules(site / "zero_jax") == modules(ROOT / "zero_jax")
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    shutil.copy(ROOT / "train.py", elsewhere)  # the script alone: the package is the wheel's
    # The default model cut to one layer, two steps: the point is where the code comes from.
    # Compile-bound: LLVM at level 0, as the suite compiles.
    env = {**SUBPROCESS_ENV, "PYTHONPATH": str(site)}
    # The copied script is the same CLI (``train.py --help``, run as ``python train.py`` runs
    # it); then, in the same process (one start-up of JAX less), where the configs and every
    # module it imported (the run's too) came from.
    where = subprocess.run([sys.executable, "-c", "import runpy, sys\n"
                            "sys.argv = ['train.py', '--help']\n"
                            "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
                            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
                            "import zero_jax.gpt.run, zero_jax.gpt.config as c\n"
                            "print('CUT', c.resolve('gpt2-124m'))\n"
                            "print(*(m.__file__ for n, m in sys.modules.items() "
                            "if n.startswith('zero_jax')))"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    script, listed = where.stdout.split("\nCUT ")
    assert "--save-safetensors" in script, script
    config, *loaded = listed.split()
    assert config.startswith(str(site)) and len(loaded) > 30
    assert all(f.startswith(str(site)) for f in loaded), [f for f in loaded
                                                          if not f.startswith(str(site))]
    # The installed command (``[project.scripts]``) trains.
    run = subprocess.run([str(site / "bin" / "zero-jax-train"), "--stage", "3", "--steps", "2",
                          *ONE_LAYER],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done: steps 1-2" in run.stdout and "(mean of last 2)" in run.stdout


def test_orbax_is_imported_when_a_checkpoint_opens(tmp_path):
    """A run that saves nothing starts without orbax (a sizeable part of the start-up:
    docs/testing.md); the first checkpoint opened brings it in."""
    code = ("import sys, zero_jax\n"
            "before = 'orbax.checkpoint' in sys.modules\n"
            f"zero_jax.Checkpoints({str(tmp_path / 'ckpt')!r}).close()\n"
            "print(before, 'orbax.checkpoint' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=TRAIN_ENV,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False", "True"]
