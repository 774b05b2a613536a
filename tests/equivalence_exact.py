"""``test_equivalence.check_training`` for every stage and optimizer, in a process whose
programs all compile with the CPU's default emitters (``ZJ_EXACT``, tests/flags.py): the
host-offloaded part of a program takes the process's compiler settings, not a compile's.
Prints, as JSON, "ok" or the failure for each (stage, optimizer)."""

import json
import os
import sys
import traceback

os.environ["ZJ_EXACT"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import conftest  # noqa: E402  (the 8 devices, the compiler's settings)
import test_equivalence as eq  # noqa: E402

from zero_jax.mesh import make_mesh  # noqa: E402

if __name__ == "__main__":
    mesh, small = make_mesh(conftest.N), conftest.small_problem()
    reference, results = conftest.reference_runs(small), {}
    for stage in eq.STAGES:
        for opt in conftest.OPTIMIZERS:
            try:
                eq.check_training(stage, opt, mesh, small, reference)
                results[f"{stage}-{opt}"] = "ok"
            except AssertionError:
                results[f"{stage}-{opt}"] = traceback.format_exc(limit=-2)
    print(json.dumps(results))
