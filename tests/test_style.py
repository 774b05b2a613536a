"""The code passes ruff (configured in pyproject.toml)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "zero_jax", "tests", "bench",
                          "train.py"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
