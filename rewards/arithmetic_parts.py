"""A two-component reward for the embedded arithmetic task (`cleanrlhf/addN`), the default of algos/gdpo.py and an
example of the `components` contract (rewards/loader.py):

- `correct`: 1 when the answer equals the label as a number, else 0 (rewards/arithmetic.py's rule);
- `digits`: partial credit, the share of the label's digits the answer has right, place by place from the units
  (an answer of the wrong length loses the places it lacks or adds: "57" for 67 is 0.5, "7" for 67 is 0.5, "167"
  for 67 is 2/3).

`reward_func(queries, prompts, labels)` returns `{"rewards": correct, "scores": correct, "components": {"correct":
..., "digits": ...}}`: the scalar reward is the exact match (what the evals' pass@1 counts, reward > 0.5, and what
grpo.py would train on), the parts one number per query each, the same names on every batch.
"""

from __future__ import annotations

import torch

from rewards.arithmetic import _canonical, parse_answer, score


def digit_credit(response: str, label: str) -> float:
    """The share of places, counted from the units over the longer of the two numbers, where the answer's digit is
    the label's: 0 without an answer or with the other sign, 1 exactly when the numbers are equal."""
    answer, label = parse_answer(response), _canonical(str(label).strip())
    if answer is None or label is None:
        return 0.0
    answer = _canonical(answer)
    if answer.startswith("-") != label.startswith("-"):
        return 0.0
    a, b = answer.lstrip("-")[::-1], label.lstrip("-")[::-1]
    return sum(x == y for x, y in zip(a, b)) / max(len(a), len(b))


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """Both components per query; `rewards` and `scores` the 0-1 correctness."""
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(f"reward_func: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    correct = torch.tensor([score(r, lab) for r, lab in zip(responses, labels)], dtype=torch.float32)
    digits = torch.tensor([digit_credit(r, lab) for r, lab in zip(responses, labels)], dtype=torch.float32)
    return {"rewards": correct, "scores": correct.clone(), "components": {"correct": correct, "digits": digits}}
