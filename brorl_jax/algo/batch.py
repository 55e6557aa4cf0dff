"""Assemble the update batch (docs/INTERFACES.md "algo") from rollouts. Host-side numpy.

Two layouts, the same per-token quantities:

padded (pack=False): one sequence per row, right-padded to seq_len. Row of response n of prompt g:
    input_tokens = prompt_g ++ response_{g,n} ++ pad
    targets[t]   = input_tokens[t + 1]           (next token)
    loss_mask[t] = targets[t] is a sampled response token (and the group is valid)
    old_logprobs[t] = rollout log-prob of that target token;  advantages [B] per row

packed (default): rows of the same width seq_len hold several whole sequences back to back
(a sequence never straddles rows); per token additionally
    segment_ids    1, 2, ... for the sequences of the row in order, 0 = padding
    positions      restart at 0 with every sequence
    advantages     the sequence's advantage on its tokens (per token, [R, T])
    sequence_index the sequence's index g * N + n in the padded order, -1 = padding
and `pack_units` int32[U] (the number of sequences in each packing unit; its length U is the
number of units). Sequences without any loss token (invalid groups, empty responses) carry no
gradient and are left out. The sequences are split into U contiguous units (PPO mini-batches),
each packed on its own by first-fit decreasing into the same number of rows, so that PPO
mini-batch m (rows [m R / M, (m + 1) R / M) for M dividing U) holds exactly the sequences of the
padded layout's mini-batch m and the loss is the same.

Row counts are bucketed (`bucket_rows`): at most 4 shapes per doubling of the row count, so a
run compiles a bounded set of update shapes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.struct
import jax
import numpy as np

Array = Any     # numpy on the host, jax.Array on device, jax.ShapeDtypeStruct when abstract


@flax.struct.dataclass
class TokenRows:
    """What a forward pass over update rows reads (the log-prob passes: reference, pi_old).

    input_tokens: int32[R, T]   positions: int32[R, T]   targets: int32[R, T] (next token)
    segment_ids: int32[R, T] | None    packed rows: 1, 2, ... per sequence, 0 = padding
    attention_mask: bool[R, T] | None  padded rows: an optional padding mask (never with
                                       segment_ids)
    routing: int[R, T, L, K] | None    the experts to replay (UpdateBatch.routing)
    """
    input_tokens: Array
    positions: Array
    targets: Array
    segment_ids: Array | None = None
    attention_mask: Array | None = None
    routing: Array | None = None

    def token_rows(self) -> "TokenRows":
        return self

    def attention_arg(self):
        """What PolicyFns.hidden gets as attention_mask: segment ids for packed rows."""
        return self.segment_ids if self.segment_ids is not None else self.attention_mask


@flax.struct.dataclass
class UpdateBatch:
    """The update's input (docs/INTERFACES.md "algo"): R rows of width T in one of the two layouts
    of this module. A pytree: jax.tree.map slices it (micro- and mini-batches), jit takes it, and
    parallel.rules.batch_shardings lays it out. An optional field is None when its feature is off.

    input_tokens: int32[R, T]     prompt ++ response (++ more sequences when packed) ++ pad
    positions: int32[R, T]        0, 1, ... (packed: restarting with every sequence)
    targets: int32[R, T]          next token (pad where there is none)
    loss_mask: bool[R, T]         targets[t] is a sampled response token of a valid group
    old_logprobs: float32[R, T]   the rollout's (behaviour policy's) log-prob of targets[t]: TIS's
                                  behaviour policy, and pi_old when recompute_old_logprobs=False
    advantages: float32[R]        padded: per row; packed: float32[R, T], per token
    ref_logprobs: float32[R, T] | None   the reference policy's log-probs: only with the KL term
                                  (algo.kl_coef > 0), filled by the runtime (make_logprob_fn)
    segment_ids: int32[R, T] | None      packed rows: 1, 2, ... per sequence, 0 = padding
    sequence_index: int32[R, T] | None   packed rows: the sequence's padded-layout row, -1 = pad
                                  (host side: unpack_to_padded)
    pack_units: int32[U] | None   packed rows: sequences per packing unit (U units, a multiple
                                  of algo.ppo_mini_batches)
    attention_mask: bool[R, T] | None    padded rows: an optional padding mask
    routing: int8/int16[R, T, L, K] | None   a mixture-of-experts model under
                                  algo.routing_replay="rollout": the experts each token went to
                                  in the rollout (algo/routing_replay.py), replayed by every
                                  forward of the update (pi_old, reference, policy)
    """
    input_tokens: Array
    positions: Array
    targets: Array
    loss_mask: Array
    old_logprobs: Array
    advantages: Array
    ref_logprobs: Array | None = None
    segment_ids: Array | None = None
    sequence_index: Array | None = None
    pack_units: Array | None = None
    attention_mask: Array | None = None
    routing: Array | None = None

    @property
    def packed(self) -> bool:
        """True for the packed layout (it has segment ids)."""
        return self.segment_ids is not None

    def token_rows(self) -> TokenRows:
        """The fields a forward pass reads."""
        return TokenRows(input_tokens=self.input_tokens, positions=self.positions,
                         targets=self.targets, segment_ids=self.segment_ids,
                         attention_mask=self.attention_mask, routing=self.routing)

    def attention_arg(self):
        """What PolicyFns.hidden gets as attention_mask: segment ids for packed rows."""
        return self.token_rows().attention_arg()

    def check_shapes(self) -> tuple[int, int]:
        """-> (rows, width); ValueError naming the field whose shape disagrees."""
        if self.packed and self.attention_mask is not None:
            raise ValueError("a packed batch (segment_ids) must not also have attention_mask: "
                             "segment id 0 marks padding")
        rows, seq = self.input_tokens.shape
        for field in dataclasses.fields(self):       # every per-token field: [R, T]
            x = getattr(self, field.name)
            if field.name in ("advantages", "pack_units") or x is None:
                continue
            if field.name == "routing" and x.ndim == 4 and x.shape[:2] == (rows, seq):
                continue       # [R, T, L, K]
            if x.shape != (rows, seq):
                raise ValueError(f"batch.{field.name} has shape {x.shape}, expected {(rows, seq)}")
        want = (rows, seq) if self.packed else (rows,)
        if self.advantages.shape != want:
            raise ValueError(f"batch.advantages has shape {self.advantages.shape}, expected {want}"
                             + (" (packed rows: per-token advantages)" if self.packed else ""))
        return rows, seq


def is_packed(batch: UpdateBatch) -> bool:
    """True for the packed layout (it has segment ids)."""
    return batch.packed


def bucket_rows(rows: int, multiple: int = 1) -> int:
    """Smallest row count >= rows of the form k * multiple with k in 1..4 or m * 2^e, m in 4..7:
    1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (x multiple). At most 25%
    (typically ~10%) padding rows and 4 shapes per doubling; a bucket value maps to itself."""
    if rows < 0 or multiple < 1:
        raise ValueError(f"bucket_rows: need rows >= 0 and multiple >= 1; got {rows}, {multiple}")
    k = max(1, -(-rows // multiple))
    if k > 4:
        e = k.bit_length() - 3            # 2^(e+2) <= k < 2^(e+3)
        k = -(-k // (1 << e)) << e
    return k * multiple


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> np.ndarray:
    """Bin index of every item: items in decreasing length (ties: lower index first), each into
    the first bin with room (a max-tree over bins' free space: O(n log n)). Bins are numbered
    in the order they are opened."""
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    if n == 0:
        return np.zeros(0, np.int64)
    if lengths.max() > capacity:
        raise ValueError(f"an item of length {int(lengths.max())} does not fit a bin of {capacity}")
    size = 1 << max(0, (n - 1).bit_length())
    free = [capacity] * (2 * size)        # free[node] = max free space of the bins below
    out = np.empty(n, np.int64)
    for item in np.argsort(-lengths, kind="stable"):
        need = int(lengths[item])
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        out[item] = node - size
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return out


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
    pack: bool = True,
    mini_batches: int | None = None,
    row_multiple: int = 1,
    min_rows: int = 0,
) -> UpdateBatch:
    """prompts: G token lists; response_tokens int [G, N, S]; response_logprobs f32 [G, N, S];
    response_mask bool [G, N, S]; advantages [G, N]; group_valid bool [G] (None = all valid).
    seq_len: the row width (>= longest prompt + S: every sequence fits one row).

    pack=False: the padded layout, B = G * N rows. pack=True (default): the packed layout (module
    docstring) with
      mini_batches  the packing units U (default: G, one per prompt group): give
                    algo.ppo_mini_batches (or a multiple) so the PPO mini-batches equal the padded
                    layout's and few rows are wasted; it must divide G * N;
      row_multiple  each unit's rows are a multiple of this (micro-batch rows x data shards);
      min_rows      each unit gets at least this many rows (processes or steps sharing a shape).
    Rows per unit: bucket_rows(max(rows needed, min_rows), row_multiple).
    ref_logprobs is None: with the KL term, fill it with make_logprob_fn on the reference params."""
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
    if gv.shape != (g,):
        raise ValueError(f"group_valid must be bool [G={g}]; got shape {gv.shape}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (the first response token is "
                         "predicted from the prompt's last one)")
    longest = max(len(p) for p in prompts) + s
    if longest > seq_len:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest prompt + max_new_tokens = {longest}")
    if not pack:
        return _padded(prompts, tok, lp, rm, adv, gv, seq_len, pad_id)
    units = g if mini_batches is None else int(mini_batches)
    if units < 1 or (g * n) % units:
        raise ValueError(f"assemble_update_batch: mini_batches={mini_batches} must be >= 1 and divide "
                         f"the G * N = {g * n} sequences (pass algo.ppo_mini_batches)")
    if row_multiple < 1 or min_rows < 0:
        raise ValueError(f"need row_multiple >= 1 and min_rows >= 0; got {row_multiple}, {min_rows}")
    return _packed(prompts, tok, lp, rm, adv, gv, seq_len, pad_id, units, row_multiple, min_rows)


def _padded(prompts, tok, lp, rm, adv, gv, seq_len, pad_id):
    g, n, s = tok.shape
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
    return UpdateBatch(
        input_tokens=inp,
        positions=np.broadcast_to(np.arange(seq_len, dtype=np.int32), (g * n, seq_len)).copy(),
        targets=targets,
        loss_mask=mask.reshape(g * n, seq_len),
        old_logprobs=old.reshape(g * n, seq_len),
        advantages=np.where(gv[:, None], adv, 0.0).reshape(g * n).astype(np.float32),
    )


def _packed(prompts, tok, lp, rm, adv, gv, width, pad_id, units, row_multiple, min_rows):
    g, n, s = tok.shape
    n_seq = g * n
    prompt_len = np.array([len(p) for p in prompts], np.int64)
    # A sequence runs to its last sampled response token (later slots are padding); one
    # without any loss token carries no gradient and is left out.
    any_resp = rm.any(-1)
    resp_len = np.where(any_resp, s - np.argmax(rm[..., ::-1], axis=-1), 0).reshape(n_seq)
    keep = (any_resp & gv[:, None]).reshape(n_seq)
    seq_g = np.repeat(np.arange(g), n)
    length = prompt_len[seq_g] + resp_len
    per_unit = n_seq // units
    row = np.full(n_seq, -1, np.int64)
    needed = 1
    for u in range(units):
        ids = np.arange(u * per_unit, (u + 1) * per_unit)
        ids = ids[keep[ids]]
        bins = first_fit_decreasing(length[ids], width)
        if len(bins):
            needed = max(needed, int(bins.max()) + 1)
        row[ids] = bins              # the unit's row offset is added once rows per unit are known
    rows_per_unit = bucket_rows(max(needed, min_rows), row_multiple)
    kept = np.flatnonzero(keep)
    row[kept] += (kept // per_unit) * rows_per_unit
    total_rows = units * rows_per_unit

    # Within a row, sequences in ascending index order; offsets by a stable sort on row.
    order = kept[np.argsort(row[kept], kind="stable")]
    r_of = row[order]
    ln = length[order]
    before = np.cumsum(ln) - ln                                     # tokens of earlier entries
    row_start = np.searchsorted(r_of, r_of, side="left")          # first entry of the same row
    offset = before - before[row_start]
    segment = np.arange(len(order)) - row_start + 1

    # Token-level scatter: token k of entry j sits at (r_of[j], offset[j] + k).
    ent = np.repeat(np.arange(len(order)), ln)
    k = np.arange(len(ent)) - np.repeat(before, ln)
    flat = np.repeat(r_of * width + offset, ln) + k
    sg = seq_g[order][ent]
    sn = (order % n)[ent]
    plen = prompt_len[sg]
    pmax = int(prompt_len.max())
    ptab = np.full((g, pmax), pad_id, np.int32)
    for i, p in enumerate(prompts):
        ptab[i, :len(p)] = np.asarray(p, np.int32)
    in_prompt = k < plen
    j = np.clip(k - plen, 0, s - 1)                                 # response slot of token k
    tokens_flat = np.where(in_prompt, ptab[sg, np.minimum(k, pmax - 1)], tok[sg, sn, j])
    # the target of token k is token k + 1 of the same sequence: response slot k + 1 - plen
    tj = k + 1 - plen
    has_target = k + 1 < ln[ent]
    tj_c = np.clip(tj, 0, s - 1)
    target_flat = np.where(~has_target, pad_id,
                           np.where(tj < 0, ptab[sg, np.clip(k + 1, 0, pmax - 1)],
                                    tok[sg, sn, tj_c]))
    trained = (tj >= 0) & has_target & rm[sg, sn, tj_c] & gv[sg]
    old_flat = np.where((tj >= 0) & has_target & rm[sg, sn, tj_c], lp[sg, sn, tj_c], 0.0)

    def scatter(values, fill, dtype):
        out = np.full(total_rows * width, fill, dtype)
        out[flat] = values
        return out.reshape(total_rows, width)

    return UpdateBatch(
        input_tokens=scatter(tokens_flat, pad_id, np.int32),
        positions=scatter(k, 0, np.int32),
        targets=scatter(target_flat, pad_id, np.int32),
        loss_mask=scatter(trained, False, bool),
        old_logprobs=scatter(old_flat, 0.0, np.float32),
        advantages=scatter(np.where(gv[sg], adv[sg, sn], 0.0), 0.0, np.float32),
        segment_ids=scatter(segment[ent], 0, np.int32),
        sequence_index=scatter(order[ent], -1, np.int32),
        pack_units=np.full(units, per_unit, np.int32),
    )


def unpack_to_padded(batch: UpdateBatch, values, num_sequences: int, seq_len: int | None = None,
                     fill: float = 0.0) -> np.ndarray:
    """Per-token values [R, T] of a packed batch (e.g. log-probs) -> [num_sequences, T] in the
    padded layout's rows and columns (sequence g * N + n, position t); `fill` where a sequence
    was left out or has no token."""
    values = np.asarray(values)
    seq = np.asarray(batch.sequence_index)
    pos = np.asarray(batch.positions)
    t = seq.shape[1] if seq_len is None else seq_len
    out = np.full((num_sequences, t) + values.shape[2:], fill, values.dtype)
    real = seq >= 0
    out[seq[real], pos[real]] = values[real]
    return out


def pad_packed_rows(batch: UpdateBatch, rows_per_unit: int, pad_id: int = 0) -> UpdateBatch:
    """A packed batch with every unit padded to `rows_per_unit` rows (empty rows: pad_id tokens,
    segment 0, no loss tokens), e.g. so that processes that packed their own sequences share one
    shape: each packs, they agree on the largest rows per unit, each pads to it."""
    units = len(batch.pack_units)
    rows = batch.input_tokens.shape[0]
    have = rows // units
    if rows_per_unit < have:
        raise ValueError(f"pad_packed_rows: rows_per_unit={rows_per_unit} < the {have} rows a unit has")

    def pad(x, fill=0):
        if x is None:
            return None
        x = np.asarray(x).reshape((units, have) + x.shape[1:])
        empty = np.full((units, rows_per_unit - have) + x.shape[2:], fill, x.dtype)
        return np.concatenate([x, empty], axis=1).reshape((units * rows_per_unit,) + x.shape[2:])

    return batch.replace(
        input_tokens=pad(batch.input_tokens, pad_id), positions=pad(batch.positions),
        targets=pad(batch.targets, pad_id), loss_mask=pad(batch.loss_mask),
        old_logprobs=pad(batch.old_logprobs), advantages=pad(batch.advantages),
        ref_logprobs=pad(batch.ref_logprobs), segment_ids=pad(batch.segment_ids),
        sequence_index=pad(batch.sequence_index, -1), attention_mask=pad(batch.attention_mask),
        routing=pad(batch.routing))


def assemble_groups(groups, advantages, *, rows: int, seq_len: int, pad_id: int = 0,
                    pack: bool = False, mini_batches: int = 1, row_multiple: int = 1,
                    min_rows: int = 0) -> UpdateBatch:
    """The update batch from kept groups (algo.Group, any sizes); advantages[g]: float32 [n_g].

    pack=False: each group's rows as assemble_update_batch builds them, concatenated in order,
    then padding rows (pad tokens, loss_mask False, advantage 0) up to exactly `rows`, so the
    compiled update keeps one shape.
    pack=True: the same `rows` sequence slots in the packed layout (sequence_index = the padded
    layout's row), packed in `mini_batches` units of rows / mini_batches slots (give
    algo.ppo_mini_batches), row_multiple / min_rows as in assemble_update_batch."""
    used = sum(grp.n for grp in groups)
    if used > rows:
        raise ValueError(f"groups hold {used} rows, more than the batch's {rows}")
    if pack:
        s = max([grp.tokens.shape[-1] for grp in groups] or [1])
        fill = rows - used

        def stack(get, dtype, fill_value=0):
            parts = [np.asarray(get(grp), dtype).reshape(grp.n, -1) for grp in groups]
            parts = [np.pad(x, ((0, 0), (0, s - x.shape[1])), constant_values=fill_value) for x in parts]
            return np.concatenate(parts + [np.full((fill, s), fill_value, dtype)])[:, None]

        prompts = [list(grp.prompt_ids) for grp in groups for _ in range(grp.n)] + [[pad_id]] * fill
        adv = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in advantages]
                             + [np.zeros(fill, np.float32)])[:, None]
        return assemble_update_batch(prompts, stack(lambda g: g.tokens, np.int32, pad_id),
                                     stack(lambda g: g.logprobs, np.float32),
                                     stack(lambda g: g.mask, bool, False), adv, seq_len=seq_len,
                                     pad_id=pad_id, mini_batches=mini_batches,
                                     row_multiple=row_multiple, min_rows=min_rows)
    parts = [assemble_update_batch([grp.prompt_ids], grp.tokens[None], grp.logprobs[None],
                                   grp.mask[None], np.asarray(adv, np.float32)[None],
                                   seq_len=seq_len, pad_id=pad_id, pack=False)
             for grp, adv in zip(groups, advantages)]
    pad = rows - used
    filler = UpdateBatch(
        input_tokens=np.full((pad, seq_len), pad_id, np.int32),
        positions=np.broadcast_to(np.arange(seq_len, dtype=np.int32), (pad, seq_len)).copy(),
        targets=np.full((pad, seq_len), pad_id, np.int32),
        loss_mask=np.zeros((pad, seq_len), bool),
        old_logprobs=np.zeros((pad, seq_len), np.float32),
        advantages=np.zeros((pad,), np.float32),
    )
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *parts, filler)
