"""Padding-free sequence packing.

Variable-length samples are concatenated into one row (1, N), or into a few rows (R, L), with `position_ids`
restarting at 0 for every sample and no attention mask. transformers (>= 4.56, tested on 5.16-5.19) turns restarting position ids into a
block-diagonal causal mask for sdpa/eager and into varlen kernels for flash-attention, so no token attends across
samples and packed log-probs equal the padded ones (tests/test_packing.py).

Conventions: an example is `{"input_ids": [...], "loss_mask": [...]}` with `loss_mask[t] = 1` when token t is a
target (predicted from tokens < t). `loss_mask[0]` of every sample must be 0: the first token of a packed sample
is "predicted" from the previous sample's last token, which is meaningless.
"""

from __future__ import annotations

import numpy as np
import torch

from core.rl_math import logprobs_from_logits


def pack(examples: list[dict], max_tokens: int) -> list[list[dict]]:
    """Split examples, in order, into groups of at most `max_tokens` tokens (a longer sample gets its own group)."""
    groups, current, size = [], [], 0
    for ex in examples:
        n = len(ex["input_ids"])
        if current and size + n > max_tokens:
            groups.append(current)
            current, size = [], 0
        current.append(ex)
        size += n
    if current:
        groups.append(current)
    return groups


def first_fit_rows(sizes: list[int], row_len: int) -> list[list[int]]:
    """Indices of items with these sizes (tokens) in rows of at most max(row_len, largest item), first-fit-decreasing:
    largest first, each into the first row with room, so rows come out nearly equally full."""
    cap, rows, used = max(row_len, *sizes), [], []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = next((r for r, u in enumerate(used) if u + sizes[i] <= cap), len(rows))
        if r == len(rows):
            rows.append([])
            used.append(0)
        rows[r].append(i)
        used[r] += sizes[i]
    return rows


def balanced_rows(sizes: list[int], row_len: int) -> list[list[int]]:
    """Indices of items with these sizes (tokens) in rows about `row_len` long, laid out so that rows × width (the
    positions a forward computes, every row padded to the fullest) is smallest among: first-fit-decreasing into rows
    of max(row_len, largest item) (`first_fit_rows`), and longest-first onto the least-filled of R = ⌈total /
    row_len⌉ rows, or of R − 1 (slightly wider) rows. On response lengths spread over 16-512 tokens this wastes
    about 2-3 % of the positions (tests/benchmarks/bench_rl_packing.py) where first-fit alone wastes 10-20 %."""

    def least_filled(n_rows: int) -> list[list[int]]:
        rows, used = [[] for _ in range(n_rows)], [0] * n_rows
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            r = min(range(n_rows), key=lambda r: used[r])
            rows[r].append(i)
            used[r] += sizes[i]
        return rows

    n = max(1, -(-sum(sizes) // max(row_len, 1)))
    layouts = [first_fit_rows(sizes, row_len), least_filled(n)] + ([least_filled(n - 1)] if n > 1 else [])
    return min(layouts, key=lambda rows: len(rows) * max(sum(sizes[i] for i in row) for row in rows))


def collate_packed(examples: list[dict], device="cpu", row_len: int | None = None) -> dict:
    """Packed batch: input_ids, position_ids, loss_mask of shape (R, L), the per-sample lengths `seq_lens` and
    `segments`, one (row, start, length) per example in input order.

    row_len None: one row (1, N) holding every example in order, the layout for flash-attention's varlen kernels.
    row_len L: rows of at most max(L, longest example) tokens, filled first-fit-decreasing (longest examples first,
    each into the first row with room), so rows come out nearly equally full. Rows are right-filled with a pad
    segment (its own position ids from 0, loss mask 0) that no real token attends to. With sdpa/eager the
    block-diagonal mask costs O(row length^2) per row, so bounded rows keep attention cost linear in the batch.
    """
    assert all(ex["loss_mask"][0] == 0 for ex in examples), "the first token of a sample cannot be a target"
    lens = [len(ex["input_ids"]) for ex in examples]
    rows = [list(range(len(examples)))] if row_len is None else first_fit_rows(lens, row_len)
    width = max(sum(lens[i] for i in row) for row in rows)
    # Laid out in Python lists and converted once per key (see collate_prefix_shared): per-sample writes into torch
    # tensors cost milliseconds a step.
    ids, pos, mask = [], [], []  # (R, L) each: one list per row
    segments: list = [None] * len(examples)
    for r, row in enumerate(rows):
        ids_r, pos_r, mask_r = [], [], []
        for i in row:
            segments[i] = (r, len(ids_r), lens[i])
            ids_r += examples[i]["input_ids"]
            pos_r += range(lens[i])
            mask_r += examples[i]["loss_mask"]
        pad = width - len(ids_r)
        ids.append(ids_r + [0] * pad)
        pos.append(pos_r + list(range(pad)))  # pad segment: attends only to itself
        mask.append(mask_r + [0] * pad)
    return {
        "input_ids": torch.from_numpy(np.array(ids, dtype=np.int64)).to(device),
        "position_ids": torch.from_numpy(np.array(pos, dtype=np.int64)).to(device),
        "loss_mask": torch.from_numpy(np.array(mask, dtype=bool)).to(device),
        "seq_lens": lens,
        "segments": segments,
    }


def pack_padded(input_ids: torch.Tensor, lengths: list[int], row_len: int | None = None) -> dict:
    """The real tokens of a right-padded batch, packed padding-free: rows of `collate_packed`'s layout, one row when
    `row_len` is None, else rows about `row_len` long (`balanced_rows`), each right-filled to the widest with a pad
    segment of its own.

    input_ids: (B, T) right-padded; lengths: B real lengths -> input_ids, position_ids (R, W) and `index` (B, T)
    long: the flat position (row · W + column) of token (b, t) in the packed rows, −1 at padding. So a packed
    per-token result `y` (R, W) reads back as `y.flatten()[index]` wherever index ≥ 0."""
    B, T = input_ids.shape
    rows = [list(range(B))] if row_len is None else balanced_rows(lengths, row_len)
    width = max(sum(lengths[i] for i in row) for row in rows)
    src = input_ids.cpu().numpy()
    ids = np.zeros((len(rows), width), dtype=np.int64)
    pos = np.zeros((len(rows), width), dtype=np.int64)
    index = np.full((B, T), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = lengths[i]
            ids[r, start : start + n] = src[i, :n]
            pos[r, start : start + n] = np.arange(n)
            index[i, :n] = r * width + start + np.arange(n)
            start += n
        pos[r, start:] = np.arange(width - start)  # the pad tail is a segment of its own (attends only to itself)
    device = input_ids.device
    return {"input_ids": torch.from_numpy(ids).to(device), "position_ids": torch.from_numpy(pos).to(device),
            "index": torch.from_numpy(index).to(device)}  # fmt: skip


def collate_padded(examples: list[dict], pad_id: int, device="cpu") -> dict:
    """Right-padded batch (B, T): input_ids, attention_mask, loss_mask (the reference for packing)."""
    width = max(len(ex["input_ids"]) for ex in examples)
    pads = [width - len(ex["input_ids"]) for ex in examples]
    ids = [[*ex["input_ids"], *[pad_id] * p] for ex, p in zip(examples, pads)]
    attn = [[1] * (width - p) + [0] * p for p in pads]
    mask = [[*ex["loss_mask"], *[0] * p] for ex, p in zip(examples, pads)]
    return {
        "input_ids": torch.from_numpy(np.array(ids, dtype=np.int64)).to(device),
        "attention_mask": torch.from_numpy(np.array(attn, dtype=np.int64)).to(device),
        "loss_mask": torch.from_numpy(np.array(mask, dtype=bool)).to(device),
    }


def picture_inputs(batch: dict) -> dict:
    """The forward's vision inputs of a batch that has them (`core.vision.add_pixels`; the rows' pictures
    concatenated in row order, as the model expects), {} for a text batch."""
    if batch.get("pixel_values") is None:
        return {}
    pixels = [p for p in batch["pixel_values"] if p is not None]
    if not pixels:
        return {"mm_token_type_ids": batch["mm_token_type_ids"]}
    device = batch["input_ids"].device
    grids = torch.cat([g for g in batch["image_grid_thw"] if g is not None]).to(device)
    return {"pixel_values": torch.cat(pixels).to(device), "image_grid_thw": grids,
            "mm_token_type_ids": batch["mm_token_type_ids"]}  # fmt: skip


def token_logprobs(model, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """log p(x_t | x_<t) at every position, shape like `batch["input_ids"]` (B, T) or (1, N); the first position of
    every row and of every packed sample holds 0. Works for packed (position_ids) and padded (attention_mask) batches,
    and padded batches with pictures (`core.vision.collate`)."""
    ids = batch["input_ids"]
    logits = model(
        input_ids=ids,
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        use_cache=False,
        **picture_inputs(batch),
    ).logits
    logp = logprobs_from_logits(logits[:, :-1], ids[:, 1:], temperature=temperature)
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
    if batch.get("position_ids") is not None:  # a packed sample's first token was "predicted" from its neighbour
        logp = torch.where(batch["position_ids"] == 0, 0.0, logp)
    return logp


def unpack(x: torch.Tensor, seq_lens: list) -> list[torch.Tensor]:
    """Split a packed tensor back into per-sample 1-D tensors, in input order: `seq_lens` (lengths, for a one-row
    (1, N) batch) or a batch's `segments` ((row, start, length) triples, for any row layout)."""
    if seq_lens and isinstance(seq_lens[0], (tuple, list)):
        return [x[r, s : s + n] for r, s, n in seq_lens]
    return list(torch.split(x[0], seq_lens))


def collate_prefix_shared(groups: list[list[dict]], device="cpu", row_len: int | None = None) -> dict:
    """Prefix-shared packing: the sequences of a group (e.g. a DPO pair's chosen and rejected, which share the
    prompt) are laid out as their longest common prefix once, then each sequence's remainder (its branch). A branch
    attends to the prefix and to its own earlier tokens only (a 4D mask), with position ids continuing the
    prefix's, so every sequence sees exactly what it would alone and the prefix is computed once.

    Rows hold whole groups, first-fit-decreasing up to max(row_len, longest group) tokens (one row per group when
    row_len is None). Returns input_ids, position_ids (R, L), `allowed` (R, L, L) bool (query, key), `last` (S, 2):
    the (row, position) of each sequence's last token (groups flattened in order, S sequences), and for every target
    token: `rows`, `logit_pos` (where its logits are), `targets`, `owner` (its sequence) and `weight` (its loss
    mask); the first token of a sequence is never a target."""
    # Everything is laid out in plain Python lists, then converted once per key through numpy (several times faster
    # than torch.tensor on a list): per-slice writes into torch tensors cost microseconds each, milliseconds a step.
    prefix_lens = [_common_prefix_len([ex["input_ids"] for ex in group]) for group in groups]
    sizes = [s + sum(len(ex["input_ids"]) - s for ex in group) for s, group in zip(prefix_lens, groups)]
    rows = [[g] for g in range(len(groups))] if row_len is None else first_fit_rows(sizes, row_len)
    width = max(sum(sizes[g] for g in row) for row in rows)
    input_ids, position_ids, group_of, branch_of = [], [], [], []  # (R, L) each: one list per row
    where: dict[int, tuple[int, int, list[int]]] = {}  # group -> (row, prefix start, branch starts)
    for r, row in enumerate(rows):
        ids_r, pos_r, group_r, branch_r = [], [], [], []
        for g in row:
            s, seqs = prefix_lens[g], [ex["input_ids"] for ex in groups[g]]
            prefix_start, starts = len(ids_r), []
            ids_r += seqs[0][:s]  # the shared prefix once, as branch 0: every branch of its group sees it
            pos_r += range(s)
            branch_r += [0] * s
            for k, x in enumerate(seqs):  # then each sequence's remainder, its positions continuing the prefix's
                starts.append(len(ids_r))
                ids_r += x[s:]
                pos_r += range(s, len(x))
                branch_r += [k + 1] * (len(x) - s)
            group_r += [g] * sizes[g]
            where[g] = (r, prefix_start, starts)
        pad = width - len(ids_r)  # the pad tail: each position is its own group, so it attends only to itself
        input_ids.append(ids_r + [0] * pad)
        position_ids.append(pos_r + [0] * pad)
        group_of.append(group_r + list(range(-2, -2 - pad, -1)))
        branch_of.append(branch_r + [0] * pad)
    group_of, branch_of = np.array(group_of, dtype=np.int64), np.array(branch_of, dtype=np.int64)
    causal = np.tri(width, dtype=bool)
    same_group = group_of[:, :, None] == group_of[:, None, :]
    visible_branch = (branch_of[:, None, :] == 0) | (branch_of[:, :, None] == branch_of[:, None, :])
    allowed = causal & same_group & visible_branch  # (R, L, L): query, key
    rows_of, logit_pos, targets, owner_of, weight, last = [], [], [], [], [], []  # one entry per target token
    owner = 0
    for g, group in enumerate(groups):
        r, a, starts = where[g]
        s = prefix_lens[g]
        for k, ex in enumerate(group):
            pos = [*range(a, a + s), *range(starts[k], starts[k] + len(ex["input_ids"]) - s)]  # its tokens' places
            n = len(pos) - 1
            rows_of += [r] * n
            logit_pos += pos[:-1]  # token j is predicted from token j - 1's logits
            targets += ex["input_ids"][1:]
            owner_of += [owner] * n
            weight += ex["loss_mask"][1:]
            last += (r, pos[-1])  # flat (row, position) pairs, (S, 2) below
            owner += 1
    out = {
        "input_ids": np.array(input_ids, dtype=np.int64),
        "position_ids": np.array(position_ids, dtype=np.int64),
        "allowed": allowed,
        "rows": np.array(rows_of, dtype=np.int64),
        "logit_pos": np.array(logit_pos, dtype=np.int64),
        "targets": np.array(targets, dtype=np.int64),
        "owner": np.array(owner_of, dtype=np.int64),
        "weight": np.array(weight, dtype=np.float32),  # the loss mask (0/1, or bools) as floats
        "last": np.array(last, dtype=np.int64).reshape(-1, 2),
    }
    batch = {k: torch.from_numpy(v).to(device) for k, v in out.items()}
    batch["num_seqs"] = owner
    return batch


def _common_prefix_len(seqs: list[list[int]]) -> int:
    """Length of the longest common prefix of these token lists (a lone sequence is all prefix; 0: nothing shared)."""
    s = min(len(x) for x in seqs)
    for x in seqs[1:]:  # shrink s to where x first differs from the first sequence
        for i in range(s):
            if x[i] != seqs[0][i]:
                s = i
                break
    return s


def prefix_shared_mask(model, batch: dict) -> torch.Tensor:
    """The additive 4D attention mask (R, 1, L, L) of a `collate_prefix_shared` batch, in the model's dtype: 0 where
    `allowed`, the dtype's minimum elsewhere. Needs an attention implementation that takes a 4D mask (sdpa, eager),
    not flash-attention's varlen kernels."""
    dtype = next(p for p in model.parameters()).dtype
    mask = torch.zeros(batch["allowed"].shape, dtype=dtype, device=batch["allowed"].device)
    return mask.masked_fill(~batch["allowed"], torch.finfo(dtype).min)[:, None]


def prefix_shared_logp_sums(model, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """Summed loss-masked log-probs (S,) of every sequence of a `collate_prefix_shared` batch, from one forward."""
    mask = prefix_shared_mask(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"],
                   use_cache=False).logits  # fmt: skip
    picked = logits[batch["rows"], batch["logit_pos"]]  # (N, V), one row per target token
    logp = logprobs_from_logits(picked[None], batch["targets"][None], temperature=temperature)[0]  # (N,)
    sums = torch.zeros(batch["num_seqs"], dtype=logp.dtype, device=logp.device)
    return sums.index_add(0, batch["owner"], logp * batch["weight"].to(logp.dtype))
