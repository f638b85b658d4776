"""A two-turn environment for the embedded arithmetic task, and the example of a `--rollout.env-file`:

    python algos/grpo.py --rollout.env-file agents/retry_env.py

The model answers `a+b=`; a right first answer earns 1.0 and ends the episode. A wrong one gets the feedback
"\\n" + the prompt again (tokens the policy did not write: masked out of the loss) and a second try, which earns 0.5
when right. So the policy learns from both turns, and the environment's text is never trained on.
"""

from __future__ import annotations

from rewards.arithmetic import score


class RetryEnv:
    def __init__(self, example: dict, retry_reward: float = 0.5):
        self.example, self.retry_reward, self.turn = example, retry_reward, 0

    def reset(self, example: dict) -> str:
        return ""  # the prompt is all the model sees before its first turn

    def step(self, response: str) -> tuple[str, float, bool]:
        self.turn += 1
        right = score(response, self.example["label"]) > 0
        if right or self.turn >= 2:
            return "", (1.0 if self.turn == 1 else self.retry_reward) * right, True
        return "\n" + self.example["prompt"], 0.0, False


def make_env(example: dict) -> RetryEnv:
    return RetryEnv(example)
