"""Scoring throughput: completions scored per second through the ScoringService.

    .venv/bin/python bench/rewards.py                 # 10,000 math + 1,000 code completions
    .venv/bin/python bench/rewards.py --math 2000 --code 200 --workers 4

Math completions mix equivalent forms, wrong answers and missing answers over distinct
ground truths (so math-verify's parse cache does not make it look faster than it is); code
completions are correct, partly wrong and crashing stdin/stdout solutions with 3 tests each,
every one run in the sandbox. Prints the isolation in force and completions/s per family.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from brorl_jax.rewards import ScoringService  # noqa: E402


def math_batch(n: int, seed: int = 0) -> tuple[list[dict], list[str]]:
    rng = random.Random(seed)
    records, completions = [], []
    for i in range(n):
        p, q = rng.randint(1, 999), rng.randint(2, 999)
        truth = f"\\frac{{{p}}}{{{q}}}"
        kind = i % 5
        if kind == 0:
            body = f"\\boxed{{\\frac{{{p}}}{{{q}}}}}"
        elif kind == 1:
            body = f"\\boxed{{{p / q:.10f}}}"
        elif kind == 2:
            body = f"Final Answer: {p}/{q}"
        elif kind == 3:
            body = f"\\boxed{{{p + 1}/{q}}}"
        else:
            body = "I am not sure."
        records.append({"data_source": "math", "ground_truth": truth})
        completions.append("Let me think step by step. " * 20 + "\n" + body)
    return records, completions


_GOOD = "a, b = map(int, input().split())\nprint(a + b)\n"
_PARTIAL = "a, b = map(int, input().split())\nprint(a + b if a % 2 else a - b)\n"
_CRASH = "a, b = map(int, input().split())\nprint(a / 0)\n"


def code_batch(n: int, seed: int = 0) -> tuple[list[dict], list[str]]:
    rng = random.Random(seed)
    records, completions = [], []
    for i in range(n):
        pairs = [(rng.randint(-99, 99), rng.randint(-99, 99)) for _ in range(3)]
        truth = {"inputs": [f"{a} {b}\n" for a, b in pairs],
                 "outputs": [str(a + b) for a, b in pairs]}
        src = (_GOOD, _PARTIAL, _CRASH)[i % 3]
        records.append({"data_source": "code", "ground_truth": truth})
        completions.append(f"Solution:\n```python\n{src}```\n")
    return records, completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--math", type=int, default=10_000)
    parser.add_argument("--code", type=int, default=1_000)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()

    with ScoringService(num_workers=args.workers, timeout_s=30.0, recycle_after=5_000,
                        rewards=["math", "code"]) as svc:
        warm = svc.score_batch(*math_batch(2 * svc.num_workers, seed=99))  # workers ready
        assert len(warm) == 2 * svc.num_workers
        print(f"machine: {os.cpu_count()} CPUs, {svc.num_workers} scoring workers")
        print(f"isolation: {svc.isolation}")
        for name, (records, completions) in (("math", math_batch(args.math)),
                                              ("code", code_batch(args.code))):
            if not records:
                continue
            start = time.perf_counter()
            results = svc.score_batch(records, completions)
            elapsed = time.perf_counter() - start
            mean = sum(r.score for r in results) / len(results)
            failures = sum(r.reason.startswith(("timeout", "worker died", "sandbox error"))
                           for r in results)
            print(f"{name}: {len(records)} completions in {elapsed:.1f} s = "
                  f"{len(records) / elapsed:.1f} completions/s "
                  f"(mean score {mean:.3f}, infrastructure failures {failures})")
        print(f"service stats: {dict(svc.stats)}")


if __name__ == "__main__":
    main()
