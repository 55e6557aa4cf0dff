"""Sandbox harness: runs untrusted Python against test inputs. Standard library only.

This file is executed by path (``python -I -S _sandbox_harness.py CONFIG``) from a scoring
worker, never imported by the package; `sandbox.py` is its only caller and documents the
isolation model. Process tree for one completion:

    scoring worker (root or the user)
      └─ launcher  (this script; joins the per-run cgroups, unshares namespaces, forks)
           └─ keeper (pid 1 of a new pid namespace when available; root inside the sandbox)
                ├─ compile check child   (limits + unprivileged uid; compiles only)
                └─ one child per test    (limits + unprivileged uid; runs the solution)

The keeper stays privileged so the untrusted children cannot signal it (different uid, and
pid 1 of a namespace ignores signals from inside it); after each test it kills every other
process of the namespace (``kill(-1)`` from pid 1), so forks and daemons do not leak into the
next test. Expected outputs never enter the sandbox: the keeper only records what the
solution printed (or returned), and the worker compares outside.

``probe`` mode (``python -I -S _sandbox_harness.py --probe``) tries every isolation layer in
throw-away namespaces and prints a JSON report of what works on this kernel.
"""

import ctypes
import json
import os
import re
import select
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21

MNT_DETACH = 2
# pivot_root has no libc wrapper: the syscall number per architecture (else chroot is used).
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217,
                  "riscv64": 41}.get(os.uname().machine)
# Where the solution's work directory and temporary directory are inside the minimal root.
ROOT_WORK = "/work"
DEVICES = ("null", "zero", "full", "random", "urandom")

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

# statvfs f_flag bits that must be kept on a bind remount (the kernel refuses to clear
# "locked" flags inside a user namespace).
_ST_TO_MS = ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC),
             (1024, MS_NOATIME), (2048, MS_NODIRATIME), (4096, MS_RELATIME))

_COMMON_MODULES = (
    "array", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal", "enum",
    "fractions", "functools", "heapq", "io", "itertools", "math", "operator", "queue",
    "random", "re", "statistics", "string", "sys", "threading", "time", "typing",
)

EXIT_SYNTAX_ERROR = 3
EXIT_SETUP_FAILED = 121

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare(%#x)" % flags)


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           "mount %s" % target)


def prctl(option, arg=0):
    _check(_libc.prctl(option, arg, 0, 0, 0), "prctl(%d)" % option)


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


# The run directory (inputs, outputs, status.json) as the keeper reaches it: by path, or, inside
# a minimal root where it is not visible, through a directory fd opened before entering it.
_RUN = {"dir": None, "fd": None}


def run_open(name, flags, mode=0o600):
    if _RUN["fd"] is not None:
        return os.open(name, flags, mode, dir_fd=_RUN["fd"])
    return os.open(os.path.join(_RUN["dir"], name), flags, mode)


def run_write(name, text):
    fd = run_open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def run_read(name):
    with os.fdopen(run_open(name, os.O_RDONLY), encoding="utf-8", errors="replace") as f:
        return f.read()


def _mount_points():
    """Mount points of this mount namespace, parents before children (mountinfo order)."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            raw = line.split()[4]
            # mountinfo escapes space, tab, newline and backslash as octal.
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), raw))
    return points


def _remount_readonly(path):
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    for st_bit, ms_bit in _ST_TO_MS:
        if st.f_flag & st_bit:
            flags |= ms_bit
    try:
        mount(None, path, None, flags)
        return True
    except OSError:
        return False


def _enter_namespaces(iso):
    """Unshares the requested namespaces (and maps the user when unprivileged)."""
    flags = iso["unshare_flags"]
    if not flags:
        return
    uid, gid = os.getuid(), os.getgid()
    unshare(flags)
    if flags & CLONE_NEWUSER:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", "0 %d 1" % uid)
        _write("/proc/self/gid_map", "0 %d 1" % gid)


def _setup_mounts(iso, run_dir, work_dir):
    """Private mount tree: everything read-only except run_dir (keeper's) and a tmpfs work dir."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount(run_dir, run_dir, None, MS_BIND)  # own mount point, so it stays writable
    opts = "size=%d,mode=0700" % iso["tmpfs_bytes"]
    if iso.get("uid") is not None:
        opts += ",uid=%d,gid=%d" % (iso["uid"], iso["gid"])
    mount("tmpfs", work_dir, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    # The interpreter's stdlib may live under a directory the sandbox uid cannot traverse
    # (e.g. /root/.pyenv): expose each sys.path directory read-only inside run_dir.
    moved = {}
    for k, entry in enumerate(p for p in sys.path if os.path.isdir(p)):
        target = os.path.join(run_dir, "py%d" % k)
        os.mkdir(target, 0o755)
        mount(entry, target, None, MS_BIND | MS_REC)
        moved[entry] = target
    keep = {run_dir, work_dir}
    failed = [p for p in _mount_points() if p not in keep and not _remount_readonly(p)]
    if not os.statvfs("/").f_flag & 1:
        raise OSError("could not make the root file system read-only")
    if iso["unshare_flags"] & CLONE_NEWPID:
        # A fresh /proc shows only this namespace's processes.
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _relocate_imports(moved)
    return failed


def _elf_interpreter(path):
    """The dynamic loader an ELF executable names (PT_INTERP), or None."""
    import struct
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:          # 64-bit ELF only
                return None
            end = "<" if head[5] == 1 else ">"
            phoff, = struct.unpack(end + "Q", head[32:40])
            phentsize, phnum = struct.unpack(end + "HH", head[54:58])
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                ptype, = struct.unpack(end + "I", f.read(4))
                if ptype == 3:                                  # PT_INTERP
                    f.seek(phoff + i * phentsize + 8)
                    offset, = struct.unpack(end + "Q", f.read(8))
                    f.seek(phoff + i * phentsize + 32)
                    size, = struct.unpack(end + "Q", f.read(8))
                    f.seek(offset)
                    return f.read(size).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def exposed_paths():
    """What the minimal root shows of the host, read-only: the interpreter, its standard
    library (sys.path of this -I -S interpreter), the directories of the shared libraries it
    has mapped (so later imports of extension modules find theirs), its dynamic loader and the
    loader's cache. Nothing else: no checkout, no data, no home, no other run's files."""
    paths = [os.path.realpath(sys.executable)]
    paths += [p for p in sys.path if os.path.exists(p)]
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    mapped = parts[5].strip()
                    if mapped.startswith("/") and ".so" in os.path.basename(mapped):
                        paths.append(os.path.dirname(mapped))
    except OSError:
        pass
    interp = _elf_interpreter(os.path.realpath(sys.executable))
    if interp:
        paths.append(interp)
    paths.append("/etc/ld.so.cache")
    out = []
    for p in paths:
        if os.path.exists(p) and p not in out:
            out.append(p)
    return out


def _mirror(root, path, bound):
    """Recreates `path` inside `root`: each symlink on the way as the same symlink, then a
    mount point (an empty file or directory) for the real thing; returns (real source, target
    inside root), or None when it is already visible (inside a directory in `bound`)."""
    parts = [c for c in path.split("/") if c]
    host = "/"
    hops = 0
    while parts:
        name = parts.pop(0)
        nxt = os.path.join(host, name)
        inside = root + nxt
        if os.path.islink(nxt):
            hops += 1
            if hops > 40:
                raise OSError("too many symlinks in %s" % path)
            target = os.readlink(nxt)
            if not os.path.lexists(inside):
                os.makedirs(os.path.dirname(inside), 0o755, exist_ok=True)
                os.symlink(target, inside)
            rest = [c for c in target.split("/") if c]
            parts = rest + parts
            host = "/" if target.startswith("/") else host
            continue
        host = nxt
        if any(host == b or host.startswith(b.rstrip("/") + "/") for b in bound):
            return None                       # already visible through a bound directory
        if not parts:
            if os.path.isdir(host):
                os.makedirs(inside, 0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(inside), 0o755, exist_ok=True)
                if not os.path.lexists(inside):
                    open(inside, "w").close()
            return host, inside
        if not os.path.isdir(host):
            return None
    return None


def _bind_readonly(source, target):
    """A read-only, nosuid, nodev bind of one host path (its submounts not included)."""
    mount(source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    st = os.statvfs(target).f_flag
    for st_bit, ms_bit in _ST_TO_MS:
        if st & st_bit:
            flags |= ms_bit        # flags the kernel keeps locked (e.g. inside a user namespace)
    mount(None, target, None, flags)


def _build_root(iso, run_dir, work_dir):
    """A new, minimal root in run_dir/root: exposed_paths() read-only, a minimal /dev, a
    private /proc (with a pid namespace), a private empty /tmp and the work dir (ROOT_WORK),
    both size-capped tmpfs. Returns the root's path."""
    root = os.path.join(run_dir, "root")
    os.mkdir(root, 0o755)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    bound = []
    for path in sorted(exposed_paths(), key=lambda p: len(os.path.realpath(p))):
        got = _mirror(root, path, bound)
        if got is not None:
            _bind_readonly(*got)
            if os.path.isdir(got[0]):
                bound.append(got[0])
    for entry in sys.path:       # the base interpreter's third-party packages: not given
        for name in ("site-packages", "dist-packages"):
            hidden = root + os.path.join(entry, name)
            if os.path.isdir(hidden) and not os.path.islink(hidden):
                mount("tmpfs", hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                      "size=4k,mode=0555")
    dev = root + "/dev"
    os.makedirs(dev, 0o755, exist_ok=True)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(os.path.join(dev, name), "w").close()
            mount("/dev/" + name, os.path.join(dev, name), None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(dev, name))
    os.mkdir(dev + "/shm", 0o1777)
    os.chmod(dev + "/shm", 0o1777)
    owner = ""
    if iso.get("uid") is not None:
        owner = ",uid=%d,gid=%d" % (iso["uid"], iso["gid"])
    mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          "size=%d,mode=1777" % (4 << 20))
    for name, mode, size in (("tmp", "1777", iso["tmpfs_bytes"]),):
        os.makedirs(root + "/" + name, 0o755, exist_ok=True)
        mount("tmpfs", root + "/" + name, "tmpfs", MS_NOSUID | MS_NODEV,
              "size=%d,mode=%s" % (size, mode))
    os.makedirs(root + ROOT_WORK, 0o755, exist_ok=True)
    mount("tmpfs", root + ROOT_WORK, "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%d,mode=0700%s" % (iso["tmpfs_bytes"], owner))
    if iso["unshare_flags"] & CLONE_NEWPID:
        os.makedirs(root + "/proc", 0o555, exist_ok=True)
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    return root


def _enter_root(root):
    """Makes `root` this process's root: pivot_root (the old root unmounted, unreachable), else
    chroot. Returns which."""
    os.chdir(root)
    if SYS_PIVOT_ROOT is not None and _libc.syscall(SYS_PIVOT_ROOT, b".", b".") == 0:
        _check(_libc.umount2(b".", MNT_DETACH), "umount the old root")
        os.chdir("/")
        return "pivot_root"
    os.chroot(".")
    os.chdir("/")
    return "chroot"


def _relocate_imports(moved):
    """Points sys.path and loaded packages' __path__ at the bind-mounted copies, so lazy
    imports (e.g. encodings.idna on the first socket call) work for the sandbox uid."""
    def relocate(path):
        for old, new in moved.items():
            if path == old or path.startswith(old + os.sep):
                return new + path[len(old):]
        return path

    sys.path[:] = [relocate(p) for p in sys.path if relocate(p) != p]
    for module in list(sys.modules.values()):
        paths = getattr(module, "__path__", None)
        if isinstance(paths, list):
            paths[:] = [relocate(p) for p in paths]
    sys.path_importer_cache.clear()


def _set_limits(lim):
    import resource
    cpu = max(1, int(lim["cpu_s"] + 0.999))
    pairs = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"])),
        (resource.RLIMIT_FSIZE, (lim["file_size_bytes"], lim["file_size_bytes"])),
        (resource.RLIMIT_NOFILE, (lim["max_open_files"], lim["max_open_files"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if lim.get("nproc_rlimit"):
        pairs.append((resource.RLIMIT_NPROC, (lim["max_processes"], lim["max_processes"])))
    for which, value in pairs:
        resource.setrlimit(which, value)


def _drop_privileges(iso):
    uid = iso.get("uid")
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(iso["gid"], iso["gid"], iso["gid"])
        os.setresuid(uid, uid, uid)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    prctl(PR_SET_DUMPABLE, 0)


def _child_setup(cfg, fds):
    """In a fresh child of the keeper: own session, fds, limits, then drop to the sandbox uid."""
    os.setsid()
    try:
        _write("/proc/self/oom_score_adj", "1000")  # the memory killer picks this one first
    except OSError:
        pass
    import fcntl
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]  # no clash with targets 0..3
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(len(fds), 65536)
    os.chdir(cfg["child_work_dir"])
    _set_limits(cfg["limits"])
    _drop_privileges(cfg["isolation"])
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _run_solution(cfg, source, args_json):
    """Executes the solution in this (already confined) process; returns the exit status.

    source and args_json were read by the keeper: the confined process cannot read run_dir.
    """
    import builtins
    import io
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                 encoding="utf-8", errors="replace")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                  encoding="utf-8")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="replace", write_through=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = ["solution.py"]
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # the datasets were verified without the 3.11 cap

    def _exit(code=None):
        raise SystemExit(code)

    builtins.exit = builtins.quit = _exit  # -S skips site, which normally defines them
    status = 0
    try:
        code = compile(source, "solution.py", "exec")
        scope = {"__name__": "__main__", "__builtins__": builtins}
        if cfg["style"] == "call":
            scope["__name__"] = "solution"
        exec(code, scope)
        if cfg["style"] == "call":
            args = json.loads(args_json)
            fn = scope.get(cfg["fn_name"])
            if fn is None and isinstance(scope.get("Solution"), type):
                fn = getattr(scope["Solution"](), cfg["fn_name"], None)
            if fn is None:
                raise NameError("function %r is not defined" % cfg["fn_name"])
            result = fn(*args) if isinstance(args, list) else fn(args)
            if isinstance(result, tuple):
                result = list(result)
            payload = json.dumps(result)
            os.lseek(3, 0, os.SEEK_SET)
            os.ftruncate(3, 0)
            os.write(3, payload.encode())
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - anything the solution raises is a failure
        import traceback
        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001
        status = status or 1
    return status


def _compile_only(source):
    try:
        compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        import traceback
        traceback.print_exc(limit=1)
        return EXIT_SYNTAX_ERROR
    return 0


def _wait(pid, timeout):
    """Waits up to timeout seconds; returns (status, timed_out, cpu seconds)."""
    deadline = time.monotonic() + timeout
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None
    try:
        delay = 0.001
        while True:
            got, status, usage = os.wait4(pid, os.WNOHANG)
            if got == pid:
                return status, False, usage.ru_utime + usage.ru_stime
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.02)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    _kill_tree(pid)
    _, status, usage = os.wait4(pid, 0)
    return status, True, usage.ru_utime + usage.ru_stime


def _kill_tree(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _kill_leftovers(cfg, pid):
    """Kills everything a test left behind (daemons, fork-bomb children), then reaps them."""
    if os.getpid() == 1:
        # pid 1 of the sandbox namespace: kill(-1) reaches exactly the namespace's other processes.
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    else:
        _kill_tree(pid)
        uid = cfg["isolation"].get("uid")
        if uid is not None and os.geteuid() == 0:
            # A dedicated uid: a helper running as that uid reaches processes that left the
            # session (setsid) or were re-parented.
            helper = os.fork()
            if helper == 0:
                try:
                    os.setresuid(uid, uid, uid)
                    for _ in range(3):
                        os.kill(-1, signal.SIGKILL)
                except OSError:
                    pass
                os._exit(0)
            os.waitpid(helper, 0)
    while True:  # reap re-parented zombies (we are pid 1 or a child subreaper)
        try:
            got, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if got == 0:
            time.sleep(0.001)
            if os.getpid() != 1:
                break


def _clear_dir(path):
    import shutil
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.unlink(full)
            except OSError:
                pass


def _decode(status, timed_out, wall, cpu):
    rec = {"timed_out": timed_out, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
           "exit_code": None, "signal": None}
    if os.WIFEXITED(status):
        rec["exit_code"] = os.WEXITSTATUS(status)
    elif os.WIFSIGNALED(status):
        rec["signal"] = os.WTERMSIG(status)
    return rec


def _open_fds(cfg, i):
    fds = [run_open("in_%d" % i, os.O_RDONLY) if cfg["style"] == "stdio"
           else os.open(os.devnull, os.O_RDONLY)]
    for name in ("out_%d" % i, "err_%d" % i, "ret_%d" % i):
        fds.append(run_open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC))
    return fds


def _fork_confined(cfg, fds, body):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _child_setup(cfg, fds)
            code = body()
        except BaseException as e:  # noqa: BLE001
            code = EXIT_SETUP_FAILED
            try:
                os.write(2, ("sandbox child setup failed: %r\n" % (e,)).encode())
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return pid


def keeper(cfg, launcher_alive_fd):
    """Runs inside the namespaces; writes status.json into run_dir."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([launcher_alive_fd], [], [], 0)[0]:
        os._exit(EXIT_SETUP_FAILED)  # the launcher died before the death signal was armed
    iso = cfg["isolation"]
    import traceback  # noqa: F401 - loaded while readable; error reports need it
    if not iso["unshare_flags"] & CLONE_NEWNS:
        # Without a mount namespace the stdlib may be unreadable to the sandbox uid: preload
        # what competitive-programming solutions commonly import.
        for name in _COMMON_MODULES:
            try:
                __import__(name)
            except ImportError:
                pass
    status = {"setup": "ok", "compile": None, "tests": [], "mount_ro_failed": [],
              "root": None}
    _RUN["dir"] = cfg["run_dir"]
    cfg["child_work_dir"] = cfg["work_dir"]
    try:
        _write("/proc/self/oom_score_adj", "-1000")
    except OSError:
        pass
    if os.getpid() != 1:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    source = run_read("solution.py")
    try:
        if iso["unshare_flags"] & CLONE_NEWNS and iso.get("minimal_root"):
            mount(None, "/", None, MS_REC | MS_PRIVATE)
            root = _build_root(iso, cfg["run_dir"], cfg["work_dir"])
            _RUN["fd"] = os.open(cfg["run_dir"], os.O_RDONLY | os.O_DIRECTORY)
            executable = os.path.realpath(sys.executable)
            status["root"] = _enter_root(root)
            sys.executable = executable          # the path the minimal root holds
            cfg["child_work_dir"] = ROOT_WORK
            os.environ.update(HOME=ROOT_WORK, TMPDIR="/tmp", PWD=ROOT_WORK)
        elif iso["unshare_flags"] & CLONE_NEWNS:
            status["mount_ro_failed"] = _setup_mounts(iso, cfg["run_dir"], cfg["work_dir"])
    except OSError as e:
        status["setup"] = "isolation setup failed: %s" % e
        run_write("status.json", json.dumps(status))
        return
    lim = cfg["limits"]
    start = time.monotonic()
    # Compile first in a confined child: a pathological source must not hit the keeper.
    pid = _fork_confined(cfg, [os.open(os.devnull, os.O_RDONLY),
                               os.open(os.devnull, os.O_WRONLY),
                               run_open("compile_err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)],
                         lambda: _compile_only(source))
    st, timed_out, cpu = _wait(pid, lim["wall_s"])
    _kill_leftovers(cfg, pid)
    rec = _decode(st, timed_out, time.monotonic() - start, cpu)
    if rec["exit_code"] == 0:
        status["compile"] = "ok"
    elif rec["exit_code"] == EXIT_SYNTAX_ERROR:
        status["compile"] = "syntax_error"
    else:
        status["compile"] = "compile check failed: %s" % json.dumps(rec)
    if status["compile"] == "ok":
        for i in range(cfg["n_tests"]):
            left = lim["total_wall_s"] - (time.monotonic() - start)
            if left <= 0:
                break  # remaining tests count as failed (recorded as not run)
            t0 = time.monotonic()
            args_json = None
            if cfg["style"] == "call":
                args_json = run_read("in_%d" % i)
            pid = _fork_confined(cfg, _open_fds(cfg, i),
                                 lambda: _run_solution(cfg, source, args_json))
            st, timed_out, cpu = _wait(pid, min(lim["wall_s"], left))
            _kill_leftovers(cfg, pid)
            status["tests"].append(_decode(st, timed_out, time.monotonic() - t0, cpu))
            _clear_dir(cfg["child_work_dir"])
            if status["root"]:
                _clear_dir("/tmp")                 # each test starts with an empty /tmp
    run_write("status.json", json.dumps(status))


def launcher(cfg):
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != cfg["parent_pid"]:
        os._exit(EXIT_SETUP_FAILED)  # the worker died before the death signal was armed
    for procs_file in cfg["isolation"].get("cgroup_procs", []):
        _write(procs_file, str(os.getpid()))
    _enter_namespaces(cfg["isolation"])
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        try:
            keeper(cfg, alive_r)
        except BaseException:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            os._exit(EXIT_SETUP_FAILED)
        os._exit(0)
    os.close(alive_r)
    _, st = os.waitpid(pid, 0)
    os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else EXIT_SETUP_FAILED)


def _probe_root(flags, probe_dir):
    """In a throw-away mount namespace: builds the minimal root and enters it; the method that
    worked ("pivot_root" / "chroot"), or {"error": ...}. Checks that the host is gone."""
    try:
        os.makedirs(probe_dir, 0o711, exist_ok=True)
        run_dir = os.path.join(probe_dir, str(os.getpid()))
        os.mkdir(run_dir, 0o711)
        iso = {"unshare_flags": flags, "tmpfs_bytes": 1 << 20, "uid": None}
        how = _enter_root(_build_root(iso, run_dir, None))
        if os.path.exists(probe_dir) or not os.path.isdir(ROOT_WORK) or os.listdir("/tmp"):
            return {"error": "the minimal root still shows the host's files"}
        return how
    except OSError as e:
        return {"error": "minimal root: %s" % e}


def probe():
    """Tries each isolation layer in throw-away namespaces; prints a JSON report."""
    report = {"euid": os.geteuid(), "errors": {}}
    base = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    candidates = [base] if os.geteuid() == 0 else []
    candidates.append(base | CLONE_NEWUSER)
    # Weaker sets for kernels that refuse some namespace types.
    for extra in (CLONE_NEWNS | CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID):
        candidates.append(extra if os.geteuid() == 0 else extra | CLONE_NEWUSER)
    chosen, root = 0, None
    probe_dir = "/tmp/brorl_sbx_%d_probe" % os.getpid()     # swept by sandbox.py if left
    for flags in candidates:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            result = {"flags": flags, "ok": False}
            try:
                _enter_namespaces({"unshare_flags": flags})
                inner = os.fork()
                if inner == 0:
                    res = {"pid1": os.getpid() == 1, "readonly_root": False, "proc": False}
                    if flags & CLONE_NEWNS:
                        try:
                            mount(None, "/", None, MS_REC | MS_PRIVATE)
                            for point in _mount_points():
                                _remount_readonly(point)
                            res["readonly_root"] = bool(os.statvfs("/").f_flag & 1)
                            if flags & CLONE_NEWPID:
                                mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                                res["proc"] = True
                            mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m")
                            res["tmpfs"] = True
                        except OSError as e:
                            res["mount_error"] = str(e)
                        res["root"] = _probe_root(flags, probe_dir)
                    os.write(w, (json.dumps(res) + "\n").encode())
                    os._exit(0)
                os.waitpid(inner, 0)
                result["ok"] = True
            except OSError as e:
                result["error"] = str(e)
            os.write(w, (json.dumps(result) + "\n").encode())
            os._exit(0)
        os.close(w)
        data = b""
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
        os.close(r)
        os.waitpid(pid, 0)
        lines = data.decode().splitlines()
        try:
            outer_res = json.loads(lines[-1])
            inner_res = json.loads(lines[-2]) if len(lines) > 1 else {}
        except (ValueError, IndexError):
            continue
        if outer_res.get("ok") and (not flags & CLONE_NEWPID or inner_res.get("pid1")):
            if flags & CLONE_NEWNS and not (inner_res.get("readonly_root")
                                            and inner_res.get("tmpfs")):
                report["errors"]["%#x" % flags] = inner_res.get("mount_error", "mount failed")
                flags &= ~CLONE_NEWNS
                if not flags & ~CLONE_NEWUSER:
                    continue
            chosen = flags
            if flags & CLONE_NEWNS:
                root = inner_res.get("root")
                if isinstance(root, dict):
                    report["errors"]["minimal_root"] = root["error"]
                    root = None
            break
        report["errors"]["%#x" % flags] = outer_res.get("error", "namespace check failed")
    try:
        import shutil
        shutil.rmtree(probe_dir, ignore_errors=True)
    except OSError:
        pass
    report["unshare_flags"] = chosen
    report["root"] = root          # "pivot_root" | "chroot" | None (the read-only host tree)
    print(json.dumps(report))


def main():
    if sys.argv[1:] == ["--probe"]:
        probe()
        return
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    launcher(cfg)


if __name__ == "__main__":
    main()
