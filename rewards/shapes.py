"""Rule reward for the embedded picture task (`cleanrlhf/shapes`): exact match of the count.

The label is the number of squares of the asked colour as a digit; the response earns 1.0 when the first word it
writes is that number, as a digit ("2") or a word ("two"), and 0.0 otherwise. `reward_func` follows OpenRLHF's
custom-reward contract like rewards/arithmetic.py: `--reward.func rewards/shapes.py`.
"""

from __future__ import annotations

import re

import torch

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
_FIRST_WORD = re.compile(r"\s*([A-Za-z]+|\d+)")


def parse_count(response: str) -> str | None:
    """The count the response starts with, as a digit string ("two" -> "2"), or None when it starts with neither a
    number nor a number word."""
    m = _FIRST_WORD.match(response)
    if not m:
        return None
    word = m.group(1).lower()
    if word.isdigit():
        return str(int(word))
    return str(NUMBER_WORDS.index(word)) if word in NUMBER_WORDS else None


def score(response: str, label) -> float:
    """1.0 when the response's count equals the label (text or int), else 0.0; any other label type is a ValueError
    naming it."""
    if isinstance(label, bool) or not isinstance(label, str | int):
        raise ValueError(f"rewards/shapes.py: label {label!r} is a {type(label).__name__}, expected the count as text "
                         "or an int")  # fmt: skip
    return float(parse_count(response) == str(label).strip())


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """Exact-match reward. queries[i] starts with prompts[i]; the response is the rest."""
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(f"reward_func: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    rewards = torch.tensor([score(r, lab) for r, lab in zip(responses, labels)], dtype=torch.float32)
    formatted = torch.tensor([float(parse_count(r) is not None) for r in responses])
    return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": {"format_ok": formatted}}
