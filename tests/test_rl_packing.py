"""Packed RL training: the rollout's real tokens forwarded padding-free in micro-batches of rows or of a token budget
(`--train.max-tokens-per-micro`), the LM head run on the target positions only, a chunk at a time. Everything is
checked against the right-padded path (`--train.no-packing`) in float32: log-probs, entropies, losses, gradients, and
whole GRPO/PPO updates (actor, critic, reference) on one and two ZeRO-3 ranks."""

import importlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import f32_rtol

from agents.executor import Episode
from core import models, packing, rl
from core.config import ModelConfig
from core.engine import free_port
from core.placement import shard_minibatch

WORKER = Path(__file__).with_name("rl_packing_worker.py")


def mixed_rollout(vocab: int, n: int = 10, seed: int = 0) -> list[Episode]:
    """Episodes with prompts of 3-9 tokens and responses of 1-60 tokens."""
    rng = random.Random(seed)
    episodes = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
        episodes.append(Episode({}, prompt, response, [-2.0] * len(response), [1] * len(response), False))
    return episodes


@pytest.fixture(scope="module")
def policy(tiny_path):
    torch.manual_seed(0)
    return models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), dtype="fp32"))


@pytest.mark.parametrize("row_len", [None, 1, 40])
def test_pack_padded_places_every_real_token_once(row_len):
    rng = random.Random(row_len)
    lengths = [rng.randint(1, 30) for _ in range(9)]
    padded = torch.zeros(9, 30, dtype=torch.long)
    for i, n in enumerate(lengths):
        padded[i, :n] = torch.arange(1, n + 1) + 100 * i
    p = packing.pack_padded(padded, lengths, row_len)
    real = torch.arange(30)[None] < torch.tensor(lengths)[:, None]
    assert torch.equal(p["index"] >= 0, real)
    assert torch.equal(p["input_ids"].flatten()[p["index"][real]], padded[real])  # each token where index says
    assert torch.equal(p["position_ids"].flatten()[p["index"][real]], real.nonzero()[:, 1])  # restart per sample
    assert len(set(p["index"][real].tolist())) == sum(lengths)  # no two tokens share a place
    if row_len is None:
        assert p["input_ids"].shape == (1, sum(lengths))


@pytest.mark.parametrize("seed", range(20))
def test_balanced_rows_hold_every_item_once_and_compute_no_more_than_first_fit(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(16, 48) + rng.randint(16, 512) for _ in range(rng.randint(1, 40))]
    row_len = 2 * max(sizes)

    def positions(rows):  # what a forward computes: every row padded to the widest
        return len(rows) * max(sum(sizes[i] for i in row) for row in rows)

    rows = packing.balanced_rows(sizes, row_len)
    assert sorted(i for row in rows for i in row) == list(range(len(sizes)))
    assert positions(rows) <= positions(packing.first_fit_rows(sizes, row_len))
    assert positions(rows) <= 1.15 * sum(sizes)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_token_budget_micro_batches_cover_the_minibatch_once_within_the_budget(world):
    rng = random.Random(world)
    lengths = [rng.choice([20, 40, 80, 300, 600]) for _ in range(40)]
    rows, budget = list(range(40)), 512
    shards = [shard_minibatch(rows, r, world, 4, lengths, budget) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank runs as many passes
    real = [m for s in shards for m, ok in s if ok]
    assert sorted(i for m in real for i in m) == rows  # every row exactly once
    for m in real:  # within the budget, or a lone row longer than it
        assert sum(lengths[i] for i in m) <= budget or len(m) == 1
    loads = [sum(lengths[i] for m, ok in s if ok for i in m) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)  # longest-first to the least-loaded rank
    # by count, the old layout: micro-batches of at most 4 rows
    assert all(len(m) <= 4 for r in range(world) for m, _ in shard_minibatch(rows, r, world, 4))


LOSSES = {"grpo": {"clip_low": 0.1, "clip_high": 0.1}, "cispo": {"clip_low": 1.0, "clip_high": 0.5},
          "sapo": {"tau_pos": 1.0, "tau_neg": 1.05}}  # fmt: skip


@pytest.mark.parametrize("script", sorted(LOSSES))
def test_packed_equals_padded_logprobs_loss_and_gradients(policy, tokenizer, script):
    """Each script's own loss (its surrogate, the KL and entropy terms) on the packed and the padded forward."""
    policy_loss = importlib.import_module(f"algos.{script}").policy_loss
    episodes = mixed_rollout(len(tokenizer))
    out = {}
    for packed in (True, False):
        seqs = rl.sequences(episodes, tokenizer.pad_token_id, torch.device("cpu"), packed)
        mask = seqs["loss_mask"]
        policy.zero_grad()
        logp, ent = rl.forward_logp(policy, seqs, temperature=0.7, entropy=True)
        old = logp.detach() + 0.3 * torch.sin(torch.arange(mask.numel()).view(mask.shape).float()) * mask
        adv = torch.linspace(-1, 1, len(episodes))[:, None].expand_as(mask).float()
        norm = {"num_tokens": mask.sum().item(), "num_seqs": len(episodes)}
        loss, _, _ = policy_loss(logp, old, adv, mask, ref_logp=old - 0.1 * mask, kl_coef=0.2, ent=ent, entropy_coef=0.01,
                              **LOSSES[script], **norm)  # fmt: skip
        loss.backward()
        out[packed] = (logp.detach(), ent.detach(), loss.item(), {n: p.grad.clone() for n, p in policy.named_parameters()})
    (lp1, e1, l1, g1), (lp0, e0, l0, g0) = out[True], out[False]
    assert (lp1 != 0).sum() == sum(len(e.token_ids) for e in episodes)  # a log-prob at every generated token
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(e1, e0, rtol=0, atol=1e-5)
    assert abs(l1 - l0) <= 1e-5
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-5, msg=n)
    assert all(g0[n].abs().sum() > 0 for n in g0)  # every parameter takes part


def test_a_table_without_padding_is_forwarded_as_it_is_and_gives_what_packing_gives(policy, tokenizer, monkeypatch):
    """Equal-length rows (a rollout forced to its token budget): no padding for packing to drop, so `model_inputs`
    forwards the table itself (packing would only double the rows' width); log-probs, entropies and gradients equal
    the packed forward's. One padding token in 200 is still under `rl.FULL_TABLE` (1 %); three are not."""
    rng = random.Random(3)
    episodes = [Episode({}, [rng.randrange(3, len(tokenizer)) for _ in range(6)],
                        [rng.randrange(3, len(tokenizer)) for _ in range(34)], [-2.0] * 34, [1] * 34, False)
                for _ in range(5)]  # fmt: skip
    seqs = rl.sequences(episodes, tokenizer.pad_token_id, torch.device("cpu"), True)
    inputs, _ = rl.model_inputs(policy, seqs)
    assert "attention_mask" in inputs and "position_ids" not in inputs and inputs["input_ids"].shape == (5, 40)
    out = {}
    for threshold in (rl.FULL_TABLE, -1.0):  # -1: never "full", always packed
        monkeypatch.setattr(rl, "FULL_TABLE", threshold)
        policy.zero_grad()
        logp, ent = rl.forward_logp(policy, seqs, temperature=0.7, entropy=True)
        (-(logp * seqs["loss_mask"]).sum() + ent.sum()).backward()
        out[threshold] = logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}
    (lp0, e0, g0), (lp1, e1, g1) = out.values()
    assert (lp0 != 0).sum() == 5 * 34
    torch.testing.assert_close(lp0, lp1, rtol=0, atol=1e-5)
    torch.testing.assert_close(e0, e1, rtol=0, atol=1e-5)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-5, atol=1e-5, msg=n)
    monkeypatch.undo()
    shorter = [*episodes[:4], Episode({}, episodes[4].prompt_ids, episodes[4].token_ids[:-1], [-2.0] * 33, [1] * 33,
                                      False)]  # fmt: skip
    assert "attention_mask" in rl.model_inputs(policy, rl.sequences(shorter, 0, torch.device("cpu"), True))[0]
    shorter[3] = Episode({}, episodes[3].prompt_ids, episodes[3].token_ids[:-2], [-2.0] * 32, [1] * 32, False)
    assert "position_ids" in rl.model_inputs(policy, rl.sequences(shorter, 0, torch.device("cpu"), True))[0]


def test_log_probs_equal_the_full_logits_path(policy, tokenizer):
    """The chunked head on the target positions against the model's own logits, log-softmaxed whole."""
    seqs = rl.sequences(mixed_rollout(len(tokenizer), seed=1), tokenizer.pad_token_id, torch.device("cpu"), False)
    with torch.no_grad():
        logp, ent = rl.forward_logp(policy, seqs, temperature=1.3, entropy=True)
        logits = policy(input_ids=seqs["input_ids"], attention_mask=seqs["attention_mask"]).logits[:, :-1].double()
        full = torch.log_softmax(logits / 1.3, -1)
        ref = full.gather(-1, seqs["input_ids"][:, 1:, None]).squeeze(-1)
        ref_ent = -(full.exp() * full).sum(-1)
    mask = seqs["loss_mask"][:, 1:]
    torch.testing.assert_close(logp[:, 1:][mask].double(), ref[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[:, 1:][mask].double(), ref_ent[mask], rtol=0, atol=1e-5)
    assert torch.equal(logp[:, 1:][~mask], torch.zeros(int((~mask).sum())))  # nothing outside the targets


def test_a_head_that_cannot_be_chunked_takes_the_full_logits_path(policy, tokenizer, monkeypatch):
    seqs = rl.sequences(mixed_rollout(len(tokenizer), seed=2), tokenizer.pad_token_id, torch.device("cpu"))
    assert models.chunked_head(policy) is policy.lm_head
    with torch.no_grad():
        chunked = rl.forward_logp(policy, seqs, 1.0, entropy=True)
        policy.config.final_logit_softcapping = 30.0  # e.g. Gemma: the head's output is post-processed
        try:
            assert models.chunked_head(policy) is None
            full = rl.forward_logp(policy, seqs, 1.0, entropy=True)
        finally:
            policy.config.final_logit_softcapping = None
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert "forward" not in vars(policy.lm_head)  # the swapped-in head forward is gone


def _worker(world: int, tmp_path: Path) -> dict:
    out = tmp_path / f"world{world}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), str(WORKER), str(out)]  # fmt: skip
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_grpo_and_ppo_updates_agree_packed_padded_and_by_token_budget_on_one_and_two_zero3_ranks(tmp_path):
    """Whole updates (2 minibatches, GRPO 2 epochs with KL and entropy; PPO's critic, GAE and actor) on ZeRO-3
    engines: right-padded rows, packed rows and packed token-budget micro-batches give the same losses and
    gradient norms, on one rank and on two."""
    results = {world: _worker(world, tmp_path) for world in (1, 2)}
    reference = results[1]["padded"]
    keys = [k for k in reference if "loss/" in k or "grad_norm" in k or "critic/" in k]
    assert {"grpo/loss/policy", "grpo/train/grad_norm", "ppo/loss/value", "ppo/critic/grad_norm"} <= set(keys)
    for world, layouts in results.items():
        for layout, metrics in layouts.items():
            for k in keys:
                # 12 rows of at most 9 + 60 tokens; the metrics average 4 optimizer steps (2 minibatches x 2 epochs)
                assert metrics[k] == pytest.approx(reference[k], rel=f32_rtol(12 * 69, updates=3), abs=1e-6), (world, layout, k)
