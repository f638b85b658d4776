"""Sequence parallelism for long context: `--train.sp-size N` splits every packed row's tokens over N consecutive
ranks (an SP group), so each rank holds the activations of 1/N of the tokens.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): everything in a decoder layer except attention works per
token, so each rank runs it on its own contiguous slice of the row. Attention needs every token: each rank's q, k, v
(its T/N tokens, all H heads) go through an all-to-all that leaves it all T tokens of H/N heads; it attends over the
whole row (the packed rows' block-diagonal causal mask, built from the full position ids), and a second all-to-all
brings its tokens' outputs of every head back. The backward of an all-to-all is the reverse all-to-all.

The per-token log-probs of the row are assembled on every rank of the group by a sum whose backward is the identity
(`replicate_sum`): every rank of an SP group then computes the same loss from the same full log-prob table, and its
backward sends each rank the gradient of its own tokens only. With DeepSpeed's gradient mean over the whole world, a
script keeps its usual `loss * world` scaling; only the data split (by data-parallel rank, `setup`'s return) and the
metrics summed over the world (divide by N: every rank of an SP group holds the same sample) change.

What is built: Ulysses attention through transformers' AttentionInterface (name "ulysses"; torch sdpa inside, with
is_causal when every row is one sequence, else a boolean (T, T) mask), for HF decoder models whose attention calls
the interface with (B, heads, T, head_dim) tensors (Qwen2, Llama, tested on Qwen2). Forwards without the SP keyword
arguments (generation, evaluation) take plain sdpa. Not built: ring attention; flash-attention varlen kernels in the
SP forward (sdpa's efficient kernel takes the mask on GPU; untested here, see docs/guide.md).

Tested with torch 2.13 (gloo, CPU, fp32) and transformers 5.19 (tests/test_sequence_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.rl_math import logprobs_from_logits

ATTENTION = "ulysses"


def setup(model, sp_size: int, flag: str = "--train.sp-size") -> tuple[int, int]:
    """Split the world into SP groups of `sp_size` consecutive ranks (ranks 0..N-1, N..2N-1, ...) and make `model` (an
    HF causal LM, optionally PEFT-wrapped, before DeepSpeed wraps it) attend with Ulysses in SP forwards. Returns this
    rank's (data-parallel rank, data-parallel world): the index of its SP group and their number. sp_size 1 changes
    nothing and returns (rank, world). Every rank must call it (creating a process group is collective)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if sp_size == 1:
        return rank, world
    if sp_size < 1 or world % sp_size:
        raise ValueError(f"{flag} {sp_size}: must divide the number of ranks ({world})")
    hf = _hf(model)
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    heads = config.num_attention_heads
    if heads % sp_size:
        raise ValueError(f"{flag} {sp_size}: must divide the model's {heads} attention heads (Ulysses gives each rank "
                         f"heads / {flag} of them)")  # fmt: skip
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"{flag} {sp_size}: sliding-window attention is not supported with sequence parallelism")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # non-SP forwards (generation, eval) build sdpa's mask
    hf.set_attn_implementation(ATTENTION)
    group = None
    for start in range(0, world, sp_size):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(start, start + sp_size)))
        if start <= rank < start + sp_size:
            group = g
    hf.__dict__["sp_group"] = group  # plain attribute, not a submodule or buffer: nothing saved, nothing moved
    return rank // sp_size, world // sp_size


def sp_group(model):
    """The SP process group `setup` gave this model (an HF model, a PEFT model or a DeepSpeed engine around one), or
    None: sp-size 1."""
    return _hf(model).__dict__.get("sp_group")


def _hf(model):
    """The HF model inside a DeepSpeed engine, a PEFT model or a scalar-head wrapper (`core.models.TokenValues`)."""
    hf = getattr(model, "module", model)
    hf = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    return hf if hasattr(hf, "config") or not isinstance(getattr(hf, "model", None), torch.nn.Module) else hf.model


# ------------------------------------------------------------------------------------------ collectives with autograd
class _AllToAll(torch.autograd.Function):
    """Within `group` (N ranks): split x into N chunks along `scatter_dim`, send chunk i to rank i, and concatenate
    what arrives (rank order) along `gather_dim`. Backward: the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, dim=scatter_dim)).contiguous()  # (N, ...): chunk i goes to rank i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # gloo and nccl both implement the single-tensor form
    return torch.cat(recv.unbind(0), dim=gather_dim)


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Autograd-aware all-to-all (see `_AllToAll`); the dimension sizes along `scatter_dim` must divide by N."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _ReplicateSum(torch.autograd.Function):
    """Forward: the sum over `group` (each rank contributes the entries it computed, zeros elsewhere). Backward: the
    identity, because every rank of the group goes on to compute the same loss from the same sum: each rank's
    gradient of the sum is already the whole gradient, and it keeps the part its own entries need."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def replicate_sum(x: torch.Tensor, group) -> torch.Tensor:
    return _ReplicateSum.apply(x, group)


# --------------------------------------------------------------------------------------------------------- attention
def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The attention mask (R, 1, T, T) bool (query, key) of packed rows: a token attends to earlier tokens of its own
    sample; a sample starts wherever the position ids do not continue by +1 (the convention transformers uses for
    packed rows). None when every row is one sequence (plain causal attention, no O(T²) mask)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not starts[:, 1:].any():
        return None
    seg = starts.cumsum(dim=1)  # (R, T): the sample each token belongs to
    T = position_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      sp_group=None, sp_mask=None, **kwargs):  # fmt: skip
    """transformers attention function (AttentionInterface). In an SP forward (`sp_group` given, see `shard`): query
    (B, H, T/N, D), key and value (B, Hkv, T/N, D) of this rank's tokens -> all-to-all -> (B, H/N, T, D) of every
    token -> attention under `sp_mask` (the whole rows' mask, None: causal) -> all-to-all -> (B, T/N, H, D). Without
    `sp_group`: transformers' own sdpa attention on whatever it was given."""
    if sp_group is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sequence parallelism (--train.sp-size) does not support sliding-window attention")
    n = dist.get_world_size(sp_group)
    if key.shape[1] % n:  # fewer key/value heads than ranks (GQA): give every query head its own copy
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    q, k, v = (all_to_all(x, sp_group, scatter_dim=1, gather_dim=2) for x in (query, key, value))
    if k.shape[1] != q.shape[1]:  # GQA: rank r holds query heads r·H/N.. and exactly their key/value heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=sp_mask, dropout_p=dropout, is_causal=sp_mask is None,
                                         scale=scaling)  # (B, H/N, T, D)  # fmt: skip
    out = all_to_all(out, sp_group, scatter_dim=2, gather_dim=1)  # (B, H, T/N, D)
    return out.transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------------------------------------------ forward passes
def shard(input_ids: torch.Tensor, position_ids: torch.Tensor, group) -> tuple[dict, int, int]:
    """This rank's model inputs for an SP forward of packed rows (R, W): the rows are right-padded to a multiple of N
    (the pad continues the last sample's positions, so no real token sees it), and rank r takes columns
    [r·W'/N, (r+1)·W'/N) of input_ids and position_ids, plus the keyword arguments `ulysses_attention` reads: the
    group and the whole rows' mask. Returns (inputs, W', first column)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    R, W = input_ids.shape
    width = -(-W // n) * n
    if width > W:
        pad = torch.arange(1, width - W + 1, device=position_ids.device)
        input_ids = torch.cat([input_ids, input_ids.new_zeros(R, width - W)], dim=1)
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + pad], dim=1)
    lo, hi = r * width // n, (r + 1) * width // n
    inputs = {"input_ids": input_ids[:, lo:hi], "position_ids": position_ids[:, lo:hi], "sp_group": group,
              "sp_mask": block_causal_mask(position_ids)}  # fmt: skip
    return inputs, width, lo


def token_logprobs(model, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """`core.packing.token_logprobs` of a packed batch (input_ids, position_ids (R, W)) with the tokens split over the
    model's SP group: log p(x_t | x_<t) (R, W) on every rank of the group, 0 at the first token of every sample. Each
    rank runs the LM head on its own slice only, against the next tokens taken from the whole row."""
    group = sp_group(model)
    ids, pos = batch["input_ids"], batch.get("position_ids")
    if pos is None or batch.get("attention_mask") is not None:
        raise ValueError("--train.sp-size needs packed batches (position ids), not padded ones (--train.no-packing)")
    inputs, width, lo = shard(ids, pos, group)
    W, w = ids.shape[1], inputs["input_ids"].shape[1]
    next_ids = F.pad(ids[:, 1:], (0, width - W + 1))  # (R, W'): the token each position predicts (0 past the end)
    logits = model(**inputs, use_cache=False).logits  # (R, W'/N, V)
    mine = logprobs_from_logits(logits, next_ids[:, lo : lo + w], temperature=temperature)
    predicted = replicate_sum(F.pad(mine, (lo, width - lo - w)), group)  # (R, W'): every rank's slice, on every rank
    logp = torch.cat([torch.zeros_like(predicted[:, :1]), predicted[:, : W - 1]], dim=1)
    return torch.where(pos == 0, 0.0, logp)  # a packed sample's first token was "predicted" from its neighbour


def token_values(model, inputs: dict) -> torch.Tensor:
    """A scalar-head model's per-token outputs (R, W) (`core.models.TokenValues`: a critic's values) of the packed
    forward `inputs` (input_ids, position_ids (R, W)) with the tokens split over the model's SP group: each rank runs
    its own slice, and the whole table is assembled on every rank of the group (`replicate_sum`: the backward gives
    each rank the gradient of its own tokens)."""
    group = sp_group(model)
    if inputs.get("position_ids") is None or inputs.get("attention_mask") is not None:
        raise ValueError("--train.sp-size needs packed batches (position ids), not padded ones (--train.no-packing)")
    W = inputs["input_ids"].shape[1]
    local, width, lo = shard(inputs["input_ids"], inputs["position_ids"], group)
    mine = model(**local)  # (R, W'/N)
    return replicate_sum(F.pad(mine, (lo, width - lo - mine.shape[1])), group)[:, :W]


def causal_logprobs(model, inputs: dict, at: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    entropy: bool = False, chunk: int | None = None):  # fmt: skip
    """`core.models.causal_logprobs` with the tokens of the packed forward `inputs` (input_ids, position_ids (R, W))
    split over the model's SP group: each rank puts the targets whose predicting position `at` lies in its slice
    through the (chunked) LM head, and the (N,) log-probs (and entropies) are assembled on every rank."""
    from core import models

    group = sp_group(model)
    if inputs.get("position_ids") is None or inputs.get("attention_mask") is not None:
        raise ValueError("--train.sp-size needs packed batches (position ids), not padded ones (--train.no-packing)")
    W = inputs["input_ids"].shape[1]
    local, width, lo = shard(inputs["input_ids"], inputs["position_ids"], group)
    w = local["input_ids"].shape[1]
    row, col = at // W, at % W
    mine = (col >= lo) & (col < lo + w)
    logp, ent = models.causal_logprobs(model, local, row[mine] * w + col[mine] - lo, labels[mine], temperature,
                                       entropy, chunk)  # fmt: skip

    def assemble(x: torch.Tensor) -> torch.Tensor:
        return replicate_sum(torch.zeros(at.shape, dtype=x.dtype, device=x.device).masked_scatter(mine, x), group)

    return assemble(logp), (assemble(ent) if entropy else None)
