"""Verifiers that misbehave on purpose, for the scoring-service tests (run in workers)."""

import os
import signal
import time

from brorl_jax.rewards.types import RewardResult


def echo(record, completion, *, time_budget_s=None):
    """Scores float(completion); details carry the worker pid (recycling test)."""
    return RewardResult(float(completion), "echo", {"pid": os.getpid()})


def hang(record, completion, *, time_budget_s=None):
    """Never returns (blocks in C, so no in-process timeout could interrupt it)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
    while True:
        time.sleep(3600)


def die(record, completion, *, time_budget_s=None):
    """Kills its own worker: a segfault-like death (SIGSEGV) or a hard exit."""
    if completion == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    os._exit(3)


def buggy(record, completion, *, time_budget_s=None):
    raise KeyError("ground_truth_typo")


def out_of_range(record, completion, *, time_budget_s=None):
    return RewardResult(1.5, "too high")
