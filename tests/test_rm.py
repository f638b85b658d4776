"""Tests for algos/rm.py: the pairwise loss by hand and by its properties, packed scores against padded and HF scores,
bad pairs, and a short run that must reach >= 90 % held-out pair accuracy and export a model that
`AutoModelForSequenceClassification` loads, with the reward statistics the server normalizes with."""

import json
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from algos.rm import Args, EvalArgs, TrainArgs, main, packed_scores, padded_scores, pair_scores, reward_loss
from core import data, models
from core.config import DataConfig, LoggerConfig
from rewards.server import RewardScorer

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def r(*xs):
    return torch.tensor(xs, dtype=F64)


# ----------------------------------------------------------------------------------------------------- the loss
def test_reward_loss_hand_computed():
    # r_c − r_r = 1: −log σ(1) = log(1 + e^−1) = 0.31326...
    assert reward_loss(r(1.0), r(0.0)).item() == pytest.approx(math.log1p(math.exp(-1.0)))
    # margin 0.5: −log σ(1 − 0.5)
    assert reward_loss(r(1.0), r(0.0), margin=r(0.5)).item() == pytest.approx(math.log1p(math.exp(-0.5)))
    # mean over pairs; equal rewards give log 2
    assert reward_loss(r(1.0, 3.0), r(0.0, 3.0)).item() == pytest.approx((math.log1p(math.exp(-1)) + math.log(2)) / 2)
    assert reward_loss(r(1.0), r(0.0), kind="logexp").item() == pytest.approx(math.log1p(math.exp(-1.0)))


@pytest.mark.parametrize("seed", range(4))
def test_reward_loss_properties(seed):
    g = torch.Generator().manual_seed(seed)
    rc, rr = torch.randn(32, generator=g, dtype=F64) * 3, torch.randn(32, generator=g, dtype=F64) * 3
    # logexp is the same function as sigmoid without a margin
    torch.testing.assert_close(reward_loss(rc, rr, kind="logexp"), reward_loss(rc, rr))
    # swapping chosen and rejected: per pair −log σ(d) − (−log σ(−d)) = −d
    torch.testing.assert_close(reward_loss(rc, rr) - reward_loss(rr, rc), -(rc - rr).mean())
    # a margin is a shift of the rejected reward; zero margin is no margin
    m = torch.rand(32, generator=g, dtype=F64)
    torch.testing.assert_close(reward_loss(rc, rr, margin=m), reward_loss(rc, rr + m))
    torch.testing.assert_close(reward_loss(rc, rr, margin=torch.zeros(32, dtype=F64)), reward_loss(rc, rr))
    # gradient: d/dr_c = −σ(−(r_c − r_r)) / P, opposite for r_r
    rc, rr = rc.clone().requires_grad_(True), rr.clone().requires_grad_(True)
    reward_loss(rc, rr).backward()
    torch.testing.assert_close(rc.grad, -torch.sigmoid(-(rc - rr)).detach() / 32)
    torch.testing.assert_close(rr.grad, -rc.grad)


def test_reward_loss_extremes_and_errors():
    for kind in ("sigmoid", "logexp"):
        assert torch.isfinite(reward_loss(r(-1e4), r(1e4), kind=kind))  # softplus, not log(1 + exp) overflow
        assert reward_loss(r(1e4), r(-1e4), kind=kind).item() == 0.0
    with pytest.raises(ValueError, match="no margin"):
        reward_loss(r(1.0), r(0.0), margin=r(0.5), kind="logexp")
    with pytest.raises(ValueError, match="unknown reward loss"):
        reward_loss(r(1.0), r(0.0), kind="hinge")
    assert F.softplus(r(2.0)).item() == pytest.approx(math.log1p(math.exp(2.0)))


# ------------------------------------------------------------------------------------------------ scoring
def test_packed_scores_equal_padded_and_hf_scores(tiny_path, tokenizer):
    torch.manual_seed(0)
    model = models.load_scalar_model(str(tiny_path), "fp32").eval()
    seqs = [data.reward_ids(tokenizer, t) for t in ["1+2=3", "11+22=33", "5+5=10", "99+1=100", "0+0=0"]]
    with torch.no_grad():
        packed = packed_scores(models.TokenValues(model), seqs, "cpu")
        padded = padded_scores(model, seqs, tokenizer.pad_token_id, "cpu")
        hf = torch.cat([model(input_ids=torch.tensor([s])).logits[:, 0] for s in seqs])
    torch.testing.assert_close(packed, hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, hf, atol=1e-5, rtol=1e-5)
    assert packed.unique().numel() == len(seqs)


def test_prefix_shared_pair_scores_equal_padded(tiny_path, tokenizer):
    """Chosen and rejected branching off their shared prompt score as they do alone, also in the gradient."""
    torch.manual_seed(0)
    model = models.load_scalar_model(str(tiny_path), "fp32")
    texts = [("1+2=3", "1+2=4"), ("11+22=33", "11+22=43"), ("5+5=10", "5+5=0"), ("99+1=100", "99+1=10")]
    pairs = [{"chosen": data.reward_ids(tokenizer, c), "rejected": data.reward_ids(tokenizer, r)} for c, r in texts]
    grads = {}
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        rc, rr = pair_scores(models.TokenValues(model), pairs, "cpu", share_prompt=share)
        (rc - 2 * rr).sum().backward()
        grads[share] = [p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            want = padded_scores(model, [p[k] for k in ("chosen", "rejected") for p in pairs], 0, "cpu")
        torch.testing.assert_close(torch.cat([rc, rr]).detach(), want, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 + 2e-6 * b.abs().max().item())


def test_reward_ids_appends_one_eos(tokenizer):
    ids = data.reward_ids(tokenizer, "1+2=3")
    assert (
        ids[0] == tokenizer.bos_token_id
        and ids[-1] == tokenizer.eos_token_id
        and ids.count(tokenizer.eos_token_id) == 1
    )
    assert data.reward_ids(tokenizer, "1+2=3" + tokenizer.eos_token) == ids
    assert data.reward_ids(tokenizer, "1+2=3", add_special_tokens=False) == ids[1:]


# --------------------------------------------------------------------------------------------------- bad input
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return str(path)


GOOD = {"prompt": "1+2=", "chosen": "3", "rejected": "4", "m": 0.5}


@pytest.mark.parametrize(
    "row,key,reason",
    [
        ({"prompt": "1+2=", "rejected": "4", "m": 1.0}, "chosen", "missing"),
        ({"prompt": "1+2=", "chosen": "3", "m": 1.0}, "rejected", "missing"),
        ({"prompt": "1+2=", "chosen": "3", "rejected": "3", "m": 1.0}, "rejected", "identical"),
        ({"prompt": "1+2=", "chosen": "3", "rejected": "", "m": 1.0}, "rejected", "empty"),
        ({"prompt": "", "chosen": "3", "rejected": "4", "m": 1.0}, "prompt", "empty"),
        ({"prompt": "1+2=", "chosen": "3", "rejected": "4"}, "m", "missing"),
    ],
)
def test_bad_pair_raises_naming_file_row_and_key(tmp_path, tokenizer, row, key, reason):
    f = write_jsonl(tmp_path / "p.jsonl", [GOOD, row])
    cfg = DataConfig(on_bad_row="raise")
    make = partial(data.reward_pair_example, tokenizer=tokenizer, cfg=cfg, margin_key="m")
    with pytest.raises(ValueError) as err:
        data.build_examples(data.load_sources(f, "train"), make, cfg)
    msg = str(err.value)
    assert f in msg and "row 1" in msg and repr(key) in msg and reason in msg


def test_bad_pairs_are_skipped_and_counted(tmp_path, tokenizer):
    rows = [GOOD, {"prompt": "1+2=", "chosen": "3", "rejected": "3"}, {"prompt": "1+2=", "chosen": "3"}, GOOD]
    logs = []
    make = partial(data.reward_pair_example, tokenizer=tokenizer, cfg=DataConfig())
    (pairs,) = data.build_examples(data.load_sources(write_jsonl(tmp_path / "p.jsonl", rows), "train"), make,
                                   DataConfig(), logs.append)  # fmt: skip
    assert len(pairs) == 2 and "skipped 2 of 4 rows" in logs[0]
    assert tokenizer.decode(pairs[0]["chosen"]) == "<s>1+2=3</s>" and pairs[0]["margin"] == 0.0
    with pytest.raises(data.BadRow, match="must hold a number"):
        data.reward_pair_example({**GOOD, "m": "big"}, tokenizer, DataConfig(), margin_key="m")


def test_margin_with_logexp_is_refused():
    with pytest.raises(ValueError, match="margin"):
        main(Args(margin_key="m", train=TrainArgs(loss="logexp")))


# ----------------------------------------------------------------------------------------------- training run
@pytest.mark.slow
def test_rm_reaches_90_percent_held_out_accuracy_and_exports_a_servable_model(tmp_path):
    args = Args(
        train=TrainArgs(),  # the defaults: 150 steps of 128 pairs
        eval=EvalArgs(every=75, max_samples=500),
        logger=LoggerConfig(run_root=str(tmp_path), tensorboard=False, quiet=True),
        run_dir=str(tmp_path / "run"),
    )
    summary = main(args)
    assert summary["eval_accuracy_last"] >= 0.9, summary
    assert summary["eval_accuracy_first"] < 0.8  # a fresh head on the SFT body does not already rank the pairs
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    for key in ("loss/rm", "train/accuracy", "train/margin", "train/chosen_reward", "train/rejected_reward",
                "train/grad_norm", "perf/step_s", "perf/tokens_per_s"):  # fmt: skip
        assert key in rows[-1] and math.isfinite(rows[-1][key]), key
    assert rows[-1]["loss/rm"] < 0.4
    # the export: AutoModelForSequenceClassification, with the statistics of the held-out rewards in its config
    export = summary["export_dir"]
    hf = AutoModelForSequenceClassification.from_pretrained(export)
    assert hf.config.num_labels == 1
    assert hf.config.reward_mean == pytest.approx(summary["reward_mean"]) and hf.config.reward_std > 0
    # served (normalized) scores rank the held-out pairs as well as training's eval did, and are standardized
    test = [json.loads(line) for line in open(data.resolve_data("cleanrlhf/add2-pref") + "/test.jsonl")]
    scorer = RewardScorer(export, normalize=True)
    chosen = scorer([x["prompt"] + x["chosen"] for x in test])
    rejected = scorer([x["prompt"] + x["rejected"] for x in test])
    assert sum(c > r for c, r in zip(chosen, rejected)) / len(test) == pytest.approx(
        summary["eval_accuracy_last"], abs=0.005
    )
    both = torch.tensor(chosen + rejected)
    assert abs(both.mean().item()) < 1e-3 and both.std().item() == pytest.approx(1.0, abs=1e-3)
