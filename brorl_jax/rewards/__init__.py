"""Verifiable rewards (math, code, Reasoning Gym) scored in worker processes. No JAX here.

Public surface:
  score(records, completions, timeout_s=None, raise_on_error=False) -> list[float]
      (a record a verifier could not judge is logged as a warning with its reason, or raises
      ScoringError with raise_on_error=True)
  score_results(records, completions, timeout_s=None) -> list[RewardResult] (every reason)
  ScoringService(num_workers, timeout_s, batch_deadline_s, recycle_after, ...)
      .score_batch(records, completions) -> list[RewardResult]; .close(); context manager
  RewardResult(score, reason, details)
  register_reward(name, fn), resolve_reward_name(data_source, reward_map)
  reasoning_gym_records(task_name, size, seed)
  isolation_report() -> dict   (what the code sandbox enforces on this machine)

Records are veRL style: {"data_source": "math" | "code" | "reasoning_gym/<task>" | ...,
"ground_truth": ..., optional "prompt", "extra_info"}.
"""

from brorl_jax.rewards.reasoning_gym_reward import reasoning_gym_records
from brorl_jax.rewards.registry import REWARDS, RewardSpec, register_reward, resolve_reward_name
from brorl_jax.rewards.sandbox import SandboxLimits, isolation_report
from brorl_jax.rewards.service import ScoringError, ScoringService, score, score_results
from brorl_jax.rewards.types import RewardResult

__all__ = [
    "REWARDS", "RewardResult", "RewardSpec", "SandboxLimits", "ScoringError", "ScoringService",
    "isolation_report", "reasoning_gym_records", "register_reward", "resolve_reward_name",
    "score", "score_results",
]
