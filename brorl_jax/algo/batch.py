"""Assemble the fixed-shape update batch (docs/INTERFACES.md "algo") from rollouts. Host-side numpy.

Row layout for response n of prompt g (right-padded to seq_len):
    input_tokens = prompt_g ++ response_{g,n} ++ pad
    targets[t]   = input_tokens[t + 1]           (next token)
    loss_mask[t] = targets[t] is a sampled response token (and the group is valid)
    old_logprobs[t] = rollout log-prob of that target token
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def assemble_update_batch(
    prompts: Sequence[Sequence[int]],
    response_tokens,
    response_logprobs,
    response_mask,
    advantages,
    group_valid=None,
    *,
    seq_len: int,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """prompts: G token lists; response_tokens int [G, N, S]; response_logprobs f32 [G, N, S];
    response_mask bool [G, N, S]; advantages [G, N]; group_valid bool [G] (None = all valid).
    Returns the batch dict with B = G * N rows of length seq_len (ref_logprobs zero-filled: fill
    them with make_logprob_fn on the reference params)."""
    tok = np.asarray(response_tokens)
    lp = np.asarray(response_logprobs, np.float32)
    rm = np.asarray(response_mask, bool)
    adv = np.asarray(advantages, np.float32)
    if tok.ndim != 3:
        raise ValueError(f"response_tokens must be [G, N, S]; got shape {tok.shape}")
    g, n, s = tok.shape
    if len(prompts) != g or lp.shape != tok.shape or rm.shape != tok.shape or adv.shape != (g, n):
        raise ValueError(f"shapes disagree: {len(prompts)} prompts, tokens {tok.shape}, logprobs {lp.shape}, "
                         f"mask {rm.shape}, advantages {adv.shape} (want G={g}, [G, N, S], [G, N])")
    gv = np.ones(g, bool) if group_valid is None else np.asarray(group_valid, bool)
    longest = max(len(p) for p in prompts) + s
    if longest > seq_len:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest prompt + max_new_tokens = {longest}")
    inp = np.full((g, n, seq_len), pad_id, np.int32)
    old = np.zeros((g, n, seq_len), np.float32)
    mask = np.zeros((g, n, seq_len), bool)
    for i, p in enumerate(prompts):
        lp_len = len(p)
        inp[i, :, :lp_len] = np.asarray(p, np.int32)
        inp[i, :, lp_len:lp_len + s] = tok[i]
        # the response token j is predicted at position lp_len + j - 1
        mask[i, :, lp_len - 1:lp_len - 1 + s] = rm[i] & gv[i]
        old[i, :, lp_len - 1:lp_len - 1 + s] = np.where(rm[i], lp[i], 0.0)
    inp = inp.reshape(g * n, seq_len)
    targets = np.concatenate([inp[:, 1:], np.full((g * n, 1), pad_id, np.int32)], axis=1)
    return {
        "input_tokens": inp,
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (g * n, seq_len)).copy(),
        "loss_mask": mask.reshape(g * n, seq_len),
        "targets": targets,
        "old_logprobs": old.reshape(g * n, seq_len),
        "ref_logprobs": np.zeros((g * n, seq_len), np.float32),
        "advantages": np.where(gv[:, None], adv, 0.0).reshape(g * n).astype(np.float32),
    }


def assemble_groups(groups, advantages, *, rows: int, seq_len: int, pad_id: int = 0
                    ) -> dict[str, np.ndarray]:
    """The update batch from kept groups (algo.Group, any sizes): each group's rows as
    assemble_update_batch builds them, concatenated in order, then padding rows (pad tokens,
    loss_mask False, advantage 0) up to exactly `rows`, so the compiled update keeps one shape.
    advantages[g]: float32 [n_g]."""
    parts = [assemble_update_batch([grp.prompt_ids], grp.tokens[None], grp.logprobs[None],
                                   grp.mask[None], np.asarray(adv, np.float32)[None],
                                   seq_len=seq_len, pad_id=pad_id)
             for grp, adv in zip(groups, advantages)]
    used = sum(p["advantages"].shape[0] for p in parts)
    if used > rows:
        raise ValueError(f"groups hold {used} rows, more than the batch's {rows}")
    pad = rows - used
    filler = {
        "input_tokens": np.full((pad, seq_len), pad_id, np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (pad, seq_len)).copy(),
        "loss_mask": np.zeros((pad, seq_len), bool),
        "targets": np.full((pad, seq_len), pad_id, np.int32),
        "old_logprobs": np.zeros((pad, seq_len), np.float32),
        "ref_logprobs": np.zeros((pad, seq_len), np.float32),
        "advantages": np.zeros((pad,), np.float32),
    }
    return {k: np.concatenate([p[k] for p in parts] + [filler[k]], axis=0) for k in filler}
