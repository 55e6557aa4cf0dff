"""Fixtures shared across test packages."""
from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import tempfile

import pytest

# One persistent JAX compilation cache for the session, set before anything imports jax: the
# many runs of the same tiny configs (in this process and in the `main` subprocesses, which
# inherit the environment) compile each program once. A cache hit returns the executable XLA
# would build again, so no result depends on it. Removed at exit; an outer setting wins.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="brorl_jax_test_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, _CACHE, True)

# The session's compile flags (LLVM optimisation off): tests/compile_env.py says why.
import compile_env  # noqa: E402, F401
import procs  # noqa: E402, F401 - started commands fork from a preloaded interpreter (tests/zygote.py)
from testutil import run_main  # noqa: E402

# The order the two workers take the files in (`make test`: --dist loadfile, and
# --no-loadscope-reorder so that xdist keeps this order instead of putting the files with the
# most tests first): the longest files first, from file_seconds.json (each file's seconds in one
# `pytest tests -n 2 --dist loadfile --durations=0`), then the rest by number of tests. With the
# end-to-end files last, as xdist's own order had them, one worker could be left running a
# minute-long file while the other had nothing to do. The order changes no result; a stale table
# only balances the workers less well. Refresh it after a full run with --durations=0:
#   python tests/file_seconds.py LOG > tests/file_seconds.json
FILE_SECONDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")


def pytest_collection_modifyitems(config, items):
    import json
    with open(FILE_SECONDS) as f:
        seconds = json.load(f)
    files: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        files[path] = files.get(path, 0) + 1
    rank = {path: i for i, path in enumerate(
        sorted(files, key=lambda p: (-seconds.get(p, 0), -files[p], p)))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])   # stable: file order kept


@pytest.fixture(scope="session")
def tiny_warm_start(tmp_path_factory) -> list[str]:
    """Command-line overrides that start configs/tiny.py from its supervised warm start, built
    once per session (`main` with train.steps=0 saves it as warm_start_model/): the loop tests
    then spend their time on RL steps, not on repeating the same 60 supervised steps. Under
    pytest-xdist the workers share it (their temporary directories sit below one directory of
    this session): the first to need it builds it under a lock, the others wait and read it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    work = base / "tiny_warm_start"
    with open(base / "tiny_warm_start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (work / "BUILT").exists():
            shutil.rmtree(work, ignore_errors=True)
            out = run_main(work, "--config.train.steps=0", "--config.train.tensorboard=False")
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
            (work / "BUILT").touch()
    return [f"--config.model.path={work / 'warm_start_model'}", "--config.sft.steps=0"]
