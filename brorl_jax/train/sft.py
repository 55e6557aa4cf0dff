"""A short supervised warm start (the demo's): teach a fresh model the answer format.

BroRL continues from a model that already solves part of its tasks (the ProRLv2 checkpoint); RL
cannot start from a random model, whose every group is all-wrong and is filtered out. The demo
therefore begins with a few hundred steps of next-token cross-entropy on (prompt, reference
answer) pairs from the training source, with the loss on answer tokens only, then hands the
parameters to BroRL. Reference answers come from the record's ground truth, rendered as the
verifier expects (`answer_text`).
"""
from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from brorl_jax import models
from brorl_jax.errors import ConfigError
from brorl_jax.workdir.logger import progress
from pallas_kernels import fused_logprob


def noisy_answer(truth: str, rng: np.random.Generator) -> str:
    """An imperfect reference: an integer answer moved by +-1 (other answers are kept)."""
    try:
        value = int(str(truth).strip())
    except ValueError:
        return str(truth)
    return str(value + (1 if rng.random() < 0.5 else -1))


def answer_text(record: dict, truth=None) -> str:
    """The completion a perfect model writes for `record`, in the verifier's answer format.

    Reasoning Gym's verifier reads the last <answer>...</answer> span; the math verifier the last
    \\boxed{...}. Code has no single reference completion, so it cannot be warm-started here.
    """
    source = str(record.get("data_source", ""))
    truth = record.get("ground_truth") if truth is None else truth
    if source.startswith("reasoning_gym"):
        return f"<answer>{truth}</answer>"
    if source == "math" or source.startswith("math/"):
        return f"\\boxed{{{truth}}}"
    raise ValueError(f"the supervised warm start has no reference completion for data_source "
                     f"{source!r}; set sft.steps=0 or use reasoning_gym/math prompts.")


def check_references(records: Sequence[dict]) -> None:
    """Refuses (ConfigError, before the model loads) a warm start on training records a data
    source of which has no reference completion (answer_text)."""
    for source in sorted({str(r.get("data_source", "")) for r in records}):
        record = next(r for r in records if str(r.get("data_source", "")) == source)
        try:
            answer_text(record)
        except ValueError as e:
            raise ConfigError(f"config key 'sft.steps' > 0 asks for a warm start, but {e}") from e


@flax.struct.dataclass
class SupervisedBatch:
    """Rows in the update's padded layout (algo.UpdateBatch's first fields), loss on the answer:
    input_tokens: int32[B, T]  prompt ++ answer ++ pad    targets: int32[B, T]  next token
    positions: int32[B, T]     0, 1, ...                  loss_mask: bool[B, T]  answer targets"""
    input_tokens: Any
    targets: Any
    positions: Any
    loss_mask: Any


def build_sft_batch(prompt_ids: Sequence[Sequence[int]], answer_ids: Sequence[Sequence[int]],
                    *, seq_len: int, pad_id: int = 0) -> SupervisedBatch:
    """A supervised batch in the update's layout (algo.assemble_update_batch): loss on the
    answer tokens only."""
    rows = len(prompt_ids)
    tokens = np.full((rows, seq_len), pad_id, np.int32)
    targets = np.full((rows, seq_len), pad_id, np.int32)
    loss_mask = np.zeros((rows, seq_len), bool)
    for r, (prompt, answer) in enumerate(zip(prompt_ids, answer_ids)):
        seq = np.asarray(list(prompt) + list(answer), np.int32)[:seq_len]
        p = len(prompt)
        tokens[r, :len(seq)] = seq
        targets[r, :len(seq) - 1] = seq[1:]
        loss_mask[r, p - 1:len(seq) - 1] = True
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()
    return SupervisedBatch(input_tokens=tokens, targets=targets, positions=positions,
                           loss_mask=loss_mask)


def _sft_loss(params, mcfg, batch: SupervisedBatch):
    h = models.forward(params, mcfg, batch.input_tokens, positions=batch.positions,
                       return_hidden=True)
    b, t, d = h.shape
    logp, _ = fused_logprob(h.reshape(b * t, d), models.lm_head_matrix(params, mcfg),
                            batch.targets.reshape(-1))
    mask = batch.loss_mask.reshape(-1).astype(jnp.float32)
    return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=(0, 3))
def _sft_step(params, mcfg, optimizer, opt_state, batch):
    loss, grads = jax.value_and_grad(_sft_loss)(params, mcfg, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def warm_start(ctx, params, prompts: Sequence) -> tuple[dict, dict]:
    """Runs `cfg.sft.steps` supervised steps on `prompts` (the training loader's data.Prompt
    list) from `params`, with the run context's tokenizer and model -> (params, metrics)."""
    cfg = ctx.cfg
    tok = ctx.tokenizer
    eos = ctx.eos_ids[0] if ctx.eos_ids else tok.eos_token_id
    rng = np.random.default_rng(cfg.train.seed + 17)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(optax.warmup_cosine_decay_schedule(
                                0.0, cfg.sft.lr, max(1, cfg.sft.steps // 20), cfg.sft.steps,
                                cfg.sft.lr * 0.1), weight_decay=0.0))
    params = jax.tree.map(jnp.array, params)     # a copy: the model's own params stay intact
    opt_state = optimizer.init(params)
    answers: dict[int, list[int]] = {}
    # Imperfect supervised data, for the demo: sft.label_noise is the fraction of prompts whose
    # reference answer is off by one, sft.untagged_frac the fraction written without the answer
    # tags the verifier requires (a format the verifier rejects), both fixed per prompt. RL with
    # the exact verifier then has something to correct; 0 (the default) is plain SFT.
    noise_rng = np.random.default_rng(cfg.train.seed + 23)
    losses = []
    for _ in progress(range(cfg.sft.steps), desc=f"warm start: SFT, batch {cfg.sft.batch_size}",
                      unit="step", enabled=ctx.runtime.process_index == 0):
        idx = rng.integers(0, len(prompts), cfg.sft.batch_size)
        p_ids, a_ids = [], []
        for i in idx:
            pr = prompts[int(i)]
            if pr.index not in answers:
                truth = pr.record.get("ground_truth")
                if cfg.sft.label_noise > 0 and noise_rng.random() < cfg.sft.label_noise:
                    truth = noisy_answer(truth, noise_rng)
                text = answer_text(pr.record, truth)
                if cfg.sft.untagged_frac > 0 and noise_rng.random() < cfg.sft.untagged_frac:
                    text = str(truth)      # the bare answer: no <answer> tags, so it scores 0
                answers[pr.index] = tok.encode(text, add_special_tokens=False) + [eos]
            p_ids.append(list(pr.ids))
            a_ids.append(answers[pr.index])
        batch = build_sft_batch(p_ids, a_ids, seq_len=ctx.seq_len, pad_id=ctx.pad_id)
        batch = jax.tree.map(jnp.asarray, batch)
        params, opt_state, loss = _sft_step(params, ctx.mcfg, optimizer, opt_state, batch)
        losses.append(loss)
    return params, {"sft/loss": float(np.mean(jax.device_get(losses[-10:])))}


def run_warm_start(ctx, params, prompts: Sequence, save_dir: str | None = None) -> dict:
    """The warm start of a run: `warm_start`, then process 0's result on every process (each saw
    its own prompts), logged and, with `save_dir`, saved as a Hugging Face directory (the common
    starting point of comparisons, experiments.compare_n)."""
    t0 = time.perf_counter()
    params, metrics = warm_start(ctx, params, prompts)
    params = ctx.runtime.broadcast(params)
    if jax.process_index() == 0:
        print(f"[sft] {ctx.cfg.sft.steps} supervised steps in {time.perf_counter() - t0:.0f}s, "
              f"final loss {metrics['sft/loss']:.3f}", flush=True)
    if save_dir is not None and ctx.runtime.process_index == 0:
        models.save_pretrained(ctx.model.with_params(params), save_dir)
    return params
