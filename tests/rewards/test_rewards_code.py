"""Code verifier and sandbox: right fractions, and adversarial programs stay contained.

Every adversarial program prints the expected output only if its attack got through, so a
sandbox that failed to contain it would score 1, not 0.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time

import pytest

from brorl_jax.rewards import ScoringService, isolation_report
from brorl_jax.rewards.code_reward import code_reward, extract_code, stdout_matches
from brorl_jax.rewards.sandbox import SandboxLimits, probe_isolation, run_python_tests

WALL_S = 2.0
CODE_OPTIONS = {"timeout_per_test_s": WALL_S, "memory_bytes": 256 << 20,
                "max_output_bytes": 1 << 20, "file_size_bytes": 1 << 20, "max_processes": 16,
                "work_dir_bytes": 8 << 20}
ADD = {"inputs": ["1 2\n", "3 4\n", "10 -10\n", "5 5\n"], "outputs": ["3", "7", "0", "10"]}
OK = {"inputs": [""], "outputs": ["ok"]}


def _fence(src):
    return "Here is my solution:\n```python\n" + textwrap.dedent(src).strip() + "\n```\n"


def _code(truth):
    return {"data_source": "code", "ground_truth": truth}


@pytest.fixture(scope="module")
def service():
    with ScoringService(num_workers=2, timeout_s=30.0, recycle_after=10_000,
                        reward_options={"code": CODE_OPTIONS}, rewards=["code"]) as svc:
        yield svc


def test_correct_and_partial_solutions(service):
    completions = [
        _fence("a, b = map(int, input().split())\nprint(a + b)"),
        _fence("a, b = map(int, input().split())\nprint(a + b if a != 10 else 1)"),  # 3/4
        _fence("a, b = map(int, input().split())\nprint(a * b)"),                    # 5 = 2+3? no
        _fence("print(3)"),                                                          # 1/4
        _fence("def f(:\n  pass"),                                                   # syntax
        "a, b = map(int, input().split())\nprint(a + b)",                            # no block
        _fence("import sys\nsys.exit(0)"),                                           # no output
        _fence("raise SystemExit('bad')"),
    ]
    results = service.score_batch([_code(ADD)] * len(completions), completions)
    scores = [r.score for r in results]
    assert scores == [1.0, 0.75, 0.0, 0.25, 0.0, 0.0, 0.0, 0.0], [r.reason for r in results]
    assert results[4].reason == "syntax error"
    assert results[5].reason == "no code block"


def test_call_style_tests(service):
    truth = {"fn_name": "solve", "inputs": [[1, 2], [[1, 2, 3]], ["ab", 2]],
             "outputs": [3, [6], ["ab", "ab"]]}
    good = _fence("""
        def solve(*args):
            if len(args) == 2 and isinstance(args[0], str):
                return (args[0],) * args[1]
            if len(args) == 1:
                return sum(args[0])
            return args[0] + args[1]
    """)
    leetcode = _fence("""
        class Solution:
            def solve(self, *args):
                return 3
    """)
    results = service.score_batch([_code(truth)] * 3, [good, leetcode, _fence("x = 1")])
    assert [r.score for r in results] == pytest.approx([1.0, 1 / 3, 0.0]), results


def test_stdlib_imports_and_big_ints_work(service):
    src = _fence("""
        import heapq, collections, fractions, itertools, bisect, math, re, decimal
        n = int(input())
        print(str(2 ** n)[:5], len(str(10 ** 5000)))
    """)
    truth = {"inputs": ["100\n"], "outputs": ["12676 5001"]}
    assert service.score_batch([_code(truth)], [src])[0].score == 1.0


ATTACKS = {
    "infinite loop": "while True:\n    pass",
    "fork bomb": """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
    "memory bomb (one block)": "x = bytearray(1 << 36)\nprint('ok')",
    "memory bomb (growing)": """
        blocks = []
        while True:
            blocks.append(bytearray(50 << 20))
    """,
    "gigabyte of output": """
        import sys
        chunk = 'x' * (1 << 20)
        for _ in range(1024):
            sys.stdout.write(chunk)
        print('ok')
    """,
    "ignore SIGTERM": """
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            pass
    """,
    "segfault via ctypes": "import ctypes\nctypes.string_at(0)\nprint('ok')",
    "kill its parent": """
        import os, signal, time
        parent = os.getppid()
        for pid in [parent] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:
            if pid not in (0, os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        time.sleep(0.2)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            print('ok')  # the parent is gone
    """,
}


def _sandbox_uids_alive():
    procs = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if 61000 <= uid < 65000:
            procs.append(p)
    return procs


def test_adversarial_programs_are_contained(service, tmp_path):
    # World-writable bait: only a read-only mount (or a non-root uid) protects these.
    bait_dir = tempfile.mkdtemp(prefix="brorl_bait_")
    os.chmod(bait_dir, 0o777)
    bait = os.path.join(bait_dir, "keep.txt")
    with open(bait, "w") as f:
        f.write("precious")
    os.chmod(bait, 0o666)
    private = tmp_path / "private.txt"  # root-owned, 0700 parents
    private.write_text("precious")
    escape = os.path.join(bait_dir, "escaped.txt")
    escape_tmp = os.path.join(tempfile.gettempdir(), f"brorl_escape_{os.getpid()}.txt")
    marker = os.path.join(tempfile.gettempdir(), f"brorl_marker_{os.getpid()}.txt")
    with open(marker, "w") as f:
        f.write("host")
    os.chmod(marker, 0o644)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    canary = subprocess.Popen(["sleep", "120"])  # a host process the attacks must not kill
    attacks = dict(ATTACKS)
    attacks.update({
        "write outside (world-writable dir)": f"open({escape!r}, 'w').write('x')\nprint('ok')",
        # /tmp is the sandbox's own (a private tmpfs): a write there succeeds but reaches the
        # host's /tmp only if the host's files are visible (the marker planted there)
        "write outside (/tmp)": f"open({escape_tmp!r}, 'w').write('x')\nimport os\n"
                                f"print('ok' if os.path.exists({marker!r}) else 'private')",
        "overwrite a reachable file": f"open({bait!r}, 'w').write('pwned')\nprint('ok')",
        "delete a reachable file": f"import os\nos.remove({bait!r})\nprint('ok')",
        "delete a private file": f"import os\nos.remove({str(private)!r})\nprint('ok')",
        "delete the tree": f"import shutil\nshutil.rmtree({bait_dir!r})\nprint('ok')",
        "open a network connection": f"""
            import socket
            s = socket.create_connection(('127.0.0.1', {port}), timeout=1)
            s.sendall(b'hi')
            print('ok')
        """,
        "reach the internet": """
            import socket
            socket.create_connection(('1.1.1.1', 53), timeout=1)
            print('ok')
        """,
    })
    workers_before = service.worker_pids()
    names = list(attacks)
    start = time.monotonic()
    try:
        results = service.score_batch([_code(OK)] * len(names),
                                      [_fence(attacks[n]) for n in names])
        elapsed = time.monotonic() - start
        for name, res in zip(names, results):
            assert res.score == 0.0, (name, res)
            assert not res.reason.startswith(("timeout", "worker died", "sandbox error")), \
                (name, res)
            # Each test finishes within its wall limit (plus scheduling slack).
            walls = [w for w in res.details.get("wall_s", []) if w is not None]
            assert all(w <= WALL_S + 1.0 for w in walls), (name, res.details)
        # Two workers; at most ~8 programs hit the 2 s limit.
        assert elapsed < 60, elapsed
        assert service.worker_pids() == workers_before  # no worker was killed or replaced
        assert canary.poll() is None                    # the host process survived
        with open(bait) as f:
            assert f.read() == "precious"
        assert private.read_text() == "precious"
        assert sorted(os.listdir(bait_dir)) == ["keep.txt"]
        assert not os.path.exists(escape_tmp)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
        time.sleep(0.2)
        assert _sandbox_uids_alive() == []  # no leftover sandbox processes (fork bomb)
        leftovers = [n for n in os.listdir(tempfile.gettempdir())
                     if n.startswith(tuple(f"brorl_sbx_{p}_" for p in workers_before))]
        assert leftovers == []
        # The service still works afterwards.
        ok = service.score_batch([_code(OK)], [_fence("print('ok')")])
        assert ok[0].score == 1.0
    finally:
        canary.kill()
        listener.close()
        shutil.rmtree(bait_dir, ignore_errors=True)
        if os.path.exists(escape_tmp):
            os.remove(escape_tmp)
        os.remove(marker)


def test_isolation_report_describes_what_is_in_force():
    report = isolation_report()
    iso = probe_isolation()
    assert set(report) >= {"network", "filesystem", "processes", "user", "cgroup", "rlimits"}
    if "net" in iso.namespaces:
        assert report["network"].startswith("blocked")
    else:
        assert report["network"].startswith("NOT isolated")
    if os.geteuid() == 0:
        assert iso.drop_uid or "user" in iso.namespaces


@pytest.mark.parametrize("source, expect", [
    ("while True:\n    pass", "timeout"),
    ("x = bytearray(1 << 36)", "exit code 1"),
    ("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))", "output limit"),
    ("import ctypes\nctypes.string_at(0)", "SIGSEGV"),
])
def test_rlimits_only_fallback_still_bounds_runaway_programs(source, expect):
    # What a machine without namespaces or cgroups gets (isolation="rlimits").
    limits = SandboxLimits(timeout_per_test_s=1.5, memory_bytes=256 << 20,
                           max_output_bytes=1 << 20, file_size_bytes=1 << 20)
    start = time.monotonic()
    result = run_python_tests(source, [""], limits=limits, isolation="rlimits")
    assert time.monotonic() - start < 10
    run = result.tests[0]
    assert not run.ok and expect in run.failure(), run


def test_helpers():
    assert extract_code("```py\na\n```\ntext\n```python\nb\n```") == "b\n"
    assert extract_code("```\nc\n```") == "c\n"
    assert extract_code("no code") is None
    assert stdout_matches("3 \n\n", "3")
    assert stdout_matches("1.0000001\n", "1.0")
    assert not stdout_matches("1.1\n", "1.0")
    assert stdout_matches("a\nb\n", ["a", "b"])


def test_bad_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="inputs"):
        code_reward({"data_source": "code", "ground_truth": {"tests": []}}, _fence("pass"))
    with pytest.raises(ValueError, match="pair up"):
        code_reward(_code({"inputs": ["1"], "outputs": []}), _fence("pass"))
