"""Long runs stay flat: resource use of a training run sampled over many steps (issue 26 item 6).

    python bench/soak.py [--steps=150] [--eval_every=25] [--checkpoint_every=10]
        [--sample_every=5] [--warmup=30] [--config=configs/tiny.py] [--workdir=DIR]
        [--override=KEY=VALUE ...]

Runs `python -m brorl_jax.main` on the config (an evaluation every --eval_every steps, a
checkpoint every --checkpoint_every) in a subprocess and, every --sample_every logged steps,
samples from outside:
  rss_mb     resident memory of the trainer (VmRSS)
  fds        its open file descriptors
  threads    its threads
  workers    its descendant processes (scoring workers, their sandboxes)
  programs   compiled XLA programs so far (entries of a fresh persistent compilation cache
             that the run writes with a zero minimum compile time)
  disk_mb    size of the work directory
then prints, for each, the least-squares slope per 100 steps after the warm-up (--warmup steps;
the last step, where the run winds down, is left out) and the range seen after it. The warm-up
must cover what a run legitimately adds early: the programs of decode-slot buckets first
visited, checkpoints up to train.keep_checkpoints. A slope within the tolerance
(docs/reliability.md "Long runs stay flat") is flat; `--check` exits 1 otherwise. Not a unit
test: minutes of CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Per 100 steps after the warm-up. Disk: metrics lines and events grow with the steps; the
# checkpoints are bounded by train.keep_checkpoints.
TOLERANCE = {"rss_mb": 20.0, "fds": 0.5, "threads": 0.5, "workers": 0.1, "programs": 0.5,
             "disk_mb": 1.0}


def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    return kids


def _descendants(pid: int) -> int:
    kids, todo, n = _children(), [pid], 0
    while todo:
        for child in kids.get(todo.pop(), []):
            n += 1
            todo.append(child)
    return n


def _dir_mb(path: str) -> float:
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    return total / 2**20


def sample(pid: int, workdir: str, cache: str) -> dict:
    st = _status(pid)
    return {"rss_mb": int(st["VmRSS"].split()[0]) / 1024, "threads": int(st["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "workers": _descendants(pid),
            "programs": sum(1 for n in os.listdir(cache) if not n.startswith(".")),
            "disk_mb": _dir_mb(workdir)}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def last_step(metrics: str) -> int:
    try:
        with open(metrics, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return -1


def analyze(samples: list[dict], warmup: int, steps: int) -> tuple[dict, bool]:
    """Prints and returns each quantity's slope per 100 steps after the warm-up, and whether it
    is flat: a slope within TOLERANCE, or (a sawtooth, as the allocator's) no higher peak in the
    second half of the window than in the first."""
    after = [s for s in samples if warmup <= s["step"] < steps]
    print(f"slopes per 100 steps after step {warmup} ({len(after)} samples, steps "
          f"{after[0]['step'] if after else '-'}-{after[-1]['step'] if after else '-'}):")
    print(f"{'':10} {'slope/100 steps':>16} {'tolerance':>10} {'min':>9} {'max':>9} "
          f"{'peak 1st/2nd half':>18}  verdict")
    report, flat = {}, True
    half = len(after) // 2
    for key, tol in TOLERANCE.items():
        values = [s[key] for s in after]
        if len(values) < 2:
            continue
        k = 100 * slope([s["step"] for s in after], values)
        peaks = (max(values[:half]), max(values[half:]))
        ok = k <= tol or peaks[1] <= peaks[0]           # shrinking is fine
        flat &= ok
        report[key] = {"slope_per_100_steps": k, "min": min(values), "max": max(values),
                       "peaks": peaks, "tolerance": tol, "flat": ok}
        print(f"{key:10} {k:16.3f} {tol:10.2f} {min(values):9.1f} {max(values):9.1f} "
              f"{peaks[0]:8.1f} /{peaks[1]:8.1f}  {'flat' if ok else 'GROWING'}")
    return report, flat


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval_every", type=int, default=25)
    ap.add_argument("--checkpoint_every", type=int, default=10)
    ap.add_argument("--sample_every", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--workdir", default=None, help="default: a temporary directory, removed")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="extra --config.KEY=VALUE for the run")
    ap.add_argument("--check", action="store_true", help="exit 1 when a slope is out of "
                    "tolerance")
    ap.add_argument("--json", default=None, help="write the samples and slopes here")
    ap.add_argument("--analyze", default=None, metavar="JSON", help="only print the slopes of "
                    "the samples a run wrote with --json (with its --warmup/--steps)")
    args = ap.parse_args(argv)
    if args.analyze:
        with open(args.analyze) as f:
            _, flat = analyze(json.load(f)["samples"], args.warmup, args.steps)
        return 1 if args.check and not flat else 0
    if min(args.steps, args.eval_every, args.checkpoint_every, args.sample_every) < 1 or \
            not 0 <= args.warmup < args.steps:
        ap.error("--steps, --eval_every, --checkpoint_every, --sample_every must be >= 1 and "
                 "0 <= --warmup < --steps")
    scratch = tempfile.mkdtemp(prefix="brorl_soak_")
    workdir = args.workdir or os.path.join(scratch, "run")
    cache = os.path.join(scratch, "jax_cache")
    os.makedirs(cache)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    cmd = [sys.executable, "-m", "brorl_jax.main", f"--config={args.config}",
           f"--workdir={workdir}", f"--config.train.steps={args.steps}",
           f"--config.eval.every={args.eval_every}",
           f"--config.train.checkpoint_every={args.checkpoint_every}",
           *(f"--config.{o}" for o in args.override)]
    print("command:", " ".join(cmd[1:]), flush=True)
    log = open(os.path.join(scratch, "run.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    samples: list[dict] = []
    t0 = time.time()
    try:
        next_step = 0
        while proc.poll() is None:
            step = last_step(os.path.join(workdir, "metrics.jsonl"))
            if step >= next_step:
                try:
                    s = sample(proc.pid, workdir, cache)
                except OSError:
                    break                              # the run ended between two checks
                s.update(step=step, wall_s=round(time.time() - t0, 1))
                samples.append(s)
                print(json.dumps(s), flush=True)
                next_step = step - step % args.sample_every + args.sample_every
            time.sleep(0.2)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        log.close()
    if rc != 0:
        with open(os.path.join(scratch, "run.log")) as f:
            print(f.read()[-3000:], file=sys.stderr)
        print(f"the run failed (exit {rc}); log in {scratch}/run.log", file=sys.stderr)
        return 2
    # after the warm-up, and before the last step (the run is ending then: final evaluation,
    # plots, workers and checkpointer closing)
    print(f"\n{len(samples)} samples over {args.steps} steps in {time.time() - t0:.0f} s")
    report, flat = analyze(samples, args.warmup, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd[1:], "samples": samples, "slopes": report}, f, indent=1)
    shutil.rmtree(scratch, ignore_errors=True)        # the cache and the log (a given
    #                                                   --workdir lies outside and is kept)
    return 1 if args.check and not flat else 0


if __name__ == "__main__":
    sys.exit(main())
