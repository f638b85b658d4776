"""What the model wrote, kept with the run: `<run>/samples.jsonl` (core/samples.py) checked against the step's metrics
and against what the loss saw, across a halt and a resume, and the console panel."""

from __future__ import annotations

import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from core import samples


# --------------------------------------------------------------------------------------------------- units
def test_watch_takes_whole_groups_the_trained_ones_first():
    keep = torch.tensor([False] * 4 + [True] * 4 + [False] * 4 + [True] * 4)  # groups of 4: 1 and 3 trained
    assert samples.watch(keep, 4, 8) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert samples.watch(keep, 4, 10) == [4, 5, 6, 7, 12, 13, 14, 15, 0, 1]  # then the filtered ones, in order
    assert samples.watch(keep, 4, 0) == [] and samples.watch(keep, 4, 100) == list(range(4, 8)) + list(
        range(12, 16)) + list(range(0, 4)) + list(range(8, 12))  # fmt: skip


def test_trace_records_each_watched_row_once_as_the_loss_used_it():
    """Rows of the update's table map back to rollout indices (the kept samples only); a row is recorded the first
    time it passes (the first minibatch pass) with the minibatch it was in, off-mask positions are NaN (null in the
    file), and the values are the tensors given, nothing recomputed: `logp` is stored as `trainer_logp`, the ratio
    and the KL are the loss's own."""
    trace = samples.Trace(watched=[3, 5, 6], rows=[1, 3, 6])  # 5 was filtered: no row
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    logp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, 0.0, -0.5, -0.25]])
    ratio, kl = torch.full((2, 4), 1.25), torch.full((2, 4), 0.5)
    trace.add([1, 2], mask, minibatch=1, logp=logp, old_logp=logp - 0.1, ratio=ratio, advantage=torch.full((2, 4), 0.7),
              kl=kl, entropy=None)  # fmt: skip
    trace.add([1], mask[:1], minibatch=2, logp=logp[:1] * 0, ratio=ratio[:1] * 0)  # a later pass: ignored
    got = trace.gather(1)
    assert sorted(got) == [3, 6] and trace.minibatch == {3: 1, 6: 1}
    nan = float("nan")
    assert got[3]["ratio"][1:3] == pytest.approx([1.25, 1.25]) and got[3]["trainer_logp"][1:3] == [-1.0, -2.0]
    assert got[3]["old_logp"][1:3] == pytest.approx([-1.1, -2.1])
    assert math.isnan(got[3]["ratio"][0]) and math.isnan(got[3]["trainer_logp"][3])
    assert got[6]["kl"][2:] == pytest.approx([0.5, 0.5]) and math.isnan(got[6]["kl"][1])
    assert got[6]["advantage"][2:] == pytest.approx([0.7, 0.7])
    assert "entropy" not in got[3]  # not computed: absent, not zeros
    assert samples._num(nan) is None and samples._num(float("inf")) is None


def test_the_trace_holds_the_ratio_a_sequence_level_loss_used():
    """GSPO's ratio (`--algo.level sequence`) is one number per sequence: the trace shows that number on every token,
    as the loss used it, not a per-token exp(logp − old) recomputed beside it."""
    from algos import grpo

    mask = torch.tensor([[0, 1, 1, 1]])
    old = torch.tensor([[0.0, -1.0, -1.0, -1.0]])
    logp = old + torch.tensor([[0.0, 0.3, -0.3, 0.6]])
    _, _, used = grpo.policy_loss(logp, old, torch.ones(1, 4), mask, level="sequence")
    trace = samples.Trace([0], [0])
    trace.add([0], mask, minibatch=0, logp=logp, old_logp=old, **used)
    ratio = trace.gather(1)[0]["ratio"]
    assert ratio[1:] == pytest.approx([math.exp(0.2)] * 3)  # exp(mean of the sequence's log-ratios)
    assert ratio[1] != pytest.approx(math.exp(0.3))


def test_train_rows_align_tokens_with_the_response_and_advantage_falls_back_to_the_token_mean(tokenizer):
    ids = tokenizer("12+3=", add_special_tokens=False)["input_ids"]
    resp = tokenizer("015", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ep = SimpleNamespace(example={"prompt": "12+3="}, prompt_ids=ids, token_ids=resp, logprobs=[-0.5] * len(resp),
                         action_mask=[1] * len(resp), truncated=False, extra={"format_ok": 1.0})  # fmt: skip
    ro = SimpleNamespace(episodes=[ep, ep])
    trace = samples.Trace([0], [0])
    L = len(ids) + len(resp)
    mask = torch.zeros(1, L + 2, dtype=torch.long)  # a padded table: the response right after the prompt
    mask[0, len(ids) : L] = 1
    adv = torch.where(mask.bool(), torch.arange(L + 2.0), 0.0)
    trace.add([0], mask, minibatch=1, logp=torch.zeros(1, L + 2), old_logp=torch.zeros(1, L + 2), advantage=adv,
              ratio=torch.ones(1, L + 2))  # fmt: skip
    (row,) = samples.train_rows(tokenizer, ro, 1, 2, torch.tensor([1.0, 0.0]), torch.tensor([True, True]), trace,
                                trace.gather(1))  # fmt: skip
    t = row["tokens"]
    assert len(t["text"]) == len(t["engine_logp"]) == len(t["ratio"]) == row["length"] == len(resp)
    assert "".join(t["text"][:-1]) == "015" and t["text"][-1] == tokenizer.eos_token
    assert t["advantage"] == [float(len(ids) + k) for k in range(len(resp))]  # position len(prompt) + k
    assert row["advantage"] == pytest.approx(sum(t["advantage"]) / len(resp)) and row["extra"] == {"format_ok": 1.0}
    assert row["group"] == 0 and row["kept"] and row["reward"] == 1.0 and row["minibatch"] == 1


# --------------------------------------------------------------------------------------- a real grpo.py run
def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_grpo_samples_agree_with_the_metrics_survive_a_resume_and_show_on_the_console(tmp_path, one_thread, capsys):
    """grpo.py keeping every sample (`--logger.samples` = the batch) and every eval answer, on-policy (one
    minibatch): each step's rows average to its `rollout/reward_mean` and `kept_frac`, a trained group's advantages
    sum to 0, the trainer's log-probs equal the engine's with ratio 1, the filtered samples carry no trainer
    quantities, the eval rows' share of right answers is `eval/pass@1`. Halted after 2 steps, with a killed run's
    later rows and a torn line appended, the resumed run keeps every (kind, step) exactly once. A panel shows a sample
    every step."""
    from algos import grpo

    def args_():
        args = grpo.Args()
        args.train.max_steps, args.rollout.batch_size, args.rollout.n_samples = 3, 8, 4
        args.train.minibatches, args.ckpt.every = 1, 1
        args.eval.every, args.eval.max_samples = 2, 16
        args.logger.samples, args.logger.eval_samples, args.logger.show_every = 32, 16, 1
        args.logger.tensorboard = False
        args.run_dir = str(tmp_path / "run")
        return args

    args = args_()
    args.train.halt_after = 2
    assert grpo.main(args)["halted"]
    path = tmp_path / "run" / "samples.jsonl"
    fake = {**_rows(path)[-1], "step": 3, "response": "from the killed run"}  # past the checkpoint of step 2
    with open(path, "a") as f:
        f.write(json.dumps(fake) + "\n" + '{"step": 3, "kind": "tr')  # and a line torn by the kill
    summary = grpo.main(args_())
    assert summary["steps"] == 3

    rows, metrics = _rows(path), {r["step"]: r for r in _rows(tmp_path / "run" / "metrics.jsonl")}
    assert not any(r["response"] == "from the killed run" for r in rows)
    counts = Counter((r["kind"], r["step"], r["index"]) for r in rows)
    assert set(counts.values()) == {1}, [k for k, c in counts.items() if c > 1]
    assert sorted({(r["kind"], r["step"]) for r in rows}) == [("eval", 0), ("eval", 2), ("eval", 3), ("train", 1),
                                                             ("train", 2), ("train", 3)]  # fmt: skip
    for step in (1, 2, 3):
        train = [r for r in rows if r["kind"] == "train" and r["step"] == step]
        assert len(train) == 32
        m = metrics[step]
        assert sum(r["reward"] for r in train) / 32 == pytest.approx(m["rollout/reward_mean"], abs=1e-6)
        assert sum(r["kept"] for r in train) / 32 == pytest.approx(m["rollout/kept_frac"])
        for g in {r["group"] for r in train}:
            group = [r for r in train if r["group"] == g]
            assert len(group) == 4 and len({r["kept"] for r in group}) == 1  # whole groups, kept or filtered as one
            if group[0]["kept"]:
                assert abs(sum(r["advantage"] for r in group)) < 1e-4, group
        for r in train:
            t = r["tokens"]
            assert len(t["text"]) == len(t["engine_logp"]) == r["length"] > 0
            if not r["kept"]:
                assert "trainer_logp" not in t and "ratio" not in t
                continue
            assert t["ratio"] == pytest.approx([1.0] * r["length"])  # on-policy: old = live, detached
            assert t["trainer_logp"] == pytest.approx(t["engine_logp"], abs=2e-3)  # the --debug check's closeness
            assert t["advantage"] == pytest.approx([r["advantage"]] * r["length"], abs=1e-5)
    for step in (0, 2, 3):
        ev = [r for r in rows if r["kind"] == "eval" and r["step"] == step]
        assert len(ev) == 16 and all("ratio" not in r["tokens"] for r in ev)
        assert sum(r["correct"] for r in ev) / 16 == pytest.approx(metrics[step]["eval/pass@1"])
    report = (tmp_path / "run" / "report.html").read_text()  # written at the end, beside learning_curve.png
    assert rows[-1]["prompt"] in report and "from the killed run" not in report  # the samples embedded, once
    out = capsys.readouterr().out
    assert "step 3: sample" in out and "response" in out and "[grpo] 16 eval prompts" in out, out[-3000:]


def test_no_samples_kept_with_zero(tmp_path):
    """`--logger.samples 0` and `--logger.eval-samples 0`: no file, and no trace work in the update."""
    trace = samples.Trace(samples.watch(torch.ones(8, dtype=torch.bool), 4, 0), list(range(8)))
    assert trace.watched == [] and trace.index_of_row == {}
    run = SimpleNamespace(world=1, rank=0, logger=SimpleNamespace(cfg=SimpleNamespace(show_every=1)))
    samples.log(run, 0, None, None, None, trace, 4)  # returns before touching anything


def test_samples_reach_tensorboard_as_text_and_wandb_as_a_table(tmp_path):
    """`RunLogger.log_samples`: the rows go to samples.jsonl, to TensorBoard as a markdown table per kind (text
    plugin) and to W&B (offline mode, no network) as a Table per kind."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from core.config import LoggerConfig
    from core.logger import RunLogger

    cfg = LoggerConfig(quiet=True, tensorboard=True, wandb=True, wandb_mode="offline")
    logger = RunLogger(cfg, tmp_path / "run", {"x": 1}, total_steps=1)
    rows = [{"step": 1, "kind": "train", "index": i, "prompt": "1+2=", "response": f"00{i}|</s>", "reward": 0.5 * i,
             "advantage": i - 0.5, "kept": True, "truncated": False, "tokens": {}} for i in range(2)]  # fmt: skip
    logger.log_samples(rows + [{**rows[0], "kind": "eval", "correct": True}], step=1)
    logger.close({})
    assert [json.loads(line)["kind"] for line in open(tmp_path / "run" / "samples.jsonl")] == ["train"] * 2 + ["eval"]
    events = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"tensors": 0}).Reload()
    assert {"samples/train/text_summary", "samples/eval/text_summary"} <= set(events.Tags()["tensors"])
    text = events.Tensors("samples/train/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "001\\|</s>" in text and "| 0.5 |" in text  # a `|` inside a cell is escaped, not a column
    tables = list((tmp_path / "run" / "wandb").rglob("samples/train_*.table.json"))
    assert tables and json.loads(tables[0].read_text())["data"][1][2] == "001|</s>", tables


@pytest.mark.slow
@pytest.mark.parametrize("script", ["dpo", "rm"])
def test_preference_scripts_keep_their_eval_pairs_with_margins_and_write_the_report(script, tmp_path, one_thread):
    """dpo.py and rm.py keep every eval's first `--logger.samples` held-out pairs with the scores they are ranked by
    (DPO's implicit rewards, the reward model's scores): with all 16 pairs kept, the rows' mean margin is the eval's
    `eval/margin`; the pair texts are the dataset's; the run's report.html is written at its end."""
    import importlib

    from core.config import LoggerConfig

    module = importlib.import_module(f"algos.{script}")
    args = module.Args()
    args.train.max_steps, args.train.batch_size = 2, 16
    args.eval.every, args.eval.max_samples = 1, 16
    args.logger = LoggerConfig(tensorboard=False, quiet=True, samples=16)
    args.run_dir = str(tmp_path / "run")
    if script == "dpo":
        args.model.name_or_path = "cleanrlhf/tiny-sft"
    module.main(args)
    rows, metrics = _rows(tmp_path / "run" / "samples.jsonl"), _rows(tmp_path / "run" / "metrics.jsonl")
    evals = {m["step"]: m["eval/margin"] for m in metrics if "eval/margin" in m}
    assert sorted(evals) == [0, 1, 2] and {r["kind"] for r in rows} == {"pair"}
    for step, margin in evals.items():
        pairs = [r for r in rows if r["step"] == step]
        assert len(pairs) == 16
        assert sum(p["margin"] for p in pairs) / 16 == pytest.approx(margin, rel=1e-4, abs=1e-5)
        assert all(p["margin"] == pytest.approx(p["chosen_score"] - p["rejected_score"], abs=1e-5) for p in pairs)
        assert all(p["chosen"] and p["rejected"] and p["chosen"] != p["rejected"] for p in pairs)
    if script == "dpo":  # a DPO pair splits into the prompt and the two responses
        assert all(p["prompt"] and "=" in p["prompt"] for p in rows)
    assert (tmp_path / "run" / "report.html").is_file()
