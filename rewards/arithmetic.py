"""Rule reward for the embedded arithmetic task (`cleanrlhf/addN`): exact match of the integer answer.

`reward_func(queries, prompts, labels)` follows OpenRLHF's custom-reward contract, so it is also an example of a
`--reward.func` file: `queries` are prompt + response texts, `labels` the reference answers. It returns
`rewards` (used for advantages), `scores` (0-1, used by dynamic filtering) and `extra_logs`.
"""

from __future__ import annotations

import re

import torch

_ANSWER = re.compile(r"-?\d+")


def parse_answer(response: str) -> str | None:
    """The integer the model wrote first, or None. Anything after the number (e.g. a stray token) is ignored."""
    m = _ANSWER.match(response.strip())
    return m.group(0) if m else None


def score(response: str, label: str) -> float:
    """1.0 when the response's leading integer equals the label exactly, else 0.0. The label is text or an int (data
    files' JSON numbers arrive as text, see `core.data.prompt_example`); anything else (a float, a bool, a list) is a
    ValueError naming its type, not a silent 0."""
    if isinstance(label, bool) or not isinstance(label, str | int):
        raise ValueError(f"rewards/arithmetic.py: label {label!r} is a {type(label).__name__}, expected text (the "
                         "answer as written, e.g. '042') or an int")  # fmt: skip
    return float(parse_answer(response) == str(label).strip())


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """Exact-match reward. queries[i] starts with prompts[i]; the response is the rest."""
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(f"reward_func: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    rewards = torch.tensor([score(r, lab) for r, lab in zip(responses, labels)], dtype=torch.float32)
    formatted = torch.tensor([float(parse_answer(r) is not None) for r in responses])
    return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": {"format_ok": formatted}}
