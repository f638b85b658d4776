"""The calculator agent (agents/examples/calculator_agent.py): the tool and its protocol, the task and demonstrations,
and (slow) tool use that learns: after a short SFT on demonstrations where a quarter of the first answers are calls,
GRPO through the agent raises both the tool-call rate and the reward on 2-digit multiplication. And the SFT
demonstrations of the native tool-call agent (agents/examples/calculator_tools_agent.py): their prompts are the ones
the agent server builds, token for token; and (slow) the recipe they feed, SFT in two stages then GRPO, raises the
tool-call rate and pass@1."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from agents.examples import calculator_agent as calc
from agents.examples import calculator_tools_agent as tools

EXAMPLE, TOOLS_EXAMPLE = Path(calc.__file__), Path(tools.__file__)


@pytest.mark.parametrize(
    "expression, result",
    [("37*05", "0185"), ("99*99", "9801"), (" 12 + 3 ", "0015"), ("7-9", "-2"), ("00*00", "0000"),
     ("", "err"), ("37*", "err"), ("2**8", "err"), ("__import__('os')", "err"), ("12345*2", "err")],
)  # fmt: skip
def test_the_calculator_evaluates_only_small_integer_arithmetic(expression, result):
    assert calc.calculate(expression) == result


def test_a_bare_call_asks_for_the_question_and_a_named_expression_is_evaluated():
    assert calc.follow_up("37*05=", "?") == "37*05=?>0185\n37*05="
    assert calc.follow_up("37*05=", "?12*34") == "37*05=?12*34>0408\n37*05="
    assert calc.follow_up("37*05=", "?junk") == "37*05=?junk>err\n37*05="


def test_task_rows_are_every_product_split_without_overlap():
    train, test = calc.task_rows()
    assert len(train) + len(test) == 10_000 and len(test) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train[:200]:
        a, b = r["prompt"].rstrip("=").split("*")
        assert r["answer"] == f"{int(a) * int(b):04d}" and len(a) == len(b) == 2


def test_demonstrations_call_at_the_given_share_and_always_show_the_copy():
    train, _ = calc.task_rows()
    rows = calc.demonstrations(train[:2000], tool_share=0.25)
    first = [r for r in rows if r["prompt"].endswith("=") and "\n" not in r["prompt"]]
    copies = [r for r in rows if "\n" in r["prompt"]]
    assert len(first) == len(copies) == 2000
    share = sum(r["answer"] == calc.TOOL for r in first) / len(first)
    assert 0.22 < share < 0.28
    for r in copies[:100]:  # the result shown in the prompt is the answer to copy
        assert r["prompt"].split(">")[1].split("\n")[0] == r["answer"]


def _completion(text: str):
    return SimpleNamespace(choices=[SimpleNamespace(text=text)])


class ScriptedClient:
    """Stands for `openai.AsyncOpenAI`: answers each completion with the next scripted text, records the prompts."""

    def __init__(self, *texts: str):
        self.texts, self.prompts = list(texts), []
        self.completions = SimpleNamespace(create=self._create)

    async def _create(self, model: str, prompt: str, **kw):
        self.prompts.append(prompt)
        return _completion(self.texts.pop(0))


@pytest.mark.parametrize(
    "texts, reward, calls",
    [(["0185"], 1.0, 1), (["0184"], 0.0, 1), (["?", "0185"], 1.0, 2), (["?", "0186"], 0.0, 2), (["?9*9", "0185"],
                                                                                                 1.0, 2)],
)  # fmt: skip
def test_the_agent_rewards_the_final_answer_with_or_without_a_call(texts, reward, calls):
    client = ScriptedClient(*texts)
    assert asyncio.run(calc.agent(client, {"prompt": "37*05=", "label": "0185"})) == reward
    assert len(client.prompts) == calls and client.prompts[0] == "37*05="
    if calls == 2:  # the second prompt continues the first call's exchange with the calculator's result
        assert client.prompts[1] == calc.follow_up("37*05=", texts[0])


# ---------------------------------------------------------------------------------------------------------------
# Native tool calls: agents/examples/calculator_tools_agent.py's demonstrations for cleanrlhf/tiny-chat


def test_tool_demonstrations_are_the_prompts_the_server_builds_and_the_tokens_it_records():
    """The SFT demonstrations of the tool-calling agent must be what the agent server shows the model at RL time: a
    stand-in engine answers each turn with the demonstration's answer (canonical token ids), and every prompt it is
    given is the demonstration's prompt tokenized whole, so the SFT model trains on the RL prompts token for token."""
    from agents.openai_agent import OpenAIAgentExecutor
    from core import embedded, models
    from core.rollout import Sample

    tok = models.load_tokenizer(str(embedded.ensure_tiny_chat()))
    train, _ = calc.task_rows()
    rows = train[:3]
    demos = tools.demonstrations(tok, rows, tool_share=1.0)
    by_prompt = {d["prompt"]: d["answer"] for d in demos}
    assert len(demos) == 6 and sum(d["answer"].startswith("<tool_call>") for d in demos) == 3  # every first answer
    seen = []

    class Engine:
        def generate(self, prompts, n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=None):
            out = []
            for p in prompts:
                text = tok.decode(p)
                seen.append((list(p), text))
                ids = tok(by_prompt[text], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                out.append([Sample(ids, [-0.1] * len(ids), "stop", False)])
            return out

    ex = OpenAIAgentExecutor(Engine(), tok, str(TOOLS_EXAMPLE), "cleanrlhf/tiny-chat", max_new_tokens=128,
                             max_context=1024)  # fmt: skip
    try:
        examples = [{"prompt": r["prompt"], "prompt_ids": [], "label": r["answer"], "datasource": "mul2"} for r in rows]
        rollout = ex.run(examples, 1, [0, 1, 2], 0)
    finally:
        ex.close()
    assert rollout.logs["rollout/agent_errors"] == 0 and rollout.logs["rollout/agent_tool_calls_mean"] == 1
    assert rollout.rewards.tolist() == [1.0, 1.0, 1.0]
    assert len(seen) == 6 and {text for _, text in seen} == set(by_prompt)
    for ids, text in seen:  # the prompt ids the server built (the first turn's sampled ids reused) = text tokenized
        assert ids == tok(text, add_special_tokens=False)["input_ids"], text[-80:]
    # stage 1's short prompts: the same turns without the tool list (the template's default system turn instead)
    short = tools.demonstrations(tok, rows, tool_share=1.0, tools=False)
    assert sorted(d["answer"] for d in short) == sorted(d["answer"] for d in demos)
    for d in short:
        assert "<tools>" not in d["prompt"] and d["prompt"].startswith("<|im_start|>system\nYou are a helpful")
        full = next(
            p
            for p, a in by_prompt.items()
            if a == d["answer"] and p.count("<|im_start|>") == d["prompt"].count("<|im_start|>")
        )
        assert full.split("<|im_end|>\n", 1)[1] == d["prompt"].split("<|im_end|>\n", 1)[1]  # after the system turn


@pytest.mark.slow
def test_grpo_learns_to_call_the_calculator(tmp_path, one_thread):
    """The recipe of the example at a smaller size: SFT from the warm start on the demonstrations (a quarter of the
    first answers are calls), then GRPO through the agent. The tool-call rate (`rollout/agent_calls_mean` - 1) and
    the reward both rise from the first step (the SFT policy's rollout) to the last three."""
    from algos import grpo, sft

    task, demos = calc.write_data(tmp_path / "data", tool_share=0.25)
    s = sft.Args()
    s.model.name_or_path, s.data.path = "cleanrlhf/tiny-sft", str(demos)
    s.train.max_steps, s.train.lr, s.train.batch_size, s.train.warmup_steps = 400, 1e-3, 64, 0
    s.eval.every, s.eval.generate, s.eval.max_samples = 400, False, 64
    s.ckpt.every, s.logger.quiet, s.logger.tensorboard = 0, True, False
    s.run_dir, s.export_dir = str(tmp_path / "sft-run"), str(tmp_path / "sft-model")
    sft.main(s)

    g = grpo.Args()
    g.actor.model.name_or_path, g.data.path, g.rollout.agent_file = s.export_dir, str(task), str(EXAMPLE)
    g.train.max_steps, g.eval.every = STEPS, 0
    g.logger.quiet, g.logger.tensorboard = True, False
    g.run_dir = str(tmp_path / "grpo")
    summary = grpo.main(g)
    rows = [json.loads(line) for line in open(Path(summary["run_dir"]) / "metrics.jsonl")]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert len(steps) == STEPS and all(r["rollout/agent_errors"] == 0 for r in steps)

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    calls_first, calls_last = (mean("rollout/agent_calls_mean", part) - 1 for part in (steps[:1], steps[-3:]))
    reward_first, reward_last = (mean("rollout/reward_mean", part) for part in (steps[:1], steps[-3:]))
    print(f"tool-call rate {calls_first:.3f} -> {calls_last:.3f}, reward {reward_first:.3f} -> {reward_last:.3f}")
    assert calls_last > calls_first + CALL_GAIN, (calls_first, calls_last)
    assert reward_last > reward_first + REWARD_GAIN, (reward_first, reward_last)


# The run recorded in docs/agents.md went 0.25 -> 0.99 (calls) and 0.24 -> 0.90 (reward) by step 7.
STEPS, CALL_GAIN, REWARD_GAIN = 8, 0.4, 0.3


def test_the_page_shows_the_commands_the_recipe_prints(tmp_path):
    """docs/agents.md's calculator recipe is what `calculator_agent.py --out runs/calc` prints (one source for both)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "agents/examples/calculator_agent.py"), "--out", "runs/calc"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    printed = [line for line in out.stdout.splitlines() if line.startswith("python algos/")]
    page = (root / "docs" / "agents.md").read_text().replace("\\\n    ", "")
    shown = [line.replace(".venv/bin/python ", "python ", 1) for line in page.splitlines()
             if line.startswith(".venv/bin/python algos/") and "runs/calc/" in line]  # fmt: skip
    assert len(printed) == 2 and printed == shown[:2], (printed, shown[:2])  # the text-protocol recipe comes first
