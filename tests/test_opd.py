"""algos/opd.py: the per-token distillation advantage by hand, the loss it feeds, the teacher's checks and group, the
CLI, and a short learning run from the warm start with the embedded GRPO teacher."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import f32_rtol, ranks_2_vs_1, short_rl_run

from algos.opd import Args, check_teacher, distill_advantages, main, policy_loss
from core import launch

REPO = Path(__file__).resolve().parent.parent


def test_distill_advantage_is_teacher_minus_student_per_token():
    # A_t = log π_T − log π_old: −0.5 − (−1.0) = 0.5 (the teacher likes the token more: push it up),
    #                            −1.0 − (−0.25) = −0.75 (the student likes it more than the teacher: push it down)
    adv = distill_advantages(torch.tensor([[-0.5, -1.0]]), torch.tensor([[-1.0, -0.25]]), torch.ones(1, 2))
    assert torch.allclose(adv, torch.tensor([[0.5, -0.75]]))


def test_distill_advantage_is_zero_off_the_mask():
    # row 0: 2 response tokens then padding; row 1: a prompt position (mask 0), 2 response tokens. The values under the
    # mask are garbage (NaN included) and must not leak. Valid: −0.2 − (−0.7) = 0.5, −3 − (−1) = −2; −1 − (−1) = 0,
    # −0.1 − (−2.1) = 2.
    teacher = torch.tensor([[-0.2, -3.0, float("nan")], [5.0, -1.0, -0.1]])
    student = torch.tensor([[-0.7, -1.0, -4.0], [-9.0, -1.0, -2.1]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    adv = distill_advantages(teacher, student, mask)
    assert torch.allclose(adv, torch.tensor([[0.5, -2.0, 0.0], [0.0, 0.0, 2.0]]))


def test_task_advantage_is_added_to_every_token_times_the_coefficient():
    # the per-token term of the first case, [0.5, −0.75] and [0.0, 0.25] (−1 − (−1), −0.5 − (−0.75)), plus
    # λ · A_i with λ = 0.5, A = (+1, −1): row 0 + 0.5 → [1.0, −0.25]; row 1 − 0.5 → [−0.5, masked 0]
    teacher = torch.tensor([[-0.5, -1.0], [-1.0, -0.5]])
    student = torch.tensor([[-1.0, -0.25], [-1.0, -0.75]])
    mask = torch.tensor([[1, 1], [1, 0]])
    task = torch.tensor([1.0, -1.0])
    adv = distill_advantages(teacher, student, mask, task, reward_coef=0.5)
    assert torch.allclose(adv, torch.tensor([[1.0, -0.25], [-0.5, 0.0]]))
    # λ = 0 (the default): the task advantage is ignored, pure distillation
    assert torch.allclose(distill_advantages(teacher, student, mask, task), torch.tensor([[0.5, -0.75], [0.0, 0.0]]))


def test_policy_loss_at_ratio_one_is_minus_the_token_mean_advantage():
    # 3 valid tokens with A = 0.5, −0.75, 2.0 (the hand cases above); at ρ = 1 nothing is clipped:
    # loss = −(0.5 − 0.75 + 2.0) / 3 = −1.75 / 3, and ∂loss/∂logp_t = −A_t / 3 on valid tokens, 0 elsewhere
    teacher = torch.tensor([[-0.5, -1.0, 0.0], [0.0, -0.1, 0.0]])
    student = torch.tensor([[-1.0, -0.25, -3.0], [-2.0, -2.1, -1.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    adv = distill_advantages(teacher, student, mask)
    logp = student.clone().requires_grad_(True)
    loss, metrics, _ = policy_loss(logp, student, adv, mask, num_tokens=3, num_seqs=2)
    assert loss.item() == pytest.approx(-1.75 / 3)
    assert metrics["loss/clipfrac"].item() == 0.0
    loss.backward()
    expected = torch.tensor([[-0.5, 0.75, 0.0], [0.0, -2.0, 0.0]]) / 3
    assert torch.allclose(logp.grad, expected)


def test_teacher_with_another_tokenizer_is_refused_naming_the_flag():
    """The embedded chat model's BPE vocabulary is not the warm start's character one: main refuses it before
    loading any model. A teacher with the student's tokenizer (the untrained `cleanrlhf/tiny`) passes."""
    args = Args()
    args.teacher.model = "cleanrlhf/tiny-chat"
    with pytest.raises(ValueError, match=r"--teacher.model 'cleanrlhf/tiny-chat': its tokenizer \(\d+ tokens\)"):
        main(args)
    args.teacher.model = "cleanrlhf/tiny"
    check_teacher(args)


def test_teacher_group_layout():
    """opd.py declares its teacher's group from `--teacher.*`; core places it by the flags' values."""
    from core.placement import group

    args = Args()
    args.teacher.ranks, args.teacher.colocate = 2, False
    layout = launch.group_layout({"teacher": group(args.teacher)}, 2)
    assert {r: (g.ranks, g.colocate) for r, g in layout.items()} == {"teacher": (2, False)}
    args.teacher.ranks, args.teacher.colocate = 3, True
    with pytest.raises(ValueError, match=r"--teacher.ranks 3 colocated: .*--teacher.no-colocate"):
        launch.group_layout({"teacher": group(args.teacher)}, 2)
    assert launch.group_layout({"teacher": group(Args().teacher)}, 1) == {}  # the default: in the trainer process


def test_help_lists_the_teacher_and_algo_flags():
    out = subprocess.run([sys.executable, str(REPO / "algos" / "opd.py"), "--help"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--teacher.model", "--teacher.ranks", "--teacher.zero-stage", "--teacher.offload",
                 "--algo.reward-coef", "--algo.kl-coef", "--actor.model.name-or-path", "--rollout.n-samples"):  # fmt: skip
        assert flag in out.stdout, flag
    assert "--algo.filter-zero-variance" not in out.stdout and "--algo.dr-grpo" not in out.stdout


@pytest.mark.slow
def test_opd_raises_eval_pass_at_1_from_the_warm_start(tmp_path):
    """12 steps of distillation from the GRPO teacher (pure: λ = 0, the task reward only logged) with `--debug`: the
    student's greedy pass@1 rises by 0.1 or more from the 0.48 warm start (measured 0.832 on 2026-11-30), and the
    reverse KL to the teacher falls."""
    summary, rows = short_rl_run(main, Args(), tmp_path / "run", steps=12)
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
    kl = [r["opd/reverse_kl"] for r in rows if "opd/reverse_kl" in r]
    assert len(kl) == 12 and kl[0] > 0 and sum(kl[-5:]) / 5 < kl[0], kl
    # samples.jsonl shows each token's advantage as the teacher's log-prob minus the sampling policy's (the trainer's
    # log-prob over the ratio): the per-token columns line up with the tokens the loss saw
    traced = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl") if '"kind": "train"' in line]
    assert len(traced) == 12 * 8
    for r in traced:
        t = r["tokens"]
        old = [lp - math.log(ratio) for lp, ratio in zip(t["trainer_logp"], t["ratio"])]
        assert t["advantage"] == pytest.approx([te - o for te, o in zip(t["teacher_logp"], old)], abs=1e-3), r
    assert (tmp_path / "run" / "hf" / "config.json").exists()


@pytest.mark.slow
def test_teacher_group_of_two_zero3_ranks_equals_the_in_trainer_teacher(tmp_path):
    """2 trainer ranks with the teacher as a Ray group of 2 ZeRO-3 ranks on their bundles (`--teacher.ranks 2`),
    against one process holding the whole teacher: the same samples, reverse KL and losses."""

    def configure(args, ranks):
        if ranks == 2:
            args.teacher.ranks, args.teacher.zero_stage = 2, 3

    summaries = {}
    rows = ranks_2_vs_1(Args, main, tmp_path, configure, summaries)
    assert len(rows[2]) == 2 and summaries[2]["groups"] == {"teacher": {"ranks": 2, "colocated": True, "calls": 2}}
    first2, first1 = rows[2][0], rows[1][0]
    assert first2["rollout/reward_mean"] == first1["rollout/reward_mean"]  # the same samples
    assert first1["opd/reverse_kl"] > 0.01
    for key in ("opd/reverse_kl", "loss/policy", "train/grad_norm", "loss/clipfrac"):  # 16 x 8 rows of <= 16 tokens
        assert first2[key] == pytest.approx(first1[key], rel=max(1e-4, f32_rtol(16 * 8 * 16)), abs=1e-6), key
