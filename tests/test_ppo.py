"""algos/ppo.py: KL-shaped GAE advantages and critic targets, explained variance, value alignment, the critic
warm-up (actor untouched, critic trained), value clipping in the update, the CLI, a short learning run, two Ray
ranks against one process, and multi-turn episodes."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_first_step_agrees, ranks_2_vs_1, short_rl_run, zero3_other_reference

from agents.executor import Episode
from algos.ppo import Args, explained_variance, forward_values, main, ppo_advantages, update
from core.rl import sequences

REPO = Path(__file__).resolve().parent.parent


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def test_hand_case_gae_with_kl():
    # row 0: 2 tokens, reward 1, kl 0.1, 0.2, β = 0.5 -> r = −0.05, 0.9; V = 0.2, 0.5, then 0 after the last token.
    # δ_1 = 0.9 + 0 − 0.5 = 0.4, δ_0 = −0.05 + 0.5 − 0.2 = 0.25; λ = 0.5, γ = 1: A_1 = 0.4, A_0 = 0.25 + 0.5·0.4 = 0.45
    # R = A + V = 0.65, 0.9. Row 1: 1 token, reward 0, kl 0: δ_0 = 0 − 0.3 = −0.3 = A_0, R_0 = 0. Padding holds NaN.
    nan = float("nan")
    mask = right_padded_mask([2, 1], 3)
    kl = torch.tensor([[0.1, 0.2, nan], [0.0, nan, nan]])
    values = torch.tensor([[0.2, 0.5, nan], [0.3, nan, nan]])
    adv, ret = ppo_advantages(torch.tensor([1.0, 0.0]), kl, values, mask, kl_coef=0.5, gamma=1.0, lam=0.5,
                              whiten=False)  # fmt: skip
    assert torch.allclose(adv, torch.tensor([[0.45, 0.4, 0.0], [-0.3, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.65, 0.9, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_lambda_one_gives_monte_carlo_returns_and_zero_values_reduce_to_reward_to_go():
    g = torch.Generator().manual_seed(0)
    B, T, beta = 5, 6, 0.3
    mask = right_padded_mask([6, 1, 4, 3, 5], T)
    r, kl, v = torch.randn(B, generator=g), torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    adv, ret = ppo_advantages(r, kl, v, mask, beta, gamma=1.0, lam=1.0, whiten=False)
    mc = r[:, None] - beta * torch.where(mask, kl, 0.0).flip(1).cumsum(1).flip(1)  # r − β Σ_{k≥t} KL_k
    assert torch.allclose(ret[mask], mc[mask], atol=1e-5)  # λ = 1: the critic's target ignores V
    assert torch.allclose(adv[mask], (mc - v)[mask], atol=1e-5)  # and A = R − V
    adv0, _ = ppo_advantages(r, kl, torch.zeros(B, T), mask, beta, gamma=1.0, lam=1.0, whiten=False)
    assert torch.allclose(adv0[mask], mc[mask], atol=1e-5)


def test_whitening_touches_advantages_only():
    g = torch.Generator().manual_seed(1)
    B, T = 8, 5
    mask = right_padded_mask([5, 3, 1, 4, 5, 2, 3, 4], T)
    r, kl, v = torch.randn(B, generator=g), torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    raw, ret_raw = ppo_advantages(r, kl, v, mask, 0.1, whiten=False)
    adv, ret = ppo_advantages(r, kl, v, mask, 0.1)
    assert torch.equal(ret, ret_raw)  # the critic's targets are never whitened
    assert adv[mask].mean().abs() < 1e-5 and (adv[mask].pow(2).mean() - 1).abs() < 1e-4
    vals = raw[mask]
    assert torch.allclose(adv[mask], (vals - vals.mean()) / torch.sqrt(vals.var(unbiased=False) + 1e-8), atol=1e-5)
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))


def test_rejects_bad_shapes():
    mask = torch.ones(4, 3, dtype=torch.bool)
    r, kl, v = torch.ones(4), torch.zeros(4, 3), torch.zeros(4, 3)
    for bad in ((torch.ones(3), kl, v), (r, torch.zeros(4, 2), v), (r, kl, torch.zeros(4, 2)), (r, torch.zeros(4), v)):
        with pytest.raises(ValueError, match="shapes"):
            ppo_advantages(*bad, mask, 0.1)


def test_explained_variance_hand_cases():
    mask = right_padded_mask([3, 1], 3)
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])  # valid: 1, 2, 3, 4; Var = 1.25
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full((2, 3), 2.5), returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert explained_variance(torch.zeros(2, 3), returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    # errors +1, −1, +1, −1: Var(R − V) = 1 -> 1 − 1/1.25 = 0.2; garbage at padded positions is ignored
    values = returns + torch.tensor([[1.0, -1.0, 1.0], [-1.0, float("nan"), float("inf")]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.2, abs=1e-6)
    # worse than the mean is negative: errors 2, −2, 2, −2 -> 1 − 4/1.25 = −2.2
    values = returns + torch.tensor([[2.0, -2.0, 2.0], [-2.0, 0.0, 0.0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(-2.2, abs=1e-6)
    assert math.isnan(explained_variance(torch.zeros(2, 3), torch.ones(2, 3), mask).item())


# ----------------------------------------------------------------------------------- engines on the tiny model
@pytest.fixture(scope="module")
def engines_and_batch(tiny_path, tokenizer):
    """A DeepSpeed actor and critic on the random tiny model (fp32, one process) and a 4-row rollout batch."""
    from core import engine as ds_engine
    from core import models
    from core.config import DSConfig, ModelConfig

    ds_engine.init_distributed("gloo")
    torch.manual_seed(0)
    actor = ds_engine.make_engine(models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), dtype="fp32")),
                                  DSConfig(), lr=1e-2)  # fmt: skip
    critic = ds_engine.make_engine(models.TokenValues(models.load_scalar_model(str(tiny_path), "fp32")), DSConfig(),
                                   lr=1e-2)  # fmt: skip
    prompts = [tokenizer.encode(p) for p in ("12+34=", "5+6=", "70+8=", "1+1=")]
    responses = [tokenizer.encode(a) for a in ("46", "11", "78", "3")]
    episodes = [Episode({}, p, r, [0.0] * len(r), [1] * len(r), False) for p, r in zip(prompts, responses)]
    seqs = sequences(episodes, tokenizer.pad_token_id, torch.device("cpu"))
    return actor, critic, seqs


def _update(actor, critic, seqs, args, step):
    """`update` in one process, without a reference, on rewards of 5: the GAE targets sit about 5 above the fresh
    critic's values, so the critic has to move."""
    run = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    return update(actor, critic, None, seqs, torch.full((len(seqs["loss_mask"]),), 5.0), args, run, step, kl_coef=0.0)


def _snapshot(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_forward_values_are_the_state_values_before_each_token(engines_and_batch):
    from core import models

    _, critic, seqs = engines_and_batch
    with torch.no_grad():
        v = forward_values(critic, seqs)  # packed padding-free
        v_padded = forward_values(critic, {**seqs, "packed": False})
        raw = models.token_values(critic.module.model, seqs["input_ids"], attention_mask=seqs["attention_mask"])
    real = seqs["attention_mask"].bool()
    assert v.shape == seqs["input_ids"].shape
    assert torch.equal(v[:, 0], torch.zeros(v.shape[0])) and torch.equal(v[~real], torch.zeros(int((~real).sum())))
    assert torch.equal(v_padded[:, 1:][real[:, 1:]], raw[:, :-1][real[:, 1:]])  # V(s_t): hidden state of token t − 1
    torch.testing.assert_close(v, v_padded, rtol=0, atol=1e-5)  # packed == padded


def test_critic_warmup_leaves_the_actor_untouched_then_the_actor_trains(engines_and_batch):
    actor, critic, seqs = engines_and_batch
    args = Args()
    args.critic.warmup_steps, args.train.minibatches = 1, 2
    a0, c0 = _snapshot(actor), _snapshot(critic)
    stats = _update(actor, critic, seqs, args, step=0)
    a1, c1 = _snapshot(actor), _snapshot(critic)
    assert all(torch.equal(a0[n], a1[n]) for n in a0), "the critic warm-up step changed an actor parameter"
    # every critic parameter moved, except embedding rows of tokens absent from the batch (zero grad -> no Adam step)
    for n in c0:
        if "embed_tokens" in n:
            used = seqs["input_ids"].unique()
            assert not torch.equal(c0[n][used], c1[n][used]), n
        else:
            assert not torch.equal(c0[n], c1[n]), f"critic parameter {n} did not change"
    assert stats["critic/warmup"] == 1.0 and "loss/policy" not in stats and stats["loss/value"] > 0
    # the first step after the warm-up trains both
    stats = _update(actor, critic, seqs, args, step=1)
    a2, c2 = _snapshot(actor), _snapshot(critic)
    assert any(not torch.equal(a1[n], a2[n]) for n in a1) and any(not torch.equal(c1[n], c2[n]) for n in c1)
    assert stats["critic/warmup"] == 0.0 and math.isfinite(stats["loss/policy"])


def test_a_qlora_critic_trains_its_adapters_and_value_head_only(engines_and_batch, tiny_path):
    """`--critic.lora-rank 8 --critic.load-in-4bit`: the critic's body in NF4 with LoRA adapters, its fresh value head
    trained whole; critic-only steps lower the value loss and change the adapters and the head, never the 4-bit
    codes. Without a rank the 4-bit critic is refused, naming both flags."""
    from algos.ppo import make_critic

    actor, _, seqs = engines_and_batch
    args = Args()
    args.actor.model.name_or_path, args.actor.model.dtype = str(tiny_path), "fp32"
    args.critic.load_in_4bit, args.critic.warmup_steps, args.critic.lr = True, 10, 1e-2
    with pytest.raises(ValueError, match="--critic.load-in-4bit needs --critic.lora-rank > 0"):
        make_critic(args, 100, torch.device("cpu"))
    args.critic.lora_rank = 8
    critic = make_critic(args, 100, torch.device("cpu"))
    trained = {n for n, p in critic.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or ".modules_to_save." in n for n in trained), sorted(trained)[:5]
    c0 = _snapshot(critic)
    losses = [_update(actor, critic, seqs, args, step=s)["loss/value"] for s in range(4)]
    c1 = _snapshot(critic)
    assert losses[-1] < losses[0], losses
    assert all(not torch.equal(c0[n], c1[n]) for n in trained)
    assert all(torch.equal(c0[n], c1[n]) for n in c0 if n not in trained)  # the NF4 codes, norms, embeddings


def test_value_clipping_is_applied_in_the_update(engines_and_batch):
    # Two epochs over one minibatch: the first step moves the values towards the targets (+5), so in the second
    # epoch a tight clip (1e-6) puts every token on the clipped branch; without clipping no token is clipped.
    actor, critic, seqs = engines_and_batch
    args = Args()
    args.train.minibatches, args.train.epochs = 1, 2
    args.critic.value_clip = 1e-6
    stats = _update(actor, critic, seqs, args, 0)
    assert stats["critic/clipfrac"] == pytest.approx(0.5)  # epoch 1: 0 (V = V_old); epoch 2: every token clipped
    args.critic.value_clip = None
    stats = _update(actor, critic, seqs, args, 0)
    assert stats["critic/clipfrac"] == 0.0


# ---------------------------------------------------------------------------------------------- script surface
def test_main_refuses_a_warmup_as_long_as_the_run_before_loading_anything():
    args = Args()
    args.train.max_steps, args.critic.warmup_steps = 5, 5
    with pytest.raises(ValueError, match="--critic.warmup-steps 5 must be in"):
        main(args)


def test_import_has_no_side_effects_and_defaults():
    args = Args()
    assert args.exp_name == "ppo"
    assert args.actor.model.name_or_path == "cleanrlhf/tiny-sft" and args.critic.name_or_path is None
    assert args.algo.kl_coef > 0 and args.algo.kl_estimator == "k1" and args.algo.whiten_advantages
    assert args.algo.gamma == 1.0 and 0 < args.algo.lam <= 1 and args.critic.value_clip is not None


def test_help_lists_grouped_flags():
    out = subprocess.run([sys.executable, str(REPO / "algos" / "ppo.py"), "--help"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--actor.lr", "--algo.clip-high", "--actor.model.name-or-path", "--critic.name-or-path",
                 "--critic.lr", "--critic.value-clip", "--critic.warmup-steps", "--reward.func", "--rollout.n-samples",
                 "--algo.kl-coef", "--algo.gamma", "--algo.lam", "--algo.whiten-advantages", "--vllm.sync-bucket-mb",
                 "--ds.zero-stage", "--eval.k", "--train.ranks", "--ray.num-cpus", "--rollout.env-file",
                 "--rollout.max-turns", "--rollout.max-total-tokens"):  # fmt: skip
        assert flag in out.stdout, flag


@pytest.mark.slow
def test_ppo_raises_eval_pass_at_1_from_the_warm_start(tmp_path):
    """A short run of the real loop (actor + critic + frozen reference + in-process vLLM + weight sync) learns."""
    summary, rows = short_rl_run(main, Args(), tmp_path / "run")
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
    train_rows = [row for row in rows if "loss/value" in row]
    assert len(train_rows) == 12
    for key in ("loss/value", "loss/policy", "loss/kl", "critic/values_mean", "critic/explained_variance",
                "critic/clipfrac", "rollout/reward_mean"):  # fmt: skip
        assert all(math.isfinite(row[key]) for row in train_rows), key
    assert train_rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-4)  # the first rollout's policy is the reference
    # the critic tracks the reward level: over the last 5 steps its mean value is within 0.05 of the mean return
    gaps = [abs(r["critic/values_mean"] - r["critic/returns_mean"]) for r in train_rows[-5:]]
    assert sum(gaps) / 5 < 0.05, gaps
    assert (tmp_path / "run" / "hf" / "config.json").exists()


@pytest.mark.slow
def test_two_ray_ranks_train_like_one_process(tmp_path):
    """`--train.ranks 2`: Ray placement group, two ZeRO-3 ranks in one DeepSpeed world (gloo), each with an actor and
    a critic engine, the vLLM engine as a Ray actor colocated with them, weights broadcast from rank 0, `--debug`
    checking engine == trainer log-probs after every sync. Samples are seeded by their place in the global batch, so
    the first step sees the same rollout as one process; the old log-probs, reference log-probs and old values are
    gathered from both ranks, so the KL, GAE and the whitened advantages are the same, and the update (each rank a
    share of every minibatch of both engines, the token mean over both) gives the same losses and gradient norms."""

    rows = ranks_2_vs_1(Args, main, tmp_path, zero3_other_reference)
    assert_first_step_agrees(rows, ("loss/value", "critic/grad_norm", "critic/clipfrac", "critic/values_mean",
                                    "critic/returns_mean", "critic/explained_variance"))  # fmt: skip
