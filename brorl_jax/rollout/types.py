"""What goes into a rollout call and what comes out: the checked inputs (:func:`validate_inputs`,
every entry point's first step) and the result types, one prompt's group (:class:`GroupResult`,
handed out as soon as its N samples are done) and a whole call (:class:`RolloutResult`, every
group stacked)."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from brorl_jax.models import ModelConfig


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """Rollouts of G prompts x N samples, S = max_new_tokens (numpy arrays).

    tokens int32[G, N, S]: generated ids, ``pad_id`` (0) past ``lengths``.
    logprobs float32[G, N, S]: sampling-time ``log_softmax(logits / T)[token]`` (0 past lengths).
    lengths int32[G, N]: generated tokens per sample, the stop token included.
    finished bool[G, N]: a stop token was generated. truncated bool[G, N]: hit max_new_tokens
    without a stop token (exactly one of finished/truncated is True).
    mask bool[G, N, S]: ``t < lengths``.  prompt_lengths int32[G].
    stats: per call, for logging and benchmarks (see ``Engine`` and docs/rollout.md): useful_tokens,
      decode_steps, num_slots, pool_size, mean_live_slots, occupancy, refills, compactions,
      round_trips, prefill/decode/host/total seconds, decode_forward_rows, decode_calls, ...
    routing: a mixture-of-experts rollout recorded for routing replay (Engine(record_routing=
      True), rollout/routing.py), else None: int8/int16[G, N, S, L, K], the experts response
      token t went to as an input (0 at and past its last token);
    prompt_routing: with it, per prompt int[P_g, L, K] (a tuple of G arrays), else None.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    truncated: np.ndarray
    mask: np.ndarray
    prompt_lengths: np.ndarray
    stats: dict = dataclasses.field(default_factory=dict)
    routing: np.ndarray | None = None
    prompt_routing: tuple | None = None

    @property
    def num_prompts(self) -> int:
        return self.tokens.shape[0]

    @property
    def rollouts_per_prompt(self) -> int:
        return self.tokens.shape[1]


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """The N samples of one prompt, handed out as soon as all of them are done.

    prompt_index: position of the prompt in the call's ``prompts``. tokens/logprobs [N, S],
    lengths/finished/truncated [N], mask [N, S] as in :class:`RolloutResult`.
    decode_step: decode steps run (since the call started) when the group completed.
    seconds: wall time from the start of the call to the group being ready on the host.
    versions: the weights its tokens were sampled with, ((version, first [N]), ...) oldest
    first: token t of sample n came from the last version whose first[n] <= t (the first entry
    is the version it was admitted under, first = 0; an open stream adds one per weight swap
    while the group was in flight: OpenStream.swap_params). ``((0, zeros),)`` in a plain call.
    """

    prompt_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    truncated: np.ndarray
    mask: np.ndarray
    prompt_length: int
    decode_step: int
    seconds: float
    versions: tuple = ()
    routing: np.ndarray | None = None          # [N, S, L, K], as RolloutResult.routing
    prompt_routing: np.ndarray | None = None   # [P, L, K]


def with_routing(group: GroupResult, response_route, prompt_route) -> GroupResult:
    """``group`` with its recorded routing: response [N, S, L, K] (rows past each sample's last
    input zeroed), prompt [P_bucket, L, K] cut to the prompt's length."""
    s = response_route.shape[1]
    keep = np.arange(s)[None, :] < (group.lengths[:, None] - 1)   # the last token is no input
    routing = np.where(keep[:, :, None, None], response_route, 0).astype(response_route.dtype)
    return dataclasses.replace(group, routing=routing,
                               prompt_routing=np.asarray(prompt_route)[: group.prompt_length])


def group_result(prompt_index, tok, logp, lengths, fin, prompt_length, step,
                 seconds) -> GroupResult:
    """One group's arrays trimmed to its lengths (pad 0 past them)."""
    s = tok.shape[-1]
    mask = np.arange(s) < lengths[:, None]
    fin = fin.astype(bool)
    return GroupResult(prompt_index=int(prompt_index),
                       tokens=np.where(mask, tok, 0).astype(np.int32),
                       logprobs=np.where(mask, logp, 0.0).astype(np.float32),
                       lengths=lengths.astype(np.int32), finished=fin, truncated=~fin, mask=mask,
                       prompt_length=int(prompt_length), decode_step=int(step),
                       seconds=float(seconds))


def concat_groups(parts: Sequence[GroupResult]) -> GroupResult:
    """One prompt's group from the samples of several calls (the same prompt, the same
    max_new_tokens), in the order given: a knapsack round's probe and its chunks (train/feeds.py).
    prompt_index, prompt_length and prompt_routing are the first part's; decode_step and seconds
    the latest; each part's samples keep their versions (a plain call's: one version, 0)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    cat = lambda name: np.concatenate([getattr(gr, name) for gr in parts])
    versions = [gr.versions or ((0, np.zeros(gr.lengths.size, np.int32)),) for gr in parts]
    if any(len(v) != 1 or v[0][0] != versions[0][0][0] for v in versions):
        raise ValueError("concat_groups joins samples of plain calls under one version only")
    return dataclasses.replace(
        first, tokens=cat("tokens"), logprobs=cat("logprobs"), lengths=cat("lengths"),
        finished=cat("finished"), truncated=cat("truncated"), mask=cat("mask"),
        decode_step=max(gr.decode_step for gr in parts), seconds=max(gr.seconds for gr in parts),
        versions=((versions[0][0][0], np.concatenate([v[0][1] for v in versions])),),
        routing=cat("routing") if first.routing is not None else None)


def assemble(groups: Sequence[GroupResult], stats: dict | None = None) -> RolloutResult:
    """A :class:`RolloutResult` from every prompt's group (any order)."""
    groups = sorted(groups, key=lambda gr: gr.prompt_index)
    stack = lambda name: np.stack([getattr(gr, name) for gr in groups])
    return RolloutResult(tokens=stack("tokens"), logprobs=stack("logprobs"),
                         lengths=stack("lengths"), finished=stack("finished"),
                         truncated=stack("truncated"), mask=stack("mask"),
                         prompt_lengths=np.asarray([gr.prompt_length for gr in groups], np.int32),
                         stats=dict(stats or {}),
                         routing=stack("routing") if groups[0].routing is not None else None,
                         prompt_routing=(tuple(gr.prompt_routing for gr in groups)
                                         if groups[0].routing is not None else None))


def validate_inputs(
    cfg: ModelConfig, prompts: Any, rollouts_per_prompt: int, max_new_tokens: int,
    temperature: float, top_p: float, top_k: int,
) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError("prompts must be a list of token-id lists (tokenize the text first)")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    if not isinstance(rollouts_per_prompt, (int, np.integer)) or rollouts_per_prompt <= 0:
        raise ValueError(f"rollouts_per_prompt must be a positive int, got {rollouts_per_prompt!r}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not (temperature >= 0.0) or math.isinf(temperature):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    out = []
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompts[{i}] is empty or not a flat list of token ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(
                f"prompts[{i}] has token ids outside [0, vocab_size={cfg.vocab_size})"
            )
        if ids.size + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompts[{i}] has {ids.size} tokens; with max_new_tokens={max_new_tokens} that "
                f"exceeds the model context max_position_embeddings={cfg.max_position_embeddings}; "
                "truncate the prompt or lower max_new_tokens"
            )
        out.append([int(t) for t in ids])
    return out
