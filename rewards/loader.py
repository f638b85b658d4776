"""The RL scripts' `--reward.*` section: where rewards come from and how they are checked.

- `RewardConfig`: the flags (a python reward file, a reward model, remote URLs; clipping and length penalties, which
  the scripts apply after scoring).
- `load_reward_func(cfg)`: the chosen source as one `reward_func(queries, prompts, labels)` (OpenRLHF's contract).
- `score(...)`: calls it on one batch and checks the result (one finite reward per query), so a bad reward file
  fails with a message naming the file and the batch instead of a shape error deep inside the update.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rewards.remote import ModelReward, RemoteReward


@dataclass
class RewardConfig:
    func: str | None = None
    """python file defining `reward_func(queries, prompts, labels)` returning a tensor/list of rewards or a dict
    with `rewards`, optional `scores` (0-1) and `extra_logs` (OpenRLHF's contract). Default: rewards/arithmetic.py,
    the embedded task's exact-match rule."""
    model: str | None = None
    """reward model (an `algos/rm.py` export or any one-label `AutoModelForSequenceClassification`) scored
    in-process on prompt + response; instead of `func`."""
    remote_url: list[str] = field(default_factory=list)
    """reward server URL(s) (`python -m rewards.server`, or OpenRLHF's remote RM contract); several URLs split each
    batch between them; instead of `func`."""
    normalize: bool = False
    """with `model`: score (r − reward_mean) / reward_std using the statistics `algos/rm.py` saved."""
    timeout_s: float = 60.0
    """with `remote_url`: seconds per request before it is retried."""
    retries: int = 3
    """with `remote_url`: retries per request (after a timeout, connection error or 5xx) before a clear error."""
    clip: float = 10.0
    """rewards are clipped to [−clip, clip]."""
    stop_properly_penalty: float | None = None
    """reward given instead to responses truncated at max-new-tokens (None: keep their reward)."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: responses within this many tokens of max-new-tokens lose reward linearly, up to
    `overlong-penalty-factor` at the limit (`rl_math.overlong_penalty`); 0 disables."""
    overlong_penalty_factor: float = 1.0
    """the largest overlong penalty (at max-new-tokens)."""


def load_reward_func(cfg: RewardConfig):
    """(reward_func, its name for messages): a remote server, a reward model, the user's python file, or the embedded
    task's rule reward. All follow OpenRLHF's contract `reward_func(queries, prompts, labels)`."""
    chosen = [name for name, on in (("func", cfg.func), ("model", cfg.model), ("remote-url", cfg.remote_url)) if on]
    if len(chosen) > 1:
        raise ValueError(f"--reward.{chosen[0]} and --reward.{chosen[1]}: give one reward source")
    if cfg.remote_url:
        return RemoteReward(cfg.remote_url, cfg.timeout_s, cfg.retries), ", ".join(cfg.remote_url)
    if cfg.model:
        return ModelReward(cfg.model, cfg.normalize), cfg.model
    if cfg.func is None:
        from rewards.arithmetic import reward_func

        return reward_func, "rewards/arithmetic.py"
    path = cfg.func
    if not Path(path).is_file():
        raise ValueError(f"--reward.func {path}: no such file")
    spec = importlib.util.spec_from_file_location("user_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "reward_func"):
        raise ValueError(f"--reward.func {path}: defines no `reward_func(queries, prompts, labels)`")
    return module.reward_func, path


def score(reward_func, source: str, queries, prompts, labels,
          step: int) -> tuple[torch.Tensor, dict, torch.Tensor]:  # fmt: skip
    """Call the reward function and check what it returned: one finite reward per query. Returns (rewards, logs,
    scores): `scores` are the function's optional 0-1 scores (for dynamic filtering), else the rewards."""
    try:
        out = reward_func(queries=queries, prompts=prompts, labels=labels)
    except Exception as e:
        raise ValueError(f"reward function {source} raised on batch {step}: {type(e).__name__}: {e}") from e
    rewards = out["rewards"] if isinstance(out, dict) else out
    rewards = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if rewards.numel() != len(queries):
        raise ValueError(f"reward function {source} returned {rewards.numel()} rewards for {len(queries)} queries "
                         f"on batch {step}")  # fmt: skip
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()[:5]
        raise ValueError(f"reward function {source} returned NaN/inf on batch {step} (queries {bad})")
    logs = {f"rollout/{k}": torch.as_tensor(v, dtype=torch.float32).mean().item()
            for k, v in (out.get("extra_logs", {}) if isinstance(out, dict) else {}).items()}  # fmt: skip
    scores = out.get("scores") if isinstance(out, dict) else None
    scores = rewards if scores is None else torch.as_tensor(scores, dtype=torch.float32).flatten()
    if scores.shape != rewards.shape:
        raise ValueError(f"reward function {source} returned {scores.numel()} scores for {len(queries)} queries "
                         f"on batch {step}")  # fmt: skip
    return rewards, logs, scores
