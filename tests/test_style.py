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


def _functions(paths):
    import ast

    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield path, node


LIBRARY_AND_RUNNER = [*(ROOT / "zero_jax").rglob("*.py"), ROOT / "train.py"]


def test_no_function_takes_more_than_8_parameters():
    """More than that is a policy or a record waiting to be named (``self`` not counted)."""
    many = []
    for path, f in _functions(LIBRARY_AND_RUNNER):
        a = f.args
        names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        n = len(names) + bool(a.vararg) + bool(a.kwarg) - (names[:1] in (["self"], ["cls"]))
        if n > 8:
            many.append(f"{path.relative_to(ROOT)}:{f.lineno} {f.name} ({n})")
    assert not many, many


def test_no_module_level_mutable_state_outside_internals():
    """Process-wide state (a ``ContextVar``, a module-level value a function changes, a
    ``global``) lives in ``internals.py`` alone, where it is named and fenced."""
    import ast

    mutators = {"append", "add", "update", "pop", "clear", "setdefault", "extend", "remove",
                "insert", "discard", "popitem", "set", "reset"}
    found = []
    for path in LIBRARY_AND_RUNNER:
        if path.name == "internals.py":
            continue
        tree = ast.parse(path.read_text())
        names = {t.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
                 for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Global):
                found.append(f"{where} global {', '.join(node.names)}")
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                    node.func, "id", None)) == "ContextVar":
                found.append(f"{where} ContextVar")
        for _, f in _functions([path]):
            for node in ast.walk(f):
                target = (node.func.value if isinstance(node, ast.Call)
                          and isinstance(node.func, ast.Attribute)
                          and node.func.attr in mutators else
                          node.value if isinstance(node, ast.Subscript)
                          and isinstance(node.ctx, ast.Store) else None)
                if isinstance(target, ast.Name) and target.id in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} changes {target.id}")
    assert not found, found


def test_the_training_script_is_a_short_composition():
    """``train.py`` runs the demo's composition, which stays readable at once."""
    for path in (ROOT / "train.py", ROOT / "zero_jax" / "gpt" / "run.py"):
        assert len(path.read_text().splitlines()) <= 300, path


def test_library_errors_name_the_librarys_arguments_not_a_programs_flags():
    """A library user never typed ``--keep``: what the library raises or warns names its own
    arguments; a program's flags belong to its command line (``zero_jax.gpt``, each module's
    ``main``). XLA's flags, which are set as such, are the exception."""
    import ast
    import re

    flag = re.compile(r"(?<![\w-])--(?!xla_)[a-z]")
    found = []
    for path in (ROOT / "zero_jax").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            said = node.exc if isinstance(node, ast.Raise) else node if (
                isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "warn") \
                else None
            for part in ast.walk(said) if said is not None else ():
                if isinstance(part, ast.Constant) and isinstance(part.value, str) \
                        and flag.search(part.value):
                    found.append(f"{path.name}:{part.lineno} {part.value!r}")
    assert not found, found
