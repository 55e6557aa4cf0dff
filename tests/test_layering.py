"""The package's layering (docs/INTERFACES.md "Layers"): every import, at module level or inside a
function, goes to the same package or a lower layer, never sideways into another package of the
same layer, and the module import graph has no cycle. Read from the source with ast, so nothing is
imported."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from testutil import ROOT

# Lower number = lower layer. A package may import its own modules and packages of lower layers.
LAYERS = {
    "pallas_kernels": 0,            # kernels + references; know nothing of brorl_jax
    "brorl_jax.theory": 0,          # mass balance math; depends on nothing else in the package
    "brorl_jax.config.schema": 0,   # the typed run config; imports nothing of brorl_jax
    "brorl_jax.parallel": 1,        # mesh, sharding rules, collectives, jax.distributed
    "brorl_jax.models": 2,          # the transformer, HF load/save; knows nothing of RL
    "brorl_jax.data": 2,            # prompt sources, tokenisation
    "brorl_jax.rewards": 2,         # verifiers (worker processes; no JAX)
    "brorl_jax.rollout": 3,         # generation
    "brorl_jax.algo": 3,            # advantages, losses, the update step
    "brorl_jax.config": 4,          # the run-config schema (reads the registries below it)
    "brorl_jax.workdir": 5,         # the run's files and the process (layout, checkpoints, loggers)
    "brorl_jax.train": 6,           # the loop
    "brorl_jax.cli": 7,             # what the commands share
    "brorl_jax.main": 8,            # the commands
    "brorl_jax.evaluate": 8,
    "brorl_jax.export": 8,
    "brorl_jax.experiments": 8,
    "brorl_jax": 9,                 # the package itself (its __init__ imports nothing)
}
# The run's files and process know nothing of the RL step: a checkpoint, a log line or a signal
# never depends on how samples are made or the update computed.
RL_STEP = ("brorl_jax.train", "brorl_jax.algo", "brorl_jax.rollout")
# rewards runs inside worker processes and must stay light (brorl_jax/rewards/__init__.py).
NO_JAX = ("brorl_jax.rewards",)


def _package(module: str) -> str | None:
    best = None
    for name in LAYERS:
        if module == name or module.startswith(name + "."):
            if best is None or len(name) > len(best):
                best = name
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("brorl_jax", "pallas_kernels"):
        for path in Path(ROOT, top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the repository that `module` imports (absolute and relative)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the module pkg.sub when there is one, else names of pkg
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        for name in names:
            # the longest known module that is this name or a parent of it
            while name and name not in known:
                name = name.rsplit(".", 1)[0] if "." in name else ""
            if name and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_every_module_belongs_to_a_layer():
    assert [m for m in _modules() if _package(m) is None] == []


def test_imports_go_down_the_layers():
    bad = []
    for mod, deps in _graph().items():
        pkg = _package(mod)
        for dep in deps:
            dpkg = _package(dep)
            if dpkg is None or dpkg == pkg or pkg.startswith(dpkg + ".") or dpkg.startswith(pkg + "."):
                continue
            if LAYERS[dpkg] >= LAYERS[pkg]:
                bad.append(f"{mod} -> {dep}  ({pkg}: layer {LAYERS[pkg]}, {dpkg}: {LAYERS[dpkg]})")
    assert bad == [], "upward or sideways imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            # importing a package runs its __init__, which may import the submodule itself back:
            # that is the package exporting its own parts, not a cycle between modules
            if node.startswith(dep + "."):
                continue
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_workdir_imports_nothing_of_the_rl_step():
    bad = [f"{mod} -> {dep}" for mod, deps in _graph().items() if _package(mod) == "brorl_jax.workdir"
           for dep in deps if _package(dep) in RL_STEP]
    assert bad == []


def test_rewards_do_not_import_jax():
    mods = _modules()
    bad = []
    for mod, path in mods.items():
        if not mod.startswith(NO_JAX):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{mod}: {n}" for n in names if n.split(".")[0] in ("jax", "flax", "optax")]
    assert bad == []


# ------------------------------------------------------------------------------------------------
# The code's shape (issue 40): sizes a reader can hold, one owner for the scheduler, typed batches,
# and the settings most often repeated read in few places.
# ------------------------------------------------------------------------------------------------
MAX_FUNCTION, MAX_CLASS, MAX_MODULE = 80, 300, 600
SIZE_EXEMPT = ("brorl_jax/rewards/_sandbox_harness.py",)   # runs alone inside the sandbox
MENTION_LIMITS = {"rollouts_per_prompt": 8, "max_staleness": 4}


def _package_files():
    return {str(p.relative_to(ROOT)): p.read_text() for p in Path(ROOT, "brorl_jax").rglob("*.py")}


def _too_long(files: dict[str, str]) -> list[str]:
    bad = []
    for rel, src in files.items():
        if rel in SIZE_EXEMPT:
            continue
        if src.count("\n") > MAX_MODULE:
            bad.append(f"module {rel}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            limit = (MAX_FUNCTION if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     else MAX_CLASS if isinstance(node, ast.ClassDef) else None)
            if limit and node.end_lineno - node.lineno + 1 > limit:
                bad.append(f"{rel}:{node.lineno} {node.name}: "
                           f"{node.end_lineno - node.lineno + 1} lines (limit {limit})")
    return bad


def test_no_function_class_or_module_too_long():
    assert _too_long(_package_files()) == []


def test_the_size_check_sees_a_long_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION))
    assert _too_long({"m.py": f"def f():\n{body}"}) == [f"m.py:1 f: {MAX_FUNCTION + 1} lines "
                                                      f"(limit {MAX_FUNCTION})"]


def test_batches_are_typed_and_the_scheduler_stays_in_rollout():
    subscripts, scheduler = [], []
    for rel, src in _package_files().items():
        if rel.startswith(("brorl_jax/algo/", "brorl_jax/train/")):
            subscripts += [f"{rel}: {m.group(0)}"
                           for m in re.finditer(r"\b(batch|mb)\[[\"']\w*", src)]
        if not rel.startswith("brorl_jax/rollout/") and re.search(r"\bScheduler\b", src):
            scheduler.append(rel)
    assert subscripts == [] and scheduler == []


def test_the_most_repeated_settings_are_read_in_few_modules():
    files = _package_files()
    counts = {word: sorted(rel for rel, src in files.items() if word in src)
              for word in MENTION_LIMITS}
    assert {w: m for w, m in counts.items() if len(m) > MENTION_LIMITS[w]} == {}
