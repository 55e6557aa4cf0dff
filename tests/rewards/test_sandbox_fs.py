"""Untrusted code sees no host files (issue 26 item 7): a solution that walks the file system,
lists /tmp and tries to read files planted in the host's /tmp and in the checkout finds nothing
it was not given: the interpreter, its standard library and shared libraries (read-only), a
minimal /dev, an empty /tmp and its empty work directory.
"""
import json
import os
import sys
import tempfile

import pytest
from testutil import ROOT

from brorl_jax.rewards import ScoringService
from brorl_jax.rewards.sandbox import probe_isolation, run_python_tests

WALKER = r'''
import json, os, sys
seen, opened = [], {}
for top, dirs, files in os.walk("/"):
    if top == "/proc":
        dirs[:] = []
        continue
    links = [d for d in dirs if os.path.islink(os.path.join(top, d))]
    seen += [os.path.join(top, f) for f in files + links]
    if len(seen) > 50000:
        break
for path in sys.stdin.read().split():
    try:
        opened[path] = open(path).read()
    except OSError as e:
        opened[path] = type(e).__name__
print(json.dumps({"seen": seen, "opened": opened, "tmp": os.listdir("/tmp"),
                  "cwd": os.getcwd(), "work": os.listdir("."), "root": sorted(os.listdir("/"))}))
'''


def _system_lib_dirs():
    """Where this interpreter's shared libraries and loader live on the host (the minimal root
    exposes these directories)."""
    dirs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and "/libc.so" in parts[5]:
                dirs.add(os.path.dirname(parts[5].strip()))
    return dirs


@pytest.fixture
def planted():
    host_tmp = tempfile.NamedTemporaryFile("w", prefix="brorl_planted_", suffix=".json",
                                           delete=False)
    host_tmp.write(json.dumps({"expected_output": "42"}))
    host_tmp.close()
    os.chmod(host_tmp.name, 0o644)
    in_checkout = os.path.join(ROOT, f".brorl_planted_{os.getpid()}.json")
    with open(in_checkout, "w") as f:
        f.write('{"expected_output": "42"}')
    yield [host_tmp.name, in_checkout]
    os.remove(host_tmp.name)
    os.remove(in_checkout)


def test_a_solution_walking_the_file_system_finds_no_file_it_was_not_given(planted):
    iso = probe_isolation()
    if "mount" not in iso.namespaces or not iso.root:
        pytest.skip(f"no mount namespace / minimal root on this machine ({iso.describe()})")
    result = run_python_tests(WALKER, [" ".join(planted + [ROOT, os.path.expanduser("~")])])
    run = result.tests[0]
    assert result.compile == "ok" and run.ok, (result, run and run.stderr_tail)
    got = json.loads(run.stdout)
    # nothing planted is found or readable; the checkout and the home directory do not exist
    names = {os.path.basename(p) for p in planted}
    assert not [p for p in got["seen"] if os.path.basename(p) in names]
    assert all(got["opened"][p] in ("FileNotFoundError", "PermissionError") for p in planted)
    assert got["opened"][ROOT] in ("FileNotFoundError", "IsADirectoryError") and \
        not [p for p in got["seen"] if p.startswith(ROOT + "/")]
    assert got["tmp"] == [] and got["work"] == [] and got["cwd"] == "/work"
    # everything visible is the interpreter's own: its prefix, the system library directory,
    # the loader's cache, /dev
    prefix = os.path.realpath(sys.base_prefix)
    allowed = (prefix + "/", "/dev/", "/etc/ld.so.cache",
               *(d + "/" for d in _system_lib_dirs()))
    foreign = [p for p in got["seen"] if not os.path.realpath(p).startswith(allowed)
               and not p.startswith(allowed) and os.path.dirname(p) != "/"]
    assert foreign == [], foreign[:20]
    assert not [p for p in got["seen"] if "/site-packages/" in p]   # third-party code not given
    assert set(got["root"]) <= {"dev", "etc", "lib", "lib32", "lib64", "libx32", "bin", "sbin",
                                "proc", "root", "tmp", "usr", "work", "opt", "home"}, got["root"]


def test_the_code_verifier_cannot_find_an_expected_output_on_disk():
    # The case: the expected output written to a world-readable JSON file in the host's
    # /tmp; a solution that searches the disk for it and prints it must still score 0.
    iso = probe_isolation()
    if not iso.root:
        pytest.skip(f"no minimal root on this machine ({iso.describe()['filesystem']})")
    bait = tempfile.NamedTemporaryFile("w", prefix="brorl_answers_", suffix=".json",
                                       delete=False, dir=tempfile.gettempdir())
    bait.write(json.dumps({"outputs": ["secret-7391"]}))
    bait.close()
    os.chmod(bait.name, 0o644)
    search = ("import os, json\nfor top, _, files in os.walk('/'):\n"
              "    if top.startswith('/proc'):\n        continue\n"
              "    for f in files:\n        if f.startswith('brorl_answers_'):\n"
              "            print(json.load(open(os.path.join(top, f)))['outputs'][0])\n"
              "            raise SystemExit\nprint('nothing')\n")
    try:
        with ScoringService(num_workers=1, timeout_s=30.0, rewards=["code"]) as svc:
            res = svc.score_batch([{"data_source": "code", "ground_truth": {
                "inputs": [""], "outputs": ["secret-7391"]}}],
                ["```python\n" + search + "```"])[0]
    finally:
        os.remove(bait.name)
    assert res.score == 0.0, res
