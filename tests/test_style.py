"""The code passes ruff (configured in pyproject.toml)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "zero_jax", "tests", "bench",
                          "train.py"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_library_imports_nothing_of_the_application():
    """The GPT demo (``zero_jax.gpt``) is a user of the library, never a dependency of it."""
    import ast

    for path in (ROOT / "zero_jax").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("zero_jax.gpt"), f"{path.name} imports {name}"


def test_no_function_of_the_library_or_the_runner_is_longer_than_60_lines():
    """Each function short enough to read at once (a class may be longer: its methods are)."""
    import ast

    paths = [*(ROOT / "zero_jax").rglob("*.py"), ROOT / "train.py"]
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)"
            for path in paths for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and (length := node.end_lineno - node.lineno + 1) > 60]
    assert not long, long


def test_make_plan_takes_policies_not_flags():
    """At most 8 parameters: what each option means lives in a policy that checks itself."""
    import inspect

    import zero_jax as zj

    assert len(inspect.signature(zj.make_plan).parameters) <= 8
