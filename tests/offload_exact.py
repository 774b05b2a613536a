"""``test_equivalence.check_offload`` for every stage and optimizer, in a process whose programs
all compile with the CPU's default emitters (``ZJ_EXACT``, tests/flags.py): the host-offloaded
part of a program takes the process's compiler settings, not a compile's. Prints each layout
it checked."""

import os
import sys

os.environ["ZJ_EXACT"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import conftest  # noqa: E402  (the 8 devices, the compiler's settings)
import test_equivalence  # noqa: E402

from zero_jax.mesh import make_mesh  # noqa: E402

if __name__ == "__main__":
    mesh, small = make_mesh(conftest.N), conftest.small_problem()
    for stage, opt in test_equivalence.OFFLOAD_RATIO:
        test_equivalence.check_offload(stage, opt, mesh, small)
        print(f"{stage}-{opt}", flush=True)
