# Course exercise, lesson 8: Agents and tools (docs/course/08_agents.md).
# A copy of agents/examples/calculator_agent.py with the body of `agent` left for you to write; the rest is the
# real code and runs as the file it copies. Check your function, then a short learning run with it:
#     python docs/course/check.py 8 <this file>
# Written by docs/course/make_exercises.py from the real file; edit your own copy, not this one.
"""A calculator tool the policy learns to call: 2-digit multiplication (`37*05=` -> `0185`), which the embedded 1 M
model cannot do in its head, and an agent that gives it a calculator through a plain-text protocol:

    37*05=?             the model's first answer: "?" asks the calculator for the question's expression
    >0185               the calculator's result (the agent's text: not trained on)
    37*05=0185          the question again, and the model's final answer (trained on)

A call may also name its own expression (`?12*34`: the calculator evaluates that instead). Any first answer that
does not start with "?" is the final answer. The reward is exact match of the final answer, so a call pays only if
the model then copies the result. The tool-call rate of a step is `rollout/agent_calls_mean` − 1 (an episode with a
call makes two model calls, one without makes one).

The policy starts from a short SFT on demonstrations where a quarter of the first answers are calls (the rest are
attempts in the head) and every call is followed by a copy of its result; GRPO then finds that calling pays:

    python agents/examples/calculator_agent.py --out runs/calc         # writes the data, prints the two commands

The functions are plain and importable (tests/test_tool_agent.py runs the same recipe at a smaller size).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from rewards.arithmetic import score

TOOL = "?"  # a first answer that starts with this is a calculator call: TOOL, optionally followed by an expression
_EXPRESSION = re.compile(r"^\s*(\d{1,4})\s*([-+*])\s*(\d{1,4})\s*$")


def calculate(expression: str) -> str:
    """The calculator: `a op b` with integers of up to 4 digits and op in + - *; the result zero-padded to 4 digits
    (the task's answer format), or "err" for anything else (the model may write nonsense; it gets no help then)."""
    m = _EXPRESSION.match(expression)
    if m is None:
        return "err"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    value = a * b if op == "*" else a + b if op == "+" else a - b
    return f"{value:04d}" if value >= 0 else str(value)


def follow_up(question: str, call: str) -> str:
    """The second prompt after a call: the exchange so far, the calculator's result (of the call's expression, or of
    the question's when the call names none), and the question again."""
    expression = call[len(TOOL) :].strip() or question.rstrip("=")
    return f"{question}{call}>{calculate(expression)}\n{question}"


async def agent(client, example: dict) -> float:
    """One episode: ask the policy the question; if its first answer is a call (starts with `TOOL`), ask again with
    `follow_up(question, call)` as the prompt. Returns the reward of the final answer: `score(text, example["label"])`
    (1.0 for the exact zero-padded product, else 0.0). `client` is the executor's OpenAI-style client:
    `await client.completions.create(model="policy", prompt=...)` returns a completion whose `.choices[0].text` is
    the policy's answer; every completion made through it is a turn that trains."""
    # YOUR CODE HERE: the docstring above says what to return (lesson 8).
    raise NotImplementedError("lesson 8: write agent")


# ---------------------------------------------------------------------------------------------------------------
# The task and the SFT demonstrations


def task_rows(seed: int = 0, test_size: int = 500) -> tuple[list[dict], list[dict]]:
    """Every a*b with a, b < 100, zero-padded (`07*35=` -> `0245`), shuffled by `seed`; the first `test_size` rows
    are the test split."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"{a:02d}*{b:02d}=", "answer": f"{a * b:04d}", "datasource": "mul2"} for a, b in pairs]
    return rows[test_size:], rows[:test_size]


def demonstrations(rows: list[dict], tool_share: float, seed: int = 0) -> list[dict]:
    """SFT rows (prompt / answer) from task rows: for each question one first answer, a call (`?`) with probability
    `tool_share` and the product (an attempt in the head) otherwise, and one copy of the calculator's result after a
    call. The first answers set how often the SFT model calls; the copies teach it to use the result."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        question, call = row["prompt"], TOOL
        out.append({"prompt": question, "answer": call if rng.random() < tool_share else row["answer"]})
        out.append({"prompt": follow_up(question, call), "answer": row["answer"]})
    rng.shuffle(out)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_data(out: Path, tool_share: float = 0.25, seed: int = 0) -> tuple[Path, Path]:
    """`out/mul2/{train,test}.jsonl` (the RL task) and `out/sft/{train,test}.jsonl` (the demonstrations)."""
    train, test = task_rows(seed)
    write_jsonl(out / "mul2" / "train.jsonl", train)
    write_jsonl(out / "mul2" / "test.jsonl", test)
    write_jsonl(out / "sft" / "train.jsonl", demonstrations(train, tool_share, seed))
    write_jsonl(out / "sft" / "test.jsonl", demonstrations(test, tool_share, seed + 1))
    return out / "mul2", out / "sft"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="write the calculator task's data and print how to train on it")
    ap.add_argument("--out", default="runs/calc")
    ap.add_argument("--tool-share", type=float, default=0.25, help="share of SFT first answers that are calls")
    opts = ap.parse_args()
    task, sft = write_data(Path(opts.out), opts.tool_share)
    print(f"data: {task} (RL task), {sft} (SFT demonstrations)\n")
    print(f"python algos/sft.py --model.name-or-path cleanrlhf/tiny-sft --data.path {sft} --train.max-steps 400 "
          f"--train.lr 1e-3 --train.batch-size 64 --train.warmup-steps 0 --eval.every 100 --eval.generate "
          f"--export-dir {opts.out}/sft-model --run-dir {opts.out}/sft-run")  # fmt: skip
    print(
        f"python algos/grpo.py --actor.model.name-or-path {opts.out}/sft-model --data.path {task} "
        f"--rollout.agent-file agents/examples/calculator_agent.py --train.max-steps 16 --eval.every 4 "
        f"--eval.max-samples 200"
    )
