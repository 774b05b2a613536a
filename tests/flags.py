"""How the suite's programs are compiled: for speed, and without the fused multiply-adds that
made bit-for-bit comparisons depend on how XLA fuses.

The suite compiles hundreds of small programs, where compiling costs far more than running.
Five settings of the CPU compiler make it cheaper (``FAST_COMPILE``, in ``XLA_FLAGS``):

- LLVM's optimizations off (``--xla_backend_optimization_level=0``): about a third of the
  suite's time. They act below the HLO: collectives and buffers are the same without them.
- The LLVM module of a program compiled whole, not split into parts for parallel threads
  (``--xla_cpu_parallel_codegen_split_count=1``): the default model's steps at stages 0, 2
  and 3 take 0.7x the CPU time to compile (2.67 s against 3.83, three runs each). The suite
  runs two processes on two cores, so the threads only competed; the program is the same.
- XLA's older loop emitters instead of its MLIR fusion emitters
  (``--xla_cpu_use_fusion_emitters=false``): the steps of tests/lm.py at stages 0, 2 and 3
  compile in 1.45 s instead of 3.9 s and run 20% faster; the suite took 559 s instead of 823.
  Their temp differs by 192 of ~300,000 bytes, and they copy more: a program whose copies a
  test bounds compiles with ``FUSION_EMITTERS``.
- XLA's check of its own work after each HLO pass off (``--xla_disable_hlo_passes=
  hlo-verifier``; ``import zero_jax`` adds its pass to the list): 5% of a step's compile
  (tests/lm.py's steps at stages 0-3, twice each: 4.53 s against 5.61, 3.92-3.95 against
  4.12-4.19 of XLA's own compile in two runs each), and the compiled programs' text is the same
  with it and without.
- Code generated for AVX, without fused multiply-adds (``--xla_cpu_max_isa=AVX``): XLA
  contracts a multiply and an add into one rounding where they share a fusion, so with
  them a result depends on the fusion it lands in. The NVMe tier's bands against the same
  update over the whole tree in host memory differed by an ulp in Adam's master (jax 0.10.2,
  older emitters); the fusion emitters agreed, at 2.7x the compile. Without the contraction
  the bit-for-bit comparisons no longer depend on how XLA fuses, and compile with the older
  emitters too (test_nvme.py: 53 s of CPU against 77 s).
"""

# XLA from jax 0.11 no longer knows --xla_cpu_use_fusion_emitters, and stops at it
# (docs/testing.md).
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
                " --xla_disable_hlo_passes=hlo-verifier --xla_cpu_use_fusion_emitters=false"
                " --xla_cpu_max_isa=AVX")
# For ``step.lower(...).compile(FUSION_EMITTERS)``: the default emitters, where a test bounds a
# program's copies.
FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
