"""Environments written for other libraries, as the `make_env(example)` of `--rollout.env-file`.

`from_gymnasium(env)` turns a Gymnasium-style text environment into the factory `agents.executor.MultiTurnExecutor`
calls once per episode, so any RL script rolls out in it with no change to the script or to core:

    # my_env_file.py, passed as --rollout.env-file my_env_file.py
    from agents.envs import from_gymnasium
    from my_package import MyTextEnv          # reset(seed, options) -> (obs, info); step(action) -> 5-tuple

    make_env = from_gymnasium(MyTextEnv, max_tries=3)    # extra arguments go to MyTextEnv(...)

The text protocol (Gymnasium's `Env` API with strings as observations and actions):
`reset(seed=None, options=None) -> (observation: str, info: dict)` and
`step(action: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)`.
The `gymnasium` package is not needed for the protocol (`pip install -e ".[envs]"` for its `Env` base class).

How the two protocols map (a fresh environment per episode, as the executor expects):
- `reset` gets `options={"example": row}`, the dataset row (prompt, label, ...), so the environment can pose the row's
  task. The model sees the row's prompt, then reset's observation ("" when the prompt already asks the question).
- The model's turn (decoded, special tokens removed) is the action. The observation step returns is the feedback
  (appended as its tokens, masked out of the loss; a {role, content} dict or a list of them continues a chat, as in
  `agents.executor.Environment`), the reward is this turn's reward (the episode's is the sum), and `terminated or
  truncated` ends the episode. `--rollout.max-turns` still caps the turns.
- `seed` is None: the dataset row is the task; an environment that draws its own randomness seeds itself.
- `close()` is called when the episode ends, if the environment has one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class GymnasiumAdapter:
    """One episode of a Gymnasium-style text environment, as `agents.executor.Environment` (`reset(example) -> str`,
    `step(response) -> (feedback, reward, done)`)."""

    def __init__(self, env: Any):
        self.env = env

    def reset(self, example: dict) -> str:
        observation, _info = self.env.reset(seed=None, options={"example": example})
        return self._text(observation, "reset")

    def step(self, response: str) -> tuple[str | dict | list[dict], float, bool]:
        observation, reward, terminated, truncated, _info = self.env.step(response)
        done = bool(terminated or truncated)
        if done and callable(getattr(self.env, "close", None)):
            self.env.close()
        return self._text(observation, "step"), float(reward), done

    def _text(self, observation: Any, where: str) -> str | dict | list[dict]:
        if observation is None:
            return ""
        if not isinstance(observation, str | dict | list):
            kind = type(observation).__name__
            raise ValueError(f"{type(self.env).__name__}.{where} returned a {kind} observation; a text environment "
                             "returns str (or chat messages: a {role, content} dict or a list)")  # fmt: skip
        return observation


def from_gymnasium(env: Callable[..., Any] | str, *args, **kwargs) -> Callable[[dict], GymnasiumAdapter]:
    """`make_env(example)` for `--rollout.env-file` from a Gymnasium-style text environment: its class (or any
    callable returning one: `*args, **kwargs` are passed to it), or a registered Gymnasium id (`gymnasium.make(id,
    **kwargs)`). Each call builds a fresh environment for one episode."""
    if isinstance(env, str):
        import gymnasium

        env_id = env
        return lambda example: GymnasiumAdapter(gymnasium.make(env_id, *args, **kwargs).unwrapped)
    if not callable(env):
        raise ValueError(f"from_gymnasium: {env!r} is neither an environment class (a callable) nor a Gymnasium id")
    return lambda example: GymnasiumAdapter(env(*args, **kwargs))
