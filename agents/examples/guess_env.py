"""A Gymnasium text environment, the embedded arithmetic task with "higher"/"lower" hints, and the example of
`agents.envs.from_gymnasium` as a `--rollout.env-file`:

    pip install -e ".[envs]"
    python algos/grpo.py --rollout.env-file agents/examples/guess_env.py

The model answers `37+05=`. A right answer earns 1.0 and ends the episode. A wrong one gets the hint " higher" (the
sum is larger than the guess) or " lower" (or " ?" when the answer has no number), a newline and the question again,
and up to `max_tries` - 1 more tries, a right one worth 0.5. The hints and the repeated question are the
environment's text: masked out of the loss. Run alone (no dataset row in `options`), the environment draws its own
two-digit sum with its seed and asks it in reset's observation.
"""

from __future__ import annotations

import re
import string

import gymnasium
from gymnasium import spaces

from agents.envs import from_gymnasium
from rewards.arithmetic import parse_answer, score

_INTEGER = re.compile(r"^[-+]?\d+$")


class GuessSumEnv(gymnasium.Env):
    """`reset(seed, options) -> (observation, info)`, `step(answer) -> (hint, reward, terminated, truncated, info)`."""

    metadata = {"render_modes": []}

    def __init__(self, max_tries: int = 2, retry_reward: float = 0.5):
        self.max_tries, self.retry_reward = max_tries, retry_reward
        self.observation_space = spaces.Text(max_length=256, charset=string.printable)
        self.action_space = spaces.Text(max_length=256, charset=string.printable)
        self.question, self.label, self.tries = "", "", 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.tries = 0
        example = (options or {}).get("example")
        if example is not None:  # the dataset row poses the task; its prompt is already in front of the model
            self.question, self.label = example["prompt"], str(example["label"])
            return "", {"label": self.label}
        a, b = (int(x) for x in self.np_random.integers(0, 100, size=2))
        self.question, self.label = f"{a:02d}+{b:02d}=", f"{a + b:03d}"
        return self.question, {"label": self.label}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.tries += 1
        if score(action, self.label) > 0:
            return "", 1.0 if self.tries == 1 else self.retry_reward, True, False, {"tries": self.tries}
        if self.tries >= self.max_tries:  # out of tries: the episode is over (terminated, not cut off by a limit)
            return "", 0.0, True, False, {"tries": self.tries}
        guess = parse_answer(action)
        hint = "?" if guess is None or not _INTEGER.match(self.label) else (
            "higher" if int(guess) < int(self.label) else "lower")  # fmt: skip
        return f" {hint}\n{self.question}", 0.0, False, False, {"tries": self.tries}


make_env = from_gymnasium(GuessSumEnv)
