"""Process sandbox for generated Python code (the worker side).

The code verifier (`code_reward.py`) hands a solution and its test inputs to
`run_python_tests`, which runs `_sandbox_harness.py` in a fresh interpreter with the strongest
isolation this machine allows. What is in force is detected at run time by `probe_isolation`
(once per process) and reported by `isolation_report()`; docs/rewards.md states what each layer
buys and what is lost when it is missing.

Layers, strongest first (each used when available, all combined):
  * namespaces: network (no interfaces but a down loopback: no network at all), pid (the
    solution sees only its own processes; tearing down pid 1 kills every process it started),
    mount, ipc and uts.
  * a minimal root (mount namespace + pivot_root, else chroot): the solution's file system is a
    new tmpfs root holding only the interpreter, its standard library and the shared libraries
    it loads (read-only binds of those host paths, nothing else of the host: no checkout, no
    data, no home, no other run's files), a minimal /dev (null, zero, full, random, urandom,
    a private /dev/shm), a private /proc, and two size-capped tmpfs: an empty /tmp and its work
    dir /work. Where a new root cannot be entered, the fallback is the host's tree re-mounted
    read-only with a private tmpfs work dir (files stay readable: only permissions protect
    them); the probe report says which is in force.
  * a per-run cgroup (v1 or v2) capping pids and memory, used to kill every process of the run.
  * an unprivileged uid (when the worker is root): the solution cannot write root's files or
    signal the worker; a dedicated uid per worker makes RLIMIT_NPROC meaningful.
  * always: setrlimit (CPU, address space, file size, processes, open files, no core),
    own session, wall-clock timeouts, temporary directory, scrubbed environment, no_new_privs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence

logger = logging.getLogger(__name__)

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_harness.py")
_PREFIX = "brorl_sbx_"
_NS_NAMES = {0x40000000: "net", 0x20000000: "pid", 0x00020000: "mount", 0x08000000: "ipc",
             0x04000000: "uts", 0x10000000: "user"}
_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWUSER = 0x10000000
_SANDBOX_UID_BASE = 61000  # dedicated uids (one per worker process) when running as root
_SANDBOX_UID_SPAN = 4000


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for running one completion's tests.

    timeout_per_test_s bounds both CPU and wall time of each test (ProRL used 5 s);
    total_timeout_s bounds all tests of one completion together (tests not reached fail).
    """

    timeout_per_test_s: float = 5.0
    total_timeout_s: float = 60.0
    memory_bytes: int = 1 << 30         # address space per test process, and the cgroup cap
    file_size_bytes: int = 16 << 20     # any single file the solution writes
    max_output_bytes: int = 16 << 20    # stdout of one test
    max_processes: int = 32             # processes/threads alive at once
    max_open_files: int = 64
    work_dir_bytes: int = 64 << 20      # tmpfs work dir (when a mount namespace is available)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise ValueError(f"SandboxLimits.{field.name} must be > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Isolation:
    """The isolation in force for sandboxed runs in this process (see probe_isolation)."""

    unshare_flags: int
    drop_uid: bool
    cgroup: str | None                  # "v1" | "v2" | None
    cgroup_dirs: tuple[str, ...]        # parent dirs where per-run cgroups are created
    root: str | None = None             # "pivot_root" | "chroot": a minimal root; None: host tree

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(name for bit, name in _NS_NAMES.items() if self.unshare_flags & bit)

    def describe(self) -> dict:
        """Human-readable summary: one entry per protection, saying what enforces it."""
        ns = set(self.namespaces)
        return {
            "namespaces": sorted(ns),
            "network": ("blocked: empty network namespace" if "net" in ns
                        else "NOT isolated: no network namespace on this machine"),
            "filesystem": (
                f"minimal root ({self.root}): only the interpreter, its standard library and "
                "shared libraries (read-only), a minimal /dev, a private /proc, an empty "
                "private /tmp and work dir (tmpfs); no other host file is visible"
                if "mount" in ns and self.root else
                "host tree read-only except a private tmpfs work dir (mount namespace; no "
                "minimal root on this machine: host files stay readable, subject to their "
                "permissions)"
                if "mount" in ns else
                ("unprivileged uid: cannot write files it does not own; world-writable "
                 "directories (/tmp, /dev/shm) remain writable" if self.drop_uid else
                 "NOT isolated: runs as the worker's user with only a temporary cwd")),
            "processes": ("pid namespace: sees and can signal only its own processes"
                          if "pid" in ns else
                          ("other uid: cannot signal the worker or trainer" if self.drop_uid
                           else "NOT isolated: same uid as the worker, own session only")),
            "user": ("dedicated unprivileged uid per worker" if self.drop_uid else
                     ("root inside a user namespace, mapped to the caller" if "user" in ns
                      else "same uid as the worker")),
            "cgroup": (f"{self.cgroup}: pids + memory cap, whole-tree kill" if self.cgroup
                       else "none (rlimits and session/uid kill only)"),
            "rlimits": "CPU, address space, file size, open files, core=0"
                       + (", processes (per uid)" if self.drop_uid else ""),
            "cleanup": ("pid namespace teardown" if "pid" in ns else
                        "process group kill" + (" + kill by dedicated uid" if self.drop_uid
                                                else "")) + (" + cgroup kill" if self.cgroup
                                                             else ""),
        }


@dataclasses.dataclass
class TestRun:
    """What one test did. stdout/returned are None when the test never produced them."""

    stdout: str | None
    returned: str | None        # JSON text of the return value (call-style tests)
    exit_code: int | None
    signal: int | None
    timed_out: bool
    wall_s: float
    output_truncated: bool
    stderr_tail: str

    @property
    def ok(self) -> bool:
        return (self.exit_code == 0 and not self.timed_out and not self.output_truncated)

    def failure(self) -> str:
        if self.timed_out:
            return "timeout"
        if self.output_truncated:
            return "output limit"
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.valid_signals() \
                else str(self.signal)
            return f"killed by {name}"
        if self.exit_code not in (0, None):
            last = self.stderr_tail.strip().splitlines()[-1:] or [""]
            return f"exit code {self.exit_code} {last[0][:200]}".strip()
        return "ok"


@dataclasses.dataclass
class SandboxResult:
    compile: str                 # "ok" | "syntax_error" | a setup/compile failure message
    tests: list[TestRun | None]  # None: not run (the total time budget ran out)
    compile_error: str = ""


# ----------------------------------------------------------------------------------------
# Capability detection
# ----------------------------------------------------------------------------------------

def _own_cgroup_paths() -> dict[str, str]:
    """controller name (or "" for the unified v2 hierarchy) -> path of this process's cgroup."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    paths[c] = path
    except OSError:
        pass
    return paths


def _cgroup_mounts() -> dict[str, str]:
    """controller name (or "" for cgroup2) -> mount point."""
    mounts = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                pre, _, post = line.partition(" - ")
                fstype, _, options = post.split()[:3]
                point = pre.split()[4]
                if fstype == "cgroup2":
                    mounts.setdefault("", point)
                elif fstype == "cgroup":
                    for opt in options.split(","):
                        if opt in ("pids", "memory"):
                            mounts.setdefault(opt, point)
    except OSError:
        pass
    return mounts


def _probe_cgroups() -> tuple[str | None, tuple[str, ...]]:
    own, mounts = _own_cgroup_paths(), _cgroup_mounts()
    probe_name = f"{_PREFIX}{os.getpid()}_probe"
    if "pids" in mounts and "memory" in mounts and "pids" in own and "memory" in own:
        parents = tuple(os.path.join(mounts[c], own[c].lstrip("/")) for c in ("pids", "memory"))
        made = []
        try:
            for parent, limit_file in zip(parents, ("pids.max", "memory.limit_in_bytes")):
                d = os.path.join(parent, probe_name)
                os.mkdir(d)
                made.append(d)
                if not os.path.exists(os.path.join(d, limit_file)):
                    raise OSError(f"{limit_file} missing")
            return "v1", parents
        except OSError:
            pass
        finally:
            for d in made:
                _rmdir_quiet(d)
    if "" in mounts and "" in own:
        parent = os.path.join(mounts[""], own[""].lstrip("/"))
        d = os.path.join(parent, probe_name)
        try:
            os.mkdir(d)
            try:
                ok = all(os.path.exists(os.path.join(d, f)) for f in ("memory.max", "pids.max"))
            finally:
                _rmdir_quiet(d)
            if ok:
                return "v2", (parent,)
        except OSError:
            pass
    return None, ()


def _rmdir_quiet(path: str, tries: int = 1) -> None:
    for i in range(tries):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005 * (i + 1))


@functools.lru_cache(maxsize=None)
def probe_isolation(mode: str | None = None) -> Isolation:
    """Detects the strongest isolation available to this process (cached per mode).

    mode: "auto" (default; env BRORL_SANDBOX_ISOLATION overrides) uses everything available;
    "rlimits" disables namespaces and cgroups (keeps uid drop, rlimits, sessions, timeouts),
    which is what a machine without namespace or cgroup support gets.
    """
    mode = mode or os.environ.get("BRORL_SANDBOX_ISOLATION", "auto")
    if mode not in ("auto", "rlimits"):
        raise ValueError(f"sandbox isolation mode must be 'auto' or 'rlimits', got {mode!r}")
    _sweep_stale()
    drop_uid = os.geteuid() == 0
    if mode == "rlimits" or sys.platform != "linux":
        return Isolation(0, drop_uid, None, ())
    flags, root = 0, None
    try:
        out = subprocess.run([sys.executable, "-I", "-S", _HARNESS, "--probe"], check=True,
                             capture_output=True, timeout=30, text=True)
        report = json.loads(out.stdout.strip().splitlines()[-1])
        flags = int(report["unshare_flags"])
        root = report.get("root") if flags & _CLONE_NEWNS else None
        if report.get("errors"):
            logger.info("sandbox namespace probe: %s", report["errors"])
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError) as e:
        logger.warning("sandbox namespace probe failed (%s); running without namespaces", e)
    cgroup, dirs = _probe_cgroups()
    # A user namespace maps only our uid: dropping to another uid is impossible inside it.
    drop_uid = drop_uid and not flags & _CLONE_NEWUSER
    return Isolation(flags, drop_uid, cgroup, dirs, root)


def isolation_report(mode: str | None = None) -> dict:
    """What isolation sandboxed code gets in this process, as a dict (also logged)."""
    report = probe_isolation(mode).describe()
    logger.info("code sandbox isolation: %s", report)
    return report


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _sweep_stale() -> None:
    """Removes run dirs and cgroups left by workers that were killed mid-run."""
    tmp = tempfile.gettempdir()
    candidates = []  # (path, is_cgroup)
    try:
        candidates += [(os.path.join(tmp, n), False) for n in os.listdir(tmp)
                       if n.startswith(_PREFIX)]
    except OSError:
        pass
    own, mounts = _own_cgroup_paths(), _cgroup_mounts()
    for key in ("pids", "memory", ""):
        if key in own and key in mounts:
            parent = os.path.join(mounts[key], own[key].lstrip("/"))
            try:
                candidates += [(os.path.join(parent, n), True) for n in os.listdir(parent)
                               if n.startswith(_PREFIX)]
            except OSError:
                pass
    for path, is_cgroup in candidates:
        try:
            owner = int(os.path.basename(path)[len(_PREFIX):].split("_")[0])
        except ValueError:
            continue
        if _pid_alive(owner):
            continue
        if is_cgroup:
            _kill_cgroup(path)
            _rmdir_quiet(path, tries=3)
        else:
            shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------
# One sandboxed run
# ----------------------------------------------------------------------------------------

def _sandbox_uid() -> int:
    """A uid with no passwd entry, distinct per worker process (pid-derived)."""
    start = os.getpid() % _SANDBOX_UID_SPAN
    for k in range(_SANDBOX_UID_SPAN):
        uid = _SANDBOX_UID_BASE + (start + k) % _SANDBOX_UID_SPAN
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise RuntimeError("no free sandbox uid")


@functools.lru_cache(maxsize=None)
def _warn_writable_mounts(mounts: tuple[str, ...]) -> None:
    """Logged once per worker process and set of mounts."""
    logger.warning("sandbox: these mounts could not be made read-only and stay writable "
                   "for sandboxed code (subject to file permissions): %s", list(mounts))


def _make_cgroups(iso: Isolation, limits: SandboxLimits) -> tuple[list[str], list[str]]:
    """Creates this run's cgroups; returns (dirs, cgroup.procs files). Empty when unavailable."""
    if iso.cgroup is None:
        return [], []
    name = f"{_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"
    # Launcher and keeper interpreters plus the tmpfs work dir share the memory cap.
    memory_cap = limits.memory_bytes + limits.work_dir_bytes + (128 << 20)
    pids_cap = limits.max_processes + 4
    dirs = []
    try:
        if iso.cgroup == "v1":
            pids_dir = os.path.join(iso.cgroup_dirs[0], name)
            mem_dir = os.path.join(iso.cgroup_dirs[1], name)
            os.mkdir(pids_dir)
            dirs.append(pids_dir)
            os.mkdir(mem_dir)
            dirs.append(mem_dir)
            _write(os.path.join(pids_dir, "pids.max"), str(pids_cap))
            _write(os.path.join(mem_dir, "memory.limit_in_bytes"), str(memory_cap))
            memsw = os.path.join(mem_dir, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):
                _write(memsw, str(memory_cap))  # no escape into swap
        else:
            d = os.path.join(iso.cgroup_dirs[0], name)
            os.mkdir(d)
            dirs.append(d)
            _write(os.path.join(d, "pids.max"), str(pids_cap))
            _write(os.path.join(d, "memory.max"), str(memory_cap))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), "0")
    except OSError as e:
        logger.warning("could not create sandbox cgroup (%s); this run has rlimits only", e)
        for d in dirs:
            _rmdir_quiet(d)
        return [], []
    return dirs, [os.path.join(d, "cgroup.procs") for d in dirs]


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _kill_cgroup(path: str) -> None:
    kill_file = os.path.join(path, "cgroup.kill")
    if os.path.exists(kill_file):
        try:
            _write(kill_file, "1")
        except OSError:
            pass
    for _ in range(200):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)


def _kill_uid(uid: int) -> None:
    """Kills every process of a dedicated sandbox uid (a helper sends kill(-1) as that uid)."""
    pid = os.fork()  # the worker is single-threaded; the child only calls async-safe functions
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            for _ in range(3):
                os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def _read_capped(path: str, cap: int) -> tuple[str | None, bool]:
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        return None, False
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def run_python_tests(source: str, test_inputs: Sequence[str], *, style: str = "stdio",
                     fn_name: str | None = None, limits: SandboxLimits = SandboxLimits(),
                     isolation: str | None = None) -> SandboxResult:
    """Runs `source` once per test input in the sandbox and returns what each run produced.

    style="stdio": each input is fed as stdin; the result is the text printed to stdout.
    style="call": each input is the JSON text of the argument list for `fn_name` (a top-level
    function or a method of class Solution); the result is the JSON of its return value.
    The caller compares results with the expected outputs, which never enter the sandbox.
    """
    if style not in ("stdio", "call"):
        raise ValueError(f"style must be 'stdio' or 'call', got {style!r}")
    if style == "call" and not fn_name:
        raise ValueError("style='call' needs fn_name (the function the tests call)")
    iso = probe_isolation(isolation)
    uid = _sandbox_uid() if iso.drop_uid else None
    run_dir = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}_")
    cgroup_dirs: list[str] = []
    proc = None
    try:
        os.chmod(run_dir, 0o711)  # the solution may traverse to its work dir, not list/read
        work_dir = os.path.join(run_dir, "work")
        os.mkdir(work_dir, 0o700)
        if uid is not None and not iso.unshare_flags & _CLONE_NEWNS:
            os.chown(work_dir, uid, uid)  # with a mount namespace a tmpfs owned by uid covers it
        _write(os.path.join(run_dir, "solution.py"), source)
        for i, text in enumerate(test_inputs):
            _write(os.path.join(run_dir, f"in_{i}"), text)
        cgroup_dirs, procs_files = _make_cgroups(iso, limits)
        per_test = limits.timeout_per_test_s
        total = min(limits.total_timeout_s, per_test * (len(test_inputs) + 1))
        cfg = {
            "run_dir": run_dir, "work_dir": work_dir, "style": style, "fn_name": fn_name,
            "n_tests": len(test_inputs), "parent_pid": os.getpid(),
            "limits": {
                "cpu_s": per_test, "wall_s": per_test, "total_wall_s": total,
                "memory_bytes": limits.memory_bytes,
                "file_size_bytes": max(limits.file_size_bytes, limits.max_output_bytes + 1),
                "max_processes": limits.max_processes,
                "max_open_files": limits.max_open_files,
                "nproc_rlimit": uid is not None,  # per-uid: only meaningful for our own uid
            },
            "isolation": {
                "unshare_flags": iso.unshare_flags, "uid": uid, "gid": uid,
                "cgroup_procs": procs_files, "tmpfs_bytes": limits.work_dir_bytes,
                "minimal_root": bool(iso.root),
            },
        }
        cfg_path = os.path.join(run_dir, "config.json")
        _write(cfg_path, json.dumps(cfg))
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "HOME": work_dir, "TMPDIR": work_dir}
        with open(os.path.join(run_dir, "harness_err"), "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-S", _HARNESS, cfg_path],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err, env=env, cwd=run_dir, start_new_session=True,
                                    close_fds=True)
        # Per-test wall limits are enforced inside; this is the backstop for the harness.
        _wait_exit(proc, total + per_test + 5.0)
        return _collect(run_dir, len(test_inputs), limits, proc)
    finally:
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait()
        for d in cgroup_dirs:
            _kill_cgroup(d)
        if uid is not None and not iso.unshare_flags & _CLONE_NEWPID:
            _kill_uid(uid)
        for d in cgroup_dirs:
            _rmdir_quiet(d, tries=20)
        shutil.rmtree(run_dir, ignore_errors=True)


def _wait_exit(proc: subprocess.Popen, timeout: float) -> None:
    """Waits for proc up to timeout without Popen.wait's polling sleeps (pidfd when possible)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        return
    try:
        if select.select([fd], [], [], timeout)[0]:
            proc.wait()
    finally:
        os.close(fd)


def _collect(run_dir: str, n_tests: int, limits: SandboxLimits, proc) -> SandboxResult:
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            status = json.load(f)
    except (OSError, ValueError):
        err, _ = _read_capped(os.path.join(run_dir, "harness_err"), 4000)
        code = proc.poll()
        return SandboxResult(f"sandbox failed (harness exit {code}): {(err or '').strip()[-500:]}",
                             [None] * n_tests)
    failed_ro = status.get("mount_ro_failed") or []
    if failed_ro:
        _warn_writable_mounts(tuple(failed_ro))
    if status.get("setup") != "ok":
        return SandboxResult(status.get("setup", "sandbox setup failed"), [None] * n_tests)
    if status.get("compile") != "ok":
        err, _ = _read_capped(os.path.join(run_dir, "compile_err"), 2000)
        return SandboxResult(status.get("compile") or "compile check failed", [None] * n_tests,
                             compile_error=(err or "").strip())
    tests: list[TestRun | None] = []
    for i in range(n_tests):
        if i >= len(status["tests"]):
            tests.append(None)
            continue
        rec = status["tests"][i]
        stdout, truncated = _read_capped(os.path.join(run_dir, f"out_{i}"),
                                         limits.max_output_bytes)
        returned, _ = _read_capped(os.path.join(run_dir, f"ret_{i}"), limits.max_output_bytes)
        stderr, _ = _read_capped(os.path.join(run_dir, f"err_{i}"), 2000)
        tests.append(TestRun(stdout=stdout, returned=returned or None,
                             exit_code=rec["exit_code"], signal=rec["signal"],
                             timed_out=rec["timed_out"], wall_s=rec["wall_s"],
                             output_truncated=truncated, stderr_tail=(stderr or "")[-2000:]))
    return SandboxResult("ok", tests)


if __name__ == "__main__":      # python -m brorl_jax.rewards.sandbox --probe
    if sys.argv[1:] not in ([], ["--probe"]):
        sys.exit("usage: python -m brorl_jax.rewards.sandbox [--probe]")
    print(json.dumps(isolation_report(), indent=1))
