"""Sequence parallelism checked against the plain forward, under `torchrun --nproc_per_node N` (gloo, fp32): one SP
group of all N ranks (N = 2, or 4: each rank then holds one of the tiny model's 4 heads).

Every rank builds the same models from the same seed. The reference (SP=1) is the plain model on the whole batch,
computed by each rank alone; the SP=N model splits each row's tokens over the N ranks. Each rank's backward gives
the gradient of its own tokens' computation; their sum over the group (what DeepSpeed's mean over ranks times the
scripts' `loss * world` scaling makes) must equal the reference gradient. Rank 0 writes {case: numbers} as JSON to
argv[1]: loss difference, max parameter-gradient difference, and saved-activation bytes per rank (argv[2]: the long
sequence's tokens; 0 skips the memory case)."""

import json
import random
import sys

import torch
import torch.distributed as dist

from agents.executor import Episode
from algos import dpo, grpo, sft
from core import embedded, models, packing, rl
from core import sequence_parallel as sp
from core.config import ModelConfig


def tiny(path: str, seed: int = 0, **config):
    """The embedded tiny Qwen2 (4 heads), or a fresh one with `config` overrides (e.g. GQA heads, longer context)."""
    torch.manual_seed(seed)
    if not config:
        return models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32", attn_implementation="sdpa"))
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    for k, v in config.items():
        setattr(cfg, k, v)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


def saved_bytes(fn, model) -> tuple[object, int]:
    """fn()'s result and the bytes of the distinct storages autograd saved for backward while it ran, the parameters
    of `model` (and views of them, e.g. a transposed weight) excluded: the activation memory a backward needs, each
    storage counted once however many views share it."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def grad_diff(ref, model, group) -> float:
    """max |Σ_ranks ∂(SP model) − ∂(reference)| over every parameter (summed over the SP group)."""
    worst = 0.0
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        assert ref_params[name].grad.abs().sum() > 0, f"{name}: no gradient in the reference"
        worst = max(worst, (g - ref_params[name].grad).abs().max().item())
    return worst


def random_samples(vocab: int, n: int, seed: int, lo: int = 4, hi: int = 40) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        prompt = rng.randint(1, length - 1)
        out.append({"input_ids": [rng.randrange(3, vocab) for _ in range(length)],
                    "loss_mask": [0] * prompt + [1] * (length - prompt)})  # fmt: skip
    return out


def compare(name: str, ref, model, loss_fn, group, results: dict) -> None:
    """loss_fn(model, sp) -> scalar loss; backward on both; record the loss and gradient differences."""
    ref.zero_grad()
    model.zero_grad()
    ref_loss = loss_fn(ref, False)
    ref_loss.backward()
    loss = loss_fn(model, True)
    loss.backward()
    losses = torch.tensor([loss.item()])
    dist.all_reduce(losses, op=dist.ReduceOp.MAX, group=group)  # every rank of the group holds the same loss
    results[name] = {
        "loss": ref_loss.item(),
        "loss_diff": abs(losses.item() - ref_loss.item()),
        "loss_spread": abs(losses.item() - loss.item()),
        "grad_diff": grad_diff(ref, model, group),
    }


def attention_case(group, results: dict) -> None:
    """ulysses_attention on random q/k/v against sdpa over the whole packed rows, GQA included: outputs and input
    gradients."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    worst = 0.0
    for heads, kv_heads in ((4, 4), (4, 2), (4, 1)):
        torch.manual_seed(heads * 10 + kv_heads)
        T, D = 24, 8
        q, k, v = torch.randn(2, heads, T, D), torch.randn(2, kv_heads, T, D), torch.randn(2, kv_heads, T, D)
        pos = torch.tensor([[*range(10), *range(9), *range(5)], [*range(T)]])  # 3 samples; 1 sample
        mask = sp.block_causal_mask(pos)
        for x in (q, k, v):
            x.requires_grad_(True)
        k_full, v_full = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask)  # (B, H, T, D)
        ref.transpose(1, 2).pow(2).sum().backward()
        ref_grads = [x.grad.clone() for x in (q, k, v)]
        mine = slice(r * T // n, (r + 1) * T // n)
        local = [x.detach()[:, :, mine].clone().requires_grad_(True) for x in (q, k, v)]
        out, _ = sp.ulysses_attention(None, *local, None, scaling=D**-0.5, sp_group=group, sp_mask=mask)
        out.pow(2).sum().backward()  # each rank: its own tokens' share of the same loss
        worst = max(worst, (out - ref.transpose(1, 2)[:, mine]).abs().max().item())
        for x, g in zip(local, ref_grads):
            full = torch.zeros_like(g)
            full[:, :, mine] = x.grad
            dist.all_reduce(full, group=group)
            worst = max(worst, (full - g).abs().max().item())
    results["attention"] = {"max_diff": worst}


def memory_case(path: str, vocab: int, long_len: int, n: int) -> dict:
    """Saved activations of one `long_len`-token sequence: the plain forward (SP=1) against the larger rank's share
    at SP=n, with the loss and gradient differences."""
    ref_l = tiny(path, seed=5, max_position_embeddings=long_len, num_hidden_layers=2)
    model_l = tiny(path, seed=5, max_position_embeddings=long_len, num_hidden_layers=2)
    sp.setup(model_l, n)
    long_batch = packing.collate_packed(random_samples(vocab, 1, seed=4, lo=long_len, hi=long_len), "cpu")
    mask_l, n_tok = long_batch["loss_mask"], float(long_batch["loss_mask"].sum())
    loss1, bytes1 = saved_bytes(lambda: sft.sft_loss(packing.token_logprobs(ref_l, long_batch), mask_l, n_tok), ref_l)
    loss2, bytes2 = saved_bytes(lambda: sft.sft_loss(sp.token_logprobs(model_l, long_batch), mask_l, n_tok), model_l)
    loss1.backward()
    loss2.backward()
    per_rank = torch.tensor([float(bytes2)])
    dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)  # the largest share
    return {
        "tokens": long_len,
        "sp1_bytes": bytes1,
        "sp2_bytes_per_rank": int(per_rank.item()),
        "ratio": per_rank.item() / bytes1,
        "grad_diff": grad_diff(ref_l, model_l, sp.sp_group(model_l)),
        "loss_diff": abs(loss1.item() - loss2.item()),
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    path = embedded.resolve_model("cleanrlhf/tiny")
    vocab = models.load_tokenizer(path).vocab_size
    results: dict = {}

    # the SP model: the same weights as the reference, tokens split over both ranks
    n = dist.get_world_size()
    ref, model = tiny(path), tiny(path)
    dp_rank, dp_world = sp.setup(model, n)
    group = sp.sp_group(model)
    assert (dp_rank, dp_world) == (0, 1) and dist.get_world_size(group) == n
    try:  # heads / sp-size must be whole (checked before any process group is created)
        sp.setup(tiny(path, num_attention_heads=1, num_key_value_heads=1), n)
    except ValueError as e:
        results["refused"] = str(e)
    attention_case(group, results)

    # (a) SFT: packed rows of several samples (row length not a multiple of 2: the pad path), token-mean NLL
    samples = random_samples(vocab, 9, seed=1)
    batch = packing.collate_packed(samples, "cpu", row_len=80)
    num_tokens = float(batch["loss_mask"].sum())

    def sft_loss(m, use_sp: bool):
        logp = (sp.token_logprobs if use_sp else packing.token_logprobs)(m, batch)
        return sft.sft_loss(logp, batch["loss_mask"], num_tokens)

    compare("sft", ref, model, sft_loss, group, results)
    results["sft"]["shape"] = list(batch["input_ids"].shape)

    # (b) DPO: chosen and rejected packed whole (no prompt sharing), sigmoid loss against fixed reference log-probs
    prompts = random_samples(vocab, 4, seed=2, lo=3, hi=8)
    pairs = [{k: {"input_ids": p["input_ids"] + resp["input_ids"],
                  "loss_mask": [0] * len(p["input_ids"]) + [1] * len(resp["input_ids"])}
              for k, resp in zip(("chosen", "rejected"), random_samples(vocab, 2, seed=10 + i, lo=2, hi=25))}
             for i, p in enumerate(prompts)]  # fmt: skip
    ref_c, ref_r = torch.linspace(-30, -20, 4), torch.linspace(-25, -28, 4)

    def dpo_loss(m, use_sp: bool):
        pc, pr = dpo.pair_logps(m, pairs, "cpu", share_prompt=False, sp=use_sp)
        return dpo.dpo_loss(pc, pr, ref_c, ref_r, beta=0.5)[0] - 0.1 * pc.sum() / 50

    compare("dpo", ref, model, dpo_loss, group, results)

    # (c) RL: GRPO's policy loss (clipping, KL, entropy) on core.rl.forward_logp's packed forward, chunked head
    rng = random.Random(3)
    episodes = []
    for _ in range(6):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        episodes.append(Episode({}, prompt, response, [-2.0] * len(response), [1] * len(response), False))
    seqs = rl.sequences(episodes, 0, torch.device("cpu"))
    mask = seqs["loss_mask"]
    norm = {"num_tokens": mask.sum().item(), "num_seqs": len(episodes)}
    adv = torch.linspace(-1, 1, len(episodes))[:, None].expand_as(mask).float()
    wiggle = 0.3 * torch.sin(torch.arange(mask.numel()).view(mask.shape).float()) * mask

    def grpo_loss(m, use_sp: bool):
        assert (sp.sp_group(m) is not None) == use_sp  # forward_logp splits the tokens for the SP model only
        logp, ent = rl.forward_logp(m, seqs, temperature=0.7, entropy=True)
        old = logp.detach() + wiggle
        return grpo.policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.1, ref_logp=old - 0.1 * mask,
                                kl_coef=0.2, ent=ent, entropy_coef=0.01, **norm)[0]  # fmt: skip

    compare("grpo", ref, model, grpo_loss, group, results)

    # GQA (4 query heads, 2 and 1 key/value heads) through the whole model, SFT loss
    for kv in (2, 1):
        ref_g, model_g = tiny(path, seed=kv, num_key_value_heads=kv), tiny(path, seed=kv, num_key_value_heads=kv)
        sp.setup(model_g, n)
        compare(f"sft_gqa{kv}", ref_g, model_g, sft_loss, sp.sp_group(model_g), results)

    # gradient checkpointing (the all-to-alls run again in the recomputed forward) and LoRA (random B, so that
    # every adapter factor has a gradient), SFT loss
    ref_c, model_c = tiny(path, seed=3), tiny(path, seed=3)
    for m in (ref_c, model_c):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    sp.setup(model_c, n)
    compare("sft_checkpointing", ref_c, model_c, sft_loss, sp.sp_group(model_c), results)
    from peft import LoraConfig, get_peft_model

    lora = []
    for _ in range(2):
        base = tiny(path, seed=4)
        torch.manual_seed(4)
        lora.append(get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)))
    sp.setup(lora[1], n)
    compare("sft_lora", lora[0], lora[1], sft_loss, sp.sp_group(lora[1]), results)

    # memory: saved activations of one long sequence, plain forward (SP=1) vs this rank's share at SP=N
    long_len = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    if long_len:
        results["memory"] = memory_case(path, vocab, long_len, n)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
