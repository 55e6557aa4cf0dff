"""The environment of the suite's compiles; imported by tests/conftest.py before anything imports
jax (conftest sets the persistent compilation cache first, so EXACT_ENV carries it too)."""
import os

# The suite compiles hundreds of tiny programs, and LLVM's optimisation is most of each CPU
# compile while buying nothing at these shapes: off for the session (subprocesses inherit it).
# It changes the last bits of float results (vectorised reductions), which no tolerance-based
# test sees; the tests that pin exact numbers of the default build (the recorded tiny run and the
# runs it is compared with bit for bit: tests/train/test_loop.py and the shared warm start) run
# their subprocesses with EXACT_ENV, the environment as it came.
FAST_COMPILE_FLAGS = ["--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true"]
# XLA's newer CPU fusion emitters (MLIR) cost more to compile than the classic elemental ones:
# with them off, the 8-device worker of tests/parallel/test_sharded_steps.py (cold cache) went
# from 54 s to 24-32 s on jaxlib 0.10.2. An XLA that no longer knows a flag aborts at start-up,
# so this one is set only for the jaxlib it was measured on; re-measure when jax moves.
_NEW_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"
try:
    from importlib.metadata import version as _version
    if _version("jaxlib").startswith("0.10."):
        FAST_COMPILE_FLAGS.append(_NEW_EMITTERS_OFF)
except Exception:  # noqa: BLE001 - no jaxlib metadata: keep the long-standing flags only
    pass
# pytest-xdist workers inherit the controller's environment, flags already added: the flags as
# they came are kept in OUTER, set by whichever process imports this first.
OUTER = "BRORL_TESTS_OUTER_XLA_FLAGS"
os.environ.setdefault(OUTER, os.environ.get("XLA_FLAGS", ""))
EXACT_ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
if os.environ[OUTER]:
    EXACT_ENV["XLA_FLAGS"] = os.environ[OUTER]
os.environ["XLA_FLAGS"] = " ".join(os.environ[OUTER].split() + FAST_COMPILE_FLAGS)
