"""agents/executor.py with a scripted engine (no vLLM): what reaches the trainer is exactly what the engine sampled,
environment tokens are masked out of the loss, rewards and truncation are right; and the RL scripts' batch builder
puts every engine log-prob at its token's position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agents.executor import Episode, MultiTurnExecutor, Rollout, SingleTurnExecutor
from core.rollout import Sample


class ScriptedEngines:
    """Stands for `RolloutEngines`: answers prompt i with `reply(prompt_ids)` tokens, log-prob −0.5 each; records calls."""

    def __init__(self, reply, max_new_tokens_cap: int | None = None):
        self.reply, self.calls = reply, []

    def generate(self, prompt_token_ids, n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=None):
        self.calls.append({"prompts": [list(p) for p in prompt_token_ids], "n": n, "seed": seed, "t": temperature})
        out = []
        for p in prompt_token_ids:
            toks = self.reply(list(p))
            cut = toks[:max_new_tokens]
            out.append([Sample(cut, [-0.5] * len(cut), "length" if len(toks) > max_new_tokens else "stop",
                               len(toks) > max_new_tokens) for _ in range(n)])  # fmt: skip
        return out


def _checked(queries, prompts, labels, step):
    r = torch.tensor([float(q == p + lab) for q, p, lab in zip(queries, prompts, labels)])
    return r, {"rollout/custom": 1.0}, r, [{"right": float(x)} for x in r]  # per-sample extras: kept on the episode


def test_single_turn_is_token_in_token_out_prompt_major(tokenizer):
    batch = [{"prompt": p, "prompt_ids": tokenizer.encode(p), "label": a} for p, a in (("1+2=", "3"), ("4+4=", "9"))]
    answer = {tuple(tokenizer.encode("1+2=")): tokenizer.encode("3", add_special_tokens=False),
              tuple(tokenizer.encode("4+4=")): tokenizer.encode("8", add_special_tokens=False)}  # fmt: skip
    engines = ScriptedEngines(lambda p: answer[tuple(p)])
    ro = SingleTurnExecutor(engines, tokenizer, _checked, max_new_tokens=4).run(batch, n=3, seed=7, step=0)
    assert [e.example["prompt"] for e in ro.episodes] == ["1+2="] * 3 + ["4+4="] * 3
    assert ro.rewards.tolist() == [1.0] * 3 + [0.0] * 3 and ro.logs == {"rollout/custom": 1.0}
    assert [e.extra for e in ro.episodes] == [{"right": 1.0}] * 3 + [{"right": 0.0}] * 3  # each its own extras
    for e in ro.episodes:
        assert e.token_ids == answer[tuple(e.prompt_ids)] and e.action_mask == [1] * len(e.token_ids)
        assert e.logprobs == [-0.5] * len(e.token_ids) and not e.truncated
    assert engines.calls[0]["n"] == 3 and engines.calls[0]["seed"] == 7


def test_take_groups_and_cat_keep_groups_whole():
    eps = [Episode({"i": i}, [0], [i], [0.0], [1], False) for i in range(6)]
    ro = Rollout(eps, torch.arange(6.0), torch.arange(6.0) / 4)
    part = ro.take_groups(torch.tensor([True, False, True]), 2)
    assert [e.example["i"] for e in part.episodes] == [0, 1, 4, 5] and part.rewards.tolist() == [0, 1, 4, 5]
    both = Rollout.cat([part, ro.take_groups(torch.tensor([False, True, False]), 2)])
    assert [e.example["i"] for e in both.episodes] == [0, 1, 4, 5, 2, 3]
    assert both.scores.tolist() == [0.0, 0.25, 1.0, 1.25, 0.5, 0.75]


class Retry:
    """Toy environment: answer the sum; a wrong answer gets "no" and one more try; reward 1 when right."""

    def __init__(self, example):
        self.answer = example["label"]

    def reset(self, example):
        return ""

    def step(self, response):
        return ("", 1.0, True) if response == self.answer else ("no", 0.0, False)


def test_multi_turn_appends_feedback_as_masked_tokens_and_sums_rewards(tokenizer):
    example = {"prompt": "2+2=", "prompt_ids": tokenizer.encode("2+2="), "label": "4"}
    no = tokenizer.encode("no", add_special_tokens=False)
    guesses = {0: "5", 1: "4"}  # wrong, then right after the feedback
    engines = ScriptedEngines(lambda p: tokenizer.encode(guesses[1 if p[-len(no):] == no else 0],
                                                         add_special_tokens=False))  # fmt: skip
    ex = MultiTurnExecutor(engines, tokenizer, Retry, max_new_tokens=4, max_turns=3)
    ro = ex.run([example], n=2, seed=0, step=0)
    five, four = (tokenizer.encode(x, add_special_tokens=False) for x in ("5", "4"))
    for e in ro.episodes:
        assert e.token_ids == five + no + four
        assert e.action_mask == [1] * len(five) + [0] * len(no) + [1] * len(four)
        assert e.logprobs == [-0.5] * len(five) + [0.0] * len(no) + [-0.5] * len(four)
    assert ro.rewards.tolist() == [1.0, 1.0] and ro.logs["rollout/turns_mean"] == 2
    # the second turn saw prompt + first answer + feedback, token for token
    assert engines.calls[1]["prompts"][0] == example["prompt_ids"] + five + no


def test_multi_turn_stops_at_max_turns_and_total_length(tokenizer):
    example = {"prompt": "2+2=", "prompt_ids": tokenizer.encode("2+2="), "label": "4"}
    engines = ScriptedEngines(lambda p: tokenizer.encode("7", add_special_tokens=False))
    ro = MultiTurnExecutor(engines, tokenizer, Retry, max_new_tokens=4, max_turns=3).run([example], 1, 0, 0)
    assert len(engines.calls) == 3 and ro.rewards.tolist() == [0.0] and sum(ro.episodes[0].action_mask) == 3
    assert ro.episodes[0].action_mask[-1] == 1  # it ends on the model's last turn, not on unread feedback
    engines = ScriptedEngines(lambda p: tokenizer.encode("7", add_special_tokens=False))
    ro = MultiTurnExecutor(engines, tokenizer, Retry, 4, max_turns=9, max_total_tokens=4).run([example], 1, 0, 0)
    assert ro.episodes[0].truncated and len(ro.episodes[0].token_ids) <= 4 and len(engines.calls) == 2


def test_rl_batch_masks_environment_tokens_and_aligns_engine_logprobs():
    from core.rl import sequences

    ep = Episode({}, [5, 6, 7], [10, 11, 12, 13], [-0.25, 0.0, 0.0, -0.5], [1, 0, 0, 1], False)
    short = Episode({}, [5], [9], [-0.7], [1], True)
    b = sequences([ep, short], pad_id=0, device=torch.device("cpu"))
    assert b["input_ids"][0].tolist() == [5, 6, 7, 10, 11, 12, 13]
    assert b["loss_mask"][0].tolist() == [False, False, False, True, False, False, True]
    assert b["rollout_logp"][0].tolist() == [0, 0, 0, -0.25, 0, 0, -0.5]
    assert b["loss_mask"][1].tolist() == [False, True] + [False] * 5
    assert b["rollout_logp"][1, 1].item() == torch.tensor(-0.7).item()


def test_env_file_errors_name_the_file(tmp_path):
    from agents.executor import load_env_factory

    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_env_factory(str(tmp_path / "nope.py"))
    bad = tmp_path / "no_make_env.py"
    bad.write_text("def other():\n    pass\n")
    with pytest.raises(AttributeError, match="no_make_env.py.*make_env"):
        load_env_factory(str(bad))
    good = load_env_factory(str(Path(__file__).resolve().parents[1] / "agents" / "retry_env.py"))
    env = good({"prompt": "1+2=", "label": "3"})
    assert env.reset({}) == "" and env.step("4") == ("\n1+2=", 0.0, False) and env.step("3") == ("", 0.5, True)
