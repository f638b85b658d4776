"""Tests for algos/dpo.py: the loss by hand and by its properties, the embedded preference data, bad pairs, packed
log-probs against padded ones, and a short run that must lift held-out preference accuracy to >= 90 %."""

import json
import math
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from algos.dpo import Args, EvalArgs, TrainArgs, dpo_loss, main, micro_batches, pair_logps
from core import data, packing, preference
from core import engine as ds_engine
from core.config import DataConfig, LoggerConfig, ModelConfig

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def logps(*xs):
    return torch.tensor(xs, dtype=F64)


# ----------------------------------------------------------------------------------------------------- the loss
def test_dpo_loss_hand_computed():
    # h = (−1 − (−3)) − (−2 − (−2)) = 2;  β h = 0.2;  loss = −log σ(0.2) = log(1 + e^−0.2) = 0.598139...
    loss, rc, rr = dpo_loss(logps(-1.0), logps(-3.0), logps(-2.0), logps(-2.0), beta=0.1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.2)), abs=1e-12)
    assert rc.item() == pytest.approx(0.1 * (-1.0 + 2.0)) and rr.item() == pytest.approx(0.1 * (-3.0 + 2.0))
    # cDPO, ε = 0.25: 0.75 · log(1 + e^−0.2) + 0.25 · log(1 + e^0.2)
    loss, _, _ = dpo_loss(logps(-1.0), logps(-3.0), logps(-2.0), logps(-2.0), beta=0.1, label_smoothing=0.25)
    assert loss.item() == pytest.approx(0.75 * math.log1p(math.exp(-0.2)) + 0.25 * math.log1p(math.exp(0.2)))
    # IPO, β = 0.5: (h − 1/(2β))² = (2 − 1)² = 1
    loss, _, _ = dpo_loss(logps(-1.0), logps(-3.0), logps(-2.0), logps(-2.0), beta=0.5, ipo=True)
    assert loss.item() == pytest.approx(1.0)
    # mean over pairs: h = 0 gives log 2 whatever β
    loss, _, _ = dpo_loss(logps(-1.0, -5.0), logps(-3.0, -5.0), logps(-2.0, -5.0), logps(-2.0, -5.0), beta=0.1)
    assert loss.item() == pytest.approx((math.log1p(math.exp(-0.2)) + math.log(2)) / 2)


def random_batch(seed, n=16):
    g = torch.Generator().manual_seed(seed)
    return [-10 * torch.rand(n, generator=g, dtype=F64) for _ in range(4)]


@pytest.mark.parametrize("seed", range(5))
def test_swapping_chosen_and_rejected_flips_h(seed):
    pc, pr, rc, rr = random_batch(seed)
    beta = 0.3
    loss, c1, r1 = dpo_loss(pc, pr, rc, rr, beta)
    h = (pc - pr) - (rc - rr)
    # per pair: loss(h) and loss(−h) are −log σ(βh) and −log σ(−βh); their difference is −βh (log σ(x) − log σ(−x) = x)
    swapped, c2, r2 = dpo_loss(pr, pc, rr, rc, beta)
    torch.testing.assert_close(swapped - loss, (beta * h).mean())
    torch.testing.assert_close(c2, r1)
    torch.testing.assert_close(r2, c1)
    torch.testing.assert_close(c1 - r1, beta * h)  # the reward margin is β h


def test_label_smoothing_zero_is_plain_dpo_and_smoothing_is_symmetric():
    pc, pr, rc, rr = random_batch(7)
    plain, _, _ = dpo_loss(pc, pr, rc, rr, 0.1)
    h = (pc - pr) - (rc - rr)
    torch.testing.assert_close(plain, -F.logsigmoid(0.1 * h).mean())
    torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, 0.1, label_smoothing=0.0)[0], plain)
    # ε = 0.5 does not care which response was chosen
    a = dpo_loss(pc, pr, rc, rr, 0.1, label_smoothing=0.5)[0]
    b = dpo_loss(pr, pc, rr, rc, 0.1, label_smoothing=0.5)[0]
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("beta", [0.05, 0.1, 0.5, 2.0])
def test_ipo_minimum_at_one_over_two_beta(beta):
    target = 1.0 / (2.0 * beta)
    hs = torch.linspace(target - 3, target + 3, 601, dtype=F64)
    zero = torch.zeros_like(hs)
    losses = torch.stack([dpo_loss(h[None], zero[:1], zero[:1], zero[:1], beta, ipo=True)[0] for h in hs])
    assert hs[losses.argmin()].item() == pytest.approx(target, abs=0.01)
    assert losses.min().item() == pytest.approx(0.0, abs=1e-4)
    # and the gradient vanishes exactly there
    h = torch.tensor([target], dtype=F64, requires_grad=True)
    dpo_loss(h, zero[:1], zero[:1], zero[:1], beta, ipo=True)[0].backward()
    assert h.grad.abs().item() < 1e-12


def test_gradients_push_chosen_up_rejected_down_and_ignore_reference():
    pc, pr, rc, rr = (x.clone().requires_grad_(True) for x in random_batch(3, n=8))
    loss, c, r = dpo_loss(pc, pr, rc, rr, 0.1)
    loss.backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()  # descending the loss raises π_c, lowers π_r
    torch.testing.assert_close(pc.grad, -pr.grad)
    # d loss / d π_c = −β σ(−βh) / P
    h = (pc - pr - rc + rr).detach()
    torch.testing.assert_close(pc.grad, -0.1 * torch.sigmoid(-0.1 * h) / 8)
    assert not c.requires_grad and not r.requires_grad  # rewards are detached statistics


def test_dpo_loss_is_finite_for_extreme_margins():
    big = logps(0.0, -1e4)
    loss, _, _ = dpo_loss(big, big.flip(0), logps(0.0, 0.0), logps(0.0, 0.0), beta=1.0)
    assert torch.isfinite(loss)


# -------------------------------------------------------------------------------------------- embedded pairs
def test_embedded_pairs_deterministic_plausible_and_held_out():
    train, test = preference.embedded.task_rows(2, 0)
    a, b = preference.pair_rows(train[:300], 0), preference.pair_rows(train[:300], 0)
    assert a == b and a != preference.pair_rows(train[:300], 1)
    for row in a:
        correct, wrong = row["chosen"], row["rejected"]
        assert correct == row["answer"] and int(correct) == sum(int(x) for x in row["prompt"][:-1].split("+"))
        assert wrong != correct and int(wrong) >= 0 and len(wrong) == len(correct)  # same width: only digits differ
        assert wrong in preference.wrong_answers(correct, row["prompt"])[row["kind"]]
    assert {r["kind"] for r in a} == set(preference.KINDS)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert preference.wrong_answers("042", "37+05=") == {"dropped_carry": ["032"], "off_by_ten": ["032", "052"],
                                                         "digit_swap": ["024"]}  # fmt: skip
    assert preference.wrong_answers("125", "58+67=")["dropped_carry"] == ["015"]  # both carries dropped
    assert "dropped_carry" not in preference.wrong_answers("035", "12+23=")  # no carry to drop
    assert preference.wrong_answers("000", "00+00=") == {"off_by_ten": ["010"]}  # swap: same string
    assert preference.wrong_answers("995")["off_by_ten"] == ["985"]  # 1005 does not fit the width
    assert preference.wrong_answers("82") == {"off_by_ten": ["72", "92"], "digit_swap": ["28"]}  # no prompt given


def test_embedded_preference_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEANRLHF_HOME", str(tmp_path))
    pref = data.resolve_data("cleanrlhf/add2-pref")
    rows = [json.loads(line) for line in open(f"{pref}/test.jsonl")]
    assert len(rows) == 500 and set(rows[0]) >= {"prompt", "chosen", "rejected"}
    kto = data.resolve_data("cleanrlhf/add2-kto")
    train = [json.loads(line) for line in open(f"{kto}/train.jsonl")]
    test = [json.loads(line) for line in open(f"{kto}/test.jsonl")]
    assert len({r["prompt"] for r in train}) == len(train)  # unpaired: one completion per train prompt
    assert 0.45 < sum(r["label"] for r in train) / len(train) < 0.55
    assert len(test) == 1000 and sum(r["label"] for r in test) == 500  # both completions of each test prompt
    with pytest.raises(ValueError, match="addN-pref"):
        data.resolve_data("cleanrlhf/mul2-pref")


# --------------------------------------------------------------------------------------------------- bad input
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}
BAD = [
    ({"prompt": "1+2=", "rejected": "4"}, "chosen", "missing"),
    ({"prompt": "1+2=", "chosen": "3"}, "rejected", "missing"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": "3"}, "rejected", "identical"),
    ({"prompt": "1+2=", "chosen": "", "rejected": "4"}, "chosen", "empty"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": "  "}, "rejected", "empty"),
]


def test_non_text_response_is_a_bad_row(tokenizer):
    # (not in a file: a column mixing lists and strings is an arrow schema error, reported by core.data.load_sources)
    with pytest.raises(data.BadRow, match="must hold text") as err:
        data.preference_example({"prompt": "1+2=", "chosen": ["3"], "rejected": "4"}, tokenizer, DataConfig())
    assert err.value.key == "chosen"


@pytest.mark.parametrize("row,key,reason", BAD)
def test_bad_pair_raises_naming_file_row_and_key(tmp_path, tokenizer, row, key, reason):
    f = write_jsonl(tmp_path / "p.jsonl", [GOOD, row])
    cfg = DataConfig(on_bad_row="raise")
    make = partial(data.preference_example, tokenizer=tokenizer, cfg=cfg)
    with pytest.raises(ValueError) as err:
        data.build_examples(data.load_sources(f, "train"), make, cfg)
    assert f in str(err.value) and "row 1" in str(err.value) and repr(key) in str(err.value)
    assert reason in str(err.value)


def test_bad_pairs_are_skipped_and_counted(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "p.jsonl", [GOOD] + [row for row, _, _ in BAD] + [GOOD])
    logs = []
    make = partial(data.preference_example, tokenizer=tokenizer, cfg=DataConfig())
    (pairs,) = data.build_examples(data.load_sources(f, "train"), make, DataConfig(), logs.append)
    assert len(pairs) == 2 and f"skipped {len(BAD)} of {len(BAD) + 2} rows" in logs[0]
    c, r = pairs[0]["chosen"], pairs[0]["rejected"]
    assert tokenizer.decode([t for t, m in zip(c["input_ids"], c["loss_mask"]) if m]) == "3</s>"
    assert tokenizer.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) == "4</s>"


# ------------------------------------------------------------------------------------------- packed forward
@pytest.mark.parametrize("share_prompt", [True, False])
def test_packed_pair_logps_equal_padded(tiny_model, tokenizer, share_prompt):
    rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 10)} for a, b in [(1, 2), (33, 9),
            (70, 70), (5, 55)]]  # fmt: skip
    pairs = [data.preference_example(r, tokenizer, DataConfig()) for r in rows]
    c, r = pair_logps(tiny_model, pairs, "cpu", share_prompt)
    for k, p in enumerate(pairs):
        for name, got in (("chosen", c[k]), ("rejected", r[k])):
            b = packing.collate_padded([p[name]], tokenizer.pad_token_id)
            want = (packing.token_logprobs(tiny_model, b) * b["loss_mask"]).sum()
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_micro_batches_respect_the_token_budget():
    pairs = [{"chosen": {"input_ids": [0] * n}, "rejected": {"input_ids": [0] * n}} for n in [3, 4, 5, 6, 20]]
    groups = micro_batches([0, 1, 2, 3, 4], pairs, 16)
    assert groups == [[0, 1], [2], [3], [4]] and sum(groups, []) == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------------------------------- training run
def run_args(tmp_path, **train) -> Args:
    return Args(
        model=ModelConfig(name_or_path="cleanrlhf/tiny-sft"),
        train=TrainArgs(**train),
        eval=EvalArgs(every=40, max_samples=500),
        logger=LoggerConfig(run_root=str(tmp_path), tensorboard=False, quiet=True),
        run_dir=str(tmp_path / "run"),
    )


@pytest.mark.slow
def test_dpo_raises_held_out_preference_accuracy(tmp_path):
    summary = main(run_args(tmp_path))  # the defaults: 80 steps of 128 pairs
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [r for r in rows if "eval/pref_accuracy" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval/pref_accuracy"] == pytest.approx(0.5, abs=0.05)  # h ≈ 0
    assert summary["eval_pref_accuracy_last"] >= 0.9, summary
    assert evals[-1]["eval/margin"] > 0 and evals[-1]["eval/chosen_reward"] > evals[-1]["eval/rejected_reward"]
    for key in ("loss/dpo", "train/chosen_reward", "train/rejected_reward", "train/margin", "train/reward_accuracy",
                "train/grad_norm", "train/lr", "perf/step_s", "perf/tokens_per_s"):  # fmt: skip
        assert key in rows[-1] and math.isfinite(rows[-1][key]), key
    assert rows[-1]["loss/dpo"] < math.log(2)
    # the export is an ordinary HF causal LM that ranks the held-out pairs better than the warm start did
    assert summary["eval_logp_accuracy_last"] > summary["eval_logp_accuracy_first"]
    assert (tmp_path / "run" / "hf" / "config.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_dpo_live_reference(tmp_path, lora_rank):
    """A live reference (frozen replica, or the LoRA policy with adapters off) equals the policy at step 1 and stays
    behind as the policy moves: the implicit rewards start at 0 and then do not."""
    args = run_args(tmp_path, max_steps=3, live_ref=True, batch_size=16, warmup_steps=1)
    args = replace(args, model=replace(args.model, lora_rank=lora_rank), eval=EvalArgs(every=3, max_samples=32))
    main(args)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert rows[1]["train/chosen_reward"] == pytest.approx(0.0, abs=1e-5)
    assert rows[1]["train/rejected_reward"] == pytest.approx(0.0, abs=1e-5)
    assert abs(rows[3]["train/chosen_reward"]) > 1e-4 and abs(rows[3]["train/rejected_reward"]) > 1e-4


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() and ds_engine.cpp_compiler() is None, reason="needs g++ on CPU")
def test_compiled_dpo_steps_equal_eager(tmp_path):
    """--ds.compile through the prefix-shared 4D-mask forward: the same DPO losses and rewards, step for step."""
    logged = []
    for compiled in (False, True):
        args = run_args(tmp_path / str(compiled), max_steps=4, batch_size=16)
        args = replace(args, eval=EvalArgs(every=0, max_samples=16), ds=replace(args.ds, compile=compiled))
        main(args)
        logged.append([json.loads(line) for line in open(tmp_path / str(compiled) / "run" / "metrics.jsonl")])
    eager, compiled = ([r for r in rows if "loss/dpo" in r] for rows in logged)
    assert [r["step"] for r in eager] == [r["step"] for r in compiled] == [1, 2, 3, 4]
    for a, b in zip(eager, compiled):
        for key in ("loss/dpo", "train/chosen_reward", "train/rejected_reward"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (a["step"], key)


@pytest.mark.slow
def test_dpo_resume_is_exact(tmp_path):
    """Resuming from the step-2 checkpoint (cached reference log-probs restored from it) replays step 3 exactly."""
    args = run_args(tmp_path, max_steps=3, batch_size=16)
    args = replace(args, eval=EvalArgs(every=0, max_samples=16), ckpt=replace(args.ckpt, every=1, keep_last=5))
    main(args)
    ckpt = tmp_path / "run" / "checkpoints"
    (first,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"step": 3,' in line]
    (ckpt / "step_00000002").rename(tmp_path / "forgotten")  # forget the last step: step_00000001 resumes
    (tmp_path / "run" / "summary.json").unlink()  # as a run killed in step 3 (a finished run is refused)
    main(args)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    (again,) = [r for r in rows if r["step"] == 3 and "loss/dpo" in r]  # the replay replaced the first run's row
    for key in ("loss/dpo", "train/chosen_reward", "train/rejected_reward", "train/grad_norm"):
        assert again[key] == pytest.approx(first[key], rel=1e-5, abs=1e-7), key
    with pytest.raises(ValueError, match="max-steps"):  # the cache does not cover steps the first run never planned
        main(replace(args, train=replace(args.train, max_steps=50), ckpt=replace(args.ckpt, allow_changes=True)))


@pytest.mark.slow
def test_two_ranks_zero3_and_tensor_parallel_match_one_rank(tmp_path):
    """torchrun with 2 ranks and ZeRO-3 (reference cache assembled over ranks, pad passes), and with 2 ranks as one
    AutoTP group (`--ds.tensor-parallel-size 2`: both ranks take every pair, each holds half of every layer), log the
    same losses and held-out metrics as one process."""
    import os
    import subprocess
    import sys

    from core.engine import free_port

    common = ["--model.name-or-path", "cleanrlhf/tiny", "--train.max-steps", "2", "--train.batch-size", "16",
              "--eval.every", "2", "--eval.max-samples", "50", "--logger.quiet", "--logger.no-tensorboard"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    script = str(Path(__file__).resolve().parent.parent / "algos" / "dpo.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master-port={free_port()}"]
    runs = {"one": [sys.executable, script, "--ds.zero-stage", "2"], "two": torchrun + [script, "--ds.zero-stage", "3"],
            "tp": torchrun + [script, "--ds.zero-stage", "1", "--ds.tensor-parallel-size", "2"]}  # fmt: skip
    metrics = {}
    for name, cmd in runs.items():
        out = subprocess.run(cmd + common + ["--run-dir", str(tmp_path / name)], env=env, capture_output=True,
                             text=True, timeout=400)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        metrics[name] = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    one = metrics["one"]
    for two in (metrics["two"], metrics["tp"]):
        assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2]
        for key in ("loss/dpo", "train/margin", "train/chosen_logp", "train/grad_norm", "eval/loss", "eval/margin",
                    "eval/logp_accuracy"):  # fmt: skip
            for a, b in zip(one, two):
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a["step"])
