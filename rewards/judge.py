"""A judge as the reward (`--reward.judge-url URL --reward.judge-prompt FILE`): each response is scored by asking a
model behind any OpenAI-compatible chat endpoint (vLLM's server, `python -m agents.openai_server --model <run>/hf`,
a hosted API) and reading a number or a verdict from its answer.

The prompt file is the judge's user message with three placeholders filled in per response: `{prompt}`, `{response}`
(the policy's text after the prompt) and `{label}` (the dataset's label, "" when it has none); write `{{` and `}}` for
literal braces. What the answer means, in this order:
1. a fraction `a/b` (e.g. "Score: 7/10") -> a / b;
2. else the first number (e.g. "0.8", "Rating: 4") -> that number (scale it in the prompt: ask for 0-1);
3. else a verdict word, the first one found: yes / correct / right / pass / true -> 1.0; no / incorrect / wrong /
   fail / false -> 0.0.
An answer with none of these is an error naming the endpoint, the query's place in the batch and the answer, as a
reward function that returns no number would be: the run does not train on a guess.

Requests run `--reward.judge-concurrency` at a time (a thread pool: the HTTP calls wait on the network, not the CPU),
at temperature 0, each with `--reward.timeout-s` and `--reward.retries` (after a timeout, a connection error or a
5xx; a 4xx fails at once, as `rewards/remote.py`).
"""

from __future__ import annotations

import re
import string
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

from rewards.remote import post_with_retries

PLACEHOLDERS = ("prompt", "response", "label")
_FRACTION = re.compile(r"(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_VERDICTS = {"yes": 1.0, "correct": 1.0, "right": 1.0, "pass": 1.0, "true": 1.0,
             "no": 0.0, "incorrect": 0.0, "wrong": 0.0, "fail": 0.0, "false": 0.0}  # fmt: skip
_VERDICT = re.compile(r"\b(" + "|".join(_VERDICTS) + r")\b", re.IGNORECASE)


def parse_verdict(answer: str) -> float | None:
    """The judge's answer as a reward (see the module docstring for the rules), or None when it holds none."""
    if m := _FRACTION.search(answer):
        den = float(m.group(2))
        return float(m.group(1)) / den if den else None
    if m := _NUMBER.search(answer):
        return float(m.group(0))
    if m := _VERDICT.search(answer):
        return _VERDICTS[m.group(1).lower()]
    return None


def load_prompt(path: str) -> str:
    """The prompt file's text, checked: readable, and no placeholder but {prompt}, {response}, {label}."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--reward.judge-prompt {path}: no such file")
    text = file.read_text(encoding="utf-8")
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as e:
        raise ValueError(f"--reward.judge-prompt {path}: {e} (write {{{{ and }}}} for literal braces)") from None
    unknown = sorted(fields - set(PLACEHOLDERS))
    if unknown:
        raise ValueError(f"--reward.judge-prompt {path}: unknown placeholder(s) {unknown}; the file may use "
                         f"{{prompt}}, {{response}} and {{label}}")  # fmt: skip
    if "response" not in fields:
        raise ValueError(f"--reward.judge-prompt {path}: no {{response}} placeholder, so the judge would never see "
                         "what it scores")  # fmt: skip
    return text


class JudgeReward:
    """`reward_func(queries, prompts, labels)` asking the chat endpoint at `url` (its base, e.g.
    `http://host:8000/v1`) to judge every response with the prompt file `prompt_path`."""

    def __init__(self, url: str, prompt_path: str, model: str | None = None, timeout_s: float | None = 60.0,
                 retries: int = 3, concurrency: int = 8, max_tokens: int = 64):  # fmt: skip
        if concurrency < 1:
            raise ValueError(f"--reward.judge-concurrency {concurrency}: must be >= 1")
        self.base = url.rstrip("/").removesuffix("/chat/completions")
        self.template, self.prompt_path = load_prompt(prompt_path), prompt_path
        self.timeout_s, self.retries, self.concurrency, self.max_tokens = timeout_s, retries, concurrency, max_tokens
        self.session = requests.Session()
        self._model = model

    @property
    def model(self) -> str:
        """The judge's model name: `--reward.judge-model`, else the endpoint's first model (GET /models)."""
        if self._model is None:
            try:
                resp = self.session.get(f"{self.base}/models", timeout=self.timeout_s)
                resp.raise_for_status()
                self._model = resp.json()["data"][0]["id"]
            except (requests.RequestException, ValueError, KeyError, IndexError) as e:
                raise RuntimeError(f"judge {self.base}: could not list its models ({type(e).__name__}: {e}); give "
                                   "--reward.judge-model") from None  # fmt: skip
        return self._model

    def ask(self, text: str) -> str:
        """One chat completion at temperature 0, retried as the module docstring says; returns the answer text."""
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                "max_tokens": self.max_tokens}  # fmt: skip
        resp = post_with_retries(self.session, f"{self.base}/chat/completions", body, self.timeout_s, self.retries,
                                 f"judge {self.base}")  # fmt: skip
        try:
            return resp.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            raise RuntimeError(f"judge {self.base} answered something that is not a chat completion: "
                               f"{resp.text[:300]!r}") from None  # fmt: skip

    def __call__(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        texts = [self.template.format(prompt=p, response=q[len(p):] if q.startswith(p) else q,
                                      label="" if lab is None else str(lab))
                 for q, p, lab in zip(queries, prompts, labels)]  # fmt: skip
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(texts), 1))) as pool:
            answers = list(pool.map(self.ask, texts))
        rewards = []
        for i, answer in enumerate(answers):
            value = parse_verdict(answer)
            if value is None:
                raise ValueError(f"judge {self.base}: the answer for query {i} of the batch holds no number and no "
                                 f"verdict word: {answer[:200]!r} (--reward.judge-prompt {self.prompt_path} should "
                                 "ask for a number or yes/no)")  # fmt: skip
            rewards.append(value)
        out = torch.tensor(rewards, dtype=torch.float32)
        return {"rewards": out, "scores": out.clamp(0, 1)}
