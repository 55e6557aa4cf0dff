"""The environment of the suite's compiles; imported by tests/conftest.py before anything imports
jax. Every process of the session (pytest's and the commands it starts) compiles with the same
flags, so the persistent compilation cache serves them all."""
import os
from importlib import metadata as _metadata

# The suite compiles hundreds of tiny programs, and LLVM's optimisation is most of each CPU
# compile while buying nothing at these shapes: off for the session (subprocesses inherit it).
# It changes the last bits of float results (vectorised reductions), as another CPU model does;
# the tests that compare runs bit for bit compare runs of this one environment, and the recorded
# tiny run (tests/train/golden) is compared to float32 rounding in its losses and exactly in
# everything the samples decide, which these flags were checked not to change (2026-12-02: the
# warm start and the 4-step run, built and run with them, matched the recording).
FAST_COMPILE_FLAGS = ["--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true"]
# XLA's newer CPU fusion emitters (MLIR) cost more to compile than the classic elemental ones:
# with them off, the 8-device worker of tests/parallel/test_sharded_steps.py (cold cache) went
# from 54 s to 24-32 s on jaxlib 0.10.2. An XLA that no longer knows a flag aborts at start-up,
# so this one is set only for the jaxlib it was measured on; re-measure when jax moves.
_NEW_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"
try:
    if _metadata.version("jaxlib").startswith("0.10."):
        FAST_COMPILE_FLAGS.append(_NEW_EMITTERS_OFF)
except _metadata.PackageNotFoundError:   # no jaxlib metadata: the long-standing flags only
    pass
# pytest-xdist workers inherit the controller's environment, flags already added: the flags as
# they came are kept in OUTER, set by whichever process imports this first.
OUTER = "BRORL_TESTS_OUTER_XLA_FLAGS"
os.environ.setdefault(OUTER, os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = " ".join(os.environ[OUTER].split() + FAST_COMPILE_FLAGS)
