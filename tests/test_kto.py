"""Tests for algos/kto.py: the loss by hand and by its properties, mismatched pairs, bad rows, and a short run that
must raise the held-out log-likelihood gap between desirable and undesirable completions."""

import json
import math
from functools import partial

import pytest
import torch

from algos.kto import Args, EvalArgs, TrainArgs, kto_example, kto_loss, main, mismatched, seq_logps
from core import data, packing
from core.config import DataConfig, LoggerConfig

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def t(*xs):
    return torch.tensor(xs, dtype=F64)


def sig(x):
    return 1 / (1 + math.exp(-x))


# ----------------------------------------------------------------------------------------------------- the loss
def test_kto_loss_hand_computed():
    # r = π − ref = 2, z = 1, β = 0.5:  desirable 1 − σ(0.5) = 0.37754...;  undesirable 1 − σ(−0.5) = 0.62245...
    loss, rewards = kto_loss(t(-1.0), t(-3.0), torch.tensor([True]), 1.0, beta=0.5)
    assert loss.item() == pytest.approx(1 - sig(0.5)) and rewards.item() == pytest.approx(1.0)  # β r
    loss, _ = kto_loss(t(-1.0), t(-3.0), torch.tensor([False]), 1.0, beta=0.5)
    assert loss.item() == pytest.approx(1 - sig(-0.5))
    # weights: λ_D = 2, λ_U = 0.5, mean over the two examples
    loss, _ = kto_loss(t(-1.0, -1.0), t(-3.0, -3.0), torch.tensor([True, False]), 1.0, 0.5, 2.0, 0.5)
    assert loss.item() == pytest.approx((2 * (1 - sig(0.5)) + 0.5 * (1 - sig(-0.5))) / 2)


@pytest.mark.parametrize("seed", range(4))
def test_kto_loss_properties(seed):
    g = torch.Generator().manual_seed(seed)
    pol, ref = -10 * torch.rand(16, generator=g, dtype=F64), -10 * torch.rand(16, generator=g, dtype=F64)
    good = torch.rand(16, generator=g) < 0.5
    z, beta = 0.3, 0.2
    loss, _ = kto_loss(pol, ref, good, z, beta)
    assert 0 < loss.item() < 1  # λ_y − v with v in (0, λ_y)
    # at r = z every example's loss is λ_y / 2
    assert kto_loss(ref + z, ref, good, z, beta)[0].item() == pytest.approx(0.5)
    # mirror symmetry: desirable at r and undesirable at 2z − r lose the same
    a = kto_loss(pol, ref, torch.ones(16, dtype=torch.bool), z, beta)[0]
    b = kto_loss(2 * z + 2 * ref - pol, ref, torch.zeros(16, dtype=torch.bool), z, beta)[0]
    torch.testing.assert_close(a, b)
    # gradients: desirable completions are pushed up, undesirable ones down; nothing flows into z
    pol = pol.clone().requires_grad_(True)
    kl = torch.tensor(z, dtype=F64, requires_grad=True)
    kto_loss(pol, ref, good, kl, beta)[0].backward()
    assert (pol.grad[good] < 0).all() and (pol.grad[~good] > 0).all()
    assert kl.grad is None
    # d/dπ of (1 − σ(β(r − z))) / B = −β σ(1 − σ) / B for desirable examples
    s = torch.sigmoid(beta * (pol.detach() - ref - z))
    torch.testing.assert_close(pol.grad[good], (-beta * s * (1 - s) / 16)[good])


def test_kto_reference_point_shifts_the_value():
    # raising z (policy drifted away from the reference in general) lowers desirable value, raises undesirable value
    good, bad = torch.tensor([True]), torch.tensor([False])
    assert kto_loss(t(0.0), t(0.0), good, 1.0, 1.0)[0] > kto_loss(t(0.0), t(0.0), good, 0.0, 1.0)[0]
    assert kto_loss(t(0.0), t(0.0), bad, 1.0, 1.0)[0] < kto_loss(t(0.0), t(0.0), bad, 0.0, 1.0)[0]


# ------------------------------------------------------------------------------------------- examples and data
def test_mismatched_pair_is_prompt_i_with_completion_j(tokenizer):
    a = kto_example(
        {"prompt": "1+2=", "completion": "3", "label": True}, tokenizer, DataConfig(), "completion", "label"
    )
    b = kto_example({"prompt": "40+50=", "completion": "91", "label": False}, tokenizer, DataConfig(), "completion",
                    "label")  # fmt: skip
    m = mismatched(a, b)
    assert tokenizer.decode(m["input_ids"]) == "<s>1+2=91</s>"
    assert tokenizer.decode([x for x, k in zip(m["input_ids"], m["loss_mask"]) if k]) == "91</s>"
    assert a["desirable"] and not b["desirable"] and a["prompt"] == "1+2="


def test_seq_logps_packed_equal_padded(tiny_model, tokenizer):
    exs = [kto_example({"prompt": p, "completion": c, "label": 1}, tokenizer, DataConfig(), "completion", "label")
           for p, c in [("1+2=", "3"), ("40+50=", "90"), ("7+7=", "41")]]  # fmt: skip
    got = seq_logps(tiny_model, exs, "cpu")
    for ex, g in zip(exs, got):
        b = packing.collate_padded([ex], tokenizer.pad_token_id)
        torch.testing.assert_close(g, (packing.token_logprobs(tiny_model, b) * b["loss_mask"]).sum(), atol=1e-4,
                                   rtol=1e-5)  # fmt: skip


GOOD = {"prompt": "1+2=", "completion": "3", "label": True}


@pytest.mark.parametrize(
    "row,key,reason",
    [
        ({"prompt": "1+2=", "completion": "3"}, "label", "missing"),
        ({"prompt": "1+2=", "completion": "3", "label": "yes"}, "label", "true or false"),
        ({"prompt": "1+2=", "label": True}, "completion", "missing"),
        ({"prompt": "1+2=", "completion": " ", "label": False}, "completion", "empty"),
    ],
)
def test_bad_row_raises_naming_file_row_and_key(tmp_path, tokenizer, row, key, reason):
    f = tmp_path / "k.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps(row) + "\n")
    cfg = DataConfig(on_bad_row="raise")
    make = partial(kto_example, tokenizer=tokenizer, cfg=cfg, completion_key="completion", desirable_key="label")
    with pytest.raises(ValueError) as err:
        data.build_examples(data.load_sources(str(f), "train"), make, cfg)
    msg = str(err.value)
    assert str(f) in msg and "row 1" in msg and repr(key) in msg and reason in msg


def test_batch_of_one_is_refused():
    with pytest.raises(ValueError, match="mismatched"):
        main(Args(train=TrainArgs(batch_size=1)))


# ----------------------------------------------------------------------------------------------- training run
@pytest.mark.slow
def test_kto_raises_held_out_log_likelihood_gap(tmp_path):
    args = Args(
        train=TrainArgs(),  # the defaults: 80 steps of 128 examples
        eval=EvalArgs(every=40, max_samples=400),
        logger=LoggerConfig(run_root=str(tmp_path), tensorboard=False, quiet=True),
        run_dir=str(tmp_path / "run"),
    )
    summary = main(args)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [r for r in rows if "eval/logp_gap" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval/pref_accuracy"] == pytest.approx(0.5, abs=0.05)
    gaps = [r["eval/logp_gap"] for r in evals]
    assert gaps[-1] > gaps[0] + 1.0, gaps  # nats: desirable answers gained on undesirable ones
    assert evals[-1]["eval/reward_desirable"] > evals[-1]["eval/reward_undesirable"]
    assert summary["eval_pref_accuracy_last"] > 0.75, summary
    for key in ("loss/kto", "train/kl", "train/reward_desirable", "train/reward_undesirable", "train/desirable_frac",
                "train/grad_norm", "perf/step_s"):  # fmt: skip
        assert key in rows[-1] and math.isfinite(rows[-1][key]), key
    assert all(r["train/kl"] >= 0 for r in rows if "train/kl" in r)
