"""How the suite's programs are compiled: for speed, and exactly where a test compares bits.

The suite compiles hundreds of small programs, where compiling costs far more than running.
Four settings of the CPU compiler make it cheaper (``FAST_COMPILE``, in ``XLA_FLAGS``):

- LLVM's optimizations off (``--xla_backend_optimization_level=0``): about a third of the
  suite's time. They act below the HLO: collectives and buffers are the same without them.
- The LLVM module of a program compiled whole, not split into parts for parallel threads
  (``--xla_cpu_parallel_codegen_split_count=1``): the default model's steps at stages 0, 2
  and 3 take 0.7x the CPU time to compile (2.67 s against 3.83, three runs each). The suite
  runs two processes on two cores, so the threads only competed; the program is the same.
- XLA's older loop emitters instead of its MLIR fusion emitters
  (``--xla_cpu_use_fusion_emitters=false``): the steps of tests/lm.py at stages 0, 2 and 3
  compile in 1.45 s instead of 3.9 s and run 20% faster; the suite took 559 s instead of 823.
  Their temp differs by 192 of ~300,000 bytes. With them a result can depend on the fusion
  it lands in: the NVMe tier's bands against the whole tree differ by an ulp in Adam's master
  (jax 0.10.2), through fused multiply-adds (capped at AVX, which has none, they agree). So
  NVMe comparisons compile ``EXACT``, as does a program whose copies a test bounds (the
  older emitters copy more). Bucketed against per-leaf steps, prefetched against plain ones,
  offloaded against in memory and the NNX blocks against one device give the same bits with
  the older emitters; should one start to differ by an ulp, compile its programs ``EXACT``.
- XLA's check of its own work after each HLO pass off (``--xla_disable_hlo_passes=
  hlo-verifier``; ``import zero_jax`` adds its pass to the list): 5% of a step's compile
  (tests/lm.py's steps at stages 0-3, twice each: 4.53 s against 5.61, 3.92-3.95 against
  4.12-4.19 of XLA's own compile in two runs each), and the compiled programs' text is the same
  with it and without.
"""

# XLA from jax 0.11 no longer knows the last flag, and stops at it (docs/testing.md).
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
                " --xla_disable_hlo_passes=hlo-verifier --xla_cpu_use_fusion_emitters=false")
# For ``step.lower(...).compile(EXACT)`` and ``jax.jit(f, compiler_options=EXACT)``. The
# host-offloaded part of a program takes the process's settings, not a compile's.
EXACT = {"xla_cpu_use_fusion_emitters": True}
