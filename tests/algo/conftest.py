"""Shared tiny fixtures for the algo tests: a toy policy (embedding -> tanh dense -> lm head) that
plugs into the update through PolicyFns, and random update batches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brorl_jax.algo import PolicyFns, UpdateBatch

VOCAB, DIM = 48, 16


def toy_params(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {"emb": jax.random.normal(k[0], (VOCAB, DIM)) * 0.5,
            "w": jax.random.normal(k[1], (DIM, DIM)) * 0.3,
            "head": jax.random.normal(k[2], (DIM, VOCAB)) * 0.3}


def toy_hidden(params, tokens, positions, attention_mask, remat):
    del attention_mask, remat
    x = params["emb"][tokens] + 0.01 * positions[..., None].astype(jnp.float32)
    return jnp.tanh(x @ params["w"])


TOY_POLICY = PolicyFns(hidden=toy_hidden, lm_head=lambda p: p["head"])


def toy_logits(params, tokens, positions):
    """Independent full-logits path for the toy policy: [B, T, V]."""
    return toy_hidden(params, tokens, positions, None, False) @ params["head"]


def random_batch(rows=8, seq=6, seed=0, pad_rows=0):
    rng = np.random.default_rng(seed)
    mask = rng.random((rows, seq)) < 0.75
    mask[:, 0] = True
    if pad_rows:
        mask[rows - pad_rows:] = False
    adv = rng.normal(size=rows).astype(np.float32)
    if pad_rows:
        adv[rows - pad_rows:] = 0.0
    tokens = rng.integers(0, VOCAB, (rows, seq)).astype(np.int32)
    positions = np.tile(np.arange(seq, dtype=np.int32), (rows, 1))
    targets = rng.integers(0, VOCAB, (rows, seq)).astype(np.int32)
    old = (np.log(1.0 / VOCAB) + 0.3 * rng.normal(size=(rows, seq))).astype(np.float32)
    ref = (np.log(1.0 / VOCAB) + 0.3 * rng.normal(size=(rows, seq))).astype(np.float32)
    return UpdateBatch(input_tokens=tokens, positions=positions, targets=targets, loss_mask=mask,
                       old_logprobs=old, advantages=adv, ref_logprobs=ref)


@pytest.fixture
def toy_policy():
    return TOY_POLICY
