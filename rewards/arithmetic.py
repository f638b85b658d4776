"""Rule reward for the embedded arithmetic task (`cleanrlhf/addN`): the integer answer, compared as a number.

The task's answers are zero-padded text ("063"), while a data file may hold them as JSON numbers (63), and `datasets`
turns a column mixing the two into one type (it reads "063" as 63): compared as numbers, 63, "63" and "063" are the
same answer, so neither the file's form nor the loader's can lower a correct response's reward.

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


_INTEGER = re.compile(r"([+-]?)(\d+)")


def _canonical(integer: str) -> str | None:
    """An integer's text without sign of + or leading zeros ("063" -> "63", "-0" -> "0"); None when not an integer.
    Text, not int(): an answer may be longer than Python's int-from-text limit (4300 digits)."""
    m = _INTEGER.fullmatch(integer)
    if m is None:
        return None
    digits = m.group(2).lstrip("0") or "0"
    return "-" + digits if m.group(1) == "-" and digits != "0" else digits


def score(response: str, label: str) -> float:
    """1.0 when the response's leading integer equals the label as a number (leading zeros and a sign of + do not
    matter: "063", "63" and 63 are one answer), else 0.0. The label is text or an int (data files' JSON numbers
    arrive as text, see `core.data.prompt_example`); text that is not an integer is compared as written (a response
    gives an integer, so it never matches); anything else (a float, a bool, a list) is a ValueError naming its type,
    not a silent 0."""
    if isinstance(label, bool) or not isinstance(label, str | int):
        raise ValueError(f"rewards/arithmetic.py: label {label!r} is a {type(label).__name__}, expected text (the "
                         "answer as written, e.g. '042') or an int")  # fmt: skip
    answer, label = parse_answer(response), str(label).strip()
    if answer is None:
        return 0.0
    number = _canonical(label)
    return float(_canonical(answer) == number if number is not None else answer == label)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """The answer's reward (`score`, 1 or 0). queries[i] starts with prompts[i]; the response is the rest."""
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(f"reward_func: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    rewards = torch.tensor([score(r, lab) for r, lab in zip(responses, labels)], dtype=torch.float32)
    formatted = torch.tensor([float(parse_answer(r) is not None) for r in responses])
    return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": {"format_ok": formatted}}
