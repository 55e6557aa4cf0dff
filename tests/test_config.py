"""Config validation: typos, wrong types and inconsistent values stop the run with a clear message;
every shipped config (and every preset argument it documents) validates; every schema key is read
by the code."""
import ast
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_collections
import procs
import pytest
from testutil import ROOT

from brorl_jax.config import (
    SECTIONS,
    ConfigError,
    _flatten,
    default_config,
    derived_learning_rate,
    validate,
)
from configs import brorl, prorl

CONFIG_FILES = sorted(p.stem for p in Path(ROOT, "configs").glob("*.py")
                      if p.stem not in ("__init__", "common"))
# Preset arguments documented as "configs/NAME.py:ARG" in the config files, README and docs.
_PRESET = re.compile(r"configs/(\w+)\.py:([\w=,.*+-]+)")
# Preset keys a config file documents in prose rather than as a command line, each used once.
PROSE_PRESETS = {"smollm2_arith": ["op=*,n=8,prompts=4,steps=2,tokens=32,eval_prompts=8"]}


def _documented_presets() -> list[tuple[str, str | None]]:
    texts = [p.read_text() for p in [Path(ROOT, "README.md"), *Path(ROOT, "docs").glob("*.md"),
                                     *Path(ROOT, "configs").glob("*.py")]]
    found = {(m.group(1), m.group(2).rstrip(".,")) for t in texts for m in _PRESET.finditer(t)}
    found |= {(name, arg) for name, args in PROSE_PRESETS.items() for arg in args}
    return [(name, None) for name in CONFIG_FILES] + sorted(found)


@pytest.mark.parametrize("name,arg", _documented_presets())
def test_shipped_configs_and_documented_presets_validate(name, arg, tmp_path, monkeypatch):
    """Every file in configs/, with no argument and with each preset argument documented for it,
    passes validate() (no model is loaded; smollm2_arith writes its prompt files under the
    cache directory, here a temporary one)."""
    assert name in CONFIG_FILES, f"a documented preset names configs/{name}.py, which is gone"
    monkeypatch.setenv("BRORL_JAX_CACHE", str(tmp_path))
    validate(importlib.import_module(f"configs.{name}").get_config(arg))


def test_documented_presets_cover_the_files_that_take_arguments():
    documented = {name for name, arg in _documented_presets() if arg}
    assert {"brorl", "demo", "prorl", "smollm2_arith"} <= documented


def test_unknown_preset_key_is_named():
    with pytest.raises(ValueError, match=r"unknown config preset key 'nn'; allowed: n, prompts"):
        brorl.get_config("nn=4")


# -- every schema key is read ------------------------------------------------------------------
# Read dynamically, so the static scan below cannot see it: key -> how (checked in the test).
DYNAMIC_READERS = {
    "mesh.data": "parallel.mesh.mesh_from_config reads every axis of AXES",
    "mesh.fsdp": "parallel.mesh.mesh_from_config reads every axis of AXES",
    "mesh.tensor": "parallel.mesh.mesh_from_config reads every axis of AXES",
    "mesh.expert": "parallel.mesh.mesh_from_config reads every axis of AXES",
}
# Keys validated and resume-checked but read by nothing: none (train.log_every was one until the
# loop read it, issue 24). A key put here fails the test once something reads it, as a reminder.
KNOWN_UNREAD: set[str] = set()
# In brorl_jax/config/ these functions are the schema and its checks, not readers; of schema.py
# only RunConfig's derived values count (its `update` builds UpdateConfig, counted by its fields).
SCHEMA_FUNCTIONS = {"default_config", "validate", "_validate_io_keys", "_validate_options",
                    "_validate_rules", "_range_errors", "_typed", "_type_errors", "describe",
                    "update"}


def _static_reads(schema: dict) -> set[str]:
    """Keys "section.name" the package's source reads, found by walking its syntax trees:

    * ``X.section.name``, ``X.section["name"]``, ``X["section"]["name"]``, ``X.section.get("name")``;
    * the same through an alias: a variable assigned ``X.section`` (``a, r = cfg.algo,
      cfg.rollout``) or a name ``section_cfg`` / ``section_config`` (a function's parameter);
    * a call given the dotted key as a string (``json_option(cfg, "rewards.map")``);
    * a field of the update's UpdateConfig (built from the config field by field, key for key:
      ``algo.<name>``, else ``rollout.<name>`` / ``model.<name>``) counts when ``.field`` is read
      anywhere outside brorl_jax/config/.

    Not counted: the schema itself and its validation (SCHEMA_FUNCTIONS), error-message strings,
    the resume policy table (dict keys), config files (they write keys). A key set but never
    read fails, whatever its validation says.
    """
    sections = {k.split(".")[0] for k in schema if "." in k}
    reads: set[str] = set()
    attributes: set[str] = set()

    def section_of(node, aliases):
        if isinstance(node, ast.Attribute) and node.attr in sections:
            return node.attr
        if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and node.slice.value in sections):
            return node.slice.value
        if isinstance(node, ast.Name):
            if node.id in aliases:
                return aliases[node.id]
            for suffix in ("_cfg", "_config"):
                if node.id.endswith(suffix) and node.id[: -len(suffix)] in sections:
                    return node.id[: -len(suffix)]
            if node.id.startswith("cfg_") and node.id[4:] in sections:     # cfg_rewards
                return node.id[4:]
        return None

    def scan(tree):
        aliases = {}
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign):
                targets = n.targets[0].elts if isinstance(n.targets[0], ast.Tuple) else n.targets
                values = n.value.elts if isinstance(n.value, ast.Tuple) else [n.value]
                for t, v in zip(targets, values):
                    if isinstance(t, ast.Name) and section_of(v, {}) and isinstance(v, ast.Attribute):
                        aliases[t.id] = v.attr
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute):
                base, name = n.value, n.attr
            elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
                base, name = n.value, n.slice.value
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                  and n.func.attr == "get" and n.args and isinstance(n.args[0], ast.Constant)):
                base, name = n.func.value, n.args[0].value
            else:
                base = None
            section = section_of(base, aliases) if base is not None else None
            if section and isinstance(name, str):
                reads.add(f"{section}.{name}")
            if isinstance(n, ast.Call):
                reads.update(a.value for a in n.args
                             if isinstance(a, ast.Constant) and a.value in schema)

    for path in sorted(Path(ROOT, "brorl_jax").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("brorl_jax/config/"):
            body = tree.body
            if rel == "brorl_jax/config/schema.py":
                body = next(n.body for n in body
                            if isinstance(n, ast.ClassDef) and n.name == "RunConfig")
            for node in body:
                if isinstance(node, ast.FunctionDef) and node.name not in SCHEMA_FUNCTIONS:
                    scan(node)
            continue
        scan(tree)
        attributes.update(n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute))
    from brorl_jax.config import UpdateConfig
    for f in dataclasses.fields(UpdateConfig):
        section = next(s for s in ("algo", "rollout", "model") if f"{s}.{f.name}" in schema)
        if f.name in attributes:
            reads.add(f"{section}.{f.name}")
    return reads


def test_every_schema_key_is_read_by_the_code():
    from brorl_jax.parallel.mesh import AXES
    schema = _flatten(default_config())
    assert {f"mesh.{a}" for a in AXES} == set(DYNAMIC_READERS)
    # "name", the one top-level key: the default workdir runs/NAME (brorl_jax/main.py)
    reads = _static_reads(schema) | set(DYNAMIC_READERS) | {"name"}
    unread = sorted(k for k in schema if k not in reads and k not in KNOWN_UNREAD)
    assert not unread, (f"config keys nothing reads: {unread}; read them, or remove them from "
                        "brorl_jax/config/schema.py (and the configs, README table, resume policy)")
    now_read = sorted(KNOWN_UNREAD & reads)
    assert not now_read, f"{now_read} are read now: drop them from KNOWN_UNREAD"
    gone = sorted((KNOWN_UNREAD | set(DYNAMIC_READERS)) - set(schema))
    assert not gone, f"{gone} left the schema: drop them from KNOWN_UNREAD / DYNAMIC_READERS"


def test_mesh_rules_typo_fails_at_the_door():
    c = default_config()
    c.mesh.rules = "rollout"          # the removed lock-step rule set
    with pytest.raises(ConfigError, match=r"'mesh.rules' is 'rollout'; allowed: 'default', "
                                          r"'replicated'"):
        validate(c)


def test_paper_recipes_have_paper_values():
    b, p = brorl.get_config(), prorl.get_config()
    assert (b.rollout.rollouts_per_prompt, b.algo.prompts_per_step) == (512, 128)
    assert (p.rollout.rollouts_per_prompt, p.algo.prompts_per_step) == (16, 512)
    for c in (b, p):
        assert (c.algo.clip_eps_low, c.algo.clip_eps_high) == (0.2, 0.28)
        assert c.algo.kl_estimator == "k2" and c.algo.kl_coef == 1e-4
        assert c.algo.advantage == "reinforce_pp_baseline"
        assert c.eval.temperature == 0.6 and c.eval.top_p == 0.95
    # BroRL's batch is 8x ProRL's in samples, so the sqrt rule scales the LR by sqrt(8).
    lr_b, why = derived_learning_rate(b)
    lr_p, _ = derived_learning_rate(p)
    assert lr_b / lr_p == pytest.approx(8 ** 0.5)
    assert "sqrt" in why


def test_the_streams_combinations_are_named():
    c = default_config()
    c.algo.stream_rounds, c.algo.max_staleness, c.algo.tis_mode = True, 2, "off"
    with pytest.raises(ConfigError, match=r"needs algo.tis_mode != 'off' and "
                                          r"algo.recompute_old_logprobs=True"):
        validate(c)
    c.algo.tis_mode, c.rollout.adaptive_n = "truncate", True
    with pytest.raises(ConfigError, match=r"'algo.stream_rounds'=True decodes one N"):
        validate(c)
    c.rollout.adaptive_n = False
    validate(c)


def test_misspelled_key_is_named_with_suggestion():
    c = default_config()
    c.rollout.unlock()
    c.rollout.rollout_per_prompt = 16
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.rollout_per_prompt'.*"
                                          r"rollout.rollouts_per_prompt"):
        validate(c)


def test_wrong_type_is_named():
    # A config file that builds its own ConfigDict (not from default_config) with a string.
    d = default_config().to_dict()
    d["rollout"]["rollouts_per_prompt"] = "many"
    c = ml_collections.ConfigDict(d)
    with pytest.raises(ConfigError, match=r"'rollout.rollouts_per_prompt' must be int"):
        validate(c)


@pytest.mark.parametrize("key,value,pattern", [
    ("algo.kl_estimator", "k9", r"'algo.kl_estimator' is 'k9'; allowed: 'k1', 'k2', 'k3'"),
    ("rollout.rollouts_per_prompt", 0, r"'rollout.rollouts_per_prompt' must be > 0"),
    ("rollout.top_p", 1.5, r"'rollout.top_p' must be in \(0, 1\]"),
    ("algo.micro_batch_size", 7, r"'algo.micro_batch_size'=7 does not divide"),
    ("mesh.fsdp", 0, r"'mesh.fsdp' must be a positive size or -1"),
    ("algo.max_staleness", -1, r"'algo.max_staleness' must be >= 0"),
    ("algo.max_staleness", 1, r"'algo.max_staleness'=1 .* set algo.stream_rounds=True"),
    ("model.lora_rank", -1, r"'model.lora_rank' must be >= 0"),
    ("model.lora_alpha", 0.0, r"'model.lora_alpha' must be > 0"),
    ("model.lora_targets", "q,qkv", r"'model.lora_targets' = 'q,qkv': unknown LoRA target\(s\) "
                                    r"\['qkv'\]; use comma-separated names from q,k,v,o,gate"),
])
def test_bad_values_are_named(key, value, pattern):
    c = default_config()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_command_line_typo_stops_main_with_message(tmp_path):
    out = procs.run(
        [sys.executable, "-m", "brorl_jax.main", "--config=configs/demo.py",
         f"--workdir={tmp_path}", "--config.rollout.rollout_per_prompt=4"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "rollout_per_prompt" in out.stderr


def test_command_line_bad_value_stops_main_with_message(tmp_path):
    out = procs.run(
        [sys.executable, "-m", "brorl_jax.main", "--config=configs/demo.py",
         f"--workdir={tmp_path}", "--config.algo.advantage=ppo"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "'algo.advantage' is 'ppo'" in out.stderr


@pytest.mark.parametrize("args,message", [
    (["configs/tiny.py"], "unexpected argument(s) ['configs/tiny.py']; give the config as "
                          "--config=configs/tiny.py"),
    (["--config=configs/tiny.py:n=4"], "configs/tiny.py takes no preset argument (got 'n=4')"),
])
def test_a_misplaced_config_is_one_line_at_the_door(tmp_path, args, message):
    """A positional config path used to print absl's usage text and exit 1; a preset argument
    on configs/tiny.py was accepted and overwritten by the file's own sizes."""
    out = procs.run([sys.executable, "-m", "brorl_jax.main", f"--workdir={tmp_path / 'run'}",
                     *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.splitlines()) <= 3 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["", "../escape", "a/b", ".."])
def test_a_run_name_that_is_not_one_directory_is_refused_by_main(tmp_path, name):
    """Without --workdir the run is written to runs/<name>: an empty name made runs/ itself the
    work directory, a '../' one wrote outside it. Refused at the door; nothing is created."""
    out = procs.run([sys.executable, "-m", "brorl_jax.main", f"--config={ROOT}/configs/tiny.py",
                     f"--config.name={name}"], capture_output=True, text=True, timeout=120,
                    cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"config key 'name' = {name!r}" in out.stderr and "--workdir" in out.stderr
    assert os.listdir(tmp_path) == []


def test_a_leading_tilde_is_expanded_in_every_path_key(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    c = default_config()
    c.model.path, c.data.train, c.data.eval = "~/model", "~/train.jsonl", "~/eval.parquet"
    (tmp_path / "scorer.py").write_text("def compute_score(**kw):\n    return 0.0\n")
    c.rewards.custom = "~/scorer.py:compute_score"     # its file must exist: found under ~
    run = validate(c)
    assert (run.model.path, run.data.train, run.data.eval, run.rewards.custom) == (
        f"{tmp_path}/model", f"{tmp_path}/train.jsonl", f"{tmp_path}/eval.parquet",
        f"{tmp_path}/scorer.py:compute_score")
    paths = sorted(f"{n}.{f.name}" for n, sec in SECTIONS.items()
                   for f in dataclasses.fields(sec) if f.metadata["path"])
    assert paths == ["data.eval", "data.train", "model.path", "rewards.custom"]


def test_a_tilde_path_reaches_main(tmp_path):
    """Through main: rewards.custom=~/scorer.py:fn is found under $HOME (its file is checked at
    the door), where it used to be "no file"; the run then stops at a later door check."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "scorer.py").write_text("def compute_score(**kw):\n    return 0.0\n")
    out = procs.run([sys.executable, "-m", "brorl_jax.main", "--config=configs/tiny.py",
                     f"--workdir={tmp_path / 'run'}", "--config.rewards.custom=~/scorer.py:compute_score",
                     "--config.rollout.temperature=0"],     # the door stops after the file check
                    capture_output=True, text=True, timeout=120, cwd=ROOT,
                    env={**os.environ, "HOME": str(home)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "rollout.temperature" in out.stderr and "no file" not in out.stderr


@pytest.mark.parametrize("spec", ["data/*.jsonl", "a.jsonl,b.jsonl", "part[12].jsonl"])
def test_globs_and_lists_of_data_files_are_refused_with_the_way_that_works(spec):
    c = default_config()
    c.data.train = spec
    with pytest.raises(ConfigError, match=r"one file per key; globs and lists are not expanded"
                                           r".*cat a.jsonl b.jsonl > all.jsonl"):
        validate(c)


CLI_MODULES = ["brorl_jax.main", "brorl_jax.evaluate", "brorl_jax.export",
               "brorl_jax.experiments.compare_n", "brorl_jax.experiments.plateau"]


def test_command_modules_import_together():
    # Each command defines --config; importing several into one process (a test session, a
    # notebook) must not collide in absl's global flag registry.
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in CLI_MODULES)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("module", CLI_MODULES)
def test_command_help_lists_its_flags(module):
    out = procs.run([sys.executable, "-m", module, "--helpshort"], capture_output=True,
                    text=True, timeout=120)
    # absl's help flags print and exit 1; the flags must have been defined when run as a command.
    assert "Traceback" not in out.stderr, out.stderr
    assert "--config:" in out.stdout, out.stdout


def test_paper_scale_plan_comment_matches_the_slot_plan():
    """configs/brorl_64gpu.py's comment on rollout.memory_budget_gb: its figures are plan_slots'."""
    import math

    from brorl_jax.rollout.plan import plan_slots
    from configs import brorl_64gpu
    from pallas_kernels import compile_target
    c = brorl_64gpu.get_config()
    prompts = math.ceil(c.algo.prompts_per_step * c.algo.generation_batch_multiplier)
    with compile_target("cuda"):
        plan = plan_slots(brorl_64gpu.qwen2_1p5b(), prompts, c.data.max_prompt_len,
                          c.rollout.rollouts_per_prompt, c.rollout.max_new_tokens,
                          int(c.rollout.memory_budget_gb * 2**30),
                          num_devices=brorl_64gpu.NUM_DEVICES)
    assert (prompts, plan.share, plan.page_size) == (96, 16, 16)
    assert (plan.slots, plan.slots * brorl_64gpu.NUM_DEVICES, plan.pool) == (261, 16_704, 19)


def test_a_sigterm_whose_raise_was_lost_still_stops_the_command(monkeypatch):
    """The SIGTERM handler's Interrupted, raised inside a garbage-collection callback, is printed
    and dropped by Python (an export went on and exited 0); the command raises it again before it
    commits its result and after main (cli.raise_if_signalled)."""
    import signal

    from brorl_jax import cli
    from brorl_jax.errors import Interrupted
    monkeypatch.setattr(cli, "_SIGNALLED", [])
    cli.raise_if_signalled()                          # no signal: nothing happens
    try:
        cli._terminated(signal.SIGTERM, None)
    except Interrupted:
        pass                                          # dropped, as in a gc callback
    with pytest.raises(Interrupted, match="stopped by SIGTERM") as e:
        cli.raise_if_signalled()
    assert e.value.exit_code == 143


def test_a_platform_the_machine_lacks_is_one_line(tmp_path):
    """JAX_PLATFORMS naming a platform jax cannot start (no TPU here, nor on the GPU machine) was
    jax's traceback at the first array and exit code 1."""
    out = procs.run([sys.executable, "-m", "brorl_jax.main", "--config=configs/tiny.py",
                     f"--workdir={tmp_path / 'run'}"], capture_output=True, text=True,
                    timeout=120, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "tpu"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "environment variable JAX_PLATFORMS='tpu': jax cannot start it" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_a_flat_file_without_data_source_trains_with_data_default_source(tmp_path):
    """Through main: prompt/answer rows with no data_source column were all skipped, and the fix
    named a Python argument; data.default_source routes them (a row UTF-8 cannot encode is
    skipped naming its line)."""
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(40)]
    rows.append('{"prompt": "\\ud800 What is 1 + 1?", "answer": "2"}')
    (tmp_path / "flat.jsonl").write_text("\n".join(rows) + "\n")
    out = procs.run([sys.executable, "-m", "brorl_jax.main", "--config=configs/tiny.py",
                     f"--workdir={tmp_path / 'run'}", f"--config.data.train={tmp_path}/flat.jsonl",
                     "--config.data.default_source=math", "--config.train.steps=0",
                     "--config.sft.steps=0", "--config.train.tensorboard=False"],
                    capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "invalid_unicode" in out.stdout and "-> math" in out.stdout, out.stdout[-3000:]
