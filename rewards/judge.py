"""A judge as the reward (`--reward.judge-url URL --reward.judge-prompt FILE`): each response is scored by asking a
model behind any OpenAI-compatible chat endpoint (vLLM's server, `python -m agents.openai_server --model <run>/hf`,
a hosted API) and reading its final line.

The prompt file is the judge's user message with three placeholders filled in per response: `{prompt}`, `{response}`
(the policy's text after the prompt) and `{label}` (the dataset's label, "" when it has none); write `{{` and `}}` for
literal braces. It must ask for the answer's last line in one of two forms, and name it (`Score:` or `Verdict:`);
`rewards/judge_prompt.txt` is an example:
- `Score: x` with x a number from 0 to 1 ("0.8", "1", "7/10", "2.5e-1") -> x;
- `Verdict: yes` -> 1.0, `Verdict: no` -> 0.0.
Only the last non-empty line of the answer is read (any reasoning may come before it), case and markdown emphasis
(`**Score:** 0.8`) aside, and only the forms the prompt file names. A reward is always in [0, 1]. An answer whose last
line is not such a line, or whose score lies outside [0, 1], is an error naming the endpoint, the query's place in the
batch and the answer, as a reward function that returns no number would be: the run does not train on a guess ("not
correct", "No, 2+2 is not 5" or "The answer 042 is correct" hold no final line; they are not read as 1, 2 or 42).

The judge is asked at start whether it answers (`GET /models`, which also names the model when `--reward.judge-model`
is not given), before any model loads: a dead one stops the run with "the judge at URL does not answer". Requests run
`--reward.judge-concurrency` at a time (a thread pool: the HTTP calls wait on the network, not the CPU), at
temperature 0, each bounded as a whole by `--reward.timeout-s` and retried `--reward.retries` times (after a timeout,
a connection error or a 5xx; a 4xx fails at once, as `rewards/remote.py`). The key in the environment variable named
by `--reward.api-key-env` (default CLEANRLHF_API_KEY; e.g. OPENAI_API_KEY for a hosted judge) goes with every
request as a Bearer token.
"""

from __future__ import annotations

import json
import math
import re
import string
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

from rewards.remote import DEFAULT_KEY_ENV, _auth_hint, call_json, key_session, post_with_retries

PLACEHOLDERS = ("prompt", "response", "label")
FORMS = {"score": "`Score: x` (x from 0 to 1)", "verdict": "`Verdict: yes` or `Verdict: no`"}
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_SCORE = re.compile(rf"({_NUMBER})(?:\s*/\s*({_NUMBER}))?")
_FINAL = re.compile(r"(score|verdict)\s*:\s*(.*?)\s*\.?", re.IGNORECASE)
_VERDICTS = {"yes": 1.0, "no": 0.0}


def asked_forms(template: str) -> tuple[str, ...]:
    """The final-line forms the prompt file names ("score", "verdict"), from its `Score:` / `Verdict:` mentions."""
    return tuple(f for f in FORMS if re.search(rf"\b{f}\s*:", template, re.IGNORECASE))


def parse_verdict(answer: str, forms: tuple[str, ...] = tuple(FORMS)) -> float:
    """The reward read from the judge's answer: its last non-empty line, `Score: x` (0 <= x <= 1, a fraction `a/b`
    allowed) or `Verdict: yes|no`, of the `forms` asked for. A ValueError saying what is wrong otherwise."""
    lines = [line for line in answer.splitlines() if line.strip()]
    last = re.sub(r"[*_`]", "", lines[-1]).strip() if lines else ""
    asked = " or ".join(FORMS[f] for f in forms)
    m = _FINAL.fullmatch(last)
    if m is None or m.group(1).lower() not in forms:
        return _refuse(f"its last line {last[:80]!r} is not {asked}" if last else f"it is empty, not {asked}")
    form, value = m.group(1).lower(), m.group(2)
    if form == "verdict":
        if value.lower() not in _VERDICTS:
            return _refuse(f"its verdict {value[:40]!r} is not yes or no")
        return _VERDICTS[value.lower()]
    if (s := _SCORE.fullmatch(value)) is None:
        return _refuse(f"its score {value[:40]!r} is not a number")
    num, den = float(s.group(1)), float(s.group(2) or 1)
    x = num / den if den else math.nan
    if not (math.isfinite(x) and 0.0 <= x <= 1.0):  # also a fraction over 0
        return _refuse(f"its score {value[:40]!r} is not from 0 to 1")
    return x


def _refuse(why: str) -> float:
    raise ValueError(why)


def load_prompt(path: str) -> str:
    """The prompt file's text, checked: readable, no placeholder but {prompt}, {response}, {label}, and a final line
    asked for (`Score:` or `Verdict:` named)."""
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
    if not asked_forms(text):
        raise ValueError(f"--reward.judge-prompt {path}: asks for no final line; only the answer's last line is read, "
                         f"so ask for one: {FORMS['score']} or {FORMS['verdict']} (rewards/judge_prompt.txt is an "
                         "example)")  # fmt: skip
    return text


class JudgeReward:
    """`reward_func(queries, prompts, labels)` asking the chat endpoint at `url` (its base, e.g.
    `http://host:8000/v1`) to judge every response with the prompt file `prompt_path`. Built only if the endpoint
    answers (`GET /models`)."""

    def __init__(self, url: str, prompt_path: str, model: str | None = None, timeout_s: float | None = 60.0,
                 retries: int = 3, concurrency: int = 8, max_tokens: int = 256,
                 key_env: str | None = DEFAULT_KEY_ENV):  # fmt: skip
        if concurrency < 1:
            raise ValueError(f"--reward.judge-concurrency {concurrency}: must be >= 1")
        if max_tokens < 1:
            raise ValueError(f"--reward.judge-max-tokens {max_tokens}: must be >= 1")
        self.base = url.rstrip("/").removesuffix("/chat/completions")
        self.template, self.prompt_path = load_prompt(prompt_path), prompt_path
        self.forms = asked_forms(self.template)
        self.timeout_s, self.retries, self.concurrency, self.max_tokens = timeout_s, retries, concurrency, max_tokens
        self.session = key_session(key_env)
        self.model = self._check(model)

    def _check(self, model: str | None) -> str:
        """Ask the endpoint for its models (retried as a chat request): a judge that does not answer, or refuses the
        key, stops the run here, at start. Returns `model`, else the endpoint's first model."""
        url, error = f"{self.base}/models", ""
        for attempt in range(self.retries + 1):
            try:
                status, content = call_json(self.session, "GET", url, None, self.timeout_s)
            except requests.RequestException as e:
                error = f"{type(e).__name__}: {e}"
            else:
                break
            if attempt < self.retries:
                time.sleep(attempt + 1)
        else:
            raise ValueError(f"--reward.judge-url {self.base}: the judge at {self.base} does not answer (GET {url}, "
                             f"{self.retries + 1} attempt(s): {error})")  # fmt: skip
        if status in (401, 403):
            raise ValueError(f"--reward.judge-url {self.base}: the judge refused the request (GET {url}: HTTP "
                             f"{status}){_auth_hint(status, self.session)}")  # fmt: skip
        if model is not None:
            return model  # it answers; an endpoint without /models is fine when the model is named
        try:
            if status >= 400:
                raise ValueError(f"HTTP {status}")
            return json.loads(content)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"--reward.judge-url {self.base}: could not list the judge's models (GET {url}: "
                             f"{type(e).__name__}: {e}; {content[:200]!r}); give --reward.judge-model") from None  # fmt: skip

    def ask(self, text: str) -> tuple[str, str | None]:
        """One chat completion at temperature 0, retried as the module docstring says: (the answer text, its
        finish_reason)."""
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                "max_tokens": self.max_tokens}  # fmt: skip
        answer = post_with_retries(self.session, f"{self.base}/chat/completions", body, self.timeout_s, self.retries,
                                   f"judge {self.base}")  # fmt: skip
        try:
            choice = answer["choices"][0]
            return choice["message"]["content"] or "", choice.get("finish_reason")
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"judge {self.base} answered something that is not a chat completion: "
                               f"{json.dumps(answer)[:300]!r}") from None  # fmt: skip

    def __call__(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        texts = [self.template.format(prompt=p, response=q[len(p):] if q.startswith(p) else q,
                                      label="" if lab is None else str(lab))
                 for q, p, lab in zip(queries, prompts, labels)]  # fmt: skip
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(texts), 1))) as pool:
            answers = list(pool.map(self.ask, texts))
        rewards = []
        for i, (answer, finish) in enumerate(answers):
            try:
                rewards.append(parse_verdict(answer, self.forms))
            except ValueError as e:
                cut = f"; it was cut at --reward.judge-max-tokens {self.max_tokens}" if finish == "length" else ""
                raise ValueError(f"judge {self.base}: the answer for query {i} of the batch is refused: {e}{cut}: "
                                 f"{answer[-200:]!r} (--reward.judge-prompt {self.prompt_path} asks for the last "
                                 f"line {' or '.join(FORMS[f] for f in self.forms)})") from None  # fmt: skip
        out = torch.tensor(rewards, dtype=torch.float32)
        return {"rewards": out, "scores": out}
