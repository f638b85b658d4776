"""Embedded preference data: correct vs plausible wrong answers to the embedded arithmetic task (`cleanrlhf/addN`).

Built on first use under `CLEANRLHF_HOME` (like `core/embedded.py` builds the task) and loaded through the ordinary
`--data.path` route, so DPO, RM and KTO run with no download and accept a real dataset in the same place:

| name                   | rows                                                                                 |
|------------------------|--------------------------------------------------------------------------------------|
| `cleanrlhf/addN-pref`  | paired: `prompt`, `chosen` (the sum), `rejected` (a plausible wrong sum), `kind`      |
| `cleanrlhf/addN-kto`   | unpaired: `prompt`, `completion`, `label` (true = desirable), `kind`                  |
| `cleanrlhf/shapes-pref`| paired with a picture: `image`, `prompt`, `chosen` (the count), `rejected` (another)  |

The prompts and the train/test split are exactly those of `cleanrlhf/addN`, so the 500 test prompts are held out
from the SFT warm start as well. A wrong answer is one of the mistakes a half-trained model makes: a dropped carry
(digit-wise sum, "37+05=" -> "032"), off by ten, or its last two digits swapped ("082" -> "028"), written in the
task's fixed answer width, each drawn from those that are non-negative, fit the width and differ from the sum.
Off-by-one answers (a wrong units digit) were tried first and left out: the ~1 M reward model stayed at chance on
them (58 % after 600 steps of 128 pairs) while it ranked the other kinds at 100 %, which capped rm.py at ~85 %.
Everything is deterministic given `seed`. In the KTO train split each prompt appears once, with its correct answer
(desirable) or a wrong one (undesirable), 50/50 by seed, so desirable and undesirable examples never share a prompt
(truly unpaired); the KTO test split keeps both answers of every test prompt, so a held-out log-likelihood gap can be
measured pair by pair.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from core import embedded

KINDS = ("dropped_carry", "off_by_ten", "digit_swap")
PREF_DATA_VERSION = "2"  # bump when the generator changes, so cached folders rebuild


def dropped_carry(prompt: str, width: int) -> str | None:
    """The sum of `"a+b="` computed digit by digit with every carry forgotten (`"37+05="` -> `"032"` in width 3);
    None when the prompt is not of that form."""
    a, _, b = prompt.rstrip("=").partition("+")
    if not (a.isdigit() and b.isdigit()):
        return None
    n = max(len(a), len(b))
    digits = [(int(x) + int(y)) % 10 for x, y in zip(a.zfill(n), b.zfill(n))]
    return "".join(map(str, digits)).zfill(width)[-width:]


def wrong_answers(answer: str, prompt: str | None = None) -> dict[str, list[str]]:
    """Plausible wrong answers to a sum, by kind, written in the answer's width (`"37+05="`, `"042"` -> `"032"`
    (dropped carry), `"032"`, `"052"` (off by ten), `"024"` (swap)); candidates that are negative, wider, or equal to
    the answer are left out, and so are kinds left without a candidate (no carry to drop, nothing to swap)."""
    width, value = len(answer), int(answer)
    swapped = answer[:-2] + answer[-1] + answer[-2] if width >= 2 else answer
    carry = dropped_carry(prompt, width) if prompt else None
    candidates = {
        "dropped_carry": [carry] if carry else [],
        "off_by_ten": [f"{v:0{width}d}" for v in (value - 10, value + 10) if v >= 0],
        "digit_swap": [swapped],
    }
    valid = {k: [c for c in v if len(c) == width and c != answer] for k, v in candidates.items()}
    return {k: v for k, v in valid.items() if v}


def pick_wrong(answer: str, rng: random.Random, prompt: str | None = None) -> tuple[str, str]:
    """(kind, wrong answer): a kind uniformly among the valid ones, then a candidate uniformly."""
    options = wrong_answers(answer, prompt)
    kind = rng.choice(sorted(options))
    return kind, rng.choice(options[kind])


def pair_rows(rows: list[dict], seed: int) -> list[dict]:
    """One preference pair per task row: chosen = the correct sum, rejected = a plausible wrong one."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        kind, wrong = pick_wrong(row["answer"], rng, row["prompt"])
        out.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": wrong, "kind": kind,
                    "answer": row["answer"], "datasource": row["datasource"]})  # fmt: skip
    return out


def unpaired_rows(pairs: list[dict], seed: int, both: bool) -> list[dict]:
    """KTO rows from pairs: both completions of every prompt (`both`), or one of them picked 50/50 by seed."""
    rng = random.Random(seed + 1)
    out = []
    for p in pairs:
        keep = (True, False) if both else (rng.random() < 0.5,)
        for desirable in keep:
            out.append({"prompt": p["prompt"], "completion": p["chosen"] if desirable else p["rejected"],
                        "label": desirable, "kind": p["kind"], "answer": p["answer"], "datasource": p["datasource"]})  # fmt: skip
    return out


def shapes_pair_rows(rows: list[dict], seed: int) -> list[dict]:
    """One pair per `cleanrlhf/shapes` row, for vision-language DPO (`--data.image-key image`): the row's picture and
    question, chosen = the count of squares, rejected = another count from 1-5 drawn uniformly."""
    rng = random.Random(seed)
    return [{**row, "chosen": row["answer"], "rejected": rng.choice([c for c in "12345" if c != row["answer"]]),
             "kind": "other_count"} for row in rows]  # fmt: skip


def ensure_preference_data(name: str, seed: int = 0) -> Path:
    """Build (once) and return the folder with `train.jsonl` / `test.jsonl` for `addN-pref`, `addN-kto` or
    `shapes-pref`."""
    if name == "shapes-pref":
        shapes = embedded.ensure_shapes_data()

        def build_shapes(tmp: Path) -> None:
            for split, offset in (("train", 0), ("test", 10_000)):
                rows = [json.loads(line) for line in (shapes / f"{split}.jsonl").read_text().splitlines()]
                embedded._write_jsonl(tmp / f"{split}.jsonl", shapes_pair_rows(rows, seed + offset))

        return embedded._atomic_build(embedded.home() / "data" / name, build_shapes,
                                      f"{embedded.ARTIFACT_VERSION}.{PREF_DATA_VERSION}")  # fmt: skip
    task, _, fmt = name.rpartition("-")
    if fmt not in ("pref", "kto") or not (task.startswith("add") and task[3:].isdigit() and 1 <= int(task[3:]) <= 9):
        raise ValueError(
            f"unknown embedded dataset {embedded.PREFIX}{name!r}: expected {embedded.PREFIX}addN-pref, addN-kto or shapes-pref"
        )

    def build(tmp: Path) -> None:
        train, test = embedded.task_rows(int(task[3:]), seed)
        train_pairs, test_pairs = pair_rows(train, seed), pair_rows(test, seed + 10_000)
        if fmt == "pref":
            embedded._write_jsonl(tmp / "train.jsonl", train_pairs)
            embedded._write_jsonl(tmp / "test.jsonl", test_pairs)
        else:
            embedded._write_jsonl(tmp / "train.jsonl", unpaired_rows(train_pairs, seed, both=False))
            embedded._write_jsonl(tmp / "test.jsonl", unpaired_rows(test_pairs, seed, both=True))

    return embedded._atomic_build(
        embedded.home() / "data" / name, build, f"{embedded.ARTIFACT_VERSION}.{PREF_DATA_VERSION}"
    )
